"""Speaking rate with the pitch kept: time-scale modification by Rubber Band (pylibrb), whole or streamed
(docs/serving-features.md#speaking-rate).

``Stretcher`` is one real-time stretcher fed pieces of any size, so a stream is stretched across its chunk
joins without restarting and equals the whole result (``stretch``), exactly ``round(n / speed)`` long so
durations and timestamps agree. The R3 ("finer") engine keeps the pitch (R2 does not). Speed 1.0 never reaches
the library. numpy only (no torch); pylibrb is the optional part ``.[tempo]``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from moss_npu.errors import MissingDependency, SettingError
from moss_npu.extras import TEMPO_INSTALL

MIN_SPEED, MAX_SPEED = 0.25, 4.0  # OpenAI's range for speech
_BLOCK = 4096  # samples handed to the stretcher at a time (its real-time mode takes bounded blocks)


def check_speed(speed: Any) -> None:
    """Refuse a speaking rate outside 0.25..4.0 (``SettingError`` naming ``speed``)."""
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not math.isfinite(speed):
        raise SettingError("speed", repr(speed), f"not a number; use a speaking rate {MIN_SPEED} .. {MAX_SPEED}")
    if not MIN_SPEED <= speed <= MAX_SPEED:
        raise SettingError("speed", speed, f"out of range; use {MIN_SPEED} .. {MAX_SPEED} (1.0: as the model speaks)")


def rubberband():
    """Return the pylibrb module, or raise MissingDependency naming its install (a speed other than 1.0 needs it)."""
    try:
        import pylibrb
    except ImportError:
        raise MissingDependency(f"a speed other than 1.0 needs pylibrb (Rubber Band), which is not installed "
                                f"here; install it with `{TEMPO_INSTALL}`") from None
    return pylibrb


class Stretcher:
    """One stream's time-scale modifier: ``push`` pieces (C, n) float32, then ``flush`` once for the rest."""

    def __init__(self, speed: float, sample_rate: int, channels: int) -> None:
        check_speed(speed)
        rb = rubberband()
        options = rb.Option.PROCESS_REALTIME | rb.Option.ENGINE_FINER
        self.speed, self.channels = float(speed), channels
        self._rb = rb.RubberBandStretcher(int(sample_rate), channels, options, 1.0 / self.speed, 1.0)
        self._rb.process(np.zeros((channels, self._rb.get_preferred_start_pad()), np.float32))
        self._skip = self._rb.get_start_delay()  # output samples that precede the input's first one
        self.consumed = 0  # input samples pushed
        self.produced = 0  # output samples returned

    def push(self, wave: np.ndarray) -> np.ndarray:
        """Stretch the next piece of the stream; return the output ready so far (C, m), possibly empty."""
        wave = np.ascontiguousarray(wave, dtype=np.float32)
        pieces = []
        for start in range(0, wave.shape[1], _BLOCK):
            self._rb.process(np.ascontiguousarray(wave[:, start:start + _BLOCK]))
            if self._rb.available() > 0:
                pieces.append(self._rb.retrieve_available())
        self.consumed += wave.shape[1]
        return self._take(pieces, limit=None)

    def flush(self) -> np.ndarray:
        """End the stream: return the rest, so that the whole output is exactly ``round(consumed / speed)`` long."""
        self._rb.process(np.zeros((self.channels, 0), np.float32), final=True)
        pieces = []
        while self._rb.available() > 0:
            pieces.append(self._rb.retrieve_available())
        target = int(round(self.consumed / self.speed))
        out = self._take(pieces, limit=target - self.produced)
        if self.produced < target:  # the stretcher's tail fell short: the rest is silence
            out = np.concatenate([out, np.zeros((self.channels, target - self.produced), np.float32)], axis=1)
            self.produced = target
        return out

    def _take(self, pieces: list, limit) -> np.ndarray:
        """Join retrieved output, drop the start delay, cut at ``limit`` samples; count what is returned."""
        out = np.concatenate(pieces, axis=1) if pieces else np.zeros((self.channels, 0), np.float32)
        if self._skip:
            dropped = min(self._skip, out.shape[1])
            out, self._skip = out[:, dropped:], self._skip - dropped
        if limit is not None:
            out = out[:, :max(0, limit)]
        self.produced += out.shape[1]
        return out.astype(np.float32, copy=False)


def stretch(wave: np.ndarray, sample_rate: int, speed: float) -> np.ndarray:
    """Return ``wave`` (C, n) spoken at ``speed`` with its pitch kept (``wave`` itself at speed 1.0)."""
    check_speed(speed)
    if speed == 1.0:
        return wave
    stretcher = Stretcher(speed, sample_rate, wave.shape[0])
    return np.concatenate([stretcher.push(wave), stretcher.flush()], axis=1)
