import pytest
import torch

from moss_npu.errors import NumericalError
from moss_npu.nano import generate as gen_mod
from moss_npu.nano.checkpoint import load_model, read_state_dict, write_random_checkpoint
from moss_npu.nano.generate import PhaseTimer, generate, iter_frames, left_pad, trim_codes
from moss_npu.nano.prompt import build_prompt_rows
from moss_npu.nano.tokenizer import TextTokenizer
from moss_npu.sampling import SamplingParams

from .conftest import TINY

PAD = 64
SAMPLED = SamplingParams.runtime_defaults()


def _steer(model, toward_continue: bool):
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
    return _steer(load_model(tiny_ckpt, device="cpu"), True)


@pytest.fixture(scope="module")
def prompts(tiny_ckpt, model):
    tok = TextTokenizer.from_dir(tiny_ckpt)
    return [build_prompt_rows(tok, model.config, t) for t in ("Hello world.", "The quick brown fox jumps.")]


def test_runs_to_max_new_frames(model, prompts):
    result = generate(model, prompts[0], max_new_frames=5)
    assert result.codes[0].shape == (5, 4) and not bool(result.stopped[0])
    assert bool((result.codes[0] < PAD).all())


def test_stop_token_ends_generation(tiny_ckpt, prompts):
    stopper = _steer(load_model(tiny_ckpt, device="cpu"), False)
    result = generate(stopper, prompts[0], max_new_frames=5)
    assert result.codes[0].shape == (0, 4) and bool(result.stopped[0])


def test_nq_pads_upper_channels(model, prompts):
    codes = generate(model, prompts[0], max_new_frames=3, nq=2).codes[0]
    assert codes.shape == (3, 4)
    assert bool((codes[:, 2:] == PAD).all()) and bool((codes[:, :2] < PAD).all())
    # The first nq channels do not depend on nq (channel c is decided before c + 1).
    assert torch.equal(codes[:, :2], generate(model, prompts[0], max_new_frames=3).codes[0][:, :2])


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_local_kv_cache_and_no_global_cache_give_same_codes(model, prompts, sampling, monkeypatch):
    """Local cache on (the default) vs off (the local decoder recomputed per channel) vs no global cache (the
    whole sequence re-fed every frame): the same codes. The spies show that each run took its own path."""
    calls = {"local_step": 0, "global_rows": []}
    local_step, forward = model.local_transformer.step, model.forward
    monkeypatch.setattr(model.local_transformer, "step",
                        lambda *a, **k: calls.__setitem__("local_step", calls["local_step"] + 1) or local_step(*a, **k))

    def spy_forward(rows, *args, **kwargs):
        calls["global_rows"].append(rows.shape[1])
        return forward(rows, *args, **kwargs)

    monkeypatch.setattr(model, "forward", spy_forward)
    runs, paths = [], []
    for options in ({"local_kv_cache": True}, {"local_kv_cache": False}, {"use_kv_cache": False}):
        calls.update(local_step=0, global_rows=[])
        torch.manual_seed(7)
        runs.append(generate(model, prompts[0], max_new_frames=6, sampling=sampling, **options).codes[0])
        paths.append((calls["local_step"] > 0, len(calls["global_rows"]), max(calls["global_rows"], default=0)))
    assert runs[0].shape == (6, 4)
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    prompt_len = prompts[0].shape[0]
    # cached local steps; the uncached local decoder never steps; without a global cache every frame is a full
    # forward over the growing sequence (the cached runs take one prefill forward, then single-row steps)
    assert paths[0][0] and not paths[1][0]
    assert paths[0][1] == 1 and paths[1][1] == 1
    assert paths[2][1] == 6 and paths[2][2] == prompt_len + 5


def test_local_kv_cache_logits_close(model, prompts):
    logs = {}
    for flag in (False, True):
        seen = []
        generate(model, prompts[0], max_new_frames=4, local_kv_cache=flag,
                 logits_hook=lambda kind, i, x: seen.append(x.clone()))
        logs[flag] = torch.cat([x.flatten() for x in seen])
    assert torch.allclose(logs[False], logs[True], atol=1e-5)


def test_left_padded_batch_matches_single_rows(model, prompts):
    batch, mask = left_pad(prompts, model.config)
    assert not bool(mask[0, 0]) and bool(mask[1].all())
    result = generate(model, batch, mask, max_new_frames=4)
    for b, rows in enumerate(prompts):
        assert torch.equal(result.codes[b], generate(model, rows, max_new_frames=4).codes[0])


def test_row_that_stops_early_is_trimmed(model, prompts, monkeypatch):
    """Row 1 picks the stop token at frame 2: its later frames are pad and trimmed; row 0 goes on."""
    real = gen_mod.sample_token
    calls = {"text": 0}

    def fake(logits, params, history=None, **kw):
        out = real(logits, params, history, **kw)
        if logits.shape[-1] == 2:
            calls["text"] += 1
            if calls["text"] >= 3:
                out = torch.tensor([0, 1])
        return out

    monkeypatch.setattr(gen_mod, "sample_token", fake)
    batch, mask = left_pad(prompts, model.config)
    events = list(iter_frames(model, batch, mask, max_new_frames=5))
    assert [bool(e.active[1]) for e in events] == [True, True, False, False, False]
    assert bool(events[-1].finished[1]) and not bool(events[-1].finished[0])
    assert bool((events[3].codes[1] == PAD).all())
    frames = torch.stack([e.codes for e in events], dim=1)
    assert trim_codes(frames[1], 4, model.config).shape == (2, 4)


def test_stream_equals_generate(model, prompts):
    events = list(iter_frames(model, prompts[1], max_new_frames=4))
    assert [e.step_index for e in events] == [0, 1, 2, 3]
    streamed = torch.stack([e.codes[0] for e in events])
    assert torch.equal(streamed, generate(model, prompts[1], max_new_frames=4).codes[0])


def test_seeded_sampling_reproducible(model, prompts):
    torch.manual_seed(3)
    a = generate(model, prompts[0], max_new_frames=4, sampling=SAMPLED).codes[0]
    b = generate(model, prompts[0], max_new_frames=4, sampling=SAMPLED,
                 generator=torch.Generator().manual_seed(3)).codes[0]
    assert torch.equal(a, b)  # the default generator seeded = an explicit generator with the same seed
    h1 = generate(model, prompts[0], max_new_frames=4, sampling=SAMPLED, host_rng=True,
                  generator=torch.Generator().manual_seed(5)).codes[0]
    h2 = generate(model, prompts[0], max_new_frames=4, sampling=SAMPLED, host_rng=True,
                  generator=torch.Generator().manual_seed(5)).codes[0]
    assert torch.equal(h1, h2)


def test_trim_codes():
    from moss_npu.nano.config import NanoConfig, official_config_dict

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
    models = [_steer(load_model(folder, device="cpu"), True) for folder in (src, again)]
    tok = TextTokenizer.from_dir(again)
    rows = build_prompt_rows(tok, models[0].config, "Hello world.")
    codes = [generate(m, rows, max_new_frames=3).codes[0] for m in models]
    assert codes[0].shape == (3, 4) and torch.equal(codes[0], codes[1])


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("where", ["text", "audio"])
def test_non_finite_logits_raise(tiny_ckpt, prompts, where, sampling):
    """Like upstream: non-finite logits raise a RuntimeError starting "Non-finite" (its fp32 fallback's cue), also
    when sampling (torch.multinomial never sees them); in float32 the message does not advise float32."""
    broken = _steer(load_model(tiny_ckpt, device="cpu"), True)
    with torch.no_grad():
        if where == "text":
            broken.local_transformer.ln_f.weight[1] = float("nan")
        else:
            broken.audio_lm_heads[3].weight[5, 0] = float("nan")
    with pytest.raises(NumericalError, match=f"^Non-finite {where} logits.*precision is not the cause"):
        generate(broken, prompts[0], max_new_frames=2, sampling=sampling)
    with pytest.raises(NumericalError, match=r"bfloat16\); run the model in float32"):
        generate(broken.to(torch.bfloat16), prompts[0], max_new_frames=2, sampling=sampling)


def test_phase_timer_counts_phases(model, prompts):
    timer = PhaseTimer()
    generate(model, prompts[0], max_new_frames=2, timer=timer)
    assert timer.calls["prefill"] == 1 and timer.calls["global"] == 1
    assert timer.calls["local"] == 2 * (1 + 4) and timer.calls["sample"] == 2 * (1 + 4)


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled-penalty"])
def test_reference_and_optimized_speed_give_same_codes(model, prompts, sampling):
    """Every optimisation together (decode steps, qkv table, presence mask, 2-row text head) changes no code,
    for a left-padded batch too."""
    batch, mask = left_pad(prompts, model.config)
    runs = []
    for speed in (gen_mod.SpeedOptions.reference(), gen_mod.SpeedOptions()):
        torch.manual_seed(11)
        runs.append(generate(model, batch, mask, max_new_frames=6, sampling=sampling, speed=speed).frames)
    assert torch.equal(runs[0], runs[1])


def test_qkv_table_follows_weight_edits(tiny_ckpt, prompts):
    """The tabulated first-layer projections are rebuilt after an in-place weight edit, never reused stale."""
    edited = _steer(load_model(tiny_ckpt, device="cpu"), True)
    generate(edited, prompts[0], max_new_frames=2)  # builds the table
    with torch.no_grad():
        edited.audio_embeddings[0].weight.mul_(3.0)
        edited.local_transformer.h[0].attn.c_attn.weight.mul_(2.0)
    logs = {}
    for name in ("optimized", "reference"):
        seen = []
        generate(edited, prompts[0], max_new_frames=3, speed=gen_mod.SpeedOptions.named(name),
                 logits_hook=lambda kind, i, x: seen.append(x.clone()))
        logs[name] = torch.cat([x.flatten() for x in seen])
    assert torch.allclose(logs["optimized"], logs["reference"], atol=1e-5)
