"""The float32 CPU frame step (``cpu.step``): BLAS products equal torch's, the step decodes what the torch
step decodes (codes, and hidden states to float rounding), only where it applies, and follows weight edits.
The decoder tests (test_decoder.py) run through it too: on the CPU in float32 it is the default step."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from moss_npu.errors import InputError, NumericalError
from moss_npu.cpu import blocks, prepared
from moss_npu.cpu import step as cpu_step
from moss_npu.nano.checkpoint import load_model
from moss_npu.cpu.blocks import blas_matmul
from moss_npu.cpu.step import CpuStep
from moss_npu.cpu.threads import this_thread_using
from moss_npu.cpu.weights import WeightArena
from moss_npu.nano.decoder import FrameDecoder, RequestParams
from moss_npu.nano.step import TorchStep
from moss_npu.device import backend
from moss_npu.tts.loop import generate
from moss_npu.cpu.matvec import BlasGemv
from tests.optional import missing, needs

from .test_decoder import model, prompts, steer  # noqa: F401 - the tiny steered model and its prompts (fixtures)


@pytest.mark.parametrize("rows", [1, 3])
def test_blas_matmul_is_linear_plus_residual(rows):
    layer = torch.nn.Linear(48, 80)
    x, residual = torch.randn(rows, 48), torch.randn(rows, 80)
    weight = layer.weight.detach().t().contiguous()
    with torch.no_grad():
        expected = F.linear(x, layer.weight, layer.bias)
        torch.testing.assert_close(blas_matmul(x, weight, layer.bias.detach()), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(blas_matmul(x, weight, layer.bias.detach(), residual), expected + residual,
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ready_qkv", [False, True], ids=["own-qkv", "ready-qkv"])
@pytest.mark.parametrize("keys", [1, 7])
def test_row_block_is_block_step_for_one_row(keys, ready_qkv):
    """The numpy one-row block gives block_step's output and cache rows (to float rounding) and writes nothing
    but its own row of its slot's cache."""
    e, heads, rows, inner = 32, 4, 9, 64
    d, position = e // heads, keys - 1
    gen = torch.Generator().manual_seed(keys)
    shapes = [(e,), (e,), (e, 3 * e), (3 * e,), (e, e), (e,), (e,), (e,), (e, inner), (inner,), (inner, e), (e,)]
    weights = [torch.randn(*shape, generator=gen) * 0.3 for shape in shapes]
    x, angles = torch.randn(1, e, generator=gen), torch.randn(1, d // 2, generator=gen)
    rotation = torch.complex(angles.cos(), angles.sin())
    qkv = torch.randn(1, 3 * e, generator=gen) if ready_qkv else None
    kv = torch.randn(2, 2, heads, rows, d, generator=gen)  # two slots; slot 0 is the one written
    expected_kv = kv.clone()
    index = torch.arange(heads) * rows + position
    expected = blocks.block_step(x, rotation, expected_kv, index, keys, None, qkv, *weights, heads=heads,
                                   eps=1e-5, scale=d ** -0.5, matmul=blas_matmul)
    before = kv.clone()
    cache = kv.numpy()
    arrays = [w.numpy() for w in weights]
    block = blocks.RowBlock(arrays[0], arrays[1], BlasGemv(*arrays[2:4]), BlasGemv(*arrays[4:6]), arrays[6],
                              arrays[7], BlasGemv(*arrays[8:10]), BlasGemv(*arrays[10:12]))
    out = blocks.row_block(x.numpy()[0], rotation.numpy()[0], cache[0, 0], cache[1, 0], position, keys,
                             None if qkv is None else qkv.numpy()[0], block, heads=heads, eps=1e-5, scale=d ** -0.5)
    torch.testing.assert_close(torch.from_numpy(out)[None], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv, expected_kv, rtol=1e-5, atol=1e-6)
    written = torch.zeros_like(kv, dtype=torch.bool)
    written[:, 0, :, position] = True
    assert torch.equal(kv[~written], before[~written])
    assert not torch.equal(kv[written], before[written])


def test_one_row_path_reports_non_finite_values_without_numpy_warnings(tiny_ckpt, prompts):
    """An infinite activation in the numpy row path becomes the decoder's NumericalError, not a RuntimeWarning
    printed on the way (numpy warns on inf - inf where torch does not)."""
    broken = steer(load_model(tiny_ckpt, device="cpu"))
    with torch.no_grad():
        broken.local_transformer.h[0].mlp.fc_out.bias[0] = float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(NumericalError, match="^Non-finite"):
            generate(broken, prompts[0], max_new_frames=2)


def test_arena_holds_each_weight_transposed(model):
    layers = [model.transformer.h[0].attn.c_attn, model.audio_lm_heads[1]]
    arena = WeightArena(layers)
    for layer in layers:
        weight, bias = arena.linear(layer)
        assert torch.equal(weight, layer.weight.detach().t())
        assert torch.equal(bias, layer.bias.detach() if layer.bias is not None else torch.zeros(weight.shape[1]))
    assert arena.nbytes() == sum(prepared.PageArena.room(layer.weight.numel() * 4) for layer in layers)


def decode(model, prompts, frames, use_cpu_step):
    """Decode ``prompts`` together greedily; return codes (S, F, Q) and the global hidden states (F, S, E)."""
    decoder = FrameDecoder(model, slots=len(prompts), max_len=max(p.shape[0] for p in prompts) + frames + 1)
    assert isinstance(decoder.frame_step, CpuStep)
    if not use_cpu_step:
        decoder.frame_step = TorchStep(decoder.model)
    for rows in prompts:
        decoder.admit(rows, RequestParams(max_new_frames=frames))
    codes, hidden = [], []
    while decoder.active_slots:
        codes.append(decoder.step().codes)
        hidden.append(decoder.state.hidden.clone())
    return torch.stack(codes, 1), torch.stack(hidden)


@pytest.mark.parametrize("count", [1, 3], ids=["one-slot", "three-slots-masked"])
def test_cpu_step_decodes_like_the_torch_step(model, prompts, count):
    codes, hidden = decode(model, prompts[:count], 6, use_cpu_step=True)
    ref_codes, ref_hidden = decode(model, prompts[:count], 6, use_cpu_step=False)
    assert torch.equal(codes, ref_codes)
    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-4, atol=1e-5)
    assert not torch.equal(hidden, torch.zeros_like(hidden))


def test_cpu_step_only_for_float32_on_the_cpu(model):
    bf16 = load_model_copy(model, torch.bfloat16)
    assert CpuStep.build(bf16.parts(), "auto") is None and CpuStep.build(bf16.parts(), "off") is None
    assert backend(bf16.device).frame_step(bf16.parts()) is None  # no step of its own for bf16 ...
    assert isinstance(FrameDecoder(bf16, max_len=8).frame_step, TorchStep)  # ... so the decoder runs the modules
    with pytest.raises(InputError, match="--compile on"):
        CpuStep.build(bf16.parts(), "on")
    with pytest.raises(InputError, match="--compile fast"):
        CpuStep.build(model.parts(), "fast")


def load_model_copy(model, dtype):
    import copy

    return copy.deepcopy(model).to(dtype)


def test_refresh_rebuilds_the_transposed_weights(tiny_ckpt, prompts):
    model = steer(load_model(tiny_ckpt, device="cpu"))
    decoder = FrameDecoder(model, slots=1, max_len=128)
    before = decoder.frame_step.global_blocks[0][2].clone()
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight.mul_(2.0)
    decoder.refresh()
    torch.testing.assert_close(decoder.frame_step.global_blocks[0][2], before * 2.0)


def _blas_threads() -> set:
    from threadpoolctl import threadpool_info

    return {pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}


def test_the_step_runs_numpy_blas_on_one_thread(model):
    """numpy's BLAS multiplies only single rows here; with torch's count its spinning workers fought torch's OpenMP
    workers for the cores (a prefill's last row took a prompt from 15 to 105 ms on 2 threads)."""
    from moss_npu.cpu.threads import limit_blas

    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        limit_blas(2)
        CpuStep.build(model.parts(), "off")
        assert _blas_threads() == {1}
    finally:
        torch.set_num_threads(previous)
        limit_blas(1)


def test_a_one_slot_frame_leaves_the_process_blas_count_alone(model):
    """numpy's BLAS count is the whole process's (the codec and other threads run beside the frame thread): it
    is set once when the step is built, never switched around a frame; torch's count drops in this thread only."""
    from moss_npu.cpu.threads import limit_blas

    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        step = CpuStep.build(model.parts(), "off")
        if step.kernel_target() == "none":
            missing("the C library is not built: one-slot frames multiply through numpy's BLAS on one thread")
        limit_blas(2)  # whatever the process set after the build
        assert _blas_threads() == {2}
        with step.threads(1):
            assert _blas_threads() == {2} and torch.get_num_threads() == 1
        assert _blas_threads() == {2} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)
        limit_blas(1)


@pytest.mark.slow
@needs(cpu_step._compiled_matmul() is not None, "torch.compile with custom ops needs torch >= 2.4")
def test_compiled_step_decodes_like_the_eager_one(model, prompts):
    """--compile on (inductor, BLAS products as a custom op) gives the eager CPU step's codes."""
    frames = 4
    results = []
    for mode in ("off", "on"):
        decoder = FrameDecoder(model, slots=1, max_len=256, compile=mode)
        assert decoder.frame_step.compiled is (mode == "on")
        for rows in prompts[:1]:
            decoder.admit(rows, RequestParams(max_new_frames=frames))
        codes = []
        while decoder.active_slots:
            codes.append(decoder.step().codes)
        results.append(torch.stack(codes))
        if mode == "on":
            assert decoder.frame_step.compiled and decoder.frame_step.compile_seconds > 0
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("split", [0, 6, -1], ids=["whole", "after-6-cached-rows", "last-row-only"])
def test_prefill_fills_the_cache_like_the_model_forward(model, prompts, split):
    """A prompt prefilled into slot 1 by the CPU step (after an optional cached prefix: the rows before ``split``)
    leaves the same keys/values and last hidden state as the model's own forward over the whole prompt."""
    rows = prompts[0]
    length, g = rows.shape[0], model.config.gpt2_config
    start = split % length
    step = CpuStep.build(model.parts())
    rotation = blocks.rotations(*model.transformer.rope_table(length))
    kv = torch.zeros(g.n_layer, 2, 2, g.n_head, length, g.head_dim)
    reference = model.transformer.init_cache(1, length)
    with torch.inference_mode():
        expected = model(rows[None], None, reference)[0, -1]
        embed = model.embed_rows(rows[None])[0]
        if start:
            step.prefill(embed[:start], rotation[:start], kv, [blocks.Segment(1, 0, start)])
        hidden = step.prefill(embed[start:], rotation[start:length], kv, [blocks.Segment(1, start, length - start)])[0]
    torch.testing.assert_close(hidden, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(kv[:, 0, 1], torch.stack([k[0] for k in reference.keys]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(kv[:, 1, 1], torch.stack([v[0] for v in reference.values]), rtol=1e-4, atol=1e-5)
    assert torch.equal(kv[:, :, 0], torch.zeros_like(kv[:, :, 0]))  # the other slot is untouched


@pytest.mark.parametrize("threads", [1, 2])
def test_a_prompt_row_attends_alike_in_any_call(threads):
    """A prompt row's attention has the same bits whichever rows share its call (how long the prompt is, how
    many rows before it came from the prefix cache) and on any thread count. Torch's attention alone does not: a
    last block of 1-3 query rows, or another count of keys, changes a row's sums (real-size heads)."""
    g = torch.Generator().manual_seed(0)
    heads, dim, length = 12, 64, 150
    queries, keys, values = (torch.randn(length, heads, dim, generator=g) for _ in range(3))
    keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # (H, T, D), as in a slot's cache
    whole = blocks.prompt_attention(queries, keys, values, 0, 0.125)
    with this_thread_using(threads):
        for start, end in [(0, 35), (33, 36), (0, 30), (100, 101), (64, 130), (149, 150), (5, 97)]:
            part = blocks.prompt_attention(queries[start:end], keys[:, :end], values[:, :end], start, 0.125)
            assert torch.equal(part, whole[start:end]), (start, end)


def test_prompts_prefilled_together_fill_each_slot_as_alone(model, prompts):
    """Three prompts of different lengths prefilled in one call (one pass of products over all their rows, one
    after a cached prefix) leave each slot's keys/values and last hidden state bit for bit as each prompt alone
    does, and the slot between them untouched."""
    g = model.config.gpt2_config
    longest = max(p.shape[0] for p in prompts[:3])
    step = CpuStep.build(model.parts())
    rotation = blocks.rotations(*model.transformer.rope_table(longest))
    slots, starts = [0, 2, 3], [0, 3, 0]

    def prefill(kv, chosen):
        with torch.inference_mode():
            embed = torch.cat([model.embed_rows(prompts[i][None])[0][starts[i]:] for i in chosen])
            turns = torch.cat([rotation[starts[i]:prompts[i].shape[0]] for i in chosen])
            segments = [blocks.Segment(slots[i], starts[i], prompts[i].shape[0] - starts[i]) for i in chosen]
            return step.prefill(embed, turns, kv, segments)

    fresh = lambda: torch.zeros(g.n_layer, 2, 4, g.n_head, longest, g.head_dim)  # noqa: E731
    together = fresh()
    with torch.inference_mode():  # the cached prefix of prompt 1: its first 3 rows, already in slot 2
        embed = model.embed_rows(prompts[1][None])[0][:3]
        step.prefill(embed, rotation[:3], together, [blocks.Segment(2, 0, 3)])
    prefix = together.clone()
    hidden = prefill(together, [0, 1, 2])
    assert hidden.shape == (3, g.n_embd)
    for i in range(3):
        alone = prefix.clone() if i == 1 else fresh()
        assert torch.equal(hidden[i], prefill(alone, [i])[0])
        s = slots[i]
        assert torch.equal(together[:, :, s], alone[:, :, s])
    assert torch.equal(together[:, :, 1], torch.zeros_like(together[:, :, 1]))
