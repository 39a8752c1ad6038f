"""Delay reference audio is prepared as the official llama.cpp pipeline prepares it (docs/delay.md#reference-audio).

Upstream: ``soundfile.read(path, dtype="float32")``, channel mean, ``librosa.resample(wav, orig_sr=sr,
target_sr=24000)`` with librosa's defaults, then the loudness normalisation. librosa's defaults come from
``librosa.resample``'s signature (librosa >= 0.10, ``librosa/core/audio.py``): ``res_type="soxr_hq"``,
``fix=True``, ``scale=False``; it calls ``soxr.resample(y, orig_sr, target_sr, quality=res_type)`` and
``librosa.util.fix_length`` to ``ceil(len(y) * target_sr / orig_sr)`` samples. The expected values below
are computed that way with ``soxr`` directly, on the real recordings of ../shared/fixtures/audio.
"""

import math

import numpy as np
import pytest
import soundfile as sf

from moss_npu.delay.reference import load_reference, loudness_normalize
from moss_npu.errors import AudioError
from moss_npu_verify.goldens import fixtures_root
from tests.optional import missing

AUDIO = fixtures_root() / "audio"
RECORDINGS = ["zh_1.wav", "en_7.wav", "en_3.wav", "zh_3.wav"]  # FLAC 44.1k, MP3 stereo 44.1k, WAV 48k, WAV 16k


@pytest.fixture(scope="module")
def audio_dir():
    if not AUDIO.is_dir():
        missing(f"recordings not found at {AUDIO} (set MOSS_NPU_FIXTURES)")
    return AUDIO


def librosa_default_reference(path, target=24000):
    """The official steps, with librosa.resample's defaults written out through soxr."""
    import soxr

    wav, sr = sf.read(str(path), dtype="float32")
    if wav.ndim > 1:
        wav = wav.mean(axis=1)
    if sr != target:
        n = math.ceil(wav.shape[-1] * float(target) / sr)
        wav = soxr.resample(wav, sr, target, quality="soxr_hq")  # the string librosa passes
        wav = wav[:n] if wav.shape[-1] >= n else np.pad(wav, (0, n - wav.shape[-1]))
    return np.asarray(wav, dtype=np.float32)


@pytest.mark.parametrize("name", RECORDINGS)
def test_reference_matches_soxr_with_librosa_defaults(audio_dir, name):
    expected = librosa_default_reference(audio_dir / name)
    got = load_reference(audio_dir / name, 24000)
    decoded, rate = sf.read(str(audio_dir / name), dtype="float32")  # MP3: sf.info's frame count is an estimate
    assert got.dtype == np.float32 and got.ndim == 1
    assert got.shape[0] == math.ceil(decoded.shape[0] * 24000 / rate)
    np.testing.assert_array_equal(got, expected)


def test_stereo_becomes_the_channel_mean_before_resampling(tmp_path):
    t = np.arange(4800) / 48000.0
    left, right = np.sin(2 * np.pi * 300 * t), 0.5 * np.sin(2 * np.pi * 500 * t)
    sf.write(tmp_path / "s.wav", np.stack([left, right], axis=1).astype(np.float32), 48000, subtype="FLOAT")
    sf.write(tmp_path / "m.wav", ((left + right) / 2).astype(np.float32), 48000, subtype="FLOAT")
    np.testing.assert_allclose(load_reference(tmp_path / "s.wav", 24000), load_reference(tmp_path / "m.wav", 24000),
                               atol=1e-6)  # float32 rounding of the mean


def test_a_recording_at_the_codec_rate_is_not_resampled(tmp_path):
    wave = (0.3 * np.sin(np.arange(2400) / 5.0)).astype(np.float32)
    sf.write(tmp_path / "r.wav", wave, 24000, subtype="FLOAT")
    np.testing.assert_array_equal(load_reference(tmp_path / "r.wav", 24000), wave)


def test_silent_and_missing_recordings_are_errors(tmp_path):
    sf.write(tmp_path / "z.wav", np.zeros(1000, dtype=np.float32), 16000)
    with pytest.raises(AudioError, match="silent"):
        load_reference(tmp_path / "z.wav", 24000)
    with pytest.raises(AudioError, match="not found"):
        load_reference(tmp_path / "missing.wav", 24000)


def test_a_recording_with_nan_samples_is_called_non_finite(tmp_path):
    wave = np.zeros(16000, dtype=np.float32)
    wave[100:200] = np.nan  # the rest is silence: the silence check alone would not see the NaN
    sf.write(tmp_path / "nan.wav", wave, 16000, subtype="FLOAT")
    with pytest.raises(AudioError, match="non-finite"):
        load_reference(tmp_path / "nan.wav", 24000)


def test_loudness_normalisation_moves_at_most_3_db_towards_minus_20_dbfs():
    quiet = np.full(100, 0.01, dtype=np.float32)   # -40 dBFS: +3 dB at most
    loud = np.full(100, 0.5, dtype=np.float32)     # about -6 dBFS: -3 dB at most
    near = np.full(100, 0.09, dtype=np.float32)    # about -20.9 dBFS: moved exactly to -20
    assert loudness_normalize(quiet)[0] == pytest.approx(0.01 * 10 ** (3 / 20), rel=1e-6)
    assert loudness_normalize(loud)[0] == pytest.approx(0.5 * 10 ** (-3 / 20), rel=1e-6)
    assert 20 * np.log10(loudness_normalize(near)[0]) == pytest.approx(-20.0, abs=1e-4)
