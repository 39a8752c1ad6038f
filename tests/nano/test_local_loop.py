"""A frame's audio channels in one library call (``cpu.local_loop``, ``local_loop.c``): the decoder decodes the
codes it decoded with the channels in Python (greedy, the official sampler's seeded ``torch.multinomial`` draws and
the noise-fed sampler's), for float32, bf16 and int8 tiles, one slot and a batch with masked channels; the
library's picks draw from the official sampler's distribution (a chi-square test that a wrong top-k, top-p or
repetition penalty fails) and pick what ``sample_token`` picks for the same generator and what
``sample_with_noise`` picks for the same uniform; and the fused block over n rows gives each row its own bits."""

import copy

import numpy as np
import pytest
import torch

from moss_npu.cpu import local_loop
from moss_npu.cpu.fused_block import FusedRowBlock
from moss_npu.cpu.quantize import quantize_int8, store_bf16
from moss_npu.nano.checkpoint import load_model
from moss_npu.nano.decoder import FrameDecoder, RequestParams
from moss_npu.sampling import SamplingParams, SlotSampling, TokenParams, filter_scores, sample_token
from moss_npu.sampling import sample_with_noise
from moss_npu.sampling import apply_repetition_penalty

from .test_decoder import model, prompts, steer  # noqa: F401 - the tiny steered model and its prompts (fixtures)
from .test_fused_block import _block, _inputs
from .test_matvec import kernels  # noqa: F401 - the kernels forced to each instruction set (fixture)

SAMPLED = SamplingParams.runtime_defaults()
SHARP = SamplingParams.runtime_defaults(audio_top_k=0, audio_top_p=0.6, audio_repetition_penalty=1.6)
# The official sampler's edge settings: top-k 1 (ties kept), top-p and penalty off, a cold top-k + top-p.
OFFICIAL = [SAMPLED, SHARP, SamplingParams.runtime_defaults(audio_temperature=1.0, audio_top_k=1, audio_top_p=1.0,
                                                            audio_repetition_penalty=1.0),
            SamplingParams.runtime_defaults(audio_temperature=1.3, audio_top_k=0, audio_top_p=1.0,
                                            audio_repetition_penalty=1.0),
            SamplingParams.runtime_defaults(audio_temperature=0.5, audio_top_k=5, audio_top_p=0.5,
                                            audio_repetition_penalty=3.0)]
OFFICIAL_IDS = ["defaults", "top-p-penalty", "top-k-1", "temperature-only", "cold-top-k-top-p"]


def decode(model, prompts, sampling, native, frames=12, nq=None, sampler="noise", seed=None):
    """Codes (frames, slots, Q) of ``prompts`` decoded together, the channels natively or in Python, and how many
    frames called the library's loop. ``sampling``: every slot's, or a list of one per slot; ``seed``: the official
    sampler's generator (None: torch's default one)."""
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    decoder = FrameDecoder(model, slots=len(prompts), max_len=max(p.shape[0] for p in prompts) + frames + 1,
                           sampler=sampler, generator=generator)
    assert decoder.frame_step.local_loop is not None
    calls = []
    if native:
        loop = decoder.frame_step.local_loop
        decoder.frame_step.local_loop = lambda *a, **k: calls.append(1) or loop(*a, **k)
        decoder.frame_step.local_loop.channels, decoder.frame_step.local_loop.vocab = loop.channels, loop.vocab
    else:
        decoder.frame_step.local_loop = None
    for i, rows in enumerate(prompts):
        params = sampling[i] if isinstance(sampling, list) else sampling
        decoder.admit(rows, RequestParams(params, nq if i == 1 else None, frames,
                                          torch.Generator().manual_seed(11 + i)))
    codes = []
    while decoder.active_slots:
        codes.append(decoder.step().codes)
    return torch.stack(codes), len(calls)


def _models(model):
    bf16, int8 = copy.deepcopy(model), copy.deepcopy(model)
    store_bf16(bf16)
    quantize_int8(int8)
    return {"float32": model, "bfloat16": bf16, "int8": int8}


@pytest.mark.parametrize("format", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED, SHARP], ids=["greedy", "sampled", "top-p-penalty"])
@pytest.mark.parametrize("count", [1, 3], ids=["one-slot", "three-slots-masked"])
def test_native_channels_decode_the_python_channels_codes(model, prompts, format, sampling, count):
    """The same codes, greedy and sampled (the same seeded uniforms), as the channels run in Python; the library's
    loop runs every frame, one slot's or several slots' (their rows through each tile together)."""
    chosen = _models(model)[format]
    native, calls = decode(chosen, prompts[:count], sampling, native=True, nq=2)
    assert calls == native.shape[0]
    assert torch.equal(native, decode(chosen, prompts[:count], sampling, native=False, nq=2)[0])
    assert bool((native[:, :, :2] < 64).all())


@pytest.mark.parametrize("format", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("sampling", OFFICIAL, ids=OFFICIAL_IDS)
def test_official_sampler_draws_natively_its_seeded_codes(model, prompts, format, sampling):
    """The official sampler (``torch.multinomial``, the default) draws in the library's loop, one call a frame: for
    8 seeds of the decoder's generator the codes the Python channels draw, and torch's default generator too; its
    greedy decisions as well; several slots alike (one draw of every slot's variates per channel) and mixed (a
    draw per sampling slot, greedy slots drawing nothing)."""
    chosen = _models(model)[format]
    for seed in range(8):
        native, calls = decode(chosen, prompts[:1], sampling, native=True, sampler="official", seed=seed)
        assert calls == native.shape[0] and torch.equal(native, decode(chosen, prompts[:1], sampling, native=False,
                                                                      sampler="official", seed=seed)[0])
    runs = []
    for native in (True, False):
        torch.manual_seed(5)
        runs.append(decode(chosen, prompts[:1], sampling, native=native, sampler="official"))
    assert runs[0][1] > 0 and torch.equal(runs[0][0], runs[1][0])
    other = decode(chosen, prompts[:1], sampling, native=True, sampler="official", seed=1)[0]
    assert torch.equal(runs[0][0], other) == (sampling.audio_top_k == 1)  # top-k 1 alone draws nothing
    for several in (SamplingParams(), sampling, [sampling, SamplingParams(), SHARP]):
        count = 3 if isinstance(several, list) else 2
        codes, calls = decode(chosen, prompts[:count], several, native=True, sampler="official", nq=2, seed=4)
        assert calls == codes.shape[0] and torch.equal(codes, decode(chosen, prompts[:count], several, native=False,
                                                                     sampler="official", nq=2, seed=4)[0])


def _text_prompts(model, lengths, seed):
    """Prompt rows of random text ids (20 .. 999) without audio, one per length."""
    g = torch.Generator().manual_seed(seed)
    pad, width = model.config.audio_pad_token_id, model.config.row_width
    return [torch.cat([torch.randint(20, 1000, (n, 1), generator=g), torch.full((n, width - 1), pad)], dim=1)
            for n in lengths]


@pytest.fixture(scope="module")
def golden_model(nano_fixture):
    """The nano-tiny fixture's checkpoint (the official format, 16 codebooks of 1024), steered to continue."""
    return steer(load_model(nano_fixture / "tts", device="cpu"))


@pytest.mark.parametrize("sampler", ["noise", "official"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED, SHARP], ids=["greedy", "sampled", "top-p-penalty"])
def test_seeded_codes_are_kept_on_the_fixture_checkpoint(golden_model, sampling, sampler):
    """On 16 channels of 1024 codes, 30 frames, one slot and three (rows grouped through the tiles), every frame in
    the library's loop: the Python channels' codes, greedy and seeded (the official sampler: 3 seeds of one slot)."""
    rows = _text_prompts(golden_model, (12, 19, 7), seed=3)
    for count, seed in ((1, 0), (3, 0), (1, 1), (1, 2))[:4 if sampler == "official" else 2]:
        native, calls = decode(golden_model, rows[:count], sampling, native=True, frames=30, sampler=sampler,
                               seed=seed)
        python = decode(golden_model, rows[:count], sampling, native=False, frames=30, sampler=sampler, seed=seed)[0]
        assert calls == 30 and torch.equal(native, python)


def test_official_sampled_goldens_decode_natively(nano_fixture, monkeypatch):
    """The fixture's sampled cases (the official code's codes after ``torch.manual_seed``; the golden runner
    records logits, so it decodes them in Python) decode to the same codes through the library's loop, every
    frame of them native."""
    from moss_npu.cpu.step import CpuStep
    from moss_npu.tts.loop import generate
    from moss_npu_verify import goldens

    official, local_audio = [], CpuStep.local_audio
    monkeypatch.setattr(CpuStep, "local_audio", lambda self, *a, **k: official.append(a[9] is not None) or
                        local_audio(self, *a, **k))
    fixture = goldens.load_fixture(nano_fixture)
    cases = [case for case in fixture.cases if case.get("kind") == "generate" and case.get("seed") is not None]
    model = load_model(nano_fixture / "tts", device="cpu")
    for case in cases:
        params = dict(case["params"])
        nq, frames = params.pop("nq", None), int(params.pop("max_new_frames", 300))
        torch.manual_seed(int(case["seed"]))
        rows = torch.from_numpy(np.load(fixture.path(case["input"]))).long()
        codes = generate(model, rows, sampling=SamplingParams(**params), nq=nq, max_new_frames=frames).codes[0]
        assert np.array_equal(codes.numpy(), np.load(fixture.path(case["expected"]))), case["id"]
    assert len(cases) >= 2 and official and all(official)


def _rows(params: TokenParams, count: int) -> SlotSampling:
    """``params`` for ``count`` rows, as ``SlotSampling.set`` writes them."""
    rows = SlotSampling.allocate(count, torch.device("cpu"))
    rows.do_sample[:], rows.temperature[:] = params.do_sample, params.temperature if params.do_sample else 1.0
    rows.top_k[:], rows.top_p[:], rows.repetition_penalty[:] = params.top_k, params.top_p, params.repetition_penalty
    return rows


# One decision's parameters: the defaults, each filter alone (top-k 1: ties kept), none, greedy with a penalty.
DECISIONS = {"defaults": TokenParams(True, 0.8, 25, 0.95, 1.2), "top-p-only": TokenParams(True, 1.3, 0, 0.5, 2.0),
             "top-k-only": TokenParams(True, 0.7, 3, 1.0, 1.0), "top-k-sorted": TokenParams(True, 1.1, 100, 0.99, 1.1),
             "top-k-1": TokenParams(True, 1.0, 1, 1.0, 1.0), "plain": TokenParams(True, 1.0, 0, 1.0, 1.0),
             "greedy-penalty": TokenParams(False, 1.0, 0, 1.0, 1.4)}


@pytest.mark.parametrize("params", DECISIONS.values(), ids=DECISIONS.keys())
def test_each_decision_is_sample_with_noises(kernels, params):
    """Random logits (ties at the top included), a presence mask, 400 uniforms: the library picks the code
    ``sample_with_noise`` picks, every time (the uniforms are far from CDF boundaries at float rounding)."""
    g = torch.Generator().manual_seed(params.top_k)
    logits = torch.randn(1024, generator=g) * 3
    logits[[5, 77, 300]] = logits.max()  # ties at the top: the lower id first
    seen = torch.rand(1024, generator=g) < 0.2
    uniforms = torch.rand(400, generator=g)
    want = sample_with_noise(logits.expand(400, -1), _rows(params, 400), uniforms, seen.expand(400, -1))
    got = [local_loop.decide(kernels, logits.numpy(), seen.numpy(), params, float(u)) for u in uniforms]
    assert got == want.tolist()


@pytest.mark.parametrize("params", DECISIONS.values(), ids=DECISIONS.keys())
def test_each_official_decision_is_sample_tokens(kernels, params):
    """Random logits (ties at the top included) at 4 scales, a presence mask, 100 seeds each: the library's pick
    with the Exp(1) variates torch.multinomial draws is ``sample_token``'s code for the same generator, every
    time, and the generator ends where ``sample_token`` leaves it (greedy draws nothing)."""
    g = torch.Generator().manual_seed(params.top_k)
    for scale in (0.05, 1.0, 3.0, 8.0):
        logits = torch.randn(1024, generator=g) * scale
        logits[[5, 77, 300]] = logits.max()  # ties at the top: the lower id first
        seen = torch.rand(1024, generator=g) < 0.2
        for seed in range(100):
            official, drawn = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
            want = int(sample_token(logits[None], params, seen=seen[None], generator=official)[0])
            q = torch.empty(1, 1024).exponential_(generator=drawn)[0].numpy() if params.do_sample else None
            assert local_loop.decide(kernels, logits.numpy(), seen.numpy(), params, 0.5, q) == want
            assert torch.equal(official.get_state(), drawn.get_state())


@pytest.mark.parametrize("logits", [[1.0, float("inf"), 2.0, float("nan"), 3.0], [-5.0, 2.0, 1e30, 3.0],
                                    [-5.0, float("inf"), 1.0]], ids=["nan", "overflow", "inf"])
def test_degenerate_scores_pick_what_the_samplers_pick(kernels, logits):
    """NaN weights (an infinite score, or one that a small temperature overflows) pick id 0, as
    ``sample_with_noise`` does, and the official pick draws from all ids alike, as ``sample_token`` does (its
    NaN probabilities become 1.0): the decoder drops frames of non-finite logits, but finite ones that a small
    temperature overflows are kept, and every code must index the tables."""
    row, none = torch.tensor(logits), np.zeros(len(logits), bool)
    for temperature, top_k in ((1.0, 0), (1e-10, 0), (1.0, 1), (1e-10, 2)):
        params = TokenParams(True, temperature, top_k, 0.9, 1.0)
        for u in (0.1, 0.9):
            want = int(sample_with_noise(row[None], _rows(params, 1), torch.tensor([u]))[0])
            assert local_loop.decide(kernels, row.numpy(), none, params, u) == want
        for seed in range(6):
            want = int(sample_token(row[None], params, generator=torch.Generator().manual_seed(seed))[0])
            q = torch.empty(1, len(logits)).exponential_(generator=torch.Generator().manual_seed(seed))[0]
            assert local_loop.decide(kernels, row.numpy(), none, params, 0.5, q.numpy()) == want


def _official_probabilities(logits, seen, params):
    scores = apply_repetition_penalty(logits[None], None, params.repetition_penalty, seen[None])
    return torch.softmax(filter_scores(scores, params.temperature, params.top_k, params.top_p), -1)[0].double()


@pytest.mark.parametrize("pick", ["uniform", "exponential"])
@pytest.mark.parametrize("top_p, possible_ids", [(0.9, 6), (0.95, 7)], ids=["top-p-cuts-the-tie", "tie-kept"])
def test_draws_follow_the_official_distribution(kernels, top_p, possible_ids, pick):
    """A fixed distribution where the penalty, top-k (a tie at the k-th value) and top-p (the crossing token)
    each change which ids are possible: 20,000 library draws (with uniforms, the noise-fed pick, or with
    Exp(1) variates, the official pick) against the official chain's probabilities (``sample_token``'s filters),
    chi-square p > 1e-4, and no excluded id ever drawn. top-p 0.9 cuts inside the top 6 (the crossing id 5
    kept, the tied id 6 cut); 0.95 keeps the tie as its crossing token."""
    params = TokenParams(True, 0.9, 6, top_p, 1.5)
    logits = torch.tensor([4.0, 3.6, 3.5, 3.5, 3.0, 2.9, 2.9, 1.0, -1.0, 3.9, 0.5, 2.0], dtype=torch.float32)
    seen = torch.zeros(12, dtype=torch.bool)
    seen[[9, 8]] = True  # 3.9 / 1.5 drops out of the top 6; -1.0 * 1.5 stays out
    probs = _official_probabilities(logits, seen, params)
    uniforms = torch.rand(20000, generator=torch.Generator().manual_seed(0))
    variates = torch.empty(20000, 12).exponential_(generator=torch.Generator().manual_seed(0)).numpy()
    drawn = np.bincount([local_loop.decide(kernels, logits.numpy(), seen.numpy(), params, float(u),
                                           q if pick == "exponential" else None)
                         for u, q in zip(uniforms, variates)], minlength=12)
    possible = probs > 0
    assert int(possible.sum()) == possible_ids
    assert drawn[~possible.numpy()].sum() == 0
    expected = probs[possible] / probs[possible].sum() * len(uniforms)
    statistic = ((torch.from_numpy(drawn)[possible].double() - expected) ** 2 / expected).sum()
    degrees = int(possible.sum()) - 1
    assert float(torch.special.gammaincc(torch.tensor(degrees / 2), statistic / 2)) > 1e-4  # the p-value


@pytest.mark.parametrize("format", ["float32", "bfloat16", "int8"])
def test_the_block_over_rows_gives_each_row_its_bits(kernels, format):
    """``moss_block_rows`` on 3 rows, each in its own slot's cache at its own position with its own rotation: each
    row's output and cache rows are what the one-row call gives it alone, bit for bit (so a slot decodes the same
    alone or in a batch)."""
    block, final = _block(kernels, format, 24, 40, seed=2)
    fused = FusedRowBlock(kernels, block, heads=3, eps=1e-5, scale=8 ** -0.5, final=final)
    rows = [_inputs(24, 3, 6, seed=s) for s in range(3)]
    positions, attended = np.array([3, 1, 4]), np.array([4, 2, 6])
    x, rotation = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
    keys, values = np.stack([r[2] for r in rows]), np.stack([r[3] for r in rows])
    alone_keys, alone_values = keys.copy(), values.copy()
    alone = [fused(r[0], r[1], k, v, int(p), int(a))
             for r, k, v, p, a in zip(rows, alone_keys, alone_values, positions, attended)]
    together = fused.rows(x, rotation, keys, values, positions, attended)
    assert np.array_equal(together, np.stack(alone))
    assert np.array_equal(keys, alone_keys) and np.array_equal(values, alone_values)


@pytest.fixture(scope="module")
def real_size():
    """The bench's real-size random checkpoint (16 × 1024 codebooks, 768 wide) in float32, bf16 and int8."""
    from bench.checkpoints import ensure_checkpoints, steer_to_continue

    return _models(steer_to_continue(load_model(ensure_checkpoints("real", None)[0], device="cpu")))


@pytest.mark.slow
@pytest.mark.parametrize("format", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("sampling, sampler", [(SamplingParams(), "noise"), (SAMPLED, "noise"), (SAMPLED, "official"),
                                               (SHARP, "official")],
                         ids=["greedy", "sampled", "official", "official-top-p-penalty"])
def test_real_size_codes_are_kept(real_size, format, sampling, sampler):
    """On the real-size checkpoint, one slot and two, every frame in the library's loop: the native channels decode
    the Python channels' codes (the official sampler: 3 seeds of its generator)."""
    model = real_size[format]
    prompts = _text_prompts(model, (40, 23), seed=0)
    for count, seed in ((1, 0), (2, 0), (1, 1), (1, 2))[:4 if sampler == "official" else 2]:
        native, calls = decode(model, prompts[:count], sampling, native=True, frames=4, sampler=sampler, seed=seed)
        python = decode(model, prompts[:count], sampling, native=False, frames=4, sampler=sampler, seed=seed)[0]
        assert calls == 4 and torch.equal(native, python)
