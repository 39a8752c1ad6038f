"""Recordings that arrive over HTTP (voice uploads, ``ref_audio``): check them before a worker encodes them."""

from __future__ import annotations

import io

from moss_npu.errors import AudioError, AudioTooLong
from moss_npu.serve.errors import ApiError
from moss_npu.wavfile import probe


def probe_recording(data: bytes, max_seconds: float, *, param: str) -> float:
    """Return the recording's duration in seconds; 400 when it is not audio, empty, has more than 2 channels or
    an unusable rate, 413 when too long.

    Only the header is read (``moss_npu.wavfile.probe``, the check the worker's decoding repeats): any container
    and rate libsndfile reads is accepted (the worker resamples and downmixes through ``moss_npu.audio``).
    """
    try:
        header = probe(io.BytesIO(data), param, max_seconds)
    except AudioTooLong as exc:
        raise ApiError(413, str(exc), param=param, code="audio_too_long") from None
    except AudioError as exc:
        raise ApiError(400, str(exc), param=param, code="invalid_audio") from None
    return header.seconds

