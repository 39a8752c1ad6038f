"""Audio in and out: read reference recordings, resample like torchaudio, write WAV atomically (spec §10 steps 4 and 9).

Reading goes through soundfile (libsndfile >= 1.1 reads WAV, FLAC, OGG and MP3 by content, whatever the file
is called). ``resample`` is the windowed-sinc algorithm of ``torchaudio.functional.resample`` with its
defaults, written out so torchaudio is never needed. Output is float32 WAV, unclipped, like the official
``torchaudio.save`` of a float tensor; files appear only complete (temp file in the same folder + rename).

Shapes: C channels, S samples.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Optional, Union

import numpy as np
import soundfile
import torch
import torch.nn.functional as F

from moss_npu.errors import AudioError

PathLike = Union[str, Path]
_PUBLIC_FILE_MODE = 0o644


def read_audio(path: PathLike) -> tuple[torch.Tensor, int]:
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
    return torch.from_numpy(np.ascontiguousarray(data.T)), int(rate)


def _decode_hint(path: Path, exc: Exception) -> str:
    """Explain a decode failure, naming the MP3 case (libsndfile < 1.1 has no MP3 decoder)."""
    with open(path, "rb") as fh:
        head = fh.read(4)
    is_mp3 = head[:3] == b"ID3" or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0)
    if is_mp3 and "MP3" not in soundfile.available_formats():
        return (f"it is MP3 and libsndfile {soundfile.__libsndfile_version__} cannot read MP3; "
                "run `pip install -U 'soundfile>=0.12.1'` (bundles libsndfile >= 1.1 with MP3) or convert it to WAV")
    return f"{exc}; convert it to 16-bit WAV or FLAC"


def _sinc_kernel(orig: int, new: int, lowpass_filter_width: int, rolloff: float,
                 dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, int]:
    """Polyphase Hann-windowed sinc filters ``(new, 1, 2*width + orig)`` for gcd-reduced rates."""
    cutoff = min(orig, new) * rolloff  # in units of the reduced rates; below both Nyquists
    width = math.ceil(lowpass_filter_width * orig / cutoff)
    taps = torch.arange(-width, width + orig, dtype=dtype, device=device)[None, None] / orig
    # Row j is output phase j: time of each input tap relative to output sample j/new, in input periods.
    t = torch.arange(0, -new, -1, dtype=dtype, device=device)[:, None, None] / new + taps
    t = (t * cutoff).clamp(-lowpass_filter_width, lowpass_filter_width)
    window = torch.cos(t * math.pi / lowpass_filter_width / 2) ** 2
    t = t * math.pi
    kernel = torch.where(t == 0, torch.ones((), dtype=dtype, device=device), t.sin() / t)
    return kernel * (window * (cutoff / orig)), width


def resample(wave: torch.Tensor, orig_hz: int, new_hz: int, *, lowpass_filter_width: int = 6,
             rolloff: float = 0.99) -> torch.Tensor:
    """Resample ``(..., S)`` like ``torchaudio.functional.resample`` with ``sinc_interp_hann``.

    Output length is ``ceil(S * new_hz / orig_hz)``. The filters are computed in the wave's dtype, as
    torchaudio does, so results agree to float rounding.
    """
    if orig_hz <= 0 or new_hz <= 0 or int(orig_hz) != orig_hz or int(new_hz) != new_hz:
        raise AudioError(f"resample: rates must be positive integers, got {orig_hz} -> {new_hz}")
    if orig_hz == new_hz:
        return wave
    if not wave.is_floating_point():
        raise AudioError(f"resample: expected a float waveform, got {wave.dtype}")
    gcd = math.gcd(int(orig_hz), int(new_hz))
    orig, new = int(orig_hz) // gcd, int(new_hz) // gcd
    kernel, width = _sinc_kernel(orig, new, lowpass_filter_width, rolloff, wave.dtype, wave.device)
    shape = wave.shape
    flat = F.pad(wave.reshape(-1, shape[-1]), (width, width + orig))
    out = F.conv1d(flat[:, None], kernel, stride=orig)  # (N, new, blocks): phase j of each input block
    out = out.transpose(1, 2).reshape(flat.shape[0], -1)[:, : math.ceil(new * shape[-1] / orig)]
    return out.reshape(*shape[:-1], out.shape[-1])


def to_channels(wave: torch.Tensor, channels: int, *, source: str = "audio") -> torch.Tensor:
    """Match ``(C, S)`` to ``channels``: mono repeats to stereo, stereo averages to mono, more than 2 raises."""
    have = wave.shape[0]
    if have == channels:
        return wave
    if have > 2:
        raise AudioError(f"{source}: {have} channels; the codec takes mono or stereo, downmix it to 2 channels first")
    if have == 1:
        return wave.repeat(channels, 1)
    if channels == 1:
        return wave.mean(dim=0, keepdim=True)
    raise AudioError(f"{source}: cannot map {have} channels to {channels}")


def load_reference_audio(path: PathLike, sample_rate: int = 48000, channels: int = 2, *,
                         min_samples: int = 1) -> torch.Tensor:
    """Load a voice prompt as float32 ``(channels, S)`` at ``sample_rate`` (the official reference path).

    Args:
        path: wav/flac/mp3 file (format detected from content).
        sample_rate: codec rate; other rates are resampled with ``resample``.
        channels: codec channels; see ``to_channels``.
        min_samples: shortest acceptable length after resampling, e.g. one codec frame (3840).

    Raises:
        AudioError: missing, undecodable, empty, shorter than ``min_samples``, all zeros or > 2 channels.
    """
    wave, rate = read_audio(path)
    return prepare_reference(wave, rate, sample_rate, channels, min_samples=min_samples,
                             source=f"reference audio {path}")


def prepare_reference(wave: torch.Tensor, rate: int, sample_rate: int = 48000, channels: int = 2, *,
                      min_samples: int = 1, source: str = "reference audio") -> torch.Tensor:
    """Turn a decoded voice prompt (C, S) at ``rate`` into float32 (channels, S') at ``sample_rate``.

    The checks and conversions of ``load_reference_audio``, for audio that arrives decoded (e.g. a server upload).
    """
    wave = torch.as_tensor(wave, dtype=torch.float32)
    wave = wave[None] if wave.dim() == 1 else wave
    if wave.dim() != 2 or wave.shape[-1] == 0:
        raise AudioError(f"{source}: no samples; record at least {min_samples / sample_rate:.2f} s")
    if wave.shape[0] > 2:
        wave = to_channels(wave, channels, source=source)
    wave = to_channels(resample(wave, rate, sample_rate), channels, source=source)
    if wave.shape[-1] < min_samples:
        raise AudioError(f"{source}: {wave.shape[-1] / sample_rate:.3f} s is shorter than the "
                         f"{min_samples / sample_rate:.3f} s minimum; use a longer recording")
    if not bool(wave.abs().max() > 0):
        raise AudioError(f"{source}: all samples are zero (silent); use a recording of the voice")
    return wave.contiguous()


def _as_frames(wave: torch.Tensor) -> np.ndarray:
    if wave.dim() == 1:
        wave = wave[None]
    if wave.dim() != 2:
        raise AudioError(f"write_wav: expected a (channels, samples) waveform, got shape {tuple(wave.shape)}")
    return np.ascontiguousarray(wave.detach().to("cpu", torch.float32).numpy().T)


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

    def write(self, chunk: torch.Tensor) -> None:
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


def write_wav(path: PathLike, wave: torch.Tensor, sample_rate: int) -> Path:
    """Write ``(C, S)`` float audio as a float32 WAV at ``path`` atomically (no partial file on failure)."""
    channels = 1 if wave.dim() == 1 else wave.shape[0]
    with StreamingWavWriter(path, sample_rate, channels) as writer:
        writer.write(wave)
    return Path(path)
