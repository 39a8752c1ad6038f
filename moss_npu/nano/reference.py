"""The official generation algorithm, kept plain as the oracle of the frame decoder (docs/architecture.md#generation;
upstream ``_iter_generation_events``): tests compare the decoder with it, ``bench --speed reference`` times it.

Per frame: the global decoder over the new row (``use_kv_cache``) or over the whole sequence, the local decoder
recomputed over its growing sequence for every decision, the full text head, the sampler reading the whole code
history. B batch (left-padded), L prompt rows, F frames, Q channels, V codebook size.
"""

from __future__ import annotations

from typing import Optional

import torch

from moss_npu.nano.frames import (GenerationResult, LogitsHook, PhaseTimer, check_budget, non_finite_error, phase,
                                  trim_codes)
from moss_npu.nano.model import NanoTTSModel
from moss_npu.sampling import SamplingParams, sample_token


@torch.no_grad()
def reference_generate(
    model: NanoTTSModel,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    sampling: SamplingParams = SamplingParams(),
    nq: Optional[int] = None,
    max_new_frames: int = 300,
    use_kv_cache: bool = True,
    generator: Optional[torch.Generator] = None,
    host_rng: bool = False,
    logits_hook: Optional[LogitsHook] = None,
    timer: Optional[PhaseTimer] = None,
) -> GenerationResult:
    """Generate codes for (B, L, Q + 1) or (L, Q + 1) prompt rows (``attention_mask`` (B, L) False on left padding),
    with the official ``generate``'s arguments; ``generator``/``host_rng`` choose the random source, ``logits_hook``
    sees every logits row the sampler sees, ``timer`` times the first global pass as "prefill", all else "frame"."""
    cfg, device = model.config, model.device
    nq = check_budget(nq, max_new_frames, cfg)
    rows = (input_ids[None] if input_ids.ndim == 2 else input_ids).to(device)
    batch, prompt_len = rows.shape[:2]
    mask = torch.zeros(batch, prompt_len + max_new_frames, dtype=torch.bool, device=device)
    mask[:, :prompt_len] = True if attention_mask is None else attention_mask.to(device=device, dtype=torch.bool)
    sequence, cache = rows, model.transformer.init_cache(batch, prompt_len + max_new_frames) if use_kv_cache else None
    history = torch.full((batch, max_new_frames, cfg.n_vq), cfg.audio_pad_token_id, dtype=torch.long, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    pad_row = torch.tensor([cfg.pad_token_id] + [cfg.audio_pad_token_id] * cfg.n_vq, device=device)
    draw = dict(generator=generator, host_rng=host_rng)
    new_rows, steps = rows, 0
    for step in range(max_new_frames):
        total = prompt_len + step
        with phase(timer, "prefill" if step == 0 else "frame"):
            hidden = model(new_rows if use_kv_cache else sequence, mask[:, :total], cache, check=step == 0)
        with phase(timer, "frame"):
            frame, active, finished = _frame(model, hidden[:, -1].to(model.dtype), history[:, :step], finished, nq,
                                             sampling, draw, step, logits_hook)
        if not bool(active.any()):
            break
        steps = step + 1
        history[:, step] = frame
        mask[:, total] = active
        next_row = torch.cat([torch.full_like(frame[:, :1], cfg.audio_assistant_slot_token_id), frame], dim=1)
        new_rows = torch.where(active[:, None], next_row, pad_row)[:, None]
        sequence = torch.cat([sequence, new_rows], dim=1)
    stopped = finished | (steps < max_new_frames)
    frames = history[:, :steps]
    return GenerationResult([trim_codes(frames[b], nq, cfg) for b in range(batch)], frames, stopped)


def _frame(model: NanoTTSModel, hidden: torch.Tensor, history: torch.Tensor, finished: torch.Tensor, nq: int,
           sampling: SamplingParams, draw: dict, step: int, hook: Optional[LogitsHook]):
    """Decide one frame from the global hidden state (B, E); return its codes (B, Q), active and finished (B,)."""
    cfg = model.config
    candidates = torch.tensor([cfg.audio_assistant_slot_token_id, cfg.audio_end_token_id], device=hidden.device)
    seq = hidden[:, None]
    text_logits = model.text_lm_head(model.local_hidden(seq))
    if not bool(torch.isfinite(text_logits).all()):
        raise non_finite_error("text logits", step, model.dtype)
    candidate_logits = text_logits.index_select(-1, candidates)
    if hook is not None:
        hook("text", step, candidate_logits)
    next_text = candidates[sample_token(candidate_logits, sampling.text(), **draw)]
    active = (next_text == cfg.audio_assistant_slot_token_id) & ~finished
    finished = finished | (next_text == cfg.audio_end_token_id)
    frame = torch.full((hidden.shape[0], cfg.n_vq), cfg.audio_pad_token_id, dtype=torch.long, device=hidden.device)
    if not bool(active.any()):
        return frame, active, finished
    seq = torch.cat([seq, model.transformer.wte(next_text)[:, None].to(hidden.dtype)], dim=1)
    for c in range(nq):
        logits = model.audio_lm_heads[c](model.local_hidden(seq))
        if not bool(torch.isfinite(logits).all()):
            raise non_finite_error("audio logits", step, model.dtype)
        if hook is not None:
            hook("audio", c, logits)
        frame[:, c] = sample_token(logits, sampling.audio(), history[:, :, c], **draw)
        if c + 1 < nq:
            seq = torch.cat([seq, model.audio_embeddings[c](frame[:, c])[:, None].to(hidden.dtype)], dim=1)
    return frame.masked_fill(~active[:, None], cfg.audio_pad_token_id), active, finished
