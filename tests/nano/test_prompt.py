import pytest
import torch

from moss_npu.errors import InputError
from moss_npu.nano.config import load_config
from moss_npu.nano.prompt import (AFTER_REFERENCE, build_prompt_rows, mask_unused_channels, user_prefix_ids,
                                  assistant_prefix_ids)
from moss_npu.nano.tokenizer import TextTokenizer

PAD = 64


@pytest.fixture(scope="module")
def parts(tiny_ckpt):
    return TextTokenizer.from_dir(tiny_ckpt), load_config(tiny_ckpt)


def _codes(frames, n_vq=4):
    return torch.arange(frames * n_vq).reshape(frames, n_vq) % 64


def test_official_template_ids(nano_fixture):
    """Template ids of docs/architecture.md#prompt-layouts (equal to the official ONNX manifest's)."""
    tok, cfg = TextTokenizer.from_dir(nano_fixture / "tts"), load_config(nano_fixture / "tts")
    assert user_prefix_ids(tok, cfg) == [4, 600, 289, 10356, 13, 10356, 10425, 1860, 4546, 12907, 10363, 13325, 11492]
    assert assistant_prefix_ids(tok, cfg) == [10356, 14, 5, 4, 8165, 430]
    assert len(tok.encode(AFTER_REFERENCE)) == 56


def test_continuation_layout(parts):
    tok, cfg = parts
    rows = build_prompt_rows(tok, cfg, "Hello world.")
    text = tok.encode("Hello world.")
    ids = (user_prefix_ids(tok, cfg) + tok.encode("None") + tok.encode(AFTER_REFERENCE) + text
           + assistant_prefix_ids(tok, cfg) + [cfg.audio_start_token_id])
    assert rows.dtype == torch.long and rows.shape == (len(ids), 5)
    assert rows[:, 0].tolist() == ids and bool((rows[:, 1:] == PAD).all())


def test_continuation_with_prompt_concatenates_text(parts):
    tok, cfg = parts
    codes = _codes(3)
    rows = build_prompt_rows(tok, cfg, "world.", prompt_text="Hello ", prompt_codes=codes)
    plain = build_prompt_rows(tok, cfg, "Hello world.")
    assert torch.equal(rows[: len(plain)], plain)  # prompt_text + text as one string
    assert rows[len(plain):, 0].tolist() == [cfg.audio_assistant_slot_token_id] * 3
    assert torch.equal(rows[len(plain):, 1:], codes)


def test_voice_clone_layout(parts):
    tok, cfg = parts
    codes = _codes(2)
    rows = build_prompt_rows(tok, cfg, "Hello world.", mode="voice_clone", prompt_codes=codes)
    head = user_prefix_ids(tok, cfg) + [cfg.audio_start_token_id]
    assert rows[: len(head), 0].tolist() == head
    ref = rows[len(head): len(head) + 2]
    assert ref[:, 0].tolist() == [cfg.audio_user_slot_token_id] * 2 and torch.equal(ref[:, 1:], codes)
    tail = rows[len(head) + 2:, 0].tolist()
    assert tail[0] == cfg.audio_end_token_id and tail[-1] == cfg.audio_start_token_id


@pytest.mark.parametrize("kwargs,needle", [
    ({"mode": "voice_clone"}, "needs prompt"),
    ({"mode": "voice_clone", "prompt_text": "x", "prompt_codes": _codes(1)}, "does not take prompt_text"),
    ({"prompt_text": "x"}, "both or neither"),
    ({"prompt_codes": _codes(1)}, "both or neither"),
    ({"mode": "sing"}, "not supported"),
    ({"mode": "voice_clone", "prompt_codes": torch.zeros(2, 3, dtype=torch.long)}, "shape"),
    ({"mode": "voice_clone", "prompt_codes": torch.full((2, 4), 70)}, "outside codebook"),
    ({"mode": "voice_clone", "prompt_codes": torch.zeros(2, 4)}, "dtype"),
])
def test_mode_validation(parts, kwargs, needle):
    tok, cfg = parts
    with pytest.raises(InputError, match=needle):
        build_prompt_rows(tok, cfg, "Hi.", **kwargs)


def test_pad_codes_allowed_and_mode_case_insensitive(parts):
    tok, cfg = parts
    codes = mask_unused_channels(_codes(2), 2, cfg)
    assert bool((codes[:, 2:] == PAD).all()) and bool((codes[:, :2] != PAD).all())
    rows = build_prompt_rows(tok, cfg, "Hi.", mode=" Voice_Clone ", prompt_codes=codes)
    assert rows.shape[1] == 5
