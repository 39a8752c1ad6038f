"""Reference recordings for the Delay codec, prepared as the official llama.cpp pipeline prepares them
(docs/delay.md#reference-audio), and the loudness normalisation applied to them and to the decoded output. S samples.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Union

import numpy as np

from moss_npu.errors import AudioError
from moss_npu.wavfile import read_wav


def resample_like_librosa(wave: np.ndarray, orig_hz: int, new_hz: int) -> np.ndarray:
    """Resample mono ``(S,)`` float32 as ``librosa.resample`` does with its defaults (soxr HQ, fixed length)."""
    import soxr

    if orig_hz == new_hz:
        return wave
    out = soxr.resample(np.ascontiguousarray(wave, dtype=np.float32), orig_hz, new_hz, quality="HQ")  # "soxr_hq"
    length = math.ceil(wave.shape[-1] * float(new_hz) / orig_hz)
    out = out[:length] if out.shape[-1] >= length else np.pad(out, (0, length - out.shape[-1]))
    return np.asarray(out, dtype=np.float32)


def load_reference(path: Union[str, Path], sample_rate: int) -> np.ndarray:
    """Read a voice recording as mono float32 ``(S,)`` at ``sample_rate`` (before loudness normalisation);
    ``AudioError`` for a file missing, undecodable, non-finite, empty or silent."""
    wave, rate = read_wav(path)
    if not np.isfinite(wave).all():  # NaN would pass the silence check below and poison the codec
        raise AudioError(f"reference audio {path}: holds non-finite samples (NaN or infinity); re-export the "
                         "recording as 16-bit WAV")
    if wave.shape[-1] == 0:
        raise AudioError(f"reference audio {path}: no samples; use a recording of a few seconds")
    mono = resample_like_librosa(wave.mean(axis=0), rate, sample_rate)
    if not np.any(mono):
        raise AudioError(f"reference audio {path}: all samples are zero (silent); use a recording of the voice")
    return mono


def loudness_normalize(wave: np.ndarray, target_dbfs: float = -20.0, max_gain_db: float = 3.0) -> np.ndarray:
    """Move the RMS level towards ``target_dbfs`` by at most ``max_gain_db`` either way."""
    wave = np.asarray(wave, dtype=np.float32)
    if wave.size == 0:
        return wave
    rms = np.sqrt(np.mean(wave ** 2) + 1e-9)
    gain_db = float(np.clip(target_dbfs - 20.0 * np.log10(rms), -max_gain_db, max_gain_db))
    return wave * np.float32(10.0 ** (gain_db / 20.0))
