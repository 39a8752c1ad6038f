"""Audio out of the server without a server: chunked conversion, PCM, WAV headers, encoder limits."""

import io

import numpy as np
import pytest
import soundfile
import torch

import soxr

from moss_npu.audio import to_channels
from moss_npu.serve.formats import StreamConverter, check_output, encode_file, pcm16, wav_stream_header


@pytest.mark.parametrize("rate,channels", [(24000, 1), (22050, 2), (16000, 2), (44100, 1), (48000, 1), (44099, 2),
                                          (8001, 1), (192000, 2)])
def test_chunked_conversion_equals_converting_the_whole(rate, channels):
    """Any rate, odd ones included (44099 shares no factor with 48000: the official sinc bank would be ~9 GB)."""
    wave = torch.randn(2, 30000, generator=torch.Generator().manual_seed(0))
    converter = StreamConverter(48000, rate, channels)
    pieces, start = [], 0
    for size in (3840, 1, 7680, 999, 12000, 5480):
        pieces.append(converter.push(wave[:, start:start + size]))
        start += size
    pieces.append(converter.flush())
    whole = soxr.resample(wave.numpy().T, 48000, rate, quality="HQ").T.copy()
    whole = whole if rate != 48000 else wave.numpy()
    assert torch.equal(torch.cat(pieces, dim=1), to_channels(torch.from_numpy(whole), channels))


def test_pcm16_is_interleaved_clipped_little_endian():
    wave = torch.tensor([[0.5, 2.0], [-0.5, -2.0]])
    assert np.frombuffer(pcm16(wave), dtype="<i2").tolist() == [16384, -16384, 32767, -32767]


def test_streaming_wav_header_reads_back():
    wave = torch.rand(2, 500) - 0.5
    samples, rate = soundfile.read(io.BytesIO(wav_stream_header(24000, 2) + pcm16(wave)), dtype="float32")
    assert rate == 24000 and samples.shape == (500, 2)


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus"])
def test_whole_files_decode(fmt):
    wave = 0.3 * torch.sin(torch.arange(48000) / 10.0).repeat(2, 1)
    samples, rate = soundfile.read(io.BytesIO(encode_file(wave, 48000, fmt)))
    assert rate == 48000 and samples.shape[1] == 2 and abs(samples.shape[0] - 48000) < 4000


def test_output_checks_name_the_problem():
    assert check_output("wav", 48000, 2) is None
    assert "aac" in check_output("aac", 48000, 2)
    assert "opus" in check_output("opus", 44100, 2)
    assert "channels" in check_output("pcm", 48000, 3)
    assert "sample_rate" in check_output("pcm", 1000, 1)
