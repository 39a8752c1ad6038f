"""Delay pattern and state machine: round trip, the staircase of a forced run, and a backbone-free replay."""

import json

import numpy as np
import pytest

from moss_npu.delay.config import DelayModelConfig
from moss_npu.sampling_params import SamplingParams
from moss_npu.delay.state import (NOT_DRAINING, apply_delay_pattern, de_delay, extract_segments, frames_from_rows,
                                  init_state, step)

SPECIAL = dict(pad_token_id=0, im_start_token_id=1, im_end_token_id=2, audio_start_token_id=3, audio_end_token_id=4,
               audio_user_slot_token_id=5, audio_assistant_gen_slot_token_id=6,
               audio_assistant_delay_slot_token_id=7)
CFG = DelayModelConfig(**SPECIAL)
GREEDY = SamplingParams(text_temperature=0.0, audio_temperature=0.0)


@pytest.mark.parametrize("frames", [1, 5, 32, 40])
def test_delay_round_trip(frames):
    codes = np.random.RandomState(frames).randint(0, 1024, size=(frames, 32))
    delayed = apply_delay_pattern(codes, 1024)
    assert delayed.shape == (frames + 31, 32)
    assert np.array_equal(de_delay(delayed), codes)


def test_de_delay_of_fewer_than_32_rows_is_empty():
    assert de_delay(np.zeros((31, 32), dtype=np.int64)).shape == (0, 32)


def test_segments_split_on_all_pad_frames():
    a, b = np.ones((3, 32), dtype=np.int64), np.full((2, 32), 2)
    frames = np.concatenate([a, np.full((2, 32), 1024), b])
    segments = extract_segments(apply_delay_pattern(frames, 1024), 1024)
    assert [s.tolist() for s in segments] == [a.tolist(), b.tolist()]


def _forced_text(token, vocab=16):
    logits = np.full(vocab, -5.0, dtype=np.float32)
    logits[token] = 5.0
    return logits


def test_forced_run_climbs_and_drains_the_staircase():
    """G gen slots then delay slots: counts 1..G+1, G+1 held, then falling to 0 (docs/delay.md#the-delay-pattern)."""
    prompt = np.full((4, 33), 1024, dtype=np.int64)
    prompt[:, 0] = [1, 9, 9, CFG.audio_start_token_id]
    state = init_state(prompt, CFG)
    assert (state.audio_length, state.is_audio) == (1, True)
    audio = np.zeros((32, 1025), dtype=np.float32)
    audio[:, 17] = 1.0
    rows, g = [], 5
    for i in range(g + 34):
        wanted = CFG.audio_assistant_gen_slot_token_id if i < g else CFG.audio_assistant_delay_slot_token_id
        if i == g + 33:
            wanted = CFG.im_end_token_id
        rows.append(step(state, _forced_text(wanted), audio, GREEDY, CFG, np.random.RandomState(0)))
    rows = np.stack(rows)
    counts = (rows[:, 1:] != 1024).sum(axis=1).tolist()
    assert counts == [1, 2, 3, 4, 5] + [6] * 27 + [5, 4, 3, 2, 1] + [0, 0]
    assert rows[g + 32, 0] == CFG.audio_end_token_id
    assert rows[-1, 0] == CFG.im_end_token_id and state.is_stopping
    assert state.delayed_length == NOT_DRAINING
    codes = frames_from_rows(rows, CFG)
    assert codes.shape == (g + 1, 32) and np.all(codes == 17)


def test_im_end_is_masked_for_the_first_33_steps():
    prompt = np.full((2, 33), 1024, dtype=np.int64)
    prompt[:, 0] = [1, CFG.audio_start_token_id]
    state = init_state(prompt, CFG)
    state.is_audio = False
    row = step(state, _forced_text(CFG.im_end_token_id), np.zeros((32, 1025), np.float32), GREEDY, CFG,
               np.random.RandomState(0))
    assert row[0] != CFG.im_end_token_id


def test_frames_with_a_pad_code_never_reach_the_codec():
    codes = np.random.RandomState(1).randint(0, 1024, size=(4, 32))
    codes[2, 5] = 1024
    frames = frames_from_rows(np.concatenate([np.zeros((35, 1)), apply_delay_pattern(codes, 1024)[:35]], axis=1)
                              .astype(np.int64), CFG)
    assert frames.shape == (3, 32) and not np.any(frames == 1024)


def test_replay_of_the_golden_traces_without_a_backbone(delay_fixture):
    """init + step on the recorded hidden states and text logits gives upstream's rows exactly."""
    from moss_npu.delay.heads import NumpyAudioHeads
    from moss_npu.delay.weights import DelayWeights
    from moss_npu_verify.cases.delay import order_dependent

    weights = DelayWeights.open(delay_fixture / "weights")
    heads = NumpyAudioHeads(weights)
    cases = {c["id"]: c for c in json.loads((delay_fixture / "cases.json").read_text())["cases"]}
    replayed = 0
    for case in cases.values():
        if case["kind"] != "generate" or "prompt_case" not in case["inputs"]:
            continue
        inputs, expected = case["inputs"], case["expected"]
        prompt = np.load(delay_fixture / cases[inputs["prompt_case"]]["expected"]["input_ids"])
        hidden = np.load(delay_fixture / expected["hidden_states"])
        logits = np.load(delay_fixture / expected["text_logits"])
        state, rng = init_state(prompt, weights.config), np.random.RandomState(inputs["np_random_seed"])
        sampling = SamplingParams(**inputs["sampling"])
        rows = np.stack([step(state, logits[i], heads(hidden[i]), sampling, weights.config, rng)
                         for i in range(len(hidden))])
        want = np.load(delay_fixture / expected["generated_rows"])
        assert rows.shape == want.shape, case["id"]
        # A replay does not feed its draws back, so a draw decided by the CPU's argpartition order changes only
        # its own cell (order_dependent); every other cell, and every cell of an unaffected run, is exact.
        differ = [i for i in range(len(rows)) if not np.array_equal(rows[i], want[i])]
        assert all(order_dependent(rows[i], want[i], logits[i], heads(hidden[i]), sampling) for i in differ), \
            (case["id"], differ)
        assert len(differ) <= max(1, len(rows) // 8), (case["id"], differ)
        if not differ:
            assert np.array_equal(frames_from_rows(rows, weights.config), np.load(delay_fixture / expected["codes"]))
        replayed += 1
    assert replayed
