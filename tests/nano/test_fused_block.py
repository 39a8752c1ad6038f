"""The fused one-row block (``cpu.fused_block``, the library's ``fused_block.c``): for every tile format and every
instruction set this CPU runs it computes what ``blocks.row_block`` computes in numpy (to float rounding, cache
rows included), on odd sizes, with a ready-made qkv and with the decoder's final norm; two threads give the bits
of one; and what it cannot run is refused before the call. (On aarch64 under qemu: tests/native/check_kernels.c.)"""

from dataclasses import replace

import numpy as np
import pytest
import torch

from moss_npu.cpu.blocks import RowBlock, row_block, row_norm
from moss_npu.cpu.fused_block import FusedRowBlock
from moss_npu.cpu.matvec import Bf16Tiles, Fp32Tiles, Int8Tiles

from .test_matvec import kernels  # noqa: F401 - the kernels forced to each instruction set (fixture)

FORMATS = ("float32", "bfloat16", "int8")


def _tiles(kernels, format, weight, bias):
    if format == "int8":
        return Int8Tiles.rounded(kernels, weight, bias)
    return (Bf16Tiles if format == "bfloat16" else Fp32Tiles)(kernels, weight, bias)


def _block(kernels, format, embed, inner, seed):
    gen = torch.Generator().manual_seed(seed)

    def linear(out_features, in_features):
        weight = torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5
        return _tiles(kernels, format, weight, torch.randn(out_features, generator=gen) * 0.1)

    def norm():
        return (1 + 0.2 * torch.randn(embed, generator=gen)).numpy(), (0.1 * torch.randn(embed, generator=gen)).numpy()

    ln1, ln2 = norm(), norm()
    return RowBlock(*ln1, linear(3 * embed, embed), linear(embed, embed), *ln2, linear(inner, embed),
                    linear(embed, inner)), norm()


def _inputs(embed, heads, rows, seed):
    gen = torch.Generator().manual_seed(seed)
    dim = embed // heads
    x = torch.randn(embed, generator=gen).numpy()
    angles = torch.rand(dim // 2, generator=gen) * 6
    rotation = torch.polar(torch.ones_like(angles), angles).numpy()
    keys, values = (torch.randn(heads, rows, dim, generator=gen).numpy() for _ in range(2))
    return x, rotation, keys, values


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("embed, heads, inner, rows, position", [
    (24, 3, 40, 6, 3),      # nothing a multiple of a tile
    (64, 4, 256, 9, 0),     # the first row: attends to itself alone
    (96, 2, 200, 33, 32),   # the last row of the cache
])
def test_the_fused_block_computes_what_row_block_does(kernels, format, embed, heads, inner, rows, position):
    block, final = _block(kernels, format, embed, inner, seed=embed + position)
    x, rotation, keys, values = _inputs(embed, heads, rows, seed=rows)
    scale = (embed // heads) ** -0.5
    for ready in (False, True):
        qkv = block.attn(row_norm(x, block.ln1_w, block.ln1_b, 1e-5)) if ready else None
        for last in (None, final):
            want_keys, want_values = keys.copy(), values.copy()
            want = row_block(x, rotation, want_keys, want_values, position, position + 1, qkv, block, heads=heads,
                             eps=1e-5, scale=scale)
            if last is not None:
                want = row_norm(want, *last, 1e-5)
            fused = FusedRowBlock(kernels, block, heads=heads, eps=1e-5, scale=scale, final=last)
            got_keys, got_values = keys.copy(), values.copy()
            got = fused(x, rotation, got_keys, got_values, position, position + 1, qkv)
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
            np.testing.assert_allclose(got_keys, want_keys, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(got_values, want_values, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("format", FORMATS)
def test_two_threads_give_the_bits_of_one(kernels, format):
    block, final = _block(kernels, format, 768, 3072, seed=5)
    x, rotation, keys, values = _inputs(768, 12, 40, seed=6)
    fused = FusedRowBlock(kernels, block, heads=12, eps=1e-5, scale=0.125, final=final)
    results = []
    for count in (1, 2):
        kernels.threads.use(count)
        cache = keys.copy(), values.copy()
        results.append((fused(x, rotation, *cache, 30, 31), *cache))
    kernels.threads.use(1)
    for one, two in zip(*results):
        np.testing.assert_array_equal(one, two)


def test_a_block_it_cannot_run_is_refused(kernels):
    block, _ = _block(kernels, "float32", 24, 40, seed=1)
    with pytest.raises(ValueError, match="one tile format"):
        FusedRowBlock(kernels, replace(block, proj=Bf16Tiles(kernels, torch.randn(24, 24), None)), heads=3, eps=1e-5,
                      scale=1.0)
    with pytest.raises(ValueError, match="do not chain"):
        FusedRowBlock(kernels, block, heads=5, eps=1e-5, scale=1.0)
    with pytest.raises(ValueError, match="do not chain"):
        FusedRowBlock(kernels, replace(block, proj=block.fc_out), heads=3, eps=1e-5, scale=1.0)
    with pytest.raises(ValueError, match="needs every product in tiles"):
        FusedRowBlock(kernels, replace(block, attn=lambda x: x), heads=3, eps=1e-5, scale=1.0)
    with pytest.raises(ValueError, match="final norm weight: shape"):
        FusedRowBlock(kernels, block, heads=3, eps=1e-5, scale=1.0, final=(np.ones(23, np.float32), block.ln1_b))


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "x": a["x"][:-1]}, r"x: shape \(23,\)"),
    (lambda a: {**a, "keys": a["keys"].astype(np.float64)}, "keys: dtype float64"),
    (lambda a: {**a, "values": a["values"][:, :-1]}, r"values: shape \(3, 5, 8\)"),
    (lambda a: {**a, "rotation": a["rotation"].real.copy()}, "rotation: dtype float32"),
    (lambda a: {**a, "qkv": np.zeros(71, np.float32)}, r"qkv: shape \(71,\)"),
    (lambda a: {**a, "position": 6, "attended": 7}, "does not fit a cache of 6"),
    (lambda a: {**a, "position": 3, "attended": 3}, "row 3 attending 3 rows"),
    (lambda a: {**a, "position": -1}, "row -1"),
])
def test_a_mismatched_call_is_refused_and_changes_nothing(kernels, change, message):
    block, _ = _block(kernels, "float32", 24, 40, seed=2)
    x, rotation, keys, values = _inputs(24, 3, 6, seed=3)
    fused = FusedRowBlock(kernels, block, heads=3, eps=1e-5, scale=1.0)
    args = change({"x": x, "rotation": rotation, "keys": keys, "values": values, "position": 2, "attended": 3,
                   "qkv": None})
    before = keys.copy(), values.copy(), x.copy()
    with pytest.raises(ValueError, match=message):
        fused(**args)
    for was, now in zip(before, (keys, values, x)):
        np.testing.assert_array_equal(was, now)
