"""Audio in and out for the Nano backend: reference recordings as tensors, resampled like torchaudio (spec §10
steps 4 and 9).

Files are read and written by ``moss_npu.wavfile`` (torch-free; its writer is re-exported here). ``resample``
is the windowed-sinc algorithm of ``torchaudio.functional.resample`` with its defaults, written out so
torchaudio is never needed.

Shapes: C channels, S samples.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from moss_npu.errors import AudioError
from moss_npu.wavfile import PathLike, StreamingWavWriter, read_wav, write_wav

__all__ = ["StreamingWavWriter", "load_reference_audio", "read_audio", "resample", "to_channels", "write_wav"]


def read_audio(path: PathLike) -> tuple[torch.Tensor, int]:
    """Read any soundfile-readable file as a float32 ``(C, S)`` tensor plus its sample rate (see ``read_wav``).

    Raises:
        AudioError: the file is missing or not decodable.
    """
    wave, rate = read_wav(path)
    return torch.from_numpy(wave), rate


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
    if wave.shape[-1] == 0:
        raise AudioError(f"reference audio {path}: no samples; record at least {min_samples / sample_rate:.2f} s")
    if wave.shape[0] > 2:
        wave = to_channels(wave, channels, source=f"reference audio {path}")
    wave = to_channels(resample(wave, rate, sample_rate), channels, source=f"reference audio {path}")
    if wave.shape[-1] < min_samples:
        raise AudioError(f"reference audio {path}: {wave.shape[-1] / sample_rate:.3f} s is shorter than the "
                         f"{min_samples / sample_rate:.3f} s minimum; use a longer recording")
    if not bool(wave.abs().max() > 0):
        raise AudioError(f"reference audio {path}: all samples are zero (silent); use a recording of the voice")
    return wave.contiguous()
