"""The llama.cpp pipeline on the delay-tiny weights: context cap, KV reset, synthesis with the test codec."""

import dataclasses
import sys

import numpy as np
import pytest

from moss_npu.delay.backbone import import_llama_cpp
from moss_npu.delay.config import DelayRunConfig
from moss_npu_verify.make_test_codec import write_test_codec
from moss_npu.errors import CheckpointError, ConfigError, DeviceError, GenerationError, InputError

EXACT = dict(n_ctx=512, n_threads=1, n_gpu_layers=0, kv_cache_type_k="f32", kv_cache_type_v="f32",
             flash_attn="disabled", heads_backend="numpy", audio_provider="cpu", max_new_tokens=60)


def test_without_llama_cpp_the_error_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(DeviceError, match=r'pip install -e "\.\[llama\]"'):
        import_llama_cpp()


@pytest.fixture(scope="module")
def pipeline(delay_fixture, llama_cpp, tmp_path_factory):
    from moss_npu.delay.codec_onnx import OnnxCodec
    from moss_npu.delay.pipeline import DelayPipeline
    from moss_npu.delay.weights import DelayWeights

    codec = OnnxCodec(write_test_codec(tmp_path_factory.mktemp("codec"))[0].parent, "cpu")
    with DelayPipeline(DelayWeights.open(delay_fixture / "weights"), DelayRunConfig(**EXACT), codec) as pipe:
        yield pipe


def test_repeated_runs_with_one_seed_agree(pipeline):
    """The KV cache is cleared per utterance: a second run does not see the first."""
    first = pipeline.generate("Hello world!", seed=5, record=True)
    second = pipeline.generate("Hello world!", seed=5, record=True)
    assert np.array_equal(first.rows, second.rows)
    assert np.array_equal(first.hidden, second.hidden)


def test_max_new_tokens_is_capped_by_the_context(pipeline, caplog):
    prompt_rows = pipeline.generate("Hello world!", max_new_tokens=1).prompt.shape[0]
    result = pipeline.generate("Hello world!", max_new_tokens=10_000, seed=1)
    assert result.max_new_tokens == pipeline.backbone.n_ctx - prompt_rows
    assert result.rows.shape[0] <= result.max_new_tokens
    assert "capped" in caplog.text


def test_a_prompt_longer_than_the_context_is_an_error(pipeline):
    with pytest.raises(InputError, match="n_ctx"):
        pipeline.generate("Hello world! " * 400)


def test_synthesize_returns_24khz_mono_float32(pipeline):
    frames = pipeline.generate("Hello world!", seed=3, max_new_tokens=45).codes.shape[0]
    wave, rate = pipeline.synthesize("Hello world!", seed=3, max_new_tokens=45)
    assert rate == 24000 and wave.dtype == np.float32
    assert frames > 0 and wave.shape == (1, frames * 1920)


def test_synthesize_with_a_reference_waveform(pipeline):
    reference = (0.1 * np.sin(np.arange(24000 // 2) / 7.0)).astype(np.float32)
    result = pipeline.generate("Hello", pipeline.codec.encode(reference), seed=2, max_new_tokens=2)
    assert result.prompt.shape[0] > pipeline.generate("Hello", max_new_tokens=1).prompt.shape[0]
    wave, _ = pipeline.synthesize("Hello", reference, seed=2, max_new_tokens=40)
    assert wave.shape[0] == 1 and wave.shape[1] % 1920 == 0 and wave.shape[1] > 0


def test_too_few_steps_for_a_frame(pipeline):
    with pytest.raises(InputError, match="no audio frame"):
        pipeline.synthesize("Hello", seed=1, max_new_tokens=20)


def test_a_model_that_ends_before_any_frame_is_a_runtime_failure(pipeline, monkeypatch):
    """Valid settings, and the model said <|im_end|> first: exit 1 (try another seed), not bad input."""
    real = pipeline.generate

    def ends_at_once(*args, **kwargs):
        result = real(*args, **kwargs)
        return dataclasses.replace(result, codes=result.codes[:0], stopped_on_im_end=True)

    monkeypatch.setattr(pipeline, "generate", ends_at_once)
    with pytest.raises(GenerationError, match="stopped before any audio"):
        pipeline.synthesize("Hello", seed=1, max_new_frames=2)


def test_synthesis_without_a_codec(delay_fixture, llama_cpp):
    from moss_npu.delay.pipeline import DelayPipeline

    with DelayPipeline.open(DelayRunConfig(**EXACT), delay_fixture / "weights") as pipe:
        with pytest.raises(ConfigError, match="--codec-onnx-dir"):
            pipe.synthesize("Hello")


def test_a_gguf_that_is_not_a_model(tiny_weights, llama_cpp):
    from moss_npu.delay.pipeline import DelayPipeline

    with pytest.raises(CheckpointError, match="could not load"):
        DelayPipeline.open(DelayRunConfig(**EXACT), tiny_weights)


def test_synthesize_from_a_reference_file(pipeline, tmp_path):
    """A 16 kHz stereo file goes through moss_npu.audio (resampled, downmixed) into the codec."""
    import soundfile as sf

    t = np.arange(16000) / 16000.0
    stereo = np.stack([np.sin(2 * np.pi * 220 * t), np.sin(2 * np.pi * 330 * t)], axis=1) * 0.2
    sf.write(tmp_path / "ref.wav", stereo.astype(np.float32), 16000)
    wave, rate = pipeline.synthesize("Hello", tmp_path / "ref.wav", seed=4, max_new_tokens=40)
    assert rate == 24000 and wave.shape[0] == 1 and wave.shape[1] > 0


def test_on_step_reports_every_step(pipeline):
    seen = []
    result = pipeline.generate("Hello world!", seed=3, max_new_tokens=40, on_step=seen.append)
    assert seen == list(range(1, result.rows.shape[0] + 1))
