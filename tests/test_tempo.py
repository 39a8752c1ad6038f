"""Speaking rate (moss_npu.tempo): durations, pitch, streamed against whole, and the chunk joins.

The signals are made here: a 220 Hz tone (its pitch must stay) and tone bursts at known times (their onsets
must move to time / speed, which checks the content's timing and not only the padded length).
"""

from __future__ import annotations

import numpy as np
import pytest

from moss_npu.errors import InputError
from moss_npu.tempo import Stretcher, check_speed, stretch
from tests.optional import require

require("pylibrb", 'pip install -e ".[tempo]"')

RATE = 48000
FRAME = 3840  # samples per codec frame: a stream's pieces are whole frames
SPEEDS = (0.5, 1.5, 3.0)


def tone(seconds: float, hz: float = 220.0, amplitude: float = 0.4) -> np.ndarray:
    t = np.arange(int(RATE * seconds)) / RATE
    wave = (amplitude * np.sin(2 * np.pi * hz * t)).astype(np.float32)
    return np.stack([wave, wave])


def bursts(starts: tuple[float, ...], length_s: float = 0.15, total_s: float = 3.0) -> np.ndarray:
    wave = np.zeros((2, int(RATE * total_s)), np.float32)
    burst = tone(length_s)
    for start in starts:
        at = int(start * RATE)
        wave[:, at:at + burst.shape[1]] = burst
    return wave


def onsets(wave: np.ndarray, threshold: float = 0.1) -> list[float]:
    """Times where the 5 ms envelope rises through ``threshold`` (after at least 50 ms below it)."""
    window = int(0.005 * RATE)
    envelope = np.convolve(np.abs(wave[0]), np.ones(window) / window, mode="same")
    above = envelope > threshold
    found, quiet = [], int(0.05 * RATE)
    last_above = -quiet
    for i in np.flatnonzero(above):
        if i - last_above >= quiet:
            found.append(i / RATE)
        last_above = i
    return found


def pitch(wave: np.ndarray) -> float:
    """The strongest frequency between 100 and 400 Hz (zero-padded FFT, 0.1 Hz bins for a few seconds)."""
    x = wave[0] * np.hanning(wave.shape[1])
    spectrum = np.abs(np.fft.rfft(x, 8 * len(x)))
    freqs = np.fft.rfftfreq(8 * len(x), 1 / RATE)
    band = (freqs > 100) & (freqs < 400)
    return float(freqs[band][np.argmax(spectrum[band])])


def streamed(wave: np.ndarray, speed: float, seed: int = 0) -> tuple[np.ndarray, list[int]]:
    """Stretch ``wave`` in pieces of 1–11 frames, as a stream's codec calls hand them on; also the join points
    in the output."""
    rng = np.random.default_rng(seed)
    stretcher, out, joins, i = Stretcher(speed, RATE, wave.shape[0]), [], [], 0
    while i < wave.shape[1]:
        n = int(rng.integers(1, 12)) * FRAME
        out.append(stretcher.push(wave[:, i:i + n]))
        joins.append(sum(p.shape[1] for p in out))
        i += n
    out.append(stretcher.flush())
    return np.concatenate(out, axis=1), joins[:-1]


def test_speed_one_is_the_audio_itself():
    wave = tone(0.5)
    assert stretch(wave, RATE, 1.0) is wave


@pytest.mark.parametrize("speed", SPEEDS)
def test_duration_and_timing_follow_the_speed(speed):
    starts = (0.3, 0.9, 1.5, 2.1)
    wave = bursts(starts)
    out = stretch(wave, RATE, speed)
    assert out.shape == (2, round(wave.shape[1] / speed))
    found = onsets(out)
    assert len(found) == len(starts), found
    span, expected = found[-1] - found[0], (starts[-1] - starts[0]) / speed
    assert abs(span - expected) <= 0.03 * expected, (span, expected)
    assert abs(found[0] - starts[0] / speed) <= 0.03 * starts[0] / speed + 0.01  # aligned from the start


@pytest.mark.parametrize("speed", SPEEDS)
def test_pitch_is_kept(speed):
    out = stretch(tone(3.0), RATE, speed)
    assert abs(pitch(out) - 220.0) <= 0.02 * 220.0


@pytest.mark.parametrize("speed", SPEEDS)
def test_streamed_equals_whole_and_joins_do_not_click(speed):
    wave = tone(3.0)
    whole = stretch(wave, RATE, speed)
    out, joins = streamed(wave, speed)
    assert out.shape == whole.shape
    # The stretcher is one state across the pieces, so the stream is the whole result (float rounding aside).
    np.testing.assert_allclose(out, whole, atol=1e-6)
    # A click is a jump: the step at a join is no larger than 1.25 × the largest step of the tone itself
    # (2π · 220 / 48000 · 0.4 ≈ 0.0115 per sample).
    steps = np.abs(np.diff(out[0]))
    limit = 1.25 * 2 * np.pi * 220 / RATE * 0.4
    inner = steps[int(0.1 * RATE):-int(0.1 * RATE)]  # away from the fade-in and the padded end
    assert inner.max() <= limit
    at_joins = [steps[j - 1] for j in joins if int(0.1 * RATE) < j < out.shape[1] - int(0.1 * RATE)]
    assert at_joins and max(at_joins) <= limit


@pytest.mark.parametrize("bad", [0.1, 5.0, float("nan"), "fast", True])
def test_out_of_range_speeds_are_refused(bad):
    with pytest.raises(InputError, match="--speed"):
        check_speed(bad)
