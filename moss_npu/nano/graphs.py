"""Device graphs of the frame step: warm up eagerly, capture once per slot-count bucket, replay after.

The capture API comes from the device layer (``backend(device).graph_capture()``). ``--graph on`` tries one trial
capture when the decoder is built and refuses with its reason; with ``auto`` a failed capture logs one line and
the frames run eagerly for the rest of the process, with the same result.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Callable, Optional

import torch

from moss_npu import device as devices
from moss_npu.errors import DeviceError, InputError

log = logging.getLogger(__name__)

GRAPH_MODES = ("auto", "on", "off")
WARMUP_FRAMES = 2  # eager frames per bucket before capture (lazy kernel/workspace set-up happens there)


def resolve_graph(mode: str, device: torch.device, sampler: str, has_hook: bool) -> Optional[devices.GraphCapture]:
    """Return the capture API to use for ``mode`` on ``device``, or None to run eagerly: "on" refuses what cannot
    be captured (no capture API, a failed trial capture, the device-RNG sampler, a logits hook), "auto" captures
    where the backend can and the sampler is the noise-fed one."""
    if mode not in GRAPH_MODES:
        raise InputError(f"--graph {mode}: unknown; use one of {', '.join(GRAPH_MODES)}")
    if mode == "off":
        return None
    capture = devices.backend(device).graph_capture()
    if mode == "on":
        if capture is None:
            raise InputError(f"--graph on: {device} has no device-graph capture; use --graph auto or off")
        if sampler != "noise":
            raise InputError("--graph on needs the noise-fed sampler (--host-rng): the official sampler draws "
                             "device random numbers eagerly")
        if has_hook:
            raise InputError("--graph on cannot show logits rows to a hook; use --graph off")
        failure = capture.check(device)
        if failure is not None:
            raise DeviceError(f"--graph on: a trial device-graph capture on {device} failed ({failure}); use "
                              "--graph auto or off")
    if capture is None or sampler != "noise" or has_hook or capture.broken is not None:
        return None
    return capture


class FrameGraphs:
    """One captured frame per bucket of slot counts (1, 2, 4, … up to the decoder's slots)."""

    def __init__(self, capture: devices.GraphCapture, frame: Callable[[int], None], slots: int,
                 warmup: int = WARMUP_FRAMES) -> None:
        self.capture, self.frame, self.slots, self.warmup = capture, frame, slots, warmup
        self.replays: dict[int, Callable[[], None]] = {}
        self.warm: dict[int, int] = defaultdict(int)

    def bucket(self, n: int) -> int:
        """Return the smallest bucket holding ``n`` slots: the next power of two, at most ``slots``."""
        return min(1 << max(n - 1, 0).bit_length(), self.slots)

    def reset(self) -> None:
        """Drop every captured graph (the state or weights they read were replaced)."""
        self.replays.clear()
        self.warm.clear()

    def run(self, n: int) -> None:
        """Run one frame over the bucket of ``n`` slots: eagerly while warming up or after a failure, else replay."""
        b = self.bucket(n)
        replay = self.replays.get(b)
        if replay is None and self.capture.broken is None and self.warm[b] >= self.warmup:
            replay = self._capture(b)
        if replay is None:
            self.warm[b] += 1
            self.frame(b)
        else:
            replay()

    def _capture(self, b: int) -> Optional[Callable[[], None]]:
        try:
            self.replays[b] = self.capture.capture(lambda: self.frame(b))
        except Exception as exc:  # capture support varies by driver and version: any failure means eager
            self.capture.disable(f"{type(exc).__name__}: {exc}")
            log.warning("device graph capture failed (%s); frames run eagerly for the rest of this process",
                        self.capture.broken)
            return None
        return self.replays[b]
