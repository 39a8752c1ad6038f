"""What frame generation hands out, shared by the frame decoder and the reference oracle
(docs/architecture.md#generation). B batch rows or S decoder slots, L prompt rows, F frames, Q = n_vq channels.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch

from moss_npu.errors import InputError, NumericalError
from moss_npu.nano.config import NanoConfig

# (kind, index, logits): kind "text" gives the (B, 2) candidate logits [continue, stop] of frame ``index``;
# kind "audio" gives the (B, V) logits of channel ``index``. Used by conformance checks and diagnostics.
LogitsHook = Callable[[str, int, torch.Tensor], None]


@dataclass(frozen=True)
class FrameBatch:
    """One decoder frame for every slot: ``codes`` (S, Q) with pad wherever no audio was produced.

    ``active``: the slot produced audio in this frame; ``finished``: the slot's request ended in this frame (stop
    token, frame budget or non-finite logits); ``non_finite``: it ended because a logits row was not finite.
    """

    step_index: int
    codes: torch.Tensor
    active: torch.Tensor  # (S,) bool, on the CPU
    finished: torch.Tensor  # (S,) bool, on the CPU
    non_finite: torch.Tensor  # (S,) bool, on the CPU


@dataclass(frozen=True)
class GenerationResult:
    """Codes of every row: ``codes[b]`` (F_b, Q) trimmed; ``frames`` (B, F, Q) untrimmed; ``stopped`` (B,) bool."""

    codes: list[torch.Tensor]
    frames: torch.Tensor
    stopped: torch.Tensor


class PhaseTimer:
    """Wall time per phase ("prefill", "frame", "codec", ...); ``sync`` (``backend(dev).synchronize``) makes the
    times device-honest at the cost of host syncs, for benchmarks."""

    def __init__(self, sync: Optional[Callable[[], None]] = None) -> None:
        self.sync = sync
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.sync is not None:
            self.sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync is not None:
                self.sync()
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1


def phase(timer: Optional[PhaseTimer], name: str):
    """Return ``timer.phase(name)``, or a no-op context without a timer."""
    return timer.phase(name) if timer is not None else contextlib.nullcontext()


def left_pad(rows: Sequence[torch.Tensor], config: NanoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack prompts (L_b, Q + 1) into (B, L, Q + 1) rows padded on the left with [pad, pad codes…]; + mask (B, L)."""
    if not rows:
        raise InputError("no prompts to batch; pass at least one prompt")
    length = max(int(r.shape[0]) for r in rows)
    batch = torch.full((len(rows), length, config.row_width), config.audio_pad_token_id, dtype=torch.long,
                       device=rows[0].device)
    batch[:, :, 0] = config.pad_token_id
    mask = torch.zeros(len(rows), length, dtype=torch.bool, device=rows[0].device)
    for b, r in enumerate(rows):
        batch[b, length - r.shape[0]:] = r
        mask[b, length - r.shape[0]:] = True
    return batch, mask


def unpad(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> list[torch.Tensor]:
    """Split (B, L, Q + 1) or (L, Q + 1) rows, left-padded where ``attention_mask`` (B, L) is False, into prompts."""
    if input_ids.ndim == 2:
        input_ids = input_ids[None]
    if attention_mask is None:
        return list(input_ids)
    return [rows[valid.to(torch.bool)] for rows, valid in zip(input_ids, attention_mask)]


def trim_codes(frames: torch.Tensor, nq: int, config: NanoConfig) -> torch.Tensor:
    """Pad channels >= nq and drop trailing frames whose first nq codes are all pad, for (F, Q) codes of one row."""
    frames = frames.clone()
    frames[:, nq:] = config.audio_pad_token_id
    valid = (frames[:, :nq] != config.audio_pad_token_id).any(dim=-1)
    nonzero = valid.nonzero()
    return frames[: int(nonzero[-1]) + 1] if nonzero.numel() else frames[:0]


def check_budget(nq: Optional[int], max_new_frames: int, config: NanoConfig) -> int:
    """Return the channel count (default Q) after checking it and the frame budget."""
    nq = config.n_vq if nq is None else int(nq)
    if not 1 <= nq <= config.n_vq:
        raise InputError(f"nq={nq} is outside [1, {config.n_vq}]; use a count of codebooks in that range")
    if max_new_frames < 0:
        raise InputError(f"max_new_frames={max_new_frames} is negative; use a frame count >= 0 (12.5 per second)")
    return nq


def non_finite_error(what: str, step: int, dtype: torch.dtype) -> NumericalError:
    """Return the error upstream raises (its message starts "Non-finite", which its fp32 fallback looks for),
    with the fix for ``dtype``."""
    if dtype == torch.float32:
        return NumericalError(f"Non-finite {what} by frame {step} in float32, so precision is not the cause: the "
                              "model weights are likely damaged (NaN/inf); download the model folder again")
    return NumericalError(f"Non-finite {what} by frame {step} (dtype {dtype}); run the model in float32 "
                          "(--dtype float32)")
