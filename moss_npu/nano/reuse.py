"""What the frame decoder computes once and reuses: tables derived from the weights, and recent prompt prefixes.

* ``LocalTables``: the text head's 2 candidate rows, their embeddings, and the local decoder's first-layer q|k|v of
  every embedding row it can be fed: a row lookup instead of a 3E x E projection per channel.
* ``PrefixCache``: the global keys/values of recent prompts; a new prefill starts after the longest prefix it
  shares with one of them (the prompt template, a voice-clone reference across the chunks of a text).
Both are built from the weights of one ``FrameDecoder``: after editing them call ``FrameDecoder.refresh()``.
Shapes: L prompt rows, Q channels, V codebook size, E hidden, N layers, H heads, D head dim.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from moss_npu.cpu.matvec import Prepare
from moss_npu.cpu.prepared import PageArena
from moss_npu.nano.model import NanoTTSModel

# Below this many shared rows a copy saves too little to be worth a host sync.
MIN_SHARED_ROWS = 8


@dataclass(frozen=True)
class LocalTables:
    """Weight-derived tables of one decoder (see the module docstring)."""

    candidates: torch.Tensor  # (2,) [audio_assistant_slot, audio_end] ids: index 0 = continue
    text_rows: torch.Tensor  # (2, E) their text-head rows
    text_embed: torch.Tensor  # (2, E) their wte rows (the local decoder's second input)
    text_qkv: torch.Tensor  # (2, 3E) first_qkv of text_embed
    audio_qkv: tuple[torch.Tensor, ...]  # Q - 1 tables (V_c, 3E): first_qkv of audio embedding c's rows
    global_rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin (M, D) of global positions
    local_rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin (Q + 1, D) of local positions

    @classmethod
    @torch.inference_mode()
    def build(cls, model: NanoTTSModel, max_len: int,
              audio_qkv: Optional[tuple[torch.Tensor, ...]] = None) -> "LocalTables":
        """Compute every table from the model's current weights; ``audio_qkv``: the large ones ready-made
        (``audio_qkv_tables``, computed once per weights)."""
        cfg = model.config
        ids = torch.tensor([cfg.audio_assistant_slot_token_id, cfg.audio_end_token_id], device=model.device)
        embed = model.transformer.wte(ids).to(model.dtype)
        return cls(ids, model.text_lm_head.weight.index_select(0, ids), embed, model.first_qkv(embed),
                   audio_qkv_tables(model) if audio_qkv is None else audio_qkv,
                   model.transformer.rope_table(max_len), model.local_transformer.rope_table(cfg.n_vq + 1))


def audio_qkv_bytes(model: NanoTTSModel) -> int:
    """Return the arena bytes of ``audio_qkv_tables`` for a float32 CPU model."""
    width = model.local_transformer.h[0].attn.c_attn.weight.shape[0]
    return sum(PageArena.room(e.weight.shape[0] * width * 4) for e in model.audio_embeddings[:-1])


@torch.inference_mode()
def audio_qkv_tables(model: NanoTTSModel, prepare: Optional[Prepare] = None) -> tuple[torch.Tensor, ...]:
    """Return ``LocalTables.audio_qkv``: ``first_qkv`` of audio embedding c's rows for c < Q - 1, (V_c, 3E) each;
    with ``prepare`` (a float32 CPU model) arrays of its arena, computed only where it fills them."""
    if prepare is None:
        return tuple(model.first_qkv(e.weight) for e in model.audio_embeddings[:-1])
    width = model.local_transformer.h[0].attn.c_attn.weight.shape[0]

    def table(embedding: torch.nn.Embedding) -> torch.Tensor:
        def fill(out: np.ndarray) -> None:
            torch.from_numpy(out).copy_(model.first_qkv(embedding.weight))

        return torch.from_numpy(prepare((embedding.weight.shape[0], width), np.float32, fill))

    return tuple(table(e) for e in model.audio_embeddings[:-1])


class PrefixCache:
    """Global keys/values of the last ``capacity`` prompts, looked up by their rows (least recently used out)."""

    def __init__(self, capacity: int = 4, min_rows: int = MIN_SHARED_ROWS) -> None:
        self.capacity, self.min_rows = capacity, min_rows
        self._entries: "OrderedDict[int, tuple[torch.Tensor, torch.Tensor]]" = OrderedDict()
        self._serial = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Forget every prompt (the weights changed)."""
        self._entries.clear()

    def lookup(self, rows: torch.Tensor) -> tuple[int, Optional[torch.Tensor]]:
        """Return (shared rows, keys/values (N, 2, H, >= shared, D)) of the entry sharing the longest prefix.

        At most ``len(rows) - 1`` rows are shared: the last row's hidden state must be computed. One host sync.
        """
        keys, counts = [], []
        for key, (prev, _) in self._entries.items():
            n = min(prev.shape[0], rows.shape[0] - 1)
            if n >= self.min_rows:
                keys.append(key)
                counts.append((prev[:n] == rows[:n]).all(dim=-1).long().cumprod(dim=0).sum())
        shared = torch.stack(counts).tolist() if counts else []  # every entry's shared rows in one read
        best = max(range(len(keys)), key=lambda i: shared[i], default=None)  # the first of equal ones
        if best is None or shared[best] < self.min_rows:
            return 0, None
        self._entries.move_to_end(keys[best])
        return shared[best], self._entries[keys[best]][1]

    def store(self, rows: torch.Tensor, kv: torch.Tensor) -> None:
        """Remember a prompt's rows (L, Q + 1) and its keys/values (N, 2, H, L, D) (copies both)."""
        if self.capacity <= 0:
            return
        self._serial += 1
        self._entries[self._serial] = (rows.clone(), kv.clone())
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
