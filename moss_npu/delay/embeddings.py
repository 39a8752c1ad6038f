"""Input embeddings of the Delay model (docs/delay.md#embeddings): one text row plus Q audio rows, summed in
float32 in that order from memory-mapped float16 tables. S rows, Q codebooks, H hidden size.
"""

from __future__ import annotations

import numpy as np

from moss_npu.delay.weights import DelayWeights, load_table
from moss_npu.errors import InputError


class DelayEmbeddings:
    """Sum-of-tables lookup for rows ``(S, 1 + Q)``."""

    def __init__(self, weights: DelayWeights) -> None:
        self.text = load_table(weights.embed_tokens)
        self.audio = [load_table(path) for path in weights.emb_ext]

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        """Embed integer rows ``(S, 1 + Q)`` (or one row ``(1 + Q,)``) as float32 ``(S, H)`` (or ``(H,)``)."""
        rows = np.asarray(rows)
        single = rows.ndim == 1
        rows = np.atleast_2d(rows)
        if rows.ndim != 2 or rows.shape[1] != 1 + len(self.audio) or rows.dtype.kind not in "iu":
            raise InputError(f"rows: {rows.dtype} array of shape {rows.shape}, expected integer (S, {1 + len(self.audio)})")
        limits = [self.text.shape[0]] + [t.shape[0] for t in self.audio]
        if rows.size and (rows.min() < 0 or np.any(rows.max(axis=0) >= limits)):
            raise InputError(f"rows: ids out of range (text < {limits[0]}, codes < {limits[1]})")
        out = self.text[rows[:, 0]].astype(np.float32)
        for q, table in enumerate(self.audio):
            out = out + table[rows[:, q + 1]].astype(np.float32)
        return out[0] if single else out
