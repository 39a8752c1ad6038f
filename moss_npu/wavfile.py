"""Audio files in without torch: read any soundfile-readable recording as a NumPy array.

Reading goes through soundfile (libsndfile >= 1.1 reads WAV, FLAC, OGG and MP3 by content, whatever the file
is called). Both backends read through here, so the Delay fallback never imports torch; ``moss_npu.output``
writes. Shapes: C channels, S samples.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import BinaryIO, Union

import numpy as np
import soundfile

from moss_npu.errors import AudioError

PathLike = Union[str, Path]


def read_wav(path: PathLike) -> tuple[np.ndarray, int]:
    """Read any soundfile-readable file as float32 ``(C, S)`` in [-1, 1] plus its sample rate.

    Integer PCM is scaled by 1/32768 (16-bit) etc., as torchaudio does. The format is detected from the
    content, so FLAC or MP3 files named ``.wav`` read correctly.

    Raises:
        AudioError: the file is missing or not decodable.
    """
    path = Path(path)
    if not path.is_file():
        raise AudioError(f"reference audio {path}: file not found; pass an existing wav/flac/mp3 file")
    with open(path, "rb") as fh:
        return _decode(fh, str(path))


def read_wav_bytes(data: bytes) -> tuple[np.ndarray, int]:
    """Read the bytes of a soundfile-readable file as ``read_wav`` reads a path (an upload, an HTTP body).

    Raises:
        AudioError: the bytes are not decodable.
    """
    return _decode(io.BytesIO(data), f"<{len(data)} bytes>")


def _decode(fh: BinaryIO, name: str) -> tuple[np.ndarray, int]:
    """Decode an open binary file as float32 ``(C, S)``; ``name`` says in messages what it is."""
    try:
        data, rate = soundfile.read(fh, dtype="float32", always_2d=True)
    except Exception as exc:  # libsndfile reports every decode failure as a generic error
        fh.seek(0)
        raise AudioError(f"reference audio {name}: cannot decode ({decode_hint_bytes(fh.read(4), exc)})") from exc
    return np.ascontiguousarray(data.T), int(rate)


def decode_hint_bytes(head: bytes, exc: Exception) -> str:
    """Explain a decode failure from the first bytes of the file."""
    is_mp3 = head[:3] == b"ID3" or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0)
    if is_mp3 and "MP3" not in soundfile.available_formats():
        return (f"it is MP3 and libsndfile {soundfile.__libsndfile_version__} cannot read MP3; "
                "run `pip install -U 'soundfile>=0.12.1'` (bundles libsndfile >= 1.1 with MP3) or convert it to WAV")
    return f"{exc}; convert it to 16-bit WAV or FLAC"
