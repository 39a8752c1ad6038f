"""The bf16/int8 one-row kernels (``nano.matvec``) and the CPU step that uses them: the products are the float32
products with those weights (any shape, AVX-512 or portable C), the kernels build once into the cache and never
into a half-written file, and a CPU step on bf16 or int8 weights decodes like float32 math on the same weights,
or falls back with one warning where no kernel can be built."""

import copy
import logging
import os
import platform
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from moss_npu.errors import InputError
from moss_npu.nano import matvec
from moss_npu.nano.cpu_step import CpuStep
from moss_npu.nano.decoder import FrameDecoder, RequestParams
from moss_npu.nano.matvec import Bf16Tiles, Fp32Tiles, Int8Tiles, MatVecKernels
from moss_npu.native import KernelUnavailable
from moss_npu.nano.quantize import dtype_name, int8_rows, quantize_int8, store_bf16
from tests.optional import missing

from .test_decoder import model, prompts  # noqa: F401 - the tiny steered model and its prompts (fixtures)

SHAPES = [(64, 16), (40, 24), (17, 33), (300, 200)]  # (out, in): padded columns, one tile and two


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    try:
        return MatVecKernels.load(tmp_path_factory.mktemp("kernels"))
    except KernelUnavailable as exc:
        missing(f"no kernels here: {exc}")


def _case(out_features, in_features, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(in_features, generator=gen).numpy()
    residual = torch.randn(out_features, generator=gen).numpy()
    return weight, bias, x, residual


def _expected(x, weight, bias, residual=None):
    out = x.astype(np.float64) @ weight.double().numpy().T + bias.double().numpy()
    return out if residual is None else out + residual


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp32_tiles_multiply_by_the_weight(kernels, shape):
    weight, bias, x, residual = _case(*shape, seed=shape[0] + 1)
    matrix = Fp32Tiles(kernels, weight, bias)
    np.testing.assert_allclose(matrix(x), _expected(x, weight, bias), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(matrix(x, residual), _expected(x, weight, bias, residual), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(Fp32Tiles(kernels, weight, None)(x), _expected(x, weight, torch.zeros(shape[0])),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bf16_tiles_multiply_by_the_bf16_rounded_weight(kernels, shape):
    weight, bias, x, residual = _case(*shape, seed=shape[0])
    rounded = weight.bfloat16().float()
    matrix = Bf16Tiles(kernels, weight, bias)
    np.testing.assert_allclose(matrix(x), _expected(x, rounded, bias), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(matrix(x, residual), _expected(x, rounded, bias, residual), rtol=1e-5, atol=1e-5)
    assert matrix(x).shape == (shape[0],)
    assert not np.allclose(matrix(x), _expected(x, weight, bias), rtol=1e-6, atol=1e-6)  # it did round


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_int8_tiles_multiply_by_the_dequantized_weight(kernels, shape):
    weight, bias, x, residual = _case(*shape, seed=shape[1])
    values, scale = int8_rows(weight)
    matrix = Int8Tiles(kernels, values, scale, bias)
    dequantized = values.float() * scale[:, None]
    np.testing.assert_allclose(matrix(x), _expected(x, dequantized, bias), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(matrix(x, residual), _expected(x, dequantized, bias, residual), rtol=1e-5, atol=1e-5)
    no_bias = Int8Tiles(kernels, values, scale, None)
    np.testing.assert_allclose(no_bias(x), _expected(x, dequantized, torch.zeros(shape[0])), rtol=1e-5, atol=1e-5)


def test_portable_c_gives_the_same_products(kernels, tmp_path):
    """The vector-extension-free C (what a CPU without AVX-512 runs) agrees with the AVX-512 build."""
    if platform.machine() not in ("x86_64", "AMD64"):
        missing("-mno-avx512f is an x86 flag: run on an x86-64 CPU")
    portable = MatVecKernels.load(tmp_path, flags=("-O3", "-march=native", "-mno-avx512f", "-shared", "-fPIC"))
    weight, bias, x, residual = _case(300, 200, seed=5)
    values, scale = int8_rows(weight)
    np.testing.assert_allclose(Bf16Tiles(portable, weight, bias)(x, residual),
                               Bf16Tiles(kernels, weight, bias)(x, residual), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(Fp32Tiles(portable, weight, bias)(x, residual),
                               Fp32Tiles(kernels, weight, bias)(x, residual), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(Int8Tiles(portable, values, scale, bias)(x),
                               Int8Tiles(kernels, values, scale, bias)(x), rtol=1e-5, atol=1e-5)


BIG_ENDIAN_CHECK = r"""
#include "matvec.c"
#include <stdio.h>
enum { IN = 3, OUT = 512 };
static float value(int c, int i) { return (float)((c * 7 + i * 3) % 11) - 5.0f; }
int main(void) {
    static uint16_t w[IN * OUT];
    float x[IN] = {1.0f, 2.0f, 3.0f}, y[OUT];
    for (int c = 0; c < OUT; c++)
        for (int i = 0; i < IN; i++) {
            float v = value(c, i); uint32_t bits; memcpy(&bits, &v, 4);
            int tile = c / TILE, r = c % 32, g = (c % TILE) / 32;
            int pos = 32 * g + (r < 16 ? 2 * r : 2 * (r - 16) + 1);
            w[tile * IN * TILE + i * TILE + pos] = (uint16_t)(bits >> 16);
        }
    matvec_bf16(x, w, NULL, NULL, y, IN, OUT);
    int bad = 0;
    for (int c = 0; c < OUT; c++) {
        float e = 0; for (int i = 0; i < IN; i++) e += x[i] * value(c, i);
        if (y[c] != e) bad++;
    }
    printf("%d wrong of %d\n", bad, OUT);
    return bad != 0;
}
"""


def test_bf16_portable_c_on_a_big_endian_cpu(tmp_path):
    """The portable bf16 path reads each column's 16 bits, not halves of 32-bit words, whose order depends on the
    CPU's byte order: checked on s390x where a cross compiler and qemu are installed (apt: gcc-s390x-linux-gnu,
    libc6-dev-s390x-cross, qemu-user-static)."""
    compiler, emulator = shutil.which("s390x-linux-gnu-gcc"), shutil.which("qemu-s390x-static")
    if compiler is None or emulator is None:
        missing("no s390x cross compiler and qemu here (apt: gcc-s390x-linux-gnu libc6-dev-s390x-cross "
                "qemu-user-static)")
    (tmp_path / "matvec.c").write_text(matvec.SOURCE.read_text())
    (tmp_path / "check.c").write_text(BIG_ENDIAN_CHECK)
    subprocess.run([compiler, "-O3", "-static", "-o", str(tmp_path / "check"), str(tmp_path / "check.c")],
                   check=True, capture_output=True)
    done = subprocess.run([emulator, str(tmp_path / "check")], capture_output=True, text=True)
    assert done.stdout == "0 wrong of 512\n"


def test_kernels_build_once_into_the_cache(tmp_path):
    assert MatVecKernels.load(tmp_path).built == str(tmp_path / "kernels")
    built = list((tmp_path / "kernels").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"  # no partial files left beside it
    stamp = built[0].stat().st_mtime_ns
    assert MatVecKernels.load(tmp_path).built is None
    assert list((tmp_path / "kernels").iterdir()) == built and built[0].stat().st_mtime_ns == stamp


def test_an_unusable_cache_builds_them_privately(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")  # kernels/ cannot be made under it
    kernels = MatVecKernels.load(blocked)
    weight, bias, x, _ = _case(40, 24, seed=1)
    np.testing.assert_allclose(Bf16Tiles(kernels, weight, bias)(x), _expected(x, weight.bfloat16().float(), bias),
                               rtol=1e-5, atol=1e-5)


def test_a_damaged_cache_file_is_built_again(tmp_path):
    """A truncated kernel file is compiled again with one warning (in fresh processes: a process never reopens a
    library it has loaded)."""
    script = ("import logging, sys, numpy, torch; logging.basicConfig(); from moss_npu.nano.matvec import *; "
              "k = MatVecKernels.load(sys.argv[1]); "
              "print(Bf16Tiles(k, torch.ones(32, 8), None)(numpy.ones(8, numpy.float32))[0])")
    first = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True)
    (built,) = (tmp_path / "kernels").iterdir()
    damaged = tmp_path / "damaged"
    damaged.write_bytes(built.read_bytes()[:100])
    os.replace(damaged, built)
    again = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True)
    assert first.stdout == again.stdout == "8.0\n"
    assert "is damaged" not in first.stderr and again.stderr.count("is damaged; building it again") == 1
    assert built.stat().st_size > 100 and list((tmp_path / "kernels").iterdir()) == [built]


def test_no_compiler_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.raises(KernelUnavailable, match="no C compiler.*no-such-compiler-here"):
        MatVecKernels.load(tmp_path)


def test_cc_may_carry_options(kernels, monkeypatch, tmp_path):
    """$CC as make reads it: a command with options ("ccache gcc", "zig cc"), or a path with spaces."""
    compiler = shutil.which("cc") or missing("no cc on PATH")
    spaced = tmp_path / "my tools" / "cc"
    spaced.parent.mkdir()
    spaced.symlink_to(compiler)
    for cc, cache in ((f"{compiler} -DMOSS_NPU_UNUSED=1", "options"), (str(spaced), "spaced")):
        monkeypatch.setenv("CC", cc)
        kernels = MatVecKernels.load(tmp_path / cache)
        assert kernels.built == str(tmp_path / cache / "kernels")
        np.testing.assert_allclose(Fp32Tiles(kernels, torch.ones(32, 8), None)(np.ones(8, np.float32)), 8.0)


def test_a_failed_build_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(matvec, "SOURCE", tmp_path / "broken.c")
    (tmp_path / "broken.c").write_text("this is not C\n")
    with pytest.raises(KernelUnavailable, match="compiling broken.c failed"):
        MatVecKernels.load(tmp_path)
    assert not any((tmp_path / "kernels").iterdir())


def test_a_build_that_does_not_load_says_why(monkeypatch, tmp_path):
    """A compiler that succeeds but makes a library this process cannot load ($CC a cross compiler, a folder
    mounted noexec) is KernelUnavailable, the CPU step's fallback, not an OSError; nothing unloadable is kept."""
    compiler = tmp_path / "cross-cc"
    compiler.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo cross-cc 1.0; exit 0; }\n'
                        'while [ $# -gt 0 ]; do [ "$1" = -o ] && { shift; echo not-a-library > "$1"; }; shift; done\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    with pytest.raises(KernelUnavailable, match="does not load"):
        MatVecKernels.load(tmp_path / "cache")
    assert not any((tmp_path / "cache" / "kernels").iterdir())


def test_the_cached_kernels_are_readable_by_everyone(tmp_path):
    """Another user sharing the cache (a prepared image, a team folder) can load them: not mkstemp's 0600."""
    MatVecKernels.load(tmp_path)
    (built,) = (tmp_path / "kernels").iterdir()
    assert built.stat().st_mode & 0o755 == 0o755


def _decode(model, rows, frames, use_cpu_step):
    decoder = FrameDecoder(model, slots=1, max_len=rows.shape[0] + frames + 1)
    label = decoder.cpu_step.label()
    if not use_cpu_step:
        decoder.cpu_step = None  # the torch modules: float32 math on the same weights
    decoder.admit(rows, RequestParams(max_new_frames=frames))
    codes, hidden = [], []
    while decoder.active_slots:
        codes.append(decoder.step().codes)
        hidden.append(decoder.state.hidden.clone())
    return torch.stack(codes), torch.stack(hidden), label


def test_bf16_weights_decode_like_float32_math_on_the_same_weights(model, prompts):
    rounded = copy.deepcopy(model)
    store_bf16(rounded)
    assert rounded.weight_dtype == "bfloat16" and dtype_name(rounded) == "bfloat16"
    assert all(torch.equal(p, p.bfloat16().float()) for p in rounded.parameters())
    codes, hidden, label = _decode(rounded, prompts[0], 6, use_cpu_step=True)
    ref_codes, ref_hidden, _ = _decode(rounded, prompts[0], 6, use_cpu_step=False)
    assert label == "cpu-bf16"
    assert torch.equal(codes, ref_codes)
    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-4, atol=1e-5)


def test_int8_one_row_products_are_float32_math(model, prompts):
    """One slot's frames multiply int8 weights in float32 (no bf16 activations): as close to the torch modules on
    the same rounded weights as the float32 step is."""
    quantized = copy.deepcopy(model)
    quantize_int8(quantized)
    decoder = FrameDecoder(quantized, slots=1, max_len=256)
    assert decoder.cpu_step.label() == "cpu-int8"
    x = torch.randn(1, quantized.config.hidden_size)
    layer = quantized.local_transformer.h[0].mlp.fc_in
    product = decoder.cpu_step._row_blocks[1][0].fc_in
    np.testing.assert_allclose(product(x.numpy()[0]), torch.nn.functional.linear(x, layer.weight, layer.bias)[0],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8"])
def test_without_kernels_one_warning_and_the_old_path(model, prompts, monkeypatch, caplog, kind):
    """bf16 and int8 say that they lost their speed; float32 (numpy's GEMV, a little slower) says nothing."""
    def unavailable(cls, *args, **kwargs):
        raise KernelUnavailable("no C compiler (test)")

    monkeypatch.setattr(MatVecKernels, "load", classmethod(unavailable))
    changed = copy.deepcopy(model)
    if kind != "fp32":
        (store_bf16 if kind == "bf16" else quantize_int8)(changed)
    with caplog.at_level(logging.WARNING, logger="moss_npu.nano.cpu_step"):
        codes, _, label = _decode(changed, prompts[0], 4, use_cpu_step=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == (kind != "fp32") and all("no C compiler (test)" in w for w in warnings)
    assert label == f"cpu-{kind}-no-kernel" and codes.shape[0] == 4


def test_compile_on_is_refused_for_bf16_weights(model):
    rounded = copy.deepcopy(model)
    store_bf16(rounded)
    with pytest.raises(InputError, match="--dtype bfloat16 use --compile auto or off"):
        CpuStep.build(rounded, "on")


def test_the_first_build_says_so_once(model, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("MOSS_NPU_CACHE_DIR", str(tmp_path))
    for expected in (1, 0):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="moss_npu.nano.cpu_step"):
            assert CpuStep.build(model).label() == "cpu-fp32"
        lines = [r.getMessage() for r in caplog.records if "compiled the one-row CPU kernels" in r.getMessage()]
        assert len(lines) == expected and all(str(tmp_path / "kernels") in line for line in lines)


def test_a_private_build_does_not_claim_to_be_kept(model, monkeypatch, tmp_path, caplog):
    """Where the cache folder is unusable the kernels are compiled again at every start: the line says so and
    what to set, instead of "once per CPU and compiler"."""
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("MOSS_NPU_CACHE_DIR", str(blocked))
    with caplog.at_level(logging.WARNING, logger="moss_npu.nano.cpu_step"):
        assert CpuStep.build(model).label() == "cpu-fp32"
    (line,) = [r.getMessage() for r in caplog.records if "compiled the one-row CPU kernels" in r.getMessage()]
    assert "once per" not in line and "every start" in line and "MOSS_NPU_CACHE_DIR" in line


def test_a_compiler_without_march_native_still_builds(kernels, monkeypatch, tmp_path):
    """gcc on POWER knows "this CPU" as -mcpu=native and refuses -march=native: the kernels are built with that
    (or, failing it too, without either) instead of not at all."""
    real = shutil.which("cc") or missing("no cc on PATH")
    compiler = tmp_path / "power-cc"
    compiler.write_text(f'#!/bin/sh\nfor a in "$@"; do case "$a" in -march=native)\n'
                        f'  echo "error: unrecognized command-line option \'-march=native\'" >&2; exit 1;;\n'
                        f'  -mcpu=native) echo "error: unknown -mcpu" >&2; exit 1;; esac; done\nexec {real} "$@"\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    built = MatVecKernels.load(tmp_path / "cache")
    np.testing.assert_allclose(Bf16Tiles(built, torch.ones(32, 8), None)(np.ones(8, np.float32)), 8.0)


def test_int8_rows_are_each_row_alone_bit_for_bit(kernels):
    weight, bias, _, _ = _case(300, 200, seed=9)
    values, scale = int8_rows(weight)
    tiles = Int8Tiles(kernels, values, scale, bias)
    gen = torch.Generator().manual_seed(3)
    x, residual = torch.randn(5, 200, generator=gen).numpy(), torch.randn(5, 300, generator=gen).numpy()
    rows = tiles.rows(x, residual)
    assert rows.shape == (5, 300) and rows.flags.c_contiguous
    for r in range(5):
        assert np.array_equal(rows[r], tiles(x[r], residual[r]))
    assert np.array_equal(tiles.rows(x[:1]), tiles(x[0])[None])


def test_int8_batches_decode_what_each_request_decodes_alone(model, prompts):
    """Several slots' int8 products go through the same tiles as one slot's (float32 activations), so a request
    decodes in a batch what it decodes alone: the same codes, hidden states to float32 rounding (torch's int8
    kernel rounded a batch's activations to bf16: differences ~1e-2)."""
    quantized = copy.deepcopy(model)
    quantize_int8(quantized)
    alone = [_decode(quantized, rows, 5, use_cpu_step=True) for rows in prompts[:2]]
    decoder = FrameDecoder(quantized, slots=2, max_len=max(p.shape[0] for p in prompts[:2]) + 6)
    for rows in prompts[:2]:
        decoder.admit(rows, RequestParams(max_new_frames=5))
    codes, hidden = [], []
    while decoder.active_slots:
        codes.append(decoder.step().codes)
        hidden.append(decoder.state.hidden[:2].clone())
    codes, hidden = torch.stack(codes), torch.stack(hidden)
    for slot in range(2):
        assert torch.equal(codes[:, slot], alone[slot][0][:, 0])
        torch.testing.assert_close(hidden[:, slot], alone[slot][1][:, 0], rtol=1e-5, atol=1e-5)
