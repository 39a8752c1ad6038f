"""Codec config parsing: windows derived from the config, legacy layouts, refusals."""

import pytest

from moss_npu_verify.random_checkpoints import nano_codec_config
from moss_npu.codec.config import codec_config_from_dict
from moss_npu.errors import ConfigError


def test_real_config_windows_follow_rate_times_duration():
    """96 kHz interleaved stream / patches 240,2,2,2 -> 400,200,100,50 Hz x 4,6,8,10 s (docs/architecture.md)."""
    config = codec_config_from_dict(nano_codec_config())
    assert [c for c in config.encoder_contexts() if c] == [1600, 1200, 800, 500]
    assert [c for c in config.decoder_contexts() if c] == [500, 800, 1200, 1600]
    assert config.decoder_steps_per_frame()[1::2] == (4, 8, 16, 32)


def test_windows_change_with_durations():
    raw = nano_codec_config()
    raw["encoder_kwargs"][1]["context_duration"] = 1.0
    raw["decoder_kwargs"][1]["context_duration"] = 2.5
    config = codec_config_from_dict(raw)
    assert config.encoder_contexts()[1] == 400 and config.decoder_contexts()[1] == 125


def test_missing_duration_falls_back_to_global():
    raw = nano_codec_config()
    del raw["decoder_kwargs"][1]["context_duration"]
    raw["causal_transformer_context_duration"] = 3.0
    assert codec_config_from_dict(raw).decoder_contexts()[1] == 150


def test_reversed_decoder_kwargs_equal_decoder_kwargs():
    """Legacy configs list the decoder in encoder order with in/out swapped."""
    raw = nano_codec_config()
    legacy = dict(raw)
    decoder = legacy.pop("decoder_kwargs")
    legacy["reversed_decoder_kwargs"] = [
        dict(s, input_dimension=s["output_dimension"], output_dimension=s["input_dimension"])
        if s["module_type"] == "Transformer" else s for s in reversed(decoder)]
    assert codec_config_from_dict(legacy).decoder_kwargs == codec_config_from_dict(raw).decoder_kwargs


@pytest.mark.parametrize("key, value", [("norm", "rms_norm"), ("gating", "silu"), ("causal", False)],
                         ids=["norm", "gating", "non-causal"])
def test_unsupported_stage_options_raise(key, value):
    raw = nano_codec_config()
    raw["encoder_kwargs"][1][key] = value
    with pytest.raises(ConfigError, match=key):
        codec_config_from_dict(raw)


def test_decoder_that_does_not_invert_encoder_raises():
    raw = nano_codec_config()
    raw["decoder_kwargs"][0]["patch_size"] = 2
    with pytest.raises(ConfigError, match="decoder"):
        codec_config_from_dict(raw)
