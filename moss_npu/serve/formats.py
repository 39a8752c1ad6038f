"""Audio out of the server: resample / downmix on the fly, then PCM, streaming WAV, or a whole encoded file.

The model speaks 48 kHz stereo float. A request may ask for another rate and channel count; the conversion
runs chunk by chunk (``StreamConverter``) so streamed audio equals the converted whole to float rounding.
Formats: ``pcm`` (s16le, interleaved, no header), ``wav`` (16-bit; a streaming header with unknown sizes when
streamed), ``flac``, ``mp3``, ``opus`` (Ogg) through soundfile, whole files only.
"""

from __future__ import annotations

import io
import math
import struct
from typing import Optional

import numpy as np
import soundfile
import torch

from moss_npu.audio import resample, to_channels

FORMATS = ("wav", "pcm", "flac", "mp3", "opus")
STREAMABLE = ("wav", "pcm")
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg",
               "opus": "audio/ogg"}
_SOUNDFILE = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"),
              "opus": ("OGG", "OPUS")}
# Rates the encoders accept (libsndfile's MP3 and Opus encoders refuse the others).
RATES = {"mp3": (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000),
         "opus": (8000, 12000, 16000, 24000, 48000)}
MIN_RATE, MAX_RATE = 8000, 192000
_LOWPASS_WIDTH, _ROLLOFF = 6, 0.99  # moss_npu.audio.resample's defaults


def check_output(fmt: str, sample_rate: int, channels: int) -> Optional[str]:
    """Return why ``fmt`` at ``sample_rate`` / ``channels`` cannot be produced, or None when it can."""
    if fmt not in FORMATS:
        return f"response_format {fmt!r}: unsupported; use one of {', '.join(FORMATS)}"
    if channels not in (1, 2):
        return f"channels {channels}: use 1 (mono) or 2 (stereo)"
    if not MIN_RATE <= sample_rate <= MAX_RATE:
        return f"sample_rate {sample_rate}: use {MIN_RATE}..{MAX_RATE} Hz"
    if fmt in RATES and sample_rate not in RATES[fmt]:
        return f"sample_rate {sample_rate}: {fmt} supports {', '.join(map(str, RATES[fmt]))} Hz"
    return None


class StreamConverter:
    """Resample ``(C, n)`` chunks from ``source_hz`` to ``target_hz`` and map them to ``channels``.

    Resampling works on whole blocks of the gcd-reduced rates: a block's outputs are emitted once the filter's
    right context has arrived, and enough left context is kept, so the pieces equal ``resample`` of the whole.
    """

    def __init__(self, source_hz: int, target_hz: int, channels: int) -> None:
        self.source_hz, self.target_hz, self.channels = source_hz, target_hz, channels
        gcd = math.gcd(source_hz, target_hz)
        self._orig, self._new = source_hz // gcd, target_hz // gcd
        cutoff = min(self._orig, self._new) * _ROLLOFF
        self._width = math.ceil(_LOWPASS_WIDTH * self._orig / cutoff)
        self._buffer: Optional[torch.Tensor] = None
        self._start = 0  # input index of the buffer's first sample (a block boundary)
        self._done = 0  # blocks emitted so far
        self._total = 0  # input samples seen

    def push(self, wave: torch.Tensor) -> torch.Tensor:
        """Convert the next chunk; return the samples that are final now (possibly none)."""
        if self.source_hz == self.target_hz:
            return to_channels(wave, self.channels)
        self._buffer = wave if self._buffer is None else torch.cat([self._buffer, wave], dim=1)
        self._total += wave.shape[1]
        ready = max(self._done, (self._total - self._width) // self._orig)
        return self._emit(ready, final=False)

    def flush(self) -> torch.Tensor:
        """Return the rest once the input has ended."""
        if self.source_hz == self.target_hz or self._buffer is None:
            return torch.zeros(self.channels, 0)
        return self._emit(None, final=True)

    def _emit(self, ready: Optional[int], final: bool) -> torch.Tensor:
        first = self._start // self._orig
        out = resample(self._buffer, self.source_hz, self.target_hz)
        begin = (self._done - first) * self._new
        end = out.shape[1] if final else (ready - first) * self._new
        piece = out[:, begin:end]
        if not final:
            self._done = ready
            keep = max(0, (self._done * self._orig - self._width) // self._orig * self._orig)
            self._buffer = self._buffer[:, keep - self._start:]
            self._start = keep
        return to_channels(piece, self.channels)


def pcm16(wave: torch.Tensor) -> bytes:
    """Return ``(C, n)`` float audio as interleaved little-endian signed 16-bit samples (clipped)."""
    samples = np.clip(wave.detach().cpu().numpy().T, -1.0, 1.0)
    return (np.round(samples * 32767.0)).astype("<i2").tobytes()


def wav_stream_header(sample_rate: int, channels: int) -> bytes:
    """Return a 16-bit PCM WAV header whose sizes say "unknown" (0xFFFFFFFF), for audio of open length."""
    block = channels * 2
    return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE" + b"fmt "
            + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block, block, 16)
            + b"data" + struct.pack("<I", 0xFFFFFFFF))


def encode_file(wave: torch.Tensor, sample_rate: int, fmt: str) -> bytes:
    """Encode a whole ``(C, S)`` waveform as ``fmt`` (``pcm`` is headerless)."""
    if fmt == "pcm":
        return pcm16(wave)
    container, subtype = _SOUNDFILE[fmt]
    out = io.BytesIO()
    samples = np.clip(wave.detach().cpu().numpy().T, -1.0, 1.0)
    soundfile.write(out, samples, sample_rate, format=container, subtype=subtype)
    return out.getvalue()
