"""Prompt rows of the Delay model (docs/delay.md#prompt): text + optional reference codes -> ``(S, 1 + Q)`` int64.
Special token strings come from the tokenizer by id (the ids from ``config.json``). S prompt rows, T reference
frames, Q codebooks.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import numpy as np

from moss_npu.delay.config import SPECIAL_ID_KEYS, DelayModelConfig
from moss_npu.delay.state import apply_delay_pattern
from moss_npu.errors import CheckpointError, InputError

AUDIO_PLACEHOLDER = "<|audio|>"
# The instruction's fields between the reference and the text, in order: keyword -> the label upstream writes.
FIELDS = {"instruction": "Instruction", "tokens": "Tokens", "quality": "Quality", "sound_event": "Sound Event",
          "ambient_sound": "Ambient Sound", "language": "Language"}


class DelayTokenizer:
    """The checkpoint's BPE tokenizer (``tokenizers``), checked to hold every special id as one token."""

    def __init__(self, tokenizer_json: Path | str, config: DelayModelConfig) -> None:
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(tokenizer_json))
        except Exception as exc:  # the Rust loader raises its own exception type
            raise CheckpointError(f"{tokenizer_json}: cannot load tokenizer ({exc}); re-download tokenizer/") from exc
        self.config = config
        self.strings: dict[str, str] = {}
        added = self._tok.get_added_tokens_decoder()
        for key in SPECIAL_ID_KEYS:
            token_id = getattr(config, key)
            text = self._tok.id_to_token(token_id)
            # An ordinary BPE piece would re-encode to itself too; only an added token is matched whole in any text.
            if text is None or token_id not in added or self._tok.encode(text).ids != [token_id]:
                raise CheckpointError(
                    f"{tokenizer_json}: {key}={token_id} is not a special token of this tokenizer "
                    f"(id_to_token gives {text!r}); tokenizer and config.json come from different checkpoints"
                )
            self.strings[key] = text

    def encode(self, text: str) -> list[int]:
        """Return token ids with the library default (special tokens written in the text become one id)."""
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        """Return text for ids, skipping special tokens (the ``tokenizers`` default)."""
        return self._tok.decode(ids)


def user_block(text: str, reference: str, **fields: Optional[object]) -> str:
    """Return the 18-line user instruction: ``- Label:`` then its value, each on its line, the ``FIELDS`` between
    the reference and the text; absent fields read ``None`` exactly as upstream's ``str()``."""
    lines = ["<user_inst>", "- Reference(s):", reference]
    for key, label in FIELDS.items():
        lines += [f"- {label}:", str(fields.get(key))]
    return "\n".join(lines + ["- Text:", text, "</user_inst>"])


def check_reference_codes(codes: np.ndarray, config: DelayModelConfig) -> np.ndarray:
    """Return reference codes as ``(T, Q)`` int64, refusing pads, out-of-range codes and other layouts."""
    codes = np.asarray(codes)
    if codes.ndim != 2 or codes.shape[1] != config.n_vq or codes.dtype.kind not in "iu":
        raise InputError(f"reference codes: {codes.dtype} array of shape {codes.shape}, expected integer "
                         f"(frames, {config.n_vq}); transpose a (codebooks, frames) array first")
    if codes.size and (codes.min() < 0 or codes.max() >= config.audio_vocab_size):
        raise InputError(f"reference codes: values in [{codes.min()}, {codes.max()}], expected 0.."
                         f"{config.audio_vocab_size - 1} (no pad code {config.audio_pad_code})")
    return codes.astype(np.int64)


def build_prompt_text(tokenizer: DelayTokenizer, text: str, n_ref_frames: int = 0, **fields: Optional[object]) -> str:
    """Return the full ChatML string that is tokenised in one call (the ``<|audio_start|>`` row comes apart)."""
    s = tokenizer.strings
    n_vq = tokenizer.config.n_vq
    if n_ref_frames > 0:
        # Upstream writes both the frame part and the staircase tail with the user slot token.
        block = (s["audio_start_token_id"] + s["audio_user_slot_token_id"] * (n_ref_frames + n_vq - 1)
                 + s["audio_end_token_id"])
        reference = "[S1]:\n" + block
    else:
        reference = "None"
    content = user_block(text, reference, **fields)
    im_start, im_end = s["im_start_token_id"], s["im_end_token_id"]
    return f"{im_start}user\n{content}{im_end}\n{im_start}assistant\n"


def build_prompt(tokenizer: DelayTokenizer, text: str, reference_codes: Optional[np.ndarray] = None,
                 instruction: Optional[str] = None, tokens: Optional[int] = None, quality: Optional[str] = None,
                 language: Optional[str] = None, sound_event: Optional[str] = None,
                 ambient_sound: Optional[str] = None) -> np.ndarray:
    """Build the prompt rows ``(S, 1 + Q)`` int64, in the voice of ``reference_codes`` ``(T, Q)`` if given: column 0
    the text ids, columns 1..Q the audio codes (pad outside the reference)."""
    if not isinstance(text, str) or not text.strip():
        raise InputError(f"text={text!r}: give a non-empty string to speak")
    cfg = tokenizer.config
    codes = None
    if reference_codes is not None:
        codes = check_reference_codes(reference_codes, cfg)
        if codes.shape[0] == 0:
            codes = None  # upstream treats an empty reference as no reference
    n_ref = 0 if codes is None else codes.shape[0]
    full = build_prompt_text(tokenizer, text, n_ref, instruction=instruction, tokens=tokens, quality=quality,
                             language=language, sound_event=sound_event, ambient_sound=ambient_sound)
    text_ids = np.asarray(tokenizer.encode(full), dtype=np.int64)
    audio = np.full((len(text_ids), cfg.n_vq), cfg.audio_pad_code, dtype=np.int64)
    if codes is not None:
        starts = np.flatnonzero(text_ids == cfg.audio_start_token_id)
        ends = np.flatnonzero(text_ids == cfg.audio_end_token_id)
        if len(starts) != 1 or len(ends) != 1:
            # The text itself holds audio marker tokens: the staircase would land in the wrong rows.
            raise InputError(f"text holds audio marker tokens ({len(starts)} starts, {len(ends)} ends with the "
                             "reference); remove special tokens such as <|audio_start|> from the text")
        delayed = apply_delay_pattern(codes, cfg.audio_pad_code)
        if ends[0] - starts[0] - 1 != len(delayed):
            raise InputError(f"reference block spans {ends[0] - starts[0] - 1} rows for {len(delayed)} delayed "
                             "rows; the tokenizer splits the audio slot tokens, use the checkpoint's tokenizer")
        audio[starts[0] + 1: ends[0]] = delayed
    rows = np.concatenate([text_ids[:, None], audio], axis=1)
    start_ids = tokenizer.encode(tokenizer.strings["audio_start_token_id"])
    tail = np.full((len(start_ids), 1 + cfg.n_vq), cfg.audio_pad_code, dtype=np.int64)
    tail[:, 0] = start_ids
    return np.concatenate([rows, tail], axis=0)


def parse_text(tokenizer: DelayTokenizer, text_ids: list[int]) -> str:
    """Return the generated text column as text, an audio block shown as ``<|audio|>``."""
    s = tokenizer.strings
    raw = tokenizer.decode(text_ids)
    start, gen, delay, end = (re.escape(s[k]) for k in ("audio_start_token_id", "audio_assistant_gen_slot_token_id",
                                                          "audio_assistant_delay_slot_token_id",
                                                          "audio_end_token_id"))
    pattern = re.compile(f"(?:{start})?(?:{gen})*(?:{delay})*{end}")
    return pattern.sub(lambda m: AUDIO_PLACEHOLDER if s["audio_assistant_gen_slot_token_id"] in m.group(0) else "",
                       raw)
