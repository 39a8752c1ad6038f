"""Prompt rows: reference staircase placement and the input checks (goldens run in test_cases.py)."""

import numpy as np
import pytest

from moss_npu.delay.prompt import DelayTokenizer, build_prompt, build_prompt_text, user_block
from moss_npu.delay.weights import DelayWeights
from moss_npu.errors import InputError


@pytest.fixture
def tok(tiny_weights):
    weights = DelayWeights.open(tiny_weights)
    return DelayTokenizer(weights.tokenizer_json, weights.config)


def test_user_block_has_18_lines_and_none_for_absent_fields():
    lines = user_block("hi", "None", tokens=7, language="en").split("\n")
    assert len(lines) == 18
    assert lines[6] == "7" and lines[4] == "None" and lines[-2] == "hi"


def test_prompt_without_reference_is_all_pad_and_ends_in_audio_start(tok):
    rows = build_prompt(tok, "hello world")
    cfg = tok.config
    assert rows.shape[1] == 1 + cfg.n_vq and rows.dtype == np.int64
    assert np.all(rows[:, 1:] == cfg.audio_pad_code)
    assert rows[-1, 0] == cfg.audio_start_token_id
    assert rows[0, 0] == cfg.im_start_token_id


def test_reference_codes_sit_on_the_user_slots_as_a_staircase(tok):
    cfg = tok.config
    codes = np.arange(5 * cfg.n_vq).reshape(5, cfg.n_vq) % 1000
    rows = build_prompt(tok, "hello", codes)
    start = int(np.flatnonzero(rows[:, 0] == cfg.audio_start_token_id)[0])
    end = int(np.flatnonzero(rows[:, 0] == cfg.audio_end_token_id)[0])
    assert end - start - 1 == 5 + cfg.n_vq - 1
    assert np.all(rows[start + 1: end, 0] == cfg.audio_user_slot_token_id)
    block = rows[start + 1: end, 1:]
    for q in (0, 7, 31):  # channel q starts q rows late
        assert np.array_equal(block[q: q + 5, q], codes[:, q])
        assert np.all(np.delete(block[:, q], np.arange(q, q + 5)) == cfg.audio_pad_code)
    assert np.all(rows[[start, end], 1:] == cfg.audio_pad_code)


def test_a_32_by_32_reference_is_frames_first(tok):
    codes = np.tile(np.arange(32)[:, None], (1, 32))  # frame t holds code t in every codebook
    rows = build_prompt(tok, "hello", codes)
    start = int(np.flatnonzero(rows[:, 0] == tok.config.audio_start_token_id)[0])
    assert np.array_equal(rows[start + 1: start + 33, 1], np.arange(32))


def test_empty_reference_counts_as_none(tok):
    text = build_prompt_text(tok, "hello", 0)
    assert "- Reference(s):\nNone\n" in text
    assert np.array_equal(build_prompt(tok, "hello", np.zeros((0, 32), dtype=np.int64)), build_prompt(tok, "hello"))


@pytest.mark.parametrize("codes, message", [
    (np.zeros((32, 9), dtype=np.int64), "transpose"),
    (np.full((4, 32), 1024), "no pad code"),
    (np.full((4, 32), -1), "expected 0.."),
    (np.zeros((4, 32), dtype=np.float32), "integer"),
    (np.zeros((4, 32, 1), dtype=np.int64), "integer"),
], ids=["codebooks-first", "pad", "negative", "float", "3d"])
def test_bad_reference_codes(tok, codes, message):
    with pytest.raises(InputError, match=message):
        build_prompt(tok, "hello", codes)


def test_empty_text(tok):
    with pytest.raises(InputError, match="non-empty"):
        build_prompt(tok, "  ")


def test_text_with_audio_markers_and_a_reference(tok):
    with pytest.raises(InputError, match="audio marker"):
        build_prompt(tok, "hello <|audio_start|>", np.zeros((3, 32), dtype=np.int64))
