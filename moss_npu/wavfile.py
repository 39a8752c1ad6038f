"""Audio files in without torch (so the Delay fallback never imports it): any recording soundfile reads, by
content whatever its name, as a NumPy array. A file is judged by its header first (``probe``, against
``moss_npu.limits``) and decoding reads at most the frames the limit allows, so a small file that claims hours of
8-channel audio is refused before a sample is decoded. Shapes: C channels, S samples.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Union

import numpy as np
import soundfile

from moss_npu.errors import AudioError, AudioTooLong
from moss_npu.limits import MAX_REFERENCE_CHANNELS, MAX_REFERENCE_RATE, MAX_REFERENCE_SECONDS

PathLike = Union[str, Path]


@dataclass(frozen=True)
class AudioHeader:
    """What a recording's header says: its sample rate, channel count and frames (samples per channel)."""

    rate: int
    channels: int
    frames: int

    @property
    def seconds(self) -> float:
        return self.frames / self.rate


def probe(fh: BinaryIO, name: str, max_seconds: float = MAX_REFERENCE_SECONDS) -> AudioHeader:
    """Read only the header of an open recording and check it against the limits; rewind ``fh``.

    Raises:
        AudioError: not a recording libsndfile reads, no samples, more than 2 channels, a rate outside
            1 Hz..384 kHz; ``AudioTooLong`` when it lasts longer than ``max_seconds``.
    """
    try:
        info = soundfile.info(fh)
    except Exception as exc:  # libsndfile reports every unreadable input the same way
        fh.seek(0)
        raise AudioError(f"{name}: cannot decode ({decode_hint_bytes(fh.read(4), exc)})") from None
    fh.seek(0)
    header = AudioHeader(rate=int(info.samplerate), channels=int(info.channels), frames=int(info.frames))
    if header.channels > MAX_REFERENCE_CHANNELS:
        raise AudioError(f"{name}: {header.channels} channels; the codec takes mono or stereo, "
                         "downmix it to 2 channels first")
    if not 0 < header.rate <= MAX_REFERENCE_RATE:
        raise AudioError(f"{name}: sample rate {header.rate} Hz; use 1..{MAX_REFERENCE_RATE} Hz")
    if header.frames <= 0:
        raise AudioError(f"{name}: no samples; record a few seconds of the voice")
    if header.seconds > max_seconds:
        raise AudioTooLong(f"{name}: {header.seconds:.1f} s long; the limit is {max_seconds:g} s, "
                           "trim the recording")
    return header


def read_wav(path: PathLike) -> tuple[np.ndarray, int]:
    """Read any soundfile-readable file as float32 ``(C, S)`` in [-1, 1] (integer PCM scaled as torchaudio does)
    plus its sample rate; AudioError when it is missing or not decodable."""
    path = Path(path)
    if not path.is_file():
        raise AudioError(f"reference audio {path}: file not found; pass an existing wav/flac/mp3 file")
    with open(path, "rb") as fh:
        return _decode(fh, str(path))


def read_wav_bytes(data: bytes) -> tuple[np.ndarray, int]:
    """Read the bytes of a soundfile-readable file (an upload) as ``read_wav`` reads a path."""
    return _decode(io.BytesIO(data), f"<{len(data)} bytes>")


def _decode(fh: BinaryIO, name: str, max_seconds: float = MAX_REFERENCE_SECONDS) -> tuple[np.ndarray, int]:
    """Probe, then decode an open binary file as float32 ``(C, S)``, reading at most ``max_seconds`` (a header
    may understate the length: MP3's is an estimate); ``name`` says in messages what it is."""
    header = probe(fh, f"reference audio {name}", max_seconds)
    allowed = math.floor(max_seconds * header.rate)
    try:
        data, rate = soundfile.read(fh, frames=allowed + 1, dtype="float32", always_2d=True)
    except Exception as exc:  # libsndfile reports every decode failure as a generic error
        fh.seek(0)
        raise AudioError(f"reference audio {name}: cannot decode ({decode_hint_bytes(fh.read(4), exc)})") from exc
    if data.shape[0] > allowed:
        raise AudioTooLong(f"reference audio {name}: longer than the limit of {max_seconds:g} s; trim the recording")
    return np.ascontiguousarray(data.T), int(rate)


def decode_hint_bytes(head: bytes, exc: Exception) -> str:
    """Explain a decode failure from the first bytes of the file."""
    is_mp3 = head[:3] == b"ID3" or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0)
    if is_mp3 and "MP3" not in soundfile.available_formats():
        return (f"it is MP3 and libsndfile {soundfile.__libsndfile_version__} cannot read MP3; "
                "run `pip install -U 'soundfile>=0.12.1'` (bundles libsndfile >= 1.1 with MP3) or convert it to WAV")
    return f"{exc}; convert it to 16-bit WAV or FLAC"
