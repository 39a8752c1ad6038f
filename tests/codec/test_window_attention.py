"""The C library's streamed window attention (``cpu.window_attention``) against the codec's torch attention: the
same masked softmax (query t of row b sees ring slot j when 0 <= qpos - kpos < context and the slot holds a key),
padded steps zero, on every instruction set this CPU runs where the kernel is used."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from moss_npu.codec.modules import MultiheadAttention, rope_angles, rotate_pairs
from moss_npu.codec.streaming import KVCache
from moss_npu.cpu import targets
from moss_npu.cpu.threads import use_threads
from moss_npu.cpu.window_attention import FASTER_ON, WindowAttention
from moss_npu.native import library as native


def _targets() -> list:
    try:
        library = native.load_library()[0]
    except native.KernelUnavailable:
        return []
    return [name for name in targets.runnable_targets(library) if name in FASTER_ON]


TARGETS = _targets()
pytestmark = pytest.mark.skipif(not TARGETS, reason="no kernel library, or a CPU without AVX2: torch attends")


def _kernel(target: str) -> WindowAttention:
    return WindowAttention(native.load_library()[0], target)


def _ring(batch, heads, slots, dim, context, ends, steps, seed):
    """Random rotated queries and a ring whose row b holds the last `slots` positions before ends[b] + steps (the
    chunk already written, as the module writes before attending); slots of a short stream stay empty (-1)."""
    g = torch.Generator().manual_seed(seed)
    queries = torch.randn(batch, heads, steps, dim, generator=g) * 2
    keys, values = torch.randn(batch, heads, slots, dim, generator=g) * 2, torch.randn(batch, heads, slots, dim, generator=g)
    key_positions = torch.full((batch, slots), -1, dtype=torch.long)
    for b, end in enumerate(ends):
        for p in range(max(0, end + steps - slots), end + steps):
            key_positions[b, p % slots] = p
    query_positions = torch.tensor(ends).view(-1, 1) + torch.arange(steps).view(1, -1)
    return queries, keys, values, key_positions, query_positions


def _torch(queries, keys, values, key_positions, query_positions, lengths, context):
    """The module's streamed attention with torch (modules.MultiheadAttention), as (B, T, H·D)."""
    b, h, t, d = queries.shape
    delta = query_positions.view(b, t, 1) - key_positions.view(b, 1, -1)
    allowed = ((key_positions.view(b, 1, -1) >= 0) & (delta >= 0) & (delta < context))[:, None]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=allowed)
    valid = torch.arange(t).view(1, -1) < lengths.view(-1, 1)
    out = torch.where(valid.view(b, 1, t, 1), out, torch.zeros(()))
    return out.transpose(1, 2).reshape(b, t, h * d)


CASES = [  # batch, heads, slots, dim, context, ends (stream lengths before the chunk), steps, lengths
    pytest.param(3, 4, 1856, 64, 1600, [5000, 0, 1700], 32, [32, 32, 20], id="codec-last-stage-wrapped"),
    pytest.param(2, 2, 928, 16, 800, [40, 3000], 256, [256, 100], id="several-panels"),
    pytest.param(4, 2, 424, 32, 250, [300, 10, 0, 999], 4, [4, 0, 3, 4], id="a-row-with-nothing-due"),
    pytest.param(2, 1, 40, 16, 24, [7, 100], 16, [16, 9], id="context-shorter-than-chunk"),
]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("batch,heads,slots,dim,context,ends,steps,lengths", CASES)
def test_the_kernel_attends_as_torch(target, batch, heads, slots, dim, context, ends, steps, lengths):
    q, k, v, kpos, qpos = _ring(batch, heads, slots, dim, context, ends, steps, seed=len(ends) + steps)
    lengths = torch.tensor(lengths)
    expected = _torch(q, k, v, kpos, qpos, lengths, context)
    got = _kernel(target)(q, k, v, kpos, slots, qpos, lengths, context)
    assert got is not None and got.shape == expected.shape
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max(), float((got - expected).abs().max())
    padded = torch.arange(steps).view(1, -1) >= lengths.view(-1, 1)
    assert torch.all(got[padded] == 0)


@pytest.mark.parametrize("target", TARGETS)
def test_only_the_filled_slots_and_rows_are_read(target):
    """A ring that has not wrapped: slots past `filled` and rows past the chunk's hold NaN, which must not leak."""
    q, k, v, kpos, qpos = _ring(2, 2, 64, 16, 48, [0, 5], 8, seed=3)
    filled = 13  # the longer row's 5 + 8 steps
    k[:, :, filled:], v[:, :, filled:] = float("nan"), float("nan")
    rows = torch.cat([k, torch.full_like(k[:1], float("nan"))]), torch.cat([v, torch.full_like(v[:1], float("nan"))])
    lengths = torch.tensor([8, 8])
    expected = _torch(q, k[:, :, :filled], v[:, :, :filled], kpos[:, :filled], qpos, lengths, 48)
    got = _kernel(target)(q, rows[0], rows[1], torch.cat([kpos, kpos[:1]]), filled, qpos, lengths, 48)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("target", TARGETS)
def test_what_the_kernel_cannot_take_is_left_to_torch(target):
    kernel = _kernel(target)
    q, k, v, kpos, qpos = _ring(1, 2, 32, 16, 24, [0], 4, seed=0)
    lengths = torch.tensor([4])
    assert kernel(q.double(), k.double(), v.double(), kpos, 32, qpos, lengths, 24) is None  # not float32
    assert kernel(q.transpose(2, 3), k, v, kpos, 32, qpos, lengths, 24) is None  # not contiguous
    q, k, v, kpos, qpos = _ring(1, 2, 32, 12, 24, [0], 4, seed=0)
    assert kernel(q, k, v, kpos, 32, qpos, lengths, 24) is None  # a head size of no whole vectors


def _chunk(batch, heads, dim, steps, offsets, seed):
    """A chunk's in_proj rows (B, T, 3·H·D), its positions after `offsets` and their RoPE angles."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, steps, 3 * heads * dim, generator=g) * 3
    positions = torch.tensor(offsets).view(-1, 1) + torch.arange(steps).view(1, -1)
    return qkv, positions, rope_angles(positions, dim, 10000.0)


def _rings(rows, heads, dim, context, capacity, offsets, seed):
    """Two equal rings of `rows` rows whose leading rows have streamed `offsets` steps (random keys and values)."""
    g = torch.Generator().manual_seed(seed)
    rings = [KVCache.empty(rows, heads, dim, context, capacity, torch.device("cpu"), torch.float32) for _ in range(2)]
    keys, values = torch.randn(rings[0].keys.shape, generator=g), torch.randn(rings[0].keys.shape, generator=g)
    for ring in rings:
        ring.keys.copy_(keys), ring.values.copy_(values)
        for row, offset in enumerate(offsets):
            ring.positions[row] = torch.where(torch.arange(ring.keys.shape[2]) < offset,
                                              torch.arange(ring.keys.shape[2]), -1)
            ring.offsets[row], ring.written[row] = offset, offset
    return rings


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("offsets,steps,lengths", [
    pytest.param([5000, 0, 1700], 32, [32, 32, 20], id="wrapped-and-padded"),
    pytest.param([3, 41], 5, [0, 5], id="a-row-with-nothing-due"),
])
def test_the_library_writes_the_chunk_bit_for_bit_as_torch(target, offsets, steps, lengths):
    """write_chunk (codec_ring.c) against rotate_pairs and KVCache.write: the same queries, ring and counts exactly,
    the ring's rows past the chunk's untouched."""
    heads, dim, context, capacity = 4, 64, 1600, 256
    batch = len(offsets)
    qkv, positions, rope = _chunk(batch, heads, dim, steps, offsets, seed=steps)
    lengths = torch.tensor(lengths)
    valid = torch.arange(steps).view(1, -1) < lengths.view(-1, 1)
    by_torch, by_library = _rings(batch + 1, heads, dim, context, capacity, offsets + [9], seed=1)
    q, k, v = qkv.reshape(batch, steps, 3, heads, dim).permute(2, 0, 3, 1, 4)
    by_torch.write(rotate_pairs(k, rope), v, valid, positions)
    expected = rotate_pairs(q, rope)
    got = _kernel(target).write_chunk(qkv, rope, positions, lengths, by_library.keys, by_library.values,
                                      by_library.positions)
    by_library.advance(valid)
    assert got is not None and torch.equal(got, expected)
    for name in ("keys", "values", "positions", "offsets"):
        assert torch.equal(getattr(by_library, name), getattr(by_torch, name)), name
    assert by_library.written == by_torch.written


@pytest.mark.parametrize("target", TARGETS)
def test_a_chunk_the_library_cannot_take_is_left_to_torch_unwritten(target):
    kernel = _kernel(target)
    qkv, positions, rope = _chunk(2, 2, 16, 4, [0, 7], seed=0)
    lengths = torch.tensor([4, 4])
    ring = _rings(2, 2, 16, 24, 8, [0, 7], seed=0)[0]
    before = [t.clone() for t in (ring.keys, ring.values, ring.positions)]
    assert kernel.write_chunk(qkv.double(), rope, positions, lengths, ring.keys, ring.values, ring.positions) is None
    assert kernel.write_chunk(qkv.transpose(0, 1).contiguous().transpose(0, 1), rope, positions, lengths, ring.keys,
                              ring.values, ring.positions) is None  # not contiguous
    assert kernel.write_chunk(qkv, rope, positions - 10, lengths, ring.keys, ring.values, ring.positions) is None
    assert kernel.write_chunk(qkv, rope, positions[:, :2], lengths, ring.keys, ring.values, ring.positions) is None
    assert kernel.write_chunk(qkv, rope, positions, lengths[:1], ring.keys, ring.values, ring.positions) is None
    assert all(torch.equal(a, b) for a, b in zip(before, (ring.keys, ring.values, ring.positions)))


def test_the_streamed_codec_decodes_the_same_with_and_without_it(small_codec):
    kernels = {m.window for m in small_codec.decoder.modules() if isinstance(m, MultiheadAttention)}
    assert len(kernels) == 1
    kernel = kernels.pop()
    assert isinstance(kernel, WindowAttention)  # CPU float32 with the library: the decoder streams through it
    codes = torch.randint(0, 1024, (16, 3, 12), generator=torch.Generator().manual_seed(5))
    lengths = [(1, 2, 0), (3, 1, 2), (4, 4, 4), (2, 0, 3), (2, 5, 3)]  # per call, frames of each row

    def stream() -> torch.Tensor:
        state = small_codec.init_decode_state(3, max_frames_per_step=5)
        done, out = [0, 0, 0], [[], [], []]
        for call in lengths:
            chunk = torch.zeros(16, 3, max(call), dtype=torch.long)
            for r, n in enumerate(call):
                chunk[:, r, :n] = codes[:, r, done[r]:done[r] + n]
            audio = small_codec.decode_step(chunk, state, torch.tensor(call))
            for r, n in enumerate(call):
                out[r].append(audio[r, :, :n * small_codec.frame_size])
                done[r] += n
        return torch.cat([torch.cat(o, dim=-1) for o in out], dim=-1)

    with_kernel = stream()
    for m in small_codec.modules():
        if isinstance(m, MultiheadAttention):
            m.window = None
    try:
        with_torch = stream()
    finally:
        for m in small_codec.modules():
            if isinstance(m, MultiheadAttention):
                m.window = kernel
    assert (with_kernel - with_torch).abs().max() <= 1e-5 * with_torch.abs().max()


@pytest.mark.parametrize("target", TARGETS)
def test_threads_calling_at_once_each_get_their_answer(target):
    """Each calling thread has a pool of its own (a pool serves one caller), at its own torch thread count."""
    kernel = _kernel(target)
    cases = [_ring(4, 4, 424, 32, 250, [300 + 7 * i, 10, 0, 999], 8, seed=i) for i in range(4)]
    lengths = torch.tensor([8, 5, 8, 1])
    expected = [_torch(q, k, v, kp, qp, lengths, 250) for q, k, v, kp, qp in cases]

    def attend(i: int) -> torch.Tensor:
        q, k, v, kp, qp = cases[i]
        use_threads(1 + i % 2)  # this pool thread's torch count (the executor's threads end with the test)
        return [kernel(q, k, v, kp, 424, qp, lengths, 250) for _ in range(20)][-1]

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(attend, range(4)))
    for g, e in zip(got, expected):
        assert (g - e).abs().max() <= 1e-5 * e.abs().max()
