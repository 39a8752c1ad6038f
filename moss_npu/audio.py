"""Audio in for the Nano backend: reference recordings as tensors, resampled like torchaudio.

Files are read by ``moss_npu.wavfile`` (torch-free) and written by ``moss_npu.output``. ``resample`` is
``torchaudio.functional.resample`` with its defaults, written out so torchaudio is never needed and cloned voices
get the official codes; its filter bank grows with the rates over their gcd squared, so where it would exceed
``OFFICIAL_KERNEL_LIMIT`` elements ``resample_reference`` uses soxr instead (docs/serving.md). Shapes: C channels,
S samples. See docs/architecture.md#synthesis.
"""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path
from typing import Union

import numpy as np
import soxr
import torch
import torch.nn.functional as F

from moss_npu.errors import AudioError
from moss_npu.wavfile import PathLike, probe, read_wav, read_wav_bytes

log = logging.getLogger(__name__)
OFFICIAL_KERNEL_LIMIT = 2**20  # filter-bank elements (4 MiB in float32); 44.1 kHz → 48 kHz needs 25,760
WIDTH, ROLLOFF = 6, 0.99  # torchaudio's defaults: sinc zero crossings per side, cutoff over the lower Nyquist

# A recording as a file path, the bytes of such a file, or a (waveform (C, S) or (S,), sample_rate) pair.
AudioSource = Union[str, Path, bytes, tuple]


def read_audio(path: PathLike) -> tuple[torch.Tensor, int]:
    """Read any soundfile-readable file as a float32 ``(C, S)`` tensor plus its sample rate (see ``read_wav``)."""
    wave, rate = read_wav(path)
    return torch.from_numpy(wave), rate


def read_audio_source(source: AudioSource) -> tuple[torch.Tensor, int, str]:
    """Read a path, the bytes of an audio file, or a (waveform, sample_rate) pair as float32 ``(C, S)``; return it,
    its rate and how error messages name the source (AudioError for anything else or anything unreadable)."""
    if isinstance(source, (str, Path)):
        return (*read_audio(source), str(source))
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        wave, rate = read_wav_bytes(data)
        return torch.from_numpy(wave), rate, f"<{len(data)} bytes>"
    if isinstance(source, tuple) and len(source) == 2:
        return (*_waveform_pair(*source), "(waveform, sample_rate)")
    raise AudioError(f"reference audio: {type(source).__name__} {source!r:.40} is not a recording; pass a file path, the bytes "
                     "of a wav/flac/mp3 file, or a (waveform, sample_rate) pair")


def _waveform_pair(wave, rate) -> tuple[torch.Tensor, int]:
    """Check a (waveform (C, S) or (S,), sample_rate) pair; return float32 ``(C, S)`` on the CPU and the rate."""
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or rate <= 0:
        raise AudioError(f"reference audio (waveform, sample_rate): sample_rate {rate!r} must be a positive int (Hz)")
    if isinstance(wave, np.ndarray):
        wave = torch.from_numpy(np.ascontiguousarray(wave))
    if not isinstance(wave, torch.Tensor) or not wave.is_floating_point() or wave.dim() not in (1, 2):
        what = tuple(wave.shape) if hasattr(wave, "shape") else type(wave).__name__
        raise AudioError(f"reference audio (waveform, sample_rate): waveform {what} must be a float tensor or array "
                         "shaped (channels, samples) or (samples,)")
    wave = wave.detach().to("cpu", torch.float32)
    return (wave[None] if wave.dim() == 1 else wave), int(rate)


def audio_source_key(source: AudioSource) -> str:
    """Return a hash of a source's content: a file and its bytes hash alike; a waveform by rate, shape and values.

    A file is probed first (``moss_npu.wavfile.probe``), so one that is no recording, or claims more than the
    limits allow, is refused before it is read, and it is hashed in blocks: memory stays bounded at any size.
    """
    if isinstance(source, (str, Path)):
        digest = hashlib.sha256()
        with open(source, "rb") as fh:
            probe(fh, str(source))
            for block in iter(lambda: fh.read(2**20), b""):
                digest.update(block)
        return digest.hexdigest()
    if isinstance(source, (bytes, bytearray, memoryview)):
        return hashlib.sha256(bytes(source)).hexdigest()
    wave, rate, _ = read_audio_source(source)
    digest = hashlib.sha256(f"waveform {rate} {tuple(wave.shape)}".encode())
    digest.update(wave.contiguous().numpy().tobytes())
    return digest.hexdigest()


def _reduced(orig_hz: int, new_hz: int) -> tuple[int, int, float, int]:
    """The rates over their gcd, the cutoff in units of them (below both Nyquists) and the filters' half width."""
    gcd = math.gcd(int(orig_hz), int(new_hz))
    orig, new = int(orig_hz) // gcd, int(new_hz) // gcd
    cutoff = min(orig, new) * ROLLOFF
    return orig, new, cutoff, math.ceil(WIDTH * orig / cutoff)


def _sinc_kernel(orig: int, new: int, cutoff: float, width: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """Polyphase Hann-windowed sinc filters ``(new, 1, 2*width + orig)`` for gcd-reduced rates."""
    taps = torch.arange(-width, width + orig, dtype=dtype, device=device)[None, None] / orig
    # Row j is output phase j: time of each input tap relative to output sample j/new, in input periods.
    t = torch.arange(0, -new, -1, dtype=dtype, device=device)[:, None, None] / new + taps
    t = (t * cutoff).clamp(-WIDTH, WIDTH)
    window = torch.cos(t * math.pi / WIDTH / 2) ** 2
    t = t * math.pi
    kernel = torch.where(t == 0, torch.ones((), dtype=dtype, device=device), t.sin() / t)
    return kernel * (window * (cutoff / orig))


def resample(wave: torch.Tensor, orig_hz: int, new_hz: int) -> torch.Tensor:
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
    orig, new, cutoff, width = _reduced(orig_hz, new_hz)
    kernel = _sinc_kernel(orig, new, cutoff, width, wave.dtype, wave.device)
    shape = wave.shape
    flat = F.pad(wave.reshape(-1, shape[-1]), (width, width + orig))
    out = F.conv1d(flat[:, None], kernel, stride=orig)  # (N, new, blocks): phase j of each input block
    out = out.transpose(1, 2).reshape(flat.shape[0], -1)[:, : math.ceil(new * shape[-1] / orig)]
    return out.reshape(*shape[:-1], out.shape[-1])


def official_kernel_size(orig_hz: int, new_hz: int) -> int:
    """Elements of ``resample``'s filter bank for these rates (what it allocates and convolves with)."""
    orig, new, _, width = _reduced(orig_hz, new_hz)
    return new * (2 * width + orig)


def resample_reference(wave: torch.Tensor, orig_hz: int, new_hz: int, *, source: str = "audio") -> torch.Tensor:
    """Resample a reference ``(C, S)`` as the official code does (``resample``: the official codes), unless its filter
    bank would exceed ``OFFICIAL_KERNEL_LIMIT``: then with soxr's very-high-quality resampler and one log line."""
    if orig_hz == new_hz or official_kernel_size(orig_hz, new_hz) <= OFFICIAL_KERNEL_LIMIT:
        return resample(wave, orig_hz, new_hz)
    log.warning("%s at %d Hz: the official resampler would need a %d-element filter bank; resampled with soxr "
                "instead (codes may differ slightly from the official runtime's)", source, orig_hz,
                official_kernel_size(orig_hz, new_hz))
    out = soxr.resample(wave.detach().cpu().numpy().T.astype(np.float32), orig_hz, new_hz, quality="VHQ")
    return torch.from_numpy(np.ascontiguousarray(out.T)).to(wave.dtype)


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


def load_reference_audio(source: AudioSource, sample_rate: int = 48000, channels: int = 2, *,
                         min_samples: int = 1) -> torch.Tensor:
    """Load a voice prompt (an ``AudioSource``) as float32 ``(channels, S)`` at ``sample_rate``, the official
    reference path (``resample_reference``, ``to_channels``).

    Raises:
        AudioError: missing, undecodable, non-finite, empty, shorter than ``min_samples`` after resampling (e.g.
            one codec frame), all zeros or more than 2 channels.
    """
    wave, rate, path = read_audio_source(source)  # ``path`` names the source in messages
    if not bool(torch.isfinite(wave).all()):
        raise AudioError(f"reference audio {path}: holds non-finite samples (NaN or infinity); re-export the "
                         "recording as 16-bit WAV")
    if wave.shape[-1] == 0:
        raise AudioError(f"reference audio {path}: no samples; record at least {min_samples / sample_rate:.2f} s")
    if wave.shape[0] > 2:
        wave = to_channels(wave, channels, source=f"reference audio {path}")
    wave = to_channels(resample_reference(wave, rate, sample_rate, source=f"reference audio {path}"), channels,
                       source=f"reference audio {path}")
    if wave.shape[-1] < min_samples:
        raise AudioError(f"reference audio {path}: {wave.shape[-1] / sample_rate:.3f} s is shorter than the "
                         f"{min_samples / sample_rate:.3f} s minimum; use a longer recording")
    if not bool(wave.abs().max() > 0):
        raise AudioError(f"reference audio {path}: all samples are zero (silent); use a recording of the voice")
    return wave.contiguous()
