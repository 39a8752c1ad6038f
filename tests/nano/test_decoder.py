"""The frame decoder: same codes as the official algorithm, per-request results independent of batching,
slot lifecycle, prompt-prefix reuse. The tiny model is steered so that greedy runs never stop early."""

import pytest
import torch

from moss_npu.errors import InputError, NumericalError
from moss_npu.nano import decoder as dec_mod
from moss_npu.nano.checkpoint import load_model, read_state_dict
from moss_npu.nano.decoder import FrameDecoder, RequestParams
from moss_npu.tts.loop import generate
from moss_npu.nano.frames import PhaseTimer, left_pad, trim_codes
from moss_npu.nano.prompt import build_prompt_rows
from moss_npu.nano.reference import reference_generate
from moss_npu.nano.reuse import MIN_SHARED_ROWS, PrefixCache
from moss_npu.nano.tokenizer import TextTokenizer
from moss_npu.sampling import SamplingParams
from moss_npu_verify.random_checkpoints import write_random_checkpoint

from .conftest import TINY

PAD = 64
SAMPLED = SamplingParams.runtime_defaults()
TEXTS = ("Hello world.", "The quick brown fox jumps.", "你好世界，欢迎使用。数字 123 and a longer tail of words")


def steer(model, toward_continue: bool = True):
    """Make the 2-way text decision one-sided: local ln_f feature 0 large, wte rows 9/7 opposite on it."""
    cfg = model.config
    with torch.no_grad():
        model.local_transformer.ln_f.bias[0] = 20.0
        sign = 1.0 if toward_continue else -1.0
        model.transformer.wte.weight[cfg.audio_assistant_slot_token_id, 0] = sign
        model.transformer.wte.weight[cfg.audio_end_token_id, 0] = -sign
    return model


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return steer(load_model(tiny_ckpt, device="cpu"))


@pytest.fixture(scope="module")
def prompts(tiny_ckpt, model):
    tok = TextTokenizer.from_dir(tiny_ckpt)
    return [build_prompt_rows(tok, model.config, t) for t in TEXTS]


def run_slots(decoder, schedule, frames, together=False):
    """Admit prompts at the given frame indices ({frame: [rows, ...]}), one by one or ``together`` (one
    ``admit_many`` per frame index); return each request's codes and logits."""
    logits: dict[int, list] = {}
    decoder.logits_hook = lambda kind, i, x: current.append(x.clone())
    owner, codes, order = {}, {}, 0
    step = 0
    while step in schedule or decoder.active_slots or any(k > step for k in schedule):
        due = [(rows, RequestParams(max_new_frames=frames)) for rows in schedule.get(step, [])]
        slots = decoder.admit_many(due) if together and due else [decoder.admit(*request) for request in due]
        for slot in slots:
            owner[slot], codes[order], logits[order] = order, [], []
            order += 1
        if not decoder.active_slots:
            step += 1
            continue
        current: list = []
        batch = decoder.step()
        per_slot = {s: [x[s] for x in current] for s in owner}
        for slot, request in list(owner.items()):
            if bool(batch.active[slot]):
                codes[request].append(batch.codes[slot])
                logits[request].append(torch.cat([x.flatten() for x in per_slot[slot]]))
            if bool(batch.finished[slot]):
                decoder.release(slot)
                del owner[slot]
        step += 1
    return [torch.stack(codes[r]) for r in sorted(codes)], [torch.cat(logits[r]) for r in sorted(logits)]


def test_runs_to_max_new_frames(model, prompts):
    result = generate(model, prompts[0], max_new_frames=5)
    assert result.codes[0].shape == (5, 4) and not bool(result.stopped[0])
    assert bool((result.codes[0] < PAD).all())


def test_stop_token_ends_generation(tiny_ckpt, prompts):
    stopper = steer(load_model(tiny_ckpt, device="cpu"), False)
    result = generate(stopper, prompts[0], max_new_frames=5)
    assert result.codes[0].shape == (0, 4) and bool(result.stopped[0])


def test_nq_pads_upper_channels(model, prompts):
    codes = generate(model, prompts[0], max_new_frames=3, nq=2).codes[0]
    assert codes.shape == (3, 4)
    assert bool((codes[:, 2:] == PAD).all()) and bool((codes[:, :2] < PAD).all())
    assert torch.equal(codes[:, :2], generate(model, prompts[0], max_new_frames=3).codes[0][:, :2])


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled-penalty"])
@pytest.mark.parametrize("batched", [False, True], ids=["single", "left-padded-batch"])
def test_decoder_matches_the_official_algorithm(model, prompts, sampling, batched):
    """Same seed, same codes: the decoder with the official sampler against the oracle (left padding included)."""
    rows, mask = left_pad(prompts[:2], model.config) if batched else (prompts[1], None)
    runs = []
    for fn in (reference_generate, generate):
        torch.manual_seed(11)
        runs.append(fn(model, rows, mask, sampling=sampling, max_new_frames=6))
    for want, got in zip(runs[0].codes, runs[1].codes):
        assert torch.equal(want, got)


def test_decoder_logits_match_the_oracle(model, prompts):
    logs = []
    for fn in (reference_generate, generate):
        seen = []
        fn(model, prompts[0], max_new_frames=4, logits_hook=lambda kind, i, x: seen.append(x.clone()))
        logs.append(torch.cat([x.flatten() for x in seen]))
    assert torch.allclose(logs[0], logs[1], atol=1e-5)


def test_cacheless_oracle_gives_the_same_codes(model, prompts):
    a = reference_generate(model, prompts[0], max_new_frames=4).codes[0]
    assert torch.equal(a, reference_generate(model, prompts[0], max_new_frames=4, use_kv_cache=False).codes[0])


def check_batch_invariance(model, prompts, frames, atol):
    """A request's greedy codes are identical alone, in a batch of other prompt lengths, admitted mid-flight, and
    with the prompts admitted together (one prefill over all of them)."""
    alone = [run_slots(FrameDecoder(model, slots=1, max_len=512), {0: [p]}, frames) for p in prompts]
    runs = [run_slots(FrameDecoder(model, slots=4, max_len=512), schedule, frames, together)
            for schedule in ({0: list(prompts)}, {0: [prompts[0]], 3: list(prompts[1:])}) for together in (False, True)]
    for i in range(len(prompts)):
        for codes, logits in ((run[0][i], run[1][i]) for run in runs):
            assert torch.equal(codes, alone[i][0][0])
            assert torch.allclose(logits, alone[i][1][0], atol=atol)


def test_codes_do_not_depend_on_the_batch(model, prompts):
    check_batch_invariance(model, prompts, frames=5, atol=1e-4)


@pytest.mark.slow
def test_codes_do_not_depend_on_the_batch_real_size():
    """The same on the bench's real-size random checkpoint (12 x 768 global layers, 16 x 1024 codebooks)."""
    from bench.checkpoints import ensure_checkpoints, steer_to_continue

    model = steer_to_continue(load_model(ensure_checkpoints("real", None)[0], device="cpu"))
    g = torch.Generator().manual_seed(0)
    prompts = []
    for length in (40, 57, 23):
        rows = torch.full((length, model.config.row_width), model.config.audio_pad_token_id)
        rows[:, 0] = torch.randint(20, 1000, (length,), generator=g)
        prompts.append(rows)
    check_batch_invariance(model, prompts, frames=3, atol=1e-4)


def test_noise_sampler_draws_per_request(model, prompts):
    """Sampled with the noise-fed sampler and a generator per request: alone == in a batch."""
    def params(seed):
        return RequestParams(SAMPLED, max_new_frames=5, generator=torch.Generator().manual_seed(seed))

    def collect(decoder, requests):
        slots = [decoder.admit(rows, p) for rows, p in requests]
        out = {s: [] for s in slots}
        while decoder.active_slots:
            batch = decoder.step()
            for s in slots:
                if bool(batch.active[s]):
                    out[s].append(batch.codes[s])
        return [torch.stack(out[s]) for s in slots]

    alone = [collect(FrameDecoder(model, sampler="noise", max_len=256), [(p, params(i))])[0]
             for i, p in enumerate(prompts)]
    batch = collect(FrameDecoder(model, slots=3, sampler="noise", max_len=256),
                    [(p, params(i)) for i, p in enumerate(prompts)])
    for a, b in zip(alone, batch):
        assert torch.equal(a, b)
    assert not torch.equal(alone[0], collect(FrameDecoder(model, sampler="noise", max_len=256),
                                             [(prompts[0], params(99))])[0])


def test_row_that_stops_early_is_trimmed(model, prompts, monkeypatch):
    """Row 1 picks the stop token at frame 2: it finishes there, row 0 goes on."""
    real, calls = dec_mod.sample_token, {"text": 0}

    def fake(logits, params, history=None, **kw):
        out = real(logits, params, history, **kw)
        if logits.shape[-1] == 2:
            calls["text"] += 1
            if calls["text"] >= 3:
                out = torch.tensor([0, 1])
        return out

    monkeypatch.setattr(dec_mod, "sample_token", fake)
    batch, mask = left_pad(prompts[:2], model.config)
    result = generate(model, batch, mask, max_new_frames=5)
    assert result.codes[0].shape[0] == 5 and result.codes[1].shape[0] == 2
    assert bool(result.stopped[1]) and not bool(result.stopped[0])


def test_slot_lifecycle(model, prompts):
    decoder = FrameDecoder(model, slots=2, max_len=128)
    a = decoder.admit(prompts[0], RequestParams(max_new_frames=3))
    b = decoder.admit(prompts[1], RequestParams(max_new_frames=1))
    assert (a, b) == (0, 1) and decoder.free_slots == 0
    with pytest.raises(InputError, match="busy"):
        decoder.admit(prompts[0], RequestParams(max_new_frames=1))
    first = decoder.step()
    assert first.active.tolist() == [True, True] and first.finished.tolist() == [False, True]
    decoder.release(b)
    assert decoder.admit(prompts[2], RequestParams(max_new_frames=2)) == 1  # joins while slot 0 decodes
    with pytest.raises(InputError, match="max_len"):
        FrameDecoder(model, max_len=16).admit(prompts[0], RequestParams(max_new_frames=300))
    with pytest.raises(InputError, match="holds no request"):
        FrameDecoder(model).release(0)


def test_a_frames_global_step_waits_for_the_next_call(model, prompts):
    """``step`` returns a frame's codes before the global step that prepares the next frame; an ``admit`` (like a
    ``release`` or the next ``step``) runs it first, so the joining request sees a consistent cache."""
    decoder = FrameDecoder(model, slots=2, max_len=128)
    slot, length = decoder.admit(prompts[0], RequestParams(max_new_frames=3)), prompts[0].shape[0]
    keys = lambda: decoder.state.kv[:, 0, slot, :, length]  # the row frame 1 appends to the global cache
    decoder.step()
    assert torch.equal(keys(), torch.zeros_like(keys()))
    decoder.admit(prompts[1], RequestParams(max_new_frames=1))
    assert not torch.equal(keys(), torch.zeros_like(keys()))


def test_no_global_step_after_the_last_frame(model, prompts):
    timer = PhaseTimer()
    decoder = FrameDecoder(model, max_len=128, timer=timer)
    slot = decoder.admit(prompts[0], RequestParams(max_new_frames=2))
    assert not decoder.step().finished[slot] and decoder.step().finished[slot]
    decoder.release(slot)
    assert timer.calls["frame"] == 2 and timer.calls["global"] == 1  # the second frame's would feed no one
    slot = decoder.admit(prompts[0], RequestParams(max_new_frames=5))
    decoder.step()
    decoder.release(slot)  # cancelled after one frame: its next row feeds no one either
    assert timer.calls["frame"] == 3 and timer.calls["global"] == 1


def test_a_failing_deferred_step_fails_the_next_step_not_the_release(model, prompts, monkeypatch):
    """A frame's deferred global step that raises while a finished slot is released (or a request admitted) fails
    the next ``step``, where callers handle a failed frame (the engine's thread died in ``release`` otherwise);
    when every slot it was for is released first, nothing is left to fail."""
    def broken(*args):
        raise RuntimeError("injected: out of memory")

    for release_all in (False, True):
        decoder = FrameDecoder(model, slots=2, max_len=128)
        short = decoder.admit(prompts[0], RequestParams(max_new_frames=1))
        long = decoder.admit(prompts[1], RequestParams(max_new_frames=4))
        assert decoder.step().finished[short]
        monkeypatch.setattr(decoder, "_global_step", broken)
        decoder.release(short)
        if release_all:
            decoder.release(long)
        monkeypatch.undo()
        decoder.admit(prompts[2], RequestParams(max_new_frames=2))
        if not release_all:
            with pytest.raises(RuntimeError, match="injected"):
                decoder.step()
            decoder.release(long)
        decoder.step()


def test_state_memory_is_reported(model):
    decoder = FrameDecoder(model, slots=3, max_len=100)
    g = model.config.gpt2_config
    kv = g.n_layer * 2 * 3 * g.n_head * 100 * g.head_dim * 4
    assert decoder.state.kv.shape == (g.n_layer, 2, 3, g.n_head, 100, g.head_dim)
    assert kv < decoder.memory_bytes() < kv * 1.5


def test_prefix_cache_matches_fresh_prefill(model, prompts):
    cache = PrefixCache()
    shared = int((prompts[0][:len(prompts[1])] == prompts[1][:len(prompts[0])]).all(-1).long().cumprod(0).sum())
    assert shared >= MIN_SHARED_ROWS  # the template prefix
    warm = FrameDecoder(model, max_len=256, prefix_cache=cache)
    run_slots(warm, {0: [prompts[0]]}, 1)
    assert cache.lookup(prompts[1])[0] == shared
    reused = run_slots(warm, {0: [prompts[1]]}, 3)
    fresh = run_slots(FrameDecoder(model, max_len=256), {0: [prompts[1]]}, 3)
    assert torch.equal(reused[0][0], fresh[0][0]) and torch.equal(reused[1][0], fresh[1][0])
    again = run_slots(warm, {0: [prompts[1]]}, 3)  # all but its last row cached: that row alone is prefilled
    assert cache.lookup(prompts[1])[0] == len(prompts[1]) - 1
    assert torch.equal(again[0][0], fresh[0][0]) and torch.equal(again[1][0], fresh[1][0])


def test_refresh_follows_weight_edits(tiny_ckpt, prompts):
    """Tables and cached prompts come from the weights at construction; refresh() rebuilds them."""
    edited = steer(load_model(tiny_ckpt, device="cpu"))
    decoder = FrameDecoder(edited, max_len=256, prefix_cache=PrefixCache())
    run_slots(decoder, {0: [prompts[0]]}, 1)
    with torch.no_grad():
        edited.audio_embeddings[0].weight.mul_(3.0)
        edited.local_transformer.h[0].attn.c_attn.weight.mul_(2.0)
        edited.transformer.h[0].mlp.fc_in.weight.mul_(1.5)
    decoder.refresh()
    assert len(decoder.prefix_cache) == 0
    seen = []
    reference_generate(edited, prompts[0], max_new_frames=3, logits_hook=lambda kind, i, x: seen.append(x.clone()))
    _, logits = run_slots(decoder, {0: [prompts[0]]}, 3)
    assert torch.allclose(logits[0], torch.cat([x.flatten() for x in seen]), atol=1e-5)


def test_seeded_sampling_reproducible(model, prompts):
    torch.manual_seed(3)
    a = generate(model, prompts[0], max_new_frames=4, sampling=SAMPLED).codes[0]
    b = generate(model, prompts[0], max_new_frames=4, sampling=SAMPLED,
                 generator=torch.Generator().manual_seed(3)).codes[0]
    assert torch.equal(a, b)  # the default generator seeded = an explicit generator with the same seed
    h1, h2 = (generate(model, prompts[0], max_new_frames=4, sampling=SAMPLED, host_rng=True,
                       generator=torch.Generator().manual_seed(5)).codes[0] for _ in range(2))
    assert torch.equal(h1, h2)


def test_trim_codes():
    from moss_npu.nano.config import NanoConfig
    from moss_npu_verify.random_checkpoints import official_config_dict

    cfg = NanoConfig.from_dict(official_config_dict())
    frames = torch.full((4, 16), 1024)
    frames[:2, :3] = 5
    assert trim_codes(frames, 16, cfg).shape == (2, 16)
    frames[3, 10] = 7  # only in a channel >= nq: still trailing pad
    assert trim_codes(frames, 8, cfg).shape == (2, 16)


def test_random_checkpoint_round_trip(tmp_path, tiny_tokenizer):
    """Self-contained: write a checkpoint with the package's own writer, reload as bf16 .bin and fp32, generate."""
    src = write_random_checkpoint(tmp_path / "a", TINY, seed=4, tokenizer_model=tiny_tokenizer)
    state = read_state_dict(src / "model.safetensors")
    again = write_random_checkpoint(tmp_path / "b", TINY, fmt="bin", tied_copies=True, stray_local_wte=True,
                                    state=state, tokenizer_model=tiny_tokenizer)
    models = [steer(load_model(folder, device="cpu")) for folder in (src, again)]
    rows = build_prompt_rows(TextTokenizer.from_dir(again), models[0].config, "Hello world.")
    codes = [generate(m, rows, max_new_frames=3).codes[0] for m in models]
    assert codes[0].shape == (3, 4) and torch.equal(codes[0], codes[1])


@pytest.mark.parametrize("host_rng", [False, True], ids=["official-sampler", "noise-sampler"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("where", ["text", "audio"])
def test_non_finite_logits_raise(tiny_ckpt, prompts, where, sampling, host_rng):
    """Like upstream: non-finite logits raise a RuntimeError starting "Non-finite" (its fp32 fallback's cue), also
    when sampling (the sampler never fails on them); in float32 the message does not advise float32."""
    broken = steer(load_model(tiny_ckpt, device="cpu"))
    with torch.no_grad():
        if where == "text":
            broken.local_transformer.ln_f.weight[1] = float("nan")
        else:
            broken.audio_lm_heads[3].weight[5, 0] = float("nan")
    with pytest.raises(NumericalError, match=f"^Non-finite {where} logits.*precision is not the cause"):
        generate(broken, prompts[0], max_new_frames=2, sampling=sampling, host_rng=host_rng)
    with pytest.raises(NumericalError, match=r"bfloat16\); run the model in float32"):
        generate(broken.to(torch.bfloat16), prompts[0], max_new_frames=2, sampling=sampling, host_rng=host_rng)


def test_phase_timer_counts_phases(model, prompts):
    timer = PhaseTimer()
    generate(model, prompts[0], max_new_frames=2, timer=timer)
    assert timer.calls["prefill"] == 1 and timer.calls["frame"] == 2
