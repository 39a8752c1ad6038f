"""Audio out of the server: resample / downmix chunk by chunk, then PCM, streaming WAV, or a whole encoded file.

The conversion runs on the stream (``StreamConverter``), so a whole file is the joined stream. ``pcm`` is s16le
without a header; ``wav`` streams with a header of open sizes; ``flac``, ``mp3`` and ``opus`` (Ogg) are whole
files through soundfile; ``sample_format`` asks for 24-bit or float whole files (docs/serving.md#request-body).
"""

from __future__ import annotations

import io
import struct
from typing import Optional

import numpy as np
import soundfile
import soxr
import torch

from moss_npu.audio import to_channels
from moss_npu.serve.errors import shown

FORMATS = ("wav", "pcm", "flac", "mp3", "opus")
STREAMABLE = ("wav", "pcm")
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg",
               "opus": "audio/ogg"}
_SOUNDFILE = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"),
              "opus": ("OGG", "OPUS")}
SAMPLE_FORMATS = {"s16": None, "s24": "PCM_24", "f32": "FLOAT"}  # None: the format's own (above)
DEEPER = {"s24": ("wav", "flac"), "f32": ("wav",)}  # the whole-file formats that hold them
# Rates the encoders accept (libsndfile's MP3 and Opus encoders refuse the others).
RATES = {"mp3": (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000),
         "opus": (8000, 12000, 16000, 24000, 48000)}
MIN_RATE, MAX_RATE = 8000, 192000


def check_output(fmt: str, sample_rate: int, channels: int, sample_format: str = "s16",
                 streamed: bool = False) -> Optional[str]:
    """Return why ``fmt`` at ``sample_rate`` / ``channels`` / ``sample_format`` cannot be produced, or None."""
    if fmt not in FORMATS:
        return f"response_format {shown(fmt)}: unsupported; use one of {', '.join(FORMATS)}"
    if streamed and fmt not in STREAMABLE:
        return (f"response_format {fmt} cannot stream; use pcm or wav, or ask for whole files (stream false; "
                "stream_audio false in a session)")
    if sample_format not in SAMPLE_FORMATS:
        return f"sample_format {shown(sample_format)}: use one of {', '.join(SAMPLE_FORMATS)}"
    if sample_format != "s16" and (streamed or fmt not in DEEPER[sample_format]):
        return (f"sample_format {sample_format}: only whole {' or '.join(DEEPER[sample_format])} files hold it "
                "(streams are s16; ask for whole files with stream false, or stream_audio false in a session)")
    if channels not in (1, 2):
        return f"channels {channels}: use 1 (mono) or 2 (stereo)"
    if not MIN_RATE <= sample_rate <= MAX_RATE:
        return f"sample_rate {sample_rate}: use {MIN_RATE}..{MAX_RATE} Hz"
    if fmt in RATES and sample_rate not in RATES[fmt]:
        return f"sample_rate {sample_rate}: {fmt} supports {', '.join(map(str, RATES[fmt]))} Hz"
    return None


class StreamConverter:
    """Resample ``(C, n)`` chunks from ``source_hz`` to ``target_hz`` and map them to ``channels``.

    soxr's streaming resampler (HQ) keeps its filter state between chunks and never revisits what it emitted,
    so time and memory are linear in the audio at any pair of rates, and the pieces of a stream join into
    what one call over the whole gives. The output is not the official resampler's: no official output
    exists at other rates.
    """

    def __init__(self, source_hz: int, target_hz: int, channels: int) -> None:
        self.source_hz, self.target_hz, self.channels = source_hz, target_hz, channels
        self._stream: Optional[soxr.ResampleStream] = None
        self._source_channels: Optional[int] = None

    def push(self, wave: torch.Tensor) -> torch.Tensor:
        """Convert the next chunk; return the samples that are final now (possibly none)."""
        if self.source_hz == self.target_hz:
            return to_channels(wave, self.channels)
        if self._stream is None:
            self._source_channels = wave.shape[0]
            self._stream = soxr.ResampleStream(self.source_hz, self.target_hz, wave.shape[0], dtype="float32",
                                               quality="HQ")
        return self._resampled(wave.detach().cpu().numpy().T, last=False)

    def flush(self) -> torch.Tensor:
        """Return the rest once the input has ended."""
        if self._stream is None:
            return torch.zeros(self.channels, 0)
        return self._resampled(np.zeros((0, self._source_channels), dtype=np.float32), last=True)

    def _resampled(self, samples: np.ndarray, last: bool) -> torch.Tensor:
        out = self._stream.resample_chunk(np.ascontiguousarray(samples, dtype=np.float32), last=last)
        return to_channels(torch.from_numpy(np.ascontiguousarray(out.T)), self.channels)


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


def encode_file(wave: torch.Tensor, sample_rate: int, fmt: str, sample_format: str = "s16") -> bytes:
    """Encode a whole ``(C, S)`` waveform as ``fmt`` (``pcm`` is headerless) in ``sample_format`` (checked by
    ``check_output``)."""
    if fmt == "pcm":
        return pcm16(wave)
    container, subtype = _SOUNDFILE[fmt]
    subtype = SAMPLE_FORMATS[sample_format] or subtype
    out = io.BytesIO()
    samples = np.clip(wave.detach().cpu().numpy().T, -1.0, 1.0)
    soundfile.write(out, samples, sample_rate, format=container, subtype=subtype)
    return out.getvalue()
