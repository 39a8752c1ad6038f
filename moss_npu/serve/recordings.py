"""Recordings that arrive over HTTP (voice uploads, ``ref_audio``): check them before a worker encodes them."""

from __future__ import annotations

import io

import soundfile

from moss_npu.serve.errors import ApiError


def probe_recording(data: bytes, max_seconds: float, *, param: str) -> float:
    """Return the recording's duration in seconds; 400 when it is not audio or empty, 413 when too long.

    Any container and rate libsndfile reads is accepted (the worker resamples and downmixes through
    ``moss_npu.audio``); only the header is read here.
    """
    try:
        info = soundfile.info(io.BytesIO(data))
    except Exception:  # libsndfile reports every unreadable input the same way
        raise ApiError(400, f"{param} is not a recording soundfile can read; send WAV, FLAC, MP3 or OGG",
                       param=param, code="invalid_audio") from None
    if info.frames <= 0 or info.samplerate <= 0:
        raise ApiError(400, f"{param} holds no samples", param=param, code="invalid_audio")
    duration = info.frames / info.samplerate
    if duration > max_seconds:
        raise ApiError(413, f"{param} is {duration:.1f} s long; the limit is {max_seconds:g} s", param=param,
                       code="audio_too_long")
    return duration
