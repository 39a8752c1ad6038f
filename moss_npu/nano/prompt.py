"""Prompt rows of MOSS-TTS-Nano: text → (L, n_vq + 1) integer rows for the global transformer.

Column 0 is a text id, columns 1..n_vq are audio codes (``audio_pad_token_id`` = absent). Each template string is
encoded on its own and the id lists are concatenated, as upstream does (each segment gets its own ``▁``).
See docs/architecture.md#rows, #prompt-layouts.
"""

from __future__ import annotations

from typing import Optional

import torch

from moss_npu.errors import InputError
from moss_npu.nano.config import NanoConfig
from moss_npu.nano.tokenizer import TextTokenizer

MODES = ("continuation", "voice_clone")

# Template strings of the official prompt (the user turn is an instruction form whose fields are all "None").
USER_ROLE_PREFIX = "user\n"
REFERENCE_PREFIX = "<user_inst>\n- Reference(s):\n"
AFTER_REFERENCE = ("\n- Instruction:\nNone\n- Tokens:\nNone\n- Quality:\nNone\n- Sound Event:\nNone\n"
                   "- Ambient Sound:\nNone\n- Language:\nNone\n- Text:\n")
NO_REFERENCE = "None"
USER_SUFFIX = "\n</user_inst>"
ASSISTANT_TURN_PREFIX = "\n"
ASSISTANT_ROLE_PREFIX = "assistant\n"


def user_prefix_ids(tok: TextTokenizer, config: NanoConfig) -> list[int]:
    """``<|im_start|>`` + "user⏎" + the reference header (13 ids with the official tokenizer)."""
    return [config.im_start_token_id] + tok.encode(USER_ROLE_PREFIX) + tok.encode(REFERENCE_PREFIX)


def assistant_prefix_ids(tok: TextTokenizer, config: NanoConfig) -> list[int]:
    """Close the user turn and open the assistant turn: ⏎</user_inst> <|im_end|> ⏎ <|im_start|> assistant⏎."""
    return (tok.encode(USER_SUFFIX) + [config.im_end_token_id] + tok.encode(ASSISTANT_TURN_PREFIX)
            + [config.im_start_token_id] + tok.encode(ASSISTANT_ROLE_PREFIX))


def resolve_mode(mode: Optional[str], has_prompt_text: bool, has_prompt_audio: bool) -> str:
    """Normalise and check the mode against the given prompt parts (upstream ``_resolve_inference_mode``)."""
    name = str(mode or "continuation").strip().lower() or "continuation"
    if name not in MODES:
        raise InputError(f"mode={mode!r} is not supported; use one of {list(MODES)}")
    if name == "voice_clone":
        if not has_prompt_audio:
            raise InputError("mode='voice_clone' needs prompt (reference) audio; pass a reference recording")
        if has_prompt_text:
            raise InputError("mode='voice_clone' does not take prompt_text; drop it or use mode='continuation'")
    elif has_prompt_text != has_prompt_audio:
        raise InputError("mode='continuation' takes either the text alone, or prompt_text together with prompt "
                         f"audio (got prompt_text={'set' if has_prompt_text else 'None'}, prompt audio="
                         f"{'set' if has_prompt_audio else 'None'}); pass both or neither")
    return name


def text_rows(ids: list[int], config: NanoConfig) -> torch.Tensor:
    """Rows holding text ids with every audio column set to pad."""
    rows = torch.full((len(ids), config.row_width), config.audio_pad_token_id, dtype=torch.long)
    if ids:
        rows[:, 0] = torch.tensor(ids, dtype=torch.long)
    return rows


def audio_rows(codes: torch.Tensor, slot_token_id: int, config: NanoConfig) -> torch.Tensor:
    """Rows holding audio codes (F, Q) behind a slot text id."""
    rows = torch.empty((codes.shape[0], config.row_width), dtype=torch.long)
    rows[:, 0] = int(slot_token_id)
    rows[:, 1:] = codes
    return rows


def check_codes(codes: torch.Tensor, config: NanoConfig) -> torch.Tensor:
    """Return prompt codes (F, Q) as int64 on the CPU after checking them: integer, F >= 1, Q = n_vq, each code
    inside its codebook or the pad id."""
    codes = torch.as_tensor(codes)
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise InputError(f"prompt codes have dtype {codes.dtype}; pass integer codes (frames, {config.n_vq})")
    if codes.ndim != 2 or codes.shape[1] != config.n_vq or codes.shape[0] == 0:
        raise InputError(f"prompt codes have shape {tuple(codes.shape)}; expected (frames >= 1, {config.n_vq})")
    codes = codes.to(device="cpu", dtype=torch.long)
    sizes = torch.tensor(config.audio_codebook_sizes, dtype=torch.long)
    bad = ((codes < 0) | (codes >= sizes)) & (codes != config.audio_pad_token_id)
    if bool(bad.any()):
        frame, channel = (int(i) for i in bad.nonzero()[0])
        raise InputError(f"prompt code {int(codes[frame, channel])} at frame {frame}, channel {channel} is outside "
                         f"codebook size {int(sizes[channel])}; the codes must come from the matching codec")
    return codes


def mask_unused_channels(codes: torch.Tensor, nq: int, config: NanoConfig) -> torch.Tensor:
    """Set channels >= nq of (..., Q) codes to the pad id (upstream does this to prompt and generated codes)."""
    if not 1 <= nq <= config.n_vq:
        raise InputError(f"nq={nq} is outside [1, {config.n_vq}]; use a count of codebooks in that range")
    if nq == config.n_vq:
        return codes
    codes = codes.clone()
    codes[..., nq:] = config.audio_pad_token_id
    return codes


def build_prompt_rows(tokenizer: TextTokenizer, config: NanoConfig, text: str, mode: str = "continuation",
                      prompt_text: Optional[str] = None, prompt_codes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Build the prompt rows (L, n_vq + 1) int64 of one request (one chunk of ``text``): ``continuation`` speaks
    ``text`` after ``prompt_text`` spoken as ``prompt_codes`` (F, n_vq) where given, ``voice_clone`` speaks it in
    the voice of the reference ``prompt_codes``. InputError for a bad mode combination or codes."""
    mode = resolve_mode(mode, prompt_text is not None, prompt_codes is not None)
    codes = None if prompt_codes is None else check_codes(prompt_codes, config)
    if mode == "voice_clone":
        head = user_prefix_ids(tokenizer, config) + [config.audio_start_token_id]
        tail = ([config.audio_end_token_id] + tokenizer.encode(AFTER_REFERENCE) + tokenizer.encode(text)
                + assistant_prefix_ids(tokenizer, config) + [config.audio_start_token_id])
        sections = [text_rows(head, config), audio_rows(codes, config.audio_user_slot_token_id, config),
                    text_rows(tail, config)]
    else:
        # Upstream concatenates prompt_text and text as plain strings, without a separator.
        spoken = text if prompt_text is None else prompt_text + text
        ids = (user_prefix_ids(tokenizer, config) + tokenizer.encode(NO_REFERENCE) + tokenizer.encode(AFTER_REFERENCE)
               + tokenizer.encode(spoken) + assistant_prefix_ids(tokenizer, config) + [config.audio_start_token_id])
        sections = [text_rows(ids, config)]
        if codes is not None:
            sections.append(audio_rows(codes, config.audio_assistant_slot_token_id, config))
    return torch.cat(sections, dim=0)
