"""The one-row kernels (``cpu.matvec``) and the CPU step that uses them: the products are the float32 products
with those weights (any shape, on every instruction set this CPU runs, on one thread or shared over two), a
mismatched array is refused before the call, and a CPU step on bf16 or int8 weights decodes like float32 math
on the same weights, or falls back with one warning where the library is missing. (Loading and building the
library: tests/test_native.py.)"""

import copy
import logging
import os
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest
import torch

from moss_npu.errors import InputError
from moss_npu.cpu.step import CpuStep
from moss_npu.nano.decoder import FrameDecoder, RequestParams
from moss_npu.nano.step import TorchStep
from moss_npu.cpu.matvec import Bf16Tiles, Fp32Tiles, Int8Tiles, KernelThreads, MatVecKernels
from moss_npu.native.build import TILES
from moss_npu.cpu.targets import TARGET_ENV, runnable_targets
from moss_npu.native.library import KernelUnavailable, load_library
from moss_npu.cpu.quantize import dtype_name, int8_rows, quantize_int8, store_bf16

from tests.optional import missing

from .test_decoder import model, prompts  # noqa: F401 - the tiny steered model and its prompts (fixtures)

SHAPES = [(64, 16), (40, 24), (17, 33), (300, 200), (1100, 7)]  # (out, in): padded columns, one tile to 18




def _runnable() -> list:
    try:
        return runnable_targets(load_library()[0])
    except KernelUnavailable:
        return ["none"]


@pytest.fixture(scope="module", params=_runnable())
def kernels(request):
    """The kernels forced to each instruction set this CPU runs (``$MOSS_NPU_KERNEL_TARGET``), with two threads."""
    if request.param == "none":
        missing("the package's C library is not built here (pip install -e .)")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(TARGET_ENV, request.param)
        loaded = MatVecKernels.load(threads=2)
    assert loaded.target == request.param
    return loaded


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(kernels, request):
    kernels.threads.use(request.param)
    yield request.param
    kernels.threads.use(1)


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
def test_fp32_tiles_multiply_by_the_weight(kernels, threads, shape):
    weight, bias, x, residual = _case(*shape, seed=shape[0] + 1)
    matrix = Fp32Tiles(kernels, weight, bias)
    np.testing.assert_allclose(matrix(x), _expected(x, weight, bias), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(matrix(x, residual), _expected(x, weight, bias, residual), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(Fp32Tiles(kernels, weight, None)(x), _expected(x, weight, torch.zeros(shape[0])),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bf16_tiles_multiply_by_the_bf16_rounded_weight(kernels, threads, shape):
    weight, bias, x, residual = _case(*shape, seed=shape[0])
    rounded = weight.bfloat16().float()
    matrix = Bf16Tiles(kernels, weight, bias)
    np.testing.assert_allclose(matrix(x), _expected(x, rounded, bias), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(matrix(x, residual), _expected(x, rounded, bias, residual), rtol=1e-5, atol=1e-5)
    assert matrix(x).shape == (shape[0],)
    assert not np.allclose(matrix(x), _expected(x, weight, bias), rtol=1e-6, atol=1e-6)  # it did round


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_int8_tiles_multiply_by_the_dequantized_weight(kernels, threads, shape):
    weight, bias, x, residual = _case(*shape, seed=shape[1])
    values, scale = int8_rows(weight)
    matrix = Int8Tiles(kernels, values, scale, bias)
    dequantized = values.float() * scale[:, None]
    np.testing.assert_allclose(matrix(x), _expected(x, dequantized, bias), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(matrix(x, residual), _expected(x, dequantized, bias, residual), rtol=1e-5, atol=1e-5)
    no_bias = Int8Tiles(kernels, values, scale, None)
    np.testing.assert_allclose(no_bias(x), _expected(x, dequantized, torch.zeros(shape[0])), rtol=1e-5, atol=1e-5)


def test_two_threads_give_the_bits_of_one(kernels):
    weight, bias, x, residual = _case(1100, 300, seed=11)
    values, scale = int8_rows(weight)
    for matrix in (Fp32Tiles(kernels, weight, bias), Bf16Tiles(kernels, weight, bias),
                   Int8Tiles(kernels, values, scale, bias)):
        kernels.threads.use(1)
        alone = matrix(x, residual)
        kernels.threads.use(2)
        assert np.array_equal(matrix(x, residual), alone)
    kernels.threads.use(1)


def test_lent_threads_join_the_products_from_any_thread_up_to_the_pool(kernels):
    """``lend`` adds threads from another thread without growing the pool (only its caller's ``use`` may restart
    it), ``use(..., lendable=False)`` leaves them out, ``lend(0)`` takes them back; the bits stay one thread's."""
    pool = KernelThreads(kernels.library, 1)
    weight, bias, x, residual = _case(1100, 300, seed=12)
    matrix = Fp32Tiles(kernels, weight, bias)
    alone = matrix(x, residual)
    lender = threading.Thread(target=pool.lend, args=(1,))
    lender.start()
    lender.join()
    assert (pool.size, pool.lent, pool.used) == (1, 1, 1)  # lent, but the pool has no second thread yet
    pool.use(1)
    assert (pool.size, pool.used) == (2, 2)
    kernels.threads, mine = pool, kernels.threads
    try:
        assert np.array_equal(matrix(x, residual), alone)
    finally:
        kernels.threads = mine
    pool.use(1, lendable=False)
    assert pool.used == 1 and pool.lent == 1
    pool.use(1)
    pool.lend(0)
    assert (pool.used, pool.lent) == (1, 0)


def _voluntary_switches(threads: list[str]) -> int:
    """How often these threads of this process went to sleep so far (Linux's per-thread count)."""
    total = 0
    for tid in threads:
        with open(f"/proc/self/task/{tid}/status") as status:
            total += sum(int(line.split(":")[1]) for line in status if line.startswith("voluntary_ctxt_switches"))
    return total


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts a thread's sleeps in Linux's /proc")
def test_a_worker_left_out_sleeps_through_the_products_until_taken_in_again(kernels):
    """A worker that ``use`` leaves out is not woken by the products it no longer joins (its core was taken back
    for another thread), and joins them again at once when taken in; the bits stay one thread's."""
    before = set(os.listdir("/proc/self/task"))
    pool = KernelThreads(kernels.library, 3)
    workers = sorted(set(os.listdir("/proc/self/task")) - before)
    assert len(workers) == 2
    weight, bias, x, residual = _case(1100, 300, seed=13)
    matrix = Fp32Tiles(kernels, weight, bias)
    alone = matrix(x, residual)
    kernels.threads, mine = pool, kernels.threads
    try:
        pool.use(2)
        matrix(x, residual)
        time.sleep(0.05)  # the left-out worker is asleep by now, the other one too after its 2 ms of spinning
        slept = _voluntary_switches(workers)
        products = 2000
        for _ in range(products):
            matrix(x, residual)
        woken = _voluntary_switches(workers) - slept
        assert woken < products // 10, f"the workers slept {woken} times in {products} products"
        pool.use(3)
        assert np.array_equal(matrix(x, residual), alone)
    finally:
        kernels.threads = mine


def test_an_outgrown_pool_serves_a_product_still_running_on_it_until_its_owner_goes(kernels):
    """Growing starts a new pool; the old one is not freed while a product of another thread (an engine's and a
    pipeline's over one model) may still be running on it: it stays, asleep, until the ``KernelThreads`` goes."""
    import types

    pool = KernelThreads(kernels.library, 2)
    old = pool.handle
    pool.use(3)
    assert pool.handle != old and pool._retired == [old]
    weight, bias, x, residual = _case(1100, 300, seed=15)
    matrix = Fp32Tiles(kernels, weight, bias)
    alone = matrix(x, residual)
    kernels.threads, mine = types.SimpleNamespace(handle=old), kernels.threads  # a product that loaded the old one
    try:
        assert np.array_equal(matrix(x, residual), alone)
    finally:
        kernels.threads = mine
    pool._stop()
    assert pool.handle is None and pool._retired == []


def test_a_pool_that_cannot_grow_keeps_the_threads_it_has(kernels):
    """Where the new pool's threads cannot start, ``use`` raises and the old pool goes on serving products and
    lends (a lend used to reach a freed pool)."""
    pool = KernelThreads(kernels.library, 1)

    class Refusing:
        def __getattr__(self, name):
            return getattr(kernels.library, name)

        @staticmethod
        def moss_pool_new(threads):
            return None

    pool._library = Refusing()
    handle = pool.handle
    with pytest.raises(MemoryError, match="cannot start 2 kernel threads"):
        pool.use(2)
    assert pool.handle == handle and pool.size == 1 and pool.used == 1
    pool._library = kernels.library
    pool.lend(0)
    weight, bias, x, residual = _case(300, 200, seed=14)
    matrix = Fp32Tiles(kernels, weight, bias)
    kernels.threads, mine = pool, kernels.threads
    try:
        assert np.array_equal(matrix(x, residual), Fp32Tiles(kernels, weight, bias)(x, residual))
    finally:
        kernels.threads = mine


@pytest.mark.parametrize("bad, message", [
    (lambda x: x[:-1], r"x: shape \(199,\), the kernel reads \(200,\)"),
    (lambda x: x.astype(np.float64), "x: dtype float64, the kernel reads float32"),
    (lambda x: np.repeat(x, 2)[::2], "x: not C-contiguous"),
    (lambda x: x.tolist(), "x: a numpy array expected, got list"),
    (lambda x: np.frombuffer(np.zeros(804, np.uint8).data, np.float32, 200, offset=1), "x: address not aligned"),
])
def test_a_mismatched_array_is_refused_before_the_call(kernels, bad, message):
    weight, bias, x, _ = _case(300, 200, seed=2)
    with pytest.raises(ValueError, match=message):
        Fp32Tiles(kernels, weight, bias)(bad(x))


def test_a_mismatched_residual_or_rows_are_refused(kernels):
    weight, bias, x, residual = _case(300, 200, seed=3)
    values, scale = int8_rows(weight)
    tiles = Int8Tiles(kernels, values, scale, bias)
    with pytest.raises(ValueError, match=r"residual: shape \(299,\)"):
        tiles(x, residual[:-1])
    with pytest.raises(ValueError, match=r"x: shape \(2, 100\), the kernel reads \(2, 200\)"):
        tiles.rows(np.zeros((2, 100), np.float32))
    with pytest.raises(ValueError, match=r"x: \(n, 200\) rows expected"):
        tiles.rows(x)


BIG_ENDIAN_CHECK = r"""
#include <stdio.h>
#include <string.h>
#include <stdint.h>
#define TILE 64
void moss_tile_bf16_portable(const float *x, long x_stride, long rows, const void *tile, float *y, long y_stride,
                             const float *scale, const float *bias, const float *residual, long in);
enum { IN = 3 };
static float value(int c, int i) { return (float)((c * 7 + i * 3) % 11) - 5.0f; }
int main(void) {
    static uint16_t w[IN * TILE];
    float x[IN] = {1.0f, 2.0f, 3.0f}, y[TILE];
    for (int c = 0; c < TILE; c++)
        for (int i = 0; i < IN; i++) {
            float v = value(c, i); uint32_t bits; memcpy(&bits, &v, 4);
            int r = c % 32, g = c / 32;
            w[i * TILE + 32 * g + (r < 16 ? 2 * r : 2 * (r - 16) + 1)] = (uint16_t)(bits >> 16);
        }
    moss_tile_bf16_portable(x, IN, 1, w, y, TILE, NULL, NULL, NULL, IN);
    int bad = 0;
    for (int c = 0; c < TILE; c++) {
        float e = 0; for (int i = 0; i < IN; i++) e += x[i] * value(c, i);
        if (y[c] != e) bad++;
    }
    printf("%d wrong of %d\n", bad, TILE);
    return bad != 0;
}
"""


def test_bf16_portable_c_on_a_big_endian_cpu(tmp_path):
    """The portable bf16 path reads each column's 16 bits, not halves of 32-bit words, whose order depends on the
    CPU's byte order: checked on s390x where a cross compiler and qemu are installed (apt: gcc-s390x-linux-gnu,
    libc6-dev-s390x-cross, qemu-user)."""
    compiler = shutil.which("s390x-linux-gnu-gcc")
    emulator = shutil.which("qemu-s390x-static") or shutil.which("qemu-s390x")
    if compiler is None or emulator is None:
        missing("no s390x cross compiler and qemu here (apt: gcc-s390x-linux-gnu libc6-dev-s390x-cross "
                "qemu-user-static)")
    (tmp_path / "check.c").write_text(BIG_ENDIAN_CHECK)
    subprocess.run([compiler, "-O3", "-static", "-DMOSS_TARGET=portable", "-DMOSS_PORTABLE", "-o",
                    str(tmp_path / "check"), str(tmp_path / "check.c"), str(TILES)],
                   check=True, capture_output=True)
    done = subprocess.run([emulator, str(tmp_path / "check")], capture_output=True, text=True)
    assert done.stdout == "0 wrong of 64\n"


def _decode(model, rows, frames, use_cpu_step):
    decoder = FrameDecoder(model, slots=1, max_len=rows.shape[0] + frames + 1)
    label = decoder.frame_step.label()
    if not use_cpu_step:
        decoder.frame_step = TorchStep(decoder.model)  # the torch modules: float32 math on the same weights
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
    assert decoder.frame_step.label() == "cpu-int8"
    x = torch.randn(1, quantized.config.hidden_size)
    layer = quantized.local_transformer.h[0].mlp.fc_in
    product = decoder.frame_step._row_blocks[1][0].fc_in
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
    with caplog.at_level(logging.WARNING, logger="moss_npu.cpu.step"):
        codes, _, label = _decode(changed, prompts[0], 4, use_cpu_step=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == (kind != "fp32") and all("no C compiler (test)" in w for w in warnings)
    assert label == f"cpu-{kind}-no-kernel" and codes.shape[0] == 4


def test_compile_on_is_refused_for_bf16_weights(model):
    rounded = copy.deepcopy(model)
    store_bf16(rounded)
    with pytest.raises(InputError, match="--dtype bfloat16 use --compile auto or off"):
        CpuStep.build(rounded.parts(), "on")


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


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8"])
def test_batches_decode_what_each_request_decodes_alone_bit_for_bit(model, prompts, kind):
    """Several slots' rows go through the same fused blocks and tiles as one slot's, each at its own position (the
    prompts differ in length), so a request decodes in a batch exactly what it decodes alone: the same codes and
    the same hidden states, bit for bit (oneDNN's batched products differed at rounding, ~1e-6)."""
    changed = copy.deepcopy(model)
    if kind != "fp32":
        (store_bf16 if kind == "bf16" else quantize_int8)(changed)
    alone = [_decode(changed, rows, 5, use_cpu_step=True) for rows in prompts[:3]]
    decoder = FrameDecoder(changed, slots=3, max_len=max(p.shape[0] for p in prompts[:3]) + 6)
    for rows in prompts[:3]:
        decoder.admit(rows, RequestParams(max_new_frames=5))
    codes, hidden = [], []
    while decoder.active_slots:
        codes.append(decoder.step().codes)
        hidden.append(decoder.state.hidden[:3].clone())
    codes, hidden = torch.stack(codes), torch.stack(hidden)
    assert len({p.shape[0] for p in prompts[:3]}) == 3
    for slot in range(3):
        assert torch.equal(codes[:, slot], alone[slot][0][:, 0])
        assert torch.equal(hidden[:, slot], alone[slot][1][:, 0])
