"""Audio I/O: torchaudio-equivalent resampling, real recordings, channel rules, bad input, atomic writes."""

import io
import math
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from moss_npu.audio import audio_source_key, load_reference_audio, read_audio, resample, to_channels
from moss_npu.errors import AudioError
from moss_npu_verify.goldens import fixtures_root
from tests.optional import needs

AUDIO = fixtures_root() / "audio"
NANO = fixtures_root() / "nano-tiny"
needs_audio = needs(AUDIO.is_dir(), f"fixtures not found at {AUDIO} (set MOSS_NPU_FIXTURES)")


def _direct_resample(x: np.ndarray, orig: int, new: int, width: int = 6, rolloff: float = 0.99) -> np.ndarray:
    """y[m] = sum_i x[i] * (c/orig) * sinc(t) * cos^2(pi t / 2w), t = c (i/orig - m/new), |t| < w,
    c = rolloff * min(orig, new) on gcd-reduced rates: the band-limited interpolation formula, in float64."""
    g = math.gcd(orig, new)
    orig, new = orig // g, new // g
    c = rolloff * min(orig, new)
    i = np.arange(len(x))
    out = np.empty(math.ceil(len(x) * new / orig))
    for m in range(len(out)):
        t = c * (i / orig - m / new)
        h = np.where(np.abs(t) < width, np.sinc(t) * np.cos(np.pi * t / (2 * width)) ** 2, 0.0)
        out[m] = np.dot(x, h) * c / orig
    return out


@pytest.mark.parametrize("orig, new", [(44100, 48000), (16000, 48000), (48000, 16000), (24000, 48000), (7, 5)],
                         ids=lambda r: str(r))
def test_resample_equals_direct_sinc_formula(orig, new):
    """In float64 the filters are exact; float32 input (the golden test) rounds them the way torchaudio does."""
    x = np.random.default_rng(0).uniform(-1, 1, 700)
    ours = resample(torch.from_numpy(x)[None], orig, new)[0].numpy()
    np.testing.assert_allclose(ours, _direct_resample(x, orig, new), atol=1e-9, rtol=0)


@pytest.mark.parametrize("length", [1, 99, 100, 441, 1000])
def test_resample_length_is_ceil(length):
    assert resample(torch.zeros(2, length), 44100, 48000).shape == (2, math.ceil(length * 48000 / 44100))


def test_resample_same_rate_is_identity():
    x = torch.randn(1, 50)
    assert resample(x, 48000, 48000) is x


def test_resample_keeps_a_passband_tone_and_removes_an_alias():
    """A 1 kHz tone survives 44.1 -> 48 kHz; a 10 kHz tone (above 8 kHz Nyquist) is filtered out by 48 -> 16 kHz."""
    n = np.arange(44100)
    y = resample(torch.from_numpy(np.sin(2 * np.pi * 1000 * n / 44100)).float()[None], 44100, 48000)[0].numpy()
    m = np.arange(len(y))
    interior = slice(1000, len(y) - 1000)
    assert np.abs(y - np.sin(2 * np.pi * 1000 * m / 48000))[interior].max() < 1e-2
    high = torch.from_numpy(np.sin(2 * np.pi * 10000 * np.arange(48000) / 48000)).float()[None]
    assert resample(high, 48000, 16000)[0, 1000:-1000].abs().max() < 1e-2


@needs_audio
@pytest.mark.parametrize("name, kind, rate, channels", [
    ("zh_1.wav", "FLAC", 44100, 1), ("en_7.wav", "MP3", 44100, 2),
    ("en_3.wav", "WAV", 48000, 1), ("zh_3.wav", "WAV", 16000, 1)], ids=lambda v: str(v))
def test_real_recordings_read_by_content(name, kind, rate, channels):
    """File names lie (the audio fixture holds MP3 and FLAC files named .wav): format, rate and channels come from the content."""
    assert soundfile.info(str(AUDIO / name)).format == kind
    wave, got_rate = read_audio(AUDIO / name)
    assert (got_rate, wave.shape[0], wave.dtype) == (rate, channels, torch.float32)
    assert 0 < wave.abs().max() <= 1.0
    ref = load_reference_audio(AUDIO / name, 48000, 2, min_samples=3840)
    assert ref.shape == (2, math.ceil(wave.shape[1] * 48000 / rate))
    if channels == 1:
        assert torch.equal(ref[0], ref[1])


@needs_audio
def test_mp3_is_readable_by_this_libsndfile():
    assert "MP3" in soundfile.available_formats(), (
        f"libsndfile {soundfile.__libsndfile_version__} cannot read MP3; pip install -U 'soundfile>=0.12.1'")


def test_pcm16_scales_by_32768(tmp_path):
    soundfile.write(str(tmp_path / "a.wav"), np.array([-32768, -1, 0, 16384, 32767], dtype=np.int16), 8000,
                    subtype="PCM_16")
    wave, _ = read_audio(tmp_path / "a.wav")
    assert wave[0].tolist() == [-1.0, -1 / 32768, 0.0, 0.5, 32767 / 32768]


@needs((NANO / "cases.json").is_file(), f"fixture not found at {NANO}")
def test_reference_golden_of_the_official_loader():
    expected = np.load(NANO / "goldens" / "load_reference_output.npy")
    wave = load_reference_audio(NANO / "goldens" / "reference.wav", 48000, 2)
    assert np.abs(wave[:, : expected.shape[1]].numpy() - expected).max() <= 1e-5


def test_channel_rules():
    mono, stereo = torch.randn(1, 10), torch.randn(2, 10)
    assert torch.equal(to_channels(mono, 2), mono.repeat(2, 1))
    assert torch.equal(to_channels(stereo, 1), stereo.mean(0, keepdim=True))
    with pytest.raises(AudioError, match="6 channels"):
        to_channels(torch.zeros(6, 10), 2)


def _write(path: Path, data: np.ndarray, rate: int = 16000, subtype: str = "PCM_16") -> Path:
    soundfile.write(str(path), data, rate, subtype=subtype)
    return path


@pytest.mark.parametrize("make, match", [
    (lambda p: p / "missing.wav", "not found"),
    (lambda p: (p / "junk.wav").write_bytes(b"RIFF not really audio" * 10) and p / "junk.wav", "cannot decode"),
    (lambda p: _write(p / "empty.wav", np.zeros((0, 1))), "no samples"),
    (lambda p: _write(p / "short.wav", np.full(100, 0.1)), "shorter"),
    (lambda p: _write(p / "silent.wav", np.zeros(16000)), "all samples are zero"),
    (lambda p: _write(p / "surround.wav", np.full((16000, 3), 0.1)), "3 channels"),
    (lambda p: _write(p / "nan.wav", np.where(np.arange(16000) % 7, 0.1, np.nan), subtype="FLOAT"), "non-finite"),
    (lambda p: _write(p / "nan.wav", np.full(16000, np.nan), subtype="FLOAT"), "non-finite"),
], ids=["missing", "unreadable", "empty", "too-short", "silent", "three-channels", "some-nan", "all-nan"])
def test_bad_reference_audio_raises_one_line(tmp_path, make, match):
    with pytest.raises(AudioError, match=match) as info:
        load_reference_audio(make(tmp_path), 48000, 2, min_samples=3840)
    assert "\n" not in str(info.value)


def _silence(channels: int, rate: int, seconds: int, container: str = "FLAC") -> bytes:
    out = io.BytesIO()
    subtype = "MPEG_LAYER_III" if container == "MP3" else "PCM_16"
    with soundfile.SoundFile(out, "w", samplerate=rate, channels=channels, format=container, subtype=subtype) as fh:
        for _ in range(seconds):
            fh.write(np.zeros((rate, channels), dtype=np.int16))
    return out.getvalue()


@pytest.mark.parametrize("channels, rate, seconds, container, problem", [
    (8, 655_350, 30, "FLAC", "8 channels"),
    (2, 655_350, 2, "FLAC", "sample rate 655350 Hz"),
    (1, 48_000, 130, "FLAC", "130.0 s long"),
    (1, 8_000, 130, "MP3", "130.0 s long"),
], ids=["8-channels", "655kHz", "longer-than-the-limit", "mp3-longer-than-the-limit"])
def test_a_recording_is_judged_by_its_header_before_it_is_decoded(channels, rate, seconds, container, problem):
    """A small file that decodes to hundreds of megabytes is refused without allocating them."""
    if container not in soundfile.available_formats():
        pytest.skip(f"libsndfile {soundfile.__libsndfile_version__} has no {container}")
    data = _silence(channels, rate, seconds, container)
    tracemalloc.start()
    try:
        with pytest.raises(AudioError, match=problem):
            load_reference_audio(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 * 2**20, peak


def test_a_huge_file_that_is_no_recording_is_refused_before_it_is_hashed(tmp_path):
    """The reference cache's key once read the whole file first (a 2 GB sparse file: 2.4 GB of memory)."""
    path = tmp_path / "zeros.wav"
    with open(path, "wb") as fh:
        os.truncate(fh.fileno(), 256 * 2**20)
    with pytest.raises(AudioError, match="cannot decode"):
        audio_source_key(path)
