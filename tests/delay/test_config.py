"""Run presets and the model config: precedence, unknown keys, special ids read from config.json."""

import json
from pathlib import Path

import pytest

from moss_npu.delay.config import DelayModelConfig, DelayRunConfig, load_run_config
from moss_npu.errors import CheckpointError, ConfigError

PRESETS = Path(__file__).resolve().parents[2] / "configs" / "llama_cpp"


@pytest.mark.parametrize("name", ["default.yaml", "cpu-only.yaml"])
def test_presets_load(name):
    run = load_run_config(PRESETS / name)
    assert isinstance(run, DelayRunConfig)
    assert run.sampling.audio_top_k == 25


def test_cpu_preset_keeps_the_backbone_on_the_cpu_with_an_f32_cache():
    run = load_run_config(PRESETS / "cpu-only.yaml")
    assert (run.n_gpu_layers, run.kv_cache_type_k, run.flash_attn, run.audio_provider) == (0, "f32", "disabled", "cpu")


def test_overrides_beat_the_preset_and_none_is_not_set(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("n_ctx: 2048\nn_threads: 2\n")
    run = load_run_config(preset, {"n_ctx": 512, "n_threads": None})
    assert (run.n_ctx, run.n_threads, run.n_batch) == (512, 2, DelayRunConfig().n_batch)


def test_a_preset_value_out_of_range_is_refused_even_when_overridden(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("n_ctx: -1\n")
    with pytest.raises(ConfigError, match="p.yaml.*n_ctx"):
        load_run_config(preset, {"n_ctx": 512})


def test_unknown_yaml_keys_are_listed(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("n_ctx: 2048\nbogus: 1\nuse_gpu_audio: true\n")
    with pytest.raises(ConfigError, match="bogus, use_gpu_audio"):
        load_run_config(preset)


def test_unknown_override_keys_are_listed():
    with pytest.raises(ConfigError, match="unknown keys nctx"):
        load_run_config(None, {"nctx": 5})


@pytest.mark.parametrize("bad", [{"flash_attn": "on"}, {"kv_cache_type_k": "q3"}, {"n_ctx": 0},
                                 {"audio_top_p": 0.0}, {"heads_backend": "cuda"}, {"n_gpu_layers": -2}],
                         ids=lambda d: next(iter(d)))
def test_bad_values_are_config_errors(bad):
    with pytest.raises(ConfigError, match=next(iter(bad))):
        DelayRunConfig(**bad)


def test_preset_that_is_not_a_mapping(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_run_config(preset)


def test_model_config_needs_every_special_id(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"n_vq": 32, "pad_token_id": 1}))
    with pytest.raises(CheckpointError, match="im_start_token_id"):
        DelayModelConfig.from_weights_dir(tmp_path)


def test_model_config_falls_back_to_extraction_meta(tiny_weights):
    config = json.loads((tiny_weights / "config.json").read_text())
    (tiny_weights / "config.json").unlink()
    (tiny_weights / "extraction_meta.json").write_text(json.dumps({"moss_config": config}))
    assert DelayModelConfig.from_weights_dir(tiny_weights).im_end_token_id == config["im_end_token_id"]


def test_missing_model_config_names_the_fix(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        DelayModelConfig.from_weights_dir(tmp_path)
