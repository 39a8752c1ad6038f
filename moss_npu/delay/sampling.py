"""The Delay sampler (NumPy), exactly as the upstream llama.cpp backend computes it (docs/delay.md#sampling),
because the goldens compare sampled ids: top-k candidates in ``np.argpartition`` order, float32 probabilities, one
uniform per row from the caller's ``np.random.RandomState``. Not the Nano sampler (``moss_npu/sampling.py``).
N rows, V vocabulary.
"""

from __future__ import annotations

from typing import Optional

import numpy as np


def apply_repetition_penalty(logits: np.ndarray, history: Optional[np.ndarray], penalty: float) -> np.ndarray:
    """Penalise ids seen in ``history`` (CTRL rule: positive logits divided, others multiplied), in a new array.
    ``(N, V)`` logits: the whole history applies to every row; ``(B, Q, V)``: head q sees ``history[..., q]``."""
    if history is None or penalty == 1.0:
        return logits
    history = np.asarray(history)
    if logits.ndim == 3:
        out = logits.copy()
        for q in range(logits.shape[1]):
            out[:, q] = apply_repetition_penalty(logits[:, q], history[..., q], penalty)
        return out
    seen = np.unique(history.ravel())
    seen = seen[(seen >= 0) & (seen < logits.shape[-1])]
    out = logits.copy()
    if seen.size == 0:
        return out
    picked = out[:, seen]
    positive = picked > 0
    picked[positive] /= penalty
    picked[~positive] *= penalty
    out[:, seen] = picked
    return out


def softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, shifted by the row maximum."""
    exp = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return exp / exp.sum(axis=-1, keepdims=True)


def apply_top_p(logits: np.ndarray, top_p: float) -> np.ndarray:
    """Set to -inf every logit outside the smallest prefix (by probability) whose mass reaches ``top_p``: the
    token that crosses ``top_p`` is kept, and the most likely token always is."""
    probs = softmax(logits)
    order = np.argsort(-probs, axis=-1)
    cumulative = np.cumsum(np.take_along_axis(probs, order, axis=-1), axis=-1)
    drop_sorted = np.zeros_like(cumulative, dtype=bool)
    drop_sorted[:, 1:] = cumulative[:, :-1] > top_p
    drop = np.zeros_like(drop_sorted)
    np.put_along_axis(drop, order, drop_sorted, axis=-1)
    out = logits.copy()
    out[drop] = -np.inf
    return out


def candidates(logits: np.ndarray, top_k: Optional[int], top_p: Optional[float]) -> tuple[Optional[np.ndarray], np.ndarray]:
    """Return ``(ids, probs)``, the candidates and the distribution the draw walks: with top-k, ids ``(N, k)`` in
    argpartition order and probs over them; without, ids None and probs ``(N, V)`` over the whole vocabulary."""
    if top_k is not None and top_k > 0:
        k = min(top_k, logits.shape[-1])
        ids = np.argpartition(logits, -k, axis=-1)[:, -k:]
        values = np.take_along_axis(logits, ids, axis=-1)
        if top_p is not None and top_p < 1.0:
            values = apply_top_p(values, top_p)
        return ids, softmax(values)
    if top_p is not None and top_p < 1.0:
        logits = apply_top_p(logits, top_p)
    return None, softmax(logits)


def draw(probs: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
    """Pick one index per row by inverse CDF: the count of cumulative probabilities below a uniform draw."""
    cumulative = np.cumsum(probs, axis=-1)
    uniform = rng.random_sample(probs.shape[0])[:, None]
    # A float32 cumsum can end below 1.0; clamp so a draw above it picks the last index.
    return np.minimum((cumulative < uniform).sum(axis=-1), probs.shape[-1] - 1).astype(np.int64)


def sample_token(logits: np.ndarray, rng: np.random.RandomState, history: Optional[np.ndarray] = None,
                 repetition_penalty: float = 1.0, top_p: Optional[float] = None, top_k: Optional[int] = None,
                 do_sample: bool = True) -> np.ndarray:
    """Return one int64 id per row of ``(..., V)`` float32 logits (temperature applied, masked ids at -inf):
    penalised for the ids in ``history``, then the argmax (``do_sample`` False, no uniform drawn) or a draw (one
    ``rng.random_sample(N)`` call)."""
    logits = apply_repetition_penalty(logits, history, repetition_penalty)
    if not do_sample:
        return np.argmax(logits, axis=-1).astype(np.int64)
    flat = logits.reshape(-1, logits.shape[-1])
    ids, probs = candidates(flat, top_k, top_p)
    picked = draw(probs, rng)
    if ids is not None:
        picked = ids[np.arange(ids.shape[0]), picked]
    return picked.reshape(logits.shape[:-1]).astype(np.int64)
