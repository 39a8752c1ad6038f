"""The frame decoder's state: one dataclass of tensors preallocated for S slots (docs/architecture.md#frame-decoder).

The global keys/values live in one tensor written at each slot's own position, so every frame reads and writes
the same storage (what a captured device graph needs); it holds everything a step changes and nothing else.
Shapes: S slots, M max_len (global rows per slot), N layers, H heads, D head dim, E hidden, Q channels,
V codebook size.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from moss_npu.device import backend
from moss_npu.nano.model import NanoTTSModel
from moss_npu.sampling import SlotSampling


@dataclass
class DecodeState:
    """Every tensor a frame step reads or writes, for S slots; allocated once per decoder (``allocate``)."""

    kv: torch.Tensor  # (N, 2, S, H, M, D) global keys (after RoPE) and values; slot s holds rows [0, lengths[s])
    local_kv: torch.Tensor  # (N_local, 2, S, H, Q + 1, D) the local decoder's keys/values of the current frame
    lengths: torch.Tensor  # (S,) int64 rows in the global cache = index and RoPE position of the slot's next row
    hidden: torch.Tensor  # (S, E) global hidden state that starts the slot's next frame
    seen: torch.Tensor  # (S, Q, V + 1) bool: codes each channel has produced (the last column absorbs pad)
    text: SlotSampling  # the continue/stop decision's parameters
    audio: SlotSampling  # the audio channels' parameters
    nq: torch.Tensor  # (S,) int64 channels generated; the others are pad
    steps: torch.Tensor  # (S,) int64 frames decided so far
    max_frames: torch.Tensor  # (S,) int64 frame budget
    active: torch.Tensor  # (S,) bool: the slot holds a request that is still decoding
    produced: torch.Tensor  # (S,) bool: the slot produced audio in the last frame
    stopped: torch.Tensor  # (S,) bool: the slot chose the stop token
    finite: torch.Tensor  # (S, 2) bool: every text / audio logits row of the slot so far was finite
    codes: torch.Tensor  # (S, Q) int64 the last frame (pad where nothing was produced)
    noise: torch.Tensor  # (S, Q + 1) float32 uniforms of the next frame: text decision, then channel c at c + 1

    @classmethod
    def allocate(cls, model: NanoTTSModel, slots: int, max_len: int) -> "DecodeState":
        """Allocate zeroed state for ``slots`` slots of ``max_len`` global rows on the model's device and dtype."""
        cfg, g = model.config, model.config.gpt2_config
        dev, dt = model.device, model.dtype
        q, vocab = cfg.n_vq, max(cfg.audio_codebook_sizes)

        def longs() -> torch.Tensor:
            return torch.zeros(slots, dtype=torch.long, device=dev)

        def flags() -> torch.Tensor:
            return torch.zeros(slots, dtype=torch.bool, device=dev)

        return cls(
            kv=backend(dev).zeros((g.n_layer, 2, slots, g.n_head, max_len, g.head_dim), dt, dev),
            local_kv=torch.zeros(cfg.local_transformer_layers, 2, slots, g.n_head, q + 1, g.head_dim, dtype=dt,
                                 device=dev),
            lengths=longs(), hidden=torch.zeros(slots, cfg.hidden_size, dtype=dt, device=dev),
            seen=torch.zeros(slots, q, vocab + 1, dtype=torch.bool, device=dev),
            text=SlotSampling.allocate(slots, dev), audio=SlotSampling.allocate(slots, dev),
            nq=longs() + q, steps=longs(), max_frames=longs(), active=flags(), produced=flags(), stopped=flags(),
            finite=torch.ones(slots, 2, dtype=torch.bool, device=dev), codes=torch.full((slots, q), cfg.audio_pad_token_id, dtype=torch.long, device=dev),
            noise=torch.zeros(slots, q + 1, dtype=torch.float32, device=dev))

    @property
    def slots(self) -> int:
        return self.kv.shape[2]

    @property
    def max_len(self) -> int:
        return self.kv.shape[4]

    def nbytes(self) -> int:
        """Return the bytes held by every tensor of the state (the global cache dominates)."""
        total = 0
        for f in fields(self):
            value = getattr(self, f.name)
            total += value.nbytes() if isinstance(value, SlotSampling) else value.numel() * value.element_size()
        return total

    def reset_slot(self, slot: int, pad_id: int) -> None:
        """Empty ``slot`` for a new request (the cache rows need no clearing: lengths and masks hide them)."""
        self.lengths[slot] = 0
        self.seen[slot] = False
        self.steps[slot] = 0
        for flag in (self.active, self.produced, self.stopped):
            flag[slot] = False
        self.finite[slot] = True
        self.codes[slot] = pad_id
