"""Token sampling for the MOSS-TTS-Nano frame loop (docs/architecture.md#sampling).

Order as in the official code: repetition penalty → (greedy argmax) → temperature → top-k → top-p → softmax →
draw. Everything runs in the logits' dtype, as upstream does. Shapes: B batch rows, V candidates.

Two ways to draw:
* device RNG (default): ``torch.multinomial(probs, 1, generator=generator)`` on the logits' device, the same call
  with the same shapes as upstream, so ``torch.manual_seed(seed)`` on CPU reproduces the official sampled runs;
* host RNG (``host_rng=True``): the probabilities are copied to the CPU as float64 and one uniform per row is drawn
  from a CPU generator; the token is the inverse-CDF pick. Two devices given the same seed then pick the same
  token whenever their distributions agree to within the gap between the uniform and the nearest CDF boundary.
  Top-k/top-p are hard cut-offs, so a near-tie at the cut-off can still keep a different token set on each device
  and make one draw differ (how often: docs/performance.md#host-random-numbers-across-devices).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moss_npu.errors import InputError
from moss_npu.sampling_params import SamplingParams, TokenParams

__all__ = ["SamplingParams", "TokenParams", "apply_repetition_penalty", "filter_scores", "sample_token"]


def apply_repetition_penalty(scores: torch.Tensor, history: Optional[torch.Tensor], penalty: float,
                             seen: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Penalise every id that occurs in ``history`` once (divide positive scores, multiply negative ones).

    Args:
        scores: (B, V) logits.
        history: (B, T) earlier ids of this channel; ids outside [0, V) (the pad id) are ignored.
        penalty: > 0; 1.0 leaves the scores unchanged.
        seen: (B, V) bool presence of each id in the history, kept up to date by the caller; when given it
            replaces ``history`` (the same result without rescanning the whole history per decision).
    """
    if not penalty > 0:
        raise InputError(f"repetition_penalty={penalty} must be > 0; use 1.0 to disable it")
    if seen is not None and penalty != 1.0:
        return torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)
    if penalty == 1.0 or history is None or history.shape[-1] == 0:
        return scores
    vocab = scores.shape[-1]
    ids = history.to(device=scores.device, dtype=torch.long).reshape(scores.shape[0], -1)
    ids = torch.where((ids >= 0) & (ids < vocab), ids, torch.full_like(ids, vocab))
    # A presence mask equals upstream's per-row unique() + scatter: each id is penalised once.
    seen = torch.zeros(scores.shape[0], vocab + 1, dtype=torch.bool, device=scores.device)
    seen = seen.scatter_(1, ids, True)[:, :vocab]
    penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalised, scores)


def filter_scores(scores: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Apply temperature, top-k (ties at the k-th value kept) and top-p (crossing token kept, ties by id); return
    scores."""
    scores = scores / temperature
    if top_k > 0:
        k = min(top_k, scores.shape[-1])
        threshold = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < threshold, float("-inf"))
    if 0.0 < top_p < 1.0:
        # Stable: among equal scores the lower id comes first. Upstream's default sort leaves the order of ties
        # to the implementation (it differs with the row length and the device), which only matters for exact
        # ties at the top-p boundary; a fixed rule lets every device and the noise-fed sampler agree.
        sorted_scores, order = torch.sort(scores, descending=True, dim=-1, stable=True)
        mass = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        remove = mass > top_p
        # Shift right by one so the token that crosses top_p stays in.
        remove = torch.cat([torch.zeros_like(remove[..., :1]), remove[..., :-1]], dim=-1)
        sorted_scores = sorted_scores.masked_fill(remove, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
    return scores


def draw_host(probs: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Pick one id per row by inverse CDF with a float64 uniform from a CPU generator; return ids on probs' device."""
    host = probs.detach().to(device="cpu", dtype=torch.float64)
    cdf = host.cumsum(dim=-1)
    u = torch.rand(host.shape[0], 1, dtype=torch.float64, generator=generator) * cdf[:, -1:]
    ids = torch.searchsorted(cdf, u, right=True).clamp_(max=host.shape[-1] - 1).squeeze(-1)
    return ids.to(probs.device)


def sample_token(
    logits: torch.Tensor,
    params: TokenParams,
    history: Optional[torch.Tensor] = None,
    *,
    generator: Optional[torch.Generator] = None,
    host_rng: bool = False,
    seen: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Choose one id per row from (B, V) logits; return (B,) int64 on the logits' device.

    The repetition penalty reads ``history`` (B, T), or ``seen`` (B, V) bool presence when given.

    Greedy (``params.do_sample`` False) is ``argmax`` after the repetition penalty (first index on ties).
    Sampling never fails on non-finite logits (see the comment below): checking them is the caller's job.
    ``generator`` is used for the draw: a generator on the logits' device for the default mode, a CPU generator
    with ``host_rng=True``; None means torch's default generator of that device.
    """
    scores = apply_repetition_penalty(logits, history, params.repetition_penalty, seen)
    if not params.do_sample:
        return scores.argmax(dim=-1)
    scores = filter_scores(scores, params.temperature, params.top_k, params.top_p)
    # A row with a non-finite logit softmaxes to all NaN, which makes torch.multinomial raise (or fault the device).
    # Such a row draws uniformly instead; the caller owns the finiteness check (the frame loop raises
    # NumericalError at its next host sync), so no token drawn from it is ever used.
    probs = torch.softmax(scores, dim=-1).nan_to_num(nan=1.0)
    if host_rng:
        return draw_host(probs, generator)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


@dataclass
class SlotSampling:
    """Per-slot parameters of one kind of decision as (S,) tensors: what ``sample_with_noise`` reads.

    Kept on the decoder's device so a captured frame step reads them in place; ``set`` writes one slot.
    A greedy slot stores temperature 1.0 so that its unused sampled branch stays finite.
    """

    do_sample: torch.Tensor  # (S,) bool
    temperature: torch.Tensor  # (S,) float32
    top_k: torch.Tensor  # (S,) int64, 0 = off
    top_p: torch.Tensor  # (S,) float32, 1.0 = off
    repetition_penalty: torch.Tensor  # (S,) float32, 1.0 = off

    @classmethod
    def allocate(cls, slots: int, device: torch.device, dtype: torch.dtype = torch.float32) -> "SlotSampling":
        """Return greedy parameters for ``slots`` slots."""
        ones = torch.ones(slots, dtype=dtype, device=device)
        return cls(torch.zeros(slots, dtype=torch.bool, device=device), ones.clone(),
                   torch.zeros(slots, dtype=torch.long, device=device), ones.clone(), ones.clone())

    def set(self, slot: int, params: TokenParams) -> None:
        """Write ``params`` into ``slot``."""
        self.do_sample[slot] = params.do_sample
        self.temperature[slot] = params.temperature if params.do_sample else 1.0
        self.top_k[slot] = params.top_k
        self.top_p[slot] = params.top_p
        self.repetition_penalty[slot] = params.repetition_penalty

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values())

    def rows(self, b: int, vocab: int, dtype: torch.dtype, seen: Optional[torch.Tensor] = None,
             tokens: Optional[list[TokenParams]] = None) -> "RowSampling":
        """Rows [0, b) ready for ``RowSampling.sample`` over ``vocab`` ids, derived once for every decision of a
        frame. ``seen`` (b, C, vocab) bool: each of C decisions' presence mask. ``tokens``: the parameters of the
        rows that matter, known on the host (an eager frame); the filters none of them asks for are left out
        (they would not change those rows' picks). None: any row may ask for anything (a captured frame)."""
        dtype = torch.promote_types(dtype, torch.float32)
        drawn = None if tokens is None else [t for t in tokens if t.do_sample]

        def wanted(asks) -> bool:
            return drawn is None or any(asks(t) for t in drawn)

        top_k, top_p = self.top_k[:b, None], self.top_p[:b, None]
        return RowSampling(
            wanted(lambda t: True), self.do_sample[:b] if drawn is None or len(drawn) < len(tokens) else None,
            self.temperature[:b, None].to(dtype) if wanted(lambda t: t.temperature != 1.0) else None,
            # The k-th largest score's index in the sorted row (the last one when top-k is off or k >= vocab).
            torch.where((top_k > 0) & (top_k < vocab), top_k - 1, vocab - 1) if wanted(lambda t: 0 < t.top_k < vocab)
            else None,
            torch.where(top_p < 1.0, top_p.to(dtype), float("inf")) if wanted(lambda t: t.top_p < 1.0) else None,
            # What a seen id's score is multiplied (negative) or divided (positive) by, per decision and id: x * 1
            # and x / 1 are x exactly, so this equals penalising the seen ids only.
            torch.where(seen, self.repetition_penalty[:b, None, None].to(dtype), 1.0)
            if seen is not None and (tokens is None or any(t.repetition_penalty != 1.0 for t in tokens)) else None,
            torch.arange(vocab, device=self.top_k.device), dtype)


@dataclass
class RowSampling:
    """The parameters of B rows over V ids for ``sample`` (``SlotSampling.rows``); None: that step is left out."""

    sampled: bool  # some row samples
    do_sample: Optional[torch.Tensor]  # (B,) bool; None: every row samples (no greedy argmax)
    temperature: Optional[torch.Tensor]  # (B, 1)
    kth: Optional[torch.Tensor]  # (B, 1) int64: index of the top-k threshold in the sorted row
    top_p: Optional[torch.Tensor]  # (B, 1): the top-p cut, inf where off
    penalty: Optional[torch.Tensor]  # (B, C, V): the repetition factor of each decision's ids
    ids: torch.Tensor  # (V,) int64
    dtype: torch.dtype  # what the scores are computed in

    def sample(self, logits: torch.Tensor, uniforms: torch.Tensor, decision: int = 0) -> torch.Tensor:
        """Choose one id per row of (B, V) ``logits`` by the chain ``sample_with_noise`` states, with the
        presence mask of ``decision`` (of the C given to ``SlotSampling.rows``) and a uniform per row (B,)."""
        scores = logits.to(self.dtype)
        if self.penalty is not None:
            factor = self.penalty[:, decision]
            scores = torch.where(scores < 0, scores * factor, scores / factor)
        greedy = None if self.do_sample is None else scores.argmax(dim=-1)
        if not self.sampled:
            return greedy
        if self.temperature is not None:
            scores = scores / self.temperature
        if self.kth is not None or self.top_p is not None:
            ordered, order = torch.sort(scores, dim=-1, descending=True, stable=True)
            if self.kth is not None:
                ordered.masked_fill_(ordered < ordered.gather(1, self.kth), float("-inf"))
            if self.top_p is not None:
                mass = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
                ordered[:, 1:].masked_fill_(mass[:, :-1] > self.top_p, float("-inf"))  # keep the crossing token
            scores = torch.empty_like(scores).scatter_(1, order, ordered)  # order is a permutation: all written
        probs = torch.softmax(scores, dim=-1)
        cdf = probs.cumsum(dim=-1)
        target = uniforms[:, None].to(cdf.dtype) * cdf[:, -1:]
        # Rounding can put the target on the total mass: never pick past the last id with probability.
        last = ((probs > 0) * self.ids).amax(dim=-1)
        picked = torch.minimum(torch.searchsorted(cdf, target, right=True)[:, 0], last)
        return picked if greedy is None else torch.where(self.do_sample, picked, greedy)


def sample_with_noise(logits: torch.Tensor, params: SlotSampling, uniforms: torch.Tensor,
                      seen: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Choose one id per row from (B, V) logits with per-row parameters and a given uniform per row; (B,) int64.

    The official filter chain (repetition penalty, greedy argmax or temperature → top-k with ties kept → top-p
    keeping the crossing token → softmax) then the inverse-CDF pick of ``uniforms`` (B,) in [0, 1) over the ids in
    index order, as the host-RNG mode of ``sample_token`` does. Tensor ops only (no host sync, no data-dependent
    shapes), so it runs inside a captured device graph. Computes in float32 at least (float64 stays float64).
    ``params`` rows [0, B) are read; ``seen`` (B, V) bool is the repetition presence mask. A frame's decoder
    derives the parameters once for all its decisions (``SlotSampling.rows``).
    """
    b, vocab = logits.shape
    return params.rows(b, vocab, logits.dtype, None if seen is None else seen[:, None]).sample(logits, uniforms[:b])
