"""Loading official codec folders: key tables, weight-norm folding, file formats, refusals."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moss_npu.codec import load_codec
from moss_npu.codec.checkpoint import fold_weight_norm, rename_keys
from moss_npu_verify.random_checkpoints import nano_codec_config, small_codec_overrides, write_random_codec
from moss_npu.codec.config import codec_config_from_dict
from moss_npu.codec.model import NanoCodec
from moss_npu.errors import CheckpointError


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def test_real_size_model_matches_spec_shapes_and_counts():
    """docs/architecture.md#codec-config: 10,450,944 params per side; quantizer 1,067,776 minus the 9,600 folded gains
    (g vectors of input_proj 512, output_proj 768, and 16 x (8 + 512) per-codebook projections)."""
    model = NanoCodec(codec_config_from_dict(nano_codec_config()))
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(model.encoder) == 10_450_944 and count(model.decoder) == 10_450_944
    assert count(model.quantizer) == 1_067_776 - 9_600
    state = model.state_dict()
    assert state["encoder.1.input_proj.weight"].shape == (256, 240)
    assert state["encoder.7.output_proj.weight"].shape == (192, 256)
    assert state["decoder.1.transformer.layers.3.self_attn.in_proj.weight"].shape == (768, 256)
    assert state["decoder.7.output_proj.weight"].shape == (240, 256)
    assert state["quantizer.quantizers.15.codebook.weight"].shape == (1024, 8)
    assert state["quantizer.input_proj.weight"].shape == (512, 768, 1)


def test_written_folder_uses_official_weight_norm_names(small_codec_dir):
    keys = load_file(str(small_codec_dir / "model.safetensors"))
    assert "quantizer.input_proj.parametrizations.weight.original0" in keys
    assert keys["quantizer.quantizers.0.in_proj.parametrizations.weight.original0"].shape == (8, 1, 1)
    assert not any(k.endswith((".weight_g", ".weight_v")) for k in keys)


def test_legacy_weight_norm_keys_load_to_the_same_model(tmp_path, small_codec):
    legacy = write_random_codec(tmp_path, small_codec_overrides(context_scale=0.02), seed=1,
                                legacy_weight_norm_keys=True)
    assert any(k.endswith(".weight_g") for k in load_file(str(legacy / "model.safetensors")))
    _same_weights(load_codec(legacy), small_codec)


def test_legacy_attention_and_ffn_names_are_renamed(tmp_path, small_codec_dir, small_codec):
    shutil.copy(small_codec_dir / "config.json", tmp_path / "config.json")
    state = load_file(str(small_codec_dir / "model.safetensors"))
    legacy = {}
    for key, value in state.items():
        key = key.replace("self_attn.in_proj.weight", "self_attn.in_proj_weight")
        key = key.replace("self_attn.out_proj.weight", "self_attn.out_projs.0.weight")
        key = key.replace("ffn.0.weight", "linear1.weight").replace("ffn.2.weight", "linear2.weight")
        legacy[key] = value
    assert rename_keys(legacy).keys() == state.keys()
    save_file(legacy, str(tmp_path / "model.safetensors"))
    _same_weights(load_codec(tmp_path), small_codec)


def test_folding_equals_torch_weight_norm():
    conv = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(6, 4, 1))
    with torch.no_grad():
        conv.parametrizations.weight.original0.mul_(torch.rand(4, 1, 1) + 0.5)
    folded = fold_weight_norm({f"c.{k}": v for k, v in conv.state_dict().items()})
    assert torch.equal(folded["c.weight"], conv.weight) and torch.equal(folded["c.bias"], conv.bias)


def test_pytorch_model_bin_loads_like_safetensors(tmp_path, small_codec_dir, small_codec):
    shutil.copy(small_codec_dir / "config.json", tmp_path / "config.json")
    torch.save(load_file(str(small_codec_dir / "model.safetensors")), tmp_path / "pytorch_model.bin")
    _same_weights(load_codec(tmp_path), small_codec)


def test_missing_weights_file_raises(tmp_path, small_codec_dir):
    shutil.copy(small_codec_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_codec(tmp_path)


def test_weights_of_another_config_raise(tmp_path, small_codec_dir):
    shutil.copy(small_codec_dir / "model.safetensors", tmp_path / "model.safetensors")
    raw = json.loads((small_codec_dir / "config.json").read_text())
    raw["decoder_kwargs"][1]["dim_feedforward"] = 48
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="ffn.0.weight: shape"):
        load_codec(tmp_path)


def test_missing_key_raises(tmp_path, small_codec_dir):
    shutil.copy(small_codec_dir / "config.json", tmp_path / "config.json")
    state = load_file(str(small_codec_dir / "model.safetensors"))
    del state["decoder.1.output_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing"):
        load_codec(tmp_path)
