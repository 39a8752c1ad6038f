"""The pipeline's own behaviour beyond the goldens: reference cache, chunk batching, streaming cost, settings."""

import pytest
import torch

from moss_npu import goldens
from moss_npu.errors import ConfigError, InputError
from moss_npu.tts import MossTTSNano, RunConfig
from moss_npu.tts.settings import load_preset, merge

NANO = goldens.fixtures_root() / "nano-tiny"
REFERENCE = NANO / "goldens" / "reference.wav"
needs_fixtures = pytest.mark.skipif(not NANO.is_dir(), reason=f"fixtures not found at {NANO} (set MOSS_NPU_FIXTURES)")
GREEDY = dict(device="cpu", do_sample=False, audio_repetition_penalty=1.0)


@pytest.fixture(scope="module")
def tts():
    if not NANO.is_dir():
        pytest.skip(f"fixtures not found at {NANO} (set MOSS_NPU_FIXTURES)")
    return MossTTSNano.from_pretrained(str(NANO / "tts"), str(NANO / "codec"), device="cpu")


def count_calls(monkeypatch, obj, name):
    calls = []
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapper)
    return calls


@needs_fixtures
def test_reference_is_encoded_once_per_file_content(tts, monkeypatch, tmp_path):
    calls = count_calls(monkeypatch, tts.codec, "encode")
    settings = RunConfig(**GREEDY, max_new_frames=2)
    tts.synthesize("One.", prompt_audio=REFERENCE, settings=settings)
    copy = tmp_path / "same_voice.flac"
    copy.write_bytes(REFERENCE.read_bytes())  # another name, same content: still cached
    tts.synthesize("Two.", prompt_audio=copy, settings=settings)
    assert len(calls) <= 1  # 0 when an earlier test already cached it


@needs_fixtures
def test_batched_chunks_equal_sequential_chunks(tts):
    """Left-padded batches (what NPU/CUDA do from free memory) give the same codes as one chunk at a time."""
    text = "First part of it. Second part here. The third part. And the fourth one."
    one = tts.synthesize(text, prompt_audio=REFERENCE,
                         settings=RunConfig(**GREEDY, max_new_frames=4, voice_clone_max_text_tokens=6))
    many = tts.synthesize(text, prompt_audio=REFERENCE,
                          settings=RunConfig(**GREEDY, max_new_frames=4, voice_clone_max_text_tokens=6,
                                             tts_max_batch_size=3))
    assert len(one.text_chunks) >= 3 and one.batch_size == 1 and many.batch_size == 3
    assert torch.equal(one.codes, many.codes)
    assert one.waveform.shape == many.waveform.shape


@needs_fixtures
def test_streaming_decodes_each_frame_once(tts, monkeypatch):
    """O(N) codec work: N generated frames cost N decoder frames in total, however the schedule slices them."""
    states = []
    original = tts.codec.init_decode_state

    def spy(*args, **kwargs):
        states.append(original(*args, **kwargs))
        return states[-1]

    monkeypatch.setattr(tts.codec, "init_decode_state", spy)
    frames = 20
    chunks = list(tts.synthesize_stream("Count the frames.", settings=RunConfig(**GREEDY, max_new_frames=frames)))
    audio = sum(c.waveform.shape[-1] for c in chunks)
    assert audio == frames * tts.codec.frame_size
    assert states[0].frames_processed == frames
    assert len(chunks) > 1


def test_presets_reject_unknown_keys(tmp_path):
    preset = tmp_path / "bad.yaml"
    preset.write_text("device: cpu\ntemprature: 0.5\n")
    with pytest.raises(ConfigError, match="unknown keys temprature"):
        load_preset(preset)


def test_precedence_default_preset_flag(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("max_new_frames: 100\naudio_top_k: 10\nstream_budgets: [2, 4, 8, 12]\n")
    settings = merge(load_preset(preset), {"max_new_frames": 50, "audio_top_k": None})
    assert settings.max_new_frames == 50  # flag beats preset
    assert settings.audio_top_k == 10  # an unset flag leaves the preset value
    assert settings.text_top_k == 50  # default where neither sets it
    assert settings.schedule().budgets == (2, 4, 8, 12)


@pytest.mark.parametrize("preset", ["cpu", "cuda", "npu"])
def test_shipped_presets_load(preset):
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / f"{preset}.yaml"
    settings = merge(load_preset(path))
    assert settings.device.startswith(preset)


def test_bad_settings():
    with pytest.raises(InputError, match="--mode"):
        RunConfig(mode="sing")
    with pytest.raises(InputError, match="top_p"):
        RunConfig(audio_top_p=0.0)
    with pytest.raises(ConfigError, match="budgets"):
        RunConfig(stream_budgets=(1, 2))


@needs_fixtures
def test_settings_seed_makes_sampled_runs_repeatable_without_global_state(tts):
    """RunConfig.seed seeds a generator of the pipeline's own (as torch.manual_seed(seed) would draw)."""
    settings = RunConfig(device="cpu", max_new_frames=4, seed=1)
    torch.manual_seed(123)
    a = tts.synthesize("Seeded.", settings=settings)
    torch.manual_seed(456)
    b = tts.synthesize("Seeded.", settings=settings)
    assert torch.equal(a.codes, b.codes)
    torch.manual_seed(1)
    c = tts.synthesize("Seeded.", settings=RunConfig(device="cpu", max_new_frames=4))
    assert torch.equal(a.codes, c.codes)  # same draws as the official global seeding


@needs_fixtures
def test_non_finite_low_precision_falls_back_to_float32(monkeypatch):
    """Like the official inference: a NumericalError in bf16 recasts the LM to float32 and generates again."""
    from moss_npu.errors import NumericalError
    from moss_npu.tts import pipeline as module

    tts = MossTTSNano.from_pretrained(str(NANO / "tts"), str(NANO / "codec"), device="cpu", dtype="bfloat16")
    original, calls = module.MossTTSNano._generate_batch, []

    def flaky(self, *args, **kwargs):
        calls.append(self.model.dtype)
        if self.model.dtype != torch.float32:
            raise NumericalError("Non-finite text logits by frame 0 (dtype torch.bfloat16); rerun the model in float32")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(module.MossTTSNano, "_generate_batch", flaky)
    result = tts.synthesize("Fallback.", settings=RunConfig(**GREEDY, max_new_frames=2))
    assert calls == [torch.bfloat16, torch.float32] and result.codes.shape[0] == 2
    with pytest.raises(NumericalError):
        tts.model.to(torch.bfloat16)
        tts.synthesize("No fallback.", settings=RunConfig(**GREEDY, max_new_frames=2, stability_fallback=False))
