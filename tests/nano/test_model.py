import math

import pytest
import torch

from moss_npu.errors import InputError
from moss_npu.nano.checkpoint import load_model
from moss_npu.nano.model import RotaryEmbedding, apply_rope


@pytest.fixture(scope="module")
def models(tiny_ckpt):
    return {impl: load_model(tiny_ckpt, device="cpu", attn_impl=impl) for impl in ("sdpa", "eager")}


def _rows(length, seed=0, n_vq=4, pad=64):
    g = torch.Generator().manual_seed(seed)
    rows = torch.full((length, n_vq + 1), pad, dtype=torch.long)
    rows[:, 0] = torch.randint(0, 400, (length,), generator=g)
    rows[length // 2:, 1:] = torch.randint(0, 64, (length - length // 2, n_vq), generator=g)
    return rows


def test_rope_rotates_adjacent_pairs():
    """Interleaved RoPE: features (0, 1) rotate by pos · inv_freq[0] = pos radians (not the half-split layout)."""
    rope = RotaryEmbedding(head_dim=4, base=10000.0)
    cos, sin = rope(torch.tensor([[3]]), torch.float32)
    x = torch.tensor([1.0, 0.0, 0.0, 0.0]).view(1, 1, 1, 4)
    out = apply_rope(x, cos, sin).flatten()
    assert torch.allclose(out, torch.tensor([math.cos(3), math.sin(3), 0.0, 0.0]), atol=1e-6)


def test_bf16_rope_rounds_positions():
    """A bf16 model rounds positions through bf16 (257 → 256), a fp32 one does not (docs/architecture.md)."""
    rope = RotaryEmbedding(head_dim=8, base=10000.0)
    fp32 = rope(torch.tensor([[256, 257]]), torch.float32)[0]
    assert not torch.equal(fp32[0, 0], fp32[0, 1])
    rope = rope.to(torch.bfloat16)
    bf16 = rope(torch.tensor([[256, 257]]), torch.bfloat16)[0]
    assert torch.equal(bf16[0, 0], bf16[0, 1])


def test_sdpa_equals_eager(models):
    rows = _rows(12)[None]
    a, b = models["sdpa"](rows), models["eager"](rows)
    assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("flags", [{"scale_attn_weights": False}, {"scale_attn_by_inverse_layer_idx": True}],
                         ids=["unscaled", "inverse-layer-idx"])
def test_sdpa_honours_the_configs_attention_scaling(tmp_path, tiny_tokenizer, flags):
    """sdpa uses the scale the config asks for, exactly as eager does (not sdpa's default 1/sqrt(D))."""
    from moss_npu_verify.random_checkpoints import write_random_checkpoint

    from .conftest import TINY

    config = dict(TINY, gpt2_config=dict(TINY["gpt2_config"], **flags))
    folder = write_random_checkpoint(tmp_path, config, seed=2, tokenizer_model=tiny_tokenizer)
    sdpa, eager = (load_model(folder, device="cpu", attn_impl=impl) for impl in ("sdpa", "eager"))
    rows = _rows(12)[None]
    assert torch.allclose(sdpa(rows), eager(rows), atol=1e-5)


def test_left_padding_matches_unpadded(models):
    """Positions come from the mask, so a left-padded row computes the same hidden states."""
    for model in models.values():
        rows = _rows(9, seed=1)
        alone = model(rows[None])[0]
        padded = torch.cat([torch.full((4, 5), 64, dtype=torch.long), rows])
        padded[:4, 0] = 3
        mask = torch.tensor([[False] * 4 + [True] * 9])
        out = model(padded[None], mask)[0]
        assert torch.allclose(out[4:], alone, atol=1e-5)
        assert torch.equal(out[:4], torch.zeros_like(out[:4]))


def test_kv_cache_matches_full_forward(models):
    model = models["sdpa"]
    rows = _rows(10, seed=2)[None]
    full = model(rows)
    cache = model.transformer.init_cache(1, 16)
    first = model(rows[:, :7], None, cache)
    steps = [model(rows[:, i:i + 1], torch.ones(1, i + 1, dtype=torch.bool), cache) for i in range(7, 10)]
    assert cache.length == 10
    assert torch.allclose(torch.cat([first] + steps, dim=1), full, atol=1e-5)


def test_out_of_range_codes_raise(models):
    rows = _rows(4)
    rows[0, 2] = 65
    with pytest.raises(InputError, match="channel 1"):
        models["sdpa"](rows[None])


def test_unknown_attention(tiny_ckpt):
    with pytest.raises(InputError, match="flash_attention_2"):
        load_model(tiny_ckpt, device="cpu", attn_impl="flash_attention_2")
