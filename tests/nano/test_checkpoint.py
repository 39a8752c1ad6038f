import pytest
import torch

from moss_npu.errors import CheckpointError
from moss_npu.nano.checkpoint import load_model, read_state_dict
from moss_npu.nano.config import NanoConfig, load_config
from moss_npu_verify.random_checkpoints import official_config_dict, random_state_dict, write_random_checkpoint
from moss_npu.nano.model import NanoTTSModel

from .conftest import TINY


def _unique(model):
    return {k: v for k, v in model.state_dict().items() if "lm_head" not in k}


def _assert_tied(model):
    assert model.text_lm_head.weight is model.transformer.wte.weight
    for head, table in zip(model.audio_lm_heads, model.audio_embeddings):
        assert head.weight is table.weight


def test_real_size_parameter_count():
    """Unique parameters of the real config: 117,311,232, the official count (docs/architecture.md#checkpoints)."""
    model = NanoTTSModel(NanoConfig.from_dict(official_config_dict()))
    assert sum(p.numel() for p in model.parameters()) == 117_311_232
    assert tuple(model.transformer.h[0].attn.c_attn.weight.shape) == (2304, 768)  # Linear [out, in]
    assert not hasattr(model.local_transformer, "wte")


def test_safetensors_and_bin_load_the_same(tmp_path, tiny_ckpt):
    state = read_state_dict(tiny_ckpt / "model.safetensors")
    a = load_model(tiny_ckpt, device="cpu")
    b = load_model(write_random_checkpoint(tmp_path / "bin", TINY, fmt="bin", state=state), device="cpu")
    for key, value in _unique(a).items():
        assert torch.equal(value, _unique(b)[key]), key
    _assert_tied(a)
    _assert_tied(b)


def test_bf16_bin_with_tied_copies_and_stray_key(tmp_path, tiny_ckpt):
    """The official release layout: bf16 .bin, head copies stored, stray local_transformer.wte.weight."""
    state = read_state_dict(tiny_ckpt / "model.safetensors")
    folder = write_random_checkpoint(tmp_path, TINY, fmt="bin", dtype=torch.bfloat16, tied_copies=True,
                                     stray_local_wte=True, state=state)
    stored = read_state_dict(folder / "pytorch_model.bin")
    assert "local_transformer.wte.weight" in stored and "audio_lm_heads.0.weight" in stored
    model = load_model(folder, device="cpu")  # upcast to fp32
    _assert_tied(model)
    for key, value in _unique(model).items():
        if key in state:
            assert value.dtype == torch.float32
            assert torch.equal(value, state[key].to(torch.bfloat16).float()), key
    half = load_model(folder, device="cpu", dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half.transformer.rotary.inv_freq.dtype == torch.bfloat16


def test_only_alias_stored(tmp_path, tiny_ckpt):
    """A file holding text_lm_head.weight instead of transformer.wte.weight loads the same weights."""
    state = read_state_dict(tiny_ckpt / "model.safetensors")
    state["text_lm_head.weight"] = state.pop("transformer.wte.weight")
    model = load_model(write_random_checkpoint(tmp_path, TINY, state=state), device="cpu")
    assert torch.equal(model.transformer.wte.weight, state["text_lm_head.weight"])
    _assert_tied(model)


def test_missing_key_is_named(tmp_path, tiny_ckpt):
    state = read_state_dict(tiny_ckpt / "model.safetensors")
    del state["transformer.h.1.mlp.fc_in.bias"]
    with pytest.raises(CheckpointError, match=r"missing: transformer\.h\.1\.mlp\.fc_in\.bias"):
        load_model(write_random_checkpoint(tmp_path, TINY, state=state), device="cpu")


def test_unknown_key_is_named(tmp_path, tiny_ckpt):
    state = read_state_dict(tiny_ckpt / "model.safetensors")
    state["transformer.wpe.weight"] = torch.zeros(3, 32)
    with pytest.raises(CheckpointError, match=r"unknown: transformer\.wpe\.weight"):
        load_model(write_random_checkpoint(tmp_path, TINY, state=state), device="cpu")


def test_shape_mismatch(tmp_path, tiny_ckpt):
    state = read_state_dict(tiny_ckpt / "model.safetensors")
    state["transformer.ln_f.bias"] = torch.zeros(31)
    with pytest.raises(CheckpointError, match="transformer.ln_f.bias"):
        load_model(write_random_checkpoint(tmp_path, TINY, state=state), device="cpu")


def test_no_weights_file(tmp_path):
    write_random_checkpoint(tmp_path, TINY)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors or pytorch_model.bin"):
        load_model(tmp_path, device="cpu")


def test_random_state_dict_is_seeded(tiny_ckpt):
    cfg = load_config(tiny_ckpt)
    a, b = random_state_dict(cfg, seed=3), random_state_dict(cfg, seed=3)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
