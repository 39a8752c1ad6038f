"""Audio files without torch: read any soundfile-readable recording, write float32 WAV atomically.

Reading goes through soundfile (libsndfile >= 1.1 reads WAV, FLAC, OGG and MP3 by content, whatever the file
is called). Output is float32 WAV, unclipped, like the official ``torchaudio.save`` of a float tensor; files
appear only complete (temp file in the same folder + rename). The writer takes NumPy arrays or torch tensors
(anything with ``.detach()`` is moved to the host first), so both backends share it and the Delay fallback
never imports torch. Shapes: C channels, S samples.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import soundfile

from moss_npu.errors import AudioError

PathLike = Union[str, Path]
_PUBLIC_FILE_MODE = 0o644


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
    try:
        data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except Exception as exc:  # libsndfile reports every decode failure as a generic error
        raise AudioError(f"reference audio {path}: cannot decode ({_decode_hint(path, exc)})") from exc
    return np.ascontiguousarray(data.T), int(rate)


def _decode_hint(path: Path, exc: Exception) -> str:
    """Explain a decode failure, naming the MP3 case (libsndfile < 1.1 has no MP3 decoder)."""
    with open(path, "rb") as fh:
        head = fh.read(4)
    is_mp3 = head[:3] == b"ID3" or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0)
    if is_mp3 and "MP3" not in soundfile.available_formats():
        return (f"it is MP3 and libsndfile {soundfile.__libsndfile_version__} cannot read MP3; "
                "run `pip install -U 'soundfile>=0.12.1'` (bundles libsndfile >= 1.1 with MP3) or convert it to WAV")
    return f"{exc}; convert it to 16-bit WAV or FLAC"


def _as_frames(wave: Any) -> np.ndarray:
    """Return ``(S, C)`` float32 host samples from a ``(C, S)`` or ``(S,)`` array or tensor."""
    if hasattr(wave, "detach"):  # a torch tensor, possibly on a device
        wave = wave.detach().to("cpu").float().numpy()
    wave = np.asarray(wave, dtype=np.float32)
    if wave.ndim == 1:
        wave = wave[None]
    if wave.ndim != 2:
        raise AudioError(f"write_wav: expected a (channels, samples) waveform, got shape {tuple(wave.shape)}")
    return np.ascontiguousarray(wave.T)


class StreamingWavWriter:
    """Write a float32 WAV chunk by chunk; the file appears at ``path`` only after ``close()``.

    Use as a context manager: leaving the block normally finalizes, an exception deletes the temp file.
    """

    def __init__(self, path: PathLike, sample_rate: int, channels: int) -> None:
        self.path = Path(path)
        self.samples_written = 0
        folder = self.path.parent if str(self.path.parent) else Path(".")
        if not folder.is_dir():
            raise AudioError(f"output {self.path}: folder {folder} does not exist; create it first")
        fd, tmp = tempfile.mkstemp(dir=str(folder), prefix=f".{self.path.name}.", suffix=".tmp")
        os.close(fd)
        self._tmp = Path(tmp)
        try:
            self._file: Optional[soundfile.SoundFile] = soundfile.SoundFile(
                tmp, mode="w", samplerate=int(sample_rate), channels=int(channels), format="WAV", subtype="FLOAT")
        except Exception:
            self._tmp.unlink(missing_ok=True)
            raise
        self.channels = int(channels)

    def write(self, chunk: Any) -> None:
        """Append ``(C, n)`` samples (values are stored as they are: no clipping)."""
        if self._file is None:
            raise AudioError(f"output {self.path}: writer already closed")
        frames = _as_frames(chunk)
        if frames.shape[1] != self.channels:
            raise AudioError(f"output {self.path}: chunk has {frames.shape[1]} channels, writer has {self.channels}")
        self._file.write(frames)
        self.samples_written += frames.shape[0]

    def close(self) -> Path:
        """Finish the header and move the file into place atomically; return the final path."""
        if self._file is None:
            return self.path
        self._file.close()
        self._file = None
        os.chmod(self._tmp, _PUBLIC_FILE_MODE)  # mkstemp makes 0600; a written WAV is an ordinary file
        os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        """Drop everything written; no file is left behind."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> "StreamingWavWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_wav(path: PathLike, wave: Any, sample_rate: int) -> Path:
    """Write ``(C, S)`` float audio (array or tensor) as a float32 WAV at ``path`` atomically."""
    channels = 1 if wave.ndim == 1 else wave.shape[0]
    with StreamingWavWriter(path, sample_rate, channels) as writer:
        writer.write(wave)
    return Path(path)
