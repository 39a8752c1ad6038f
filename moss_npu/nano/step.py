"""The frame step through the model's own torch modules: what a ``FrameDecoder`` runs its blocks through on any
device whose backend has no step of its own (``device.Backend.frame_step``; the float32 CPU has ``cpu.step``).

It has ``cpu.step.CpuStep``'s interface, so the decoder calls one step however it computes: rows in, hidden
states out, each slot's new key and value written into the decoder's static cache at its own position.
"""

from __future__ import annotations

import contextlib

import torch

from moss_npu.cpu.blocks import Segment
from moss_npu.device import backend
from moss_npu.nano.model import KVCache, NanoTTSModel, signed_sin


class StaticKV:
    """The ``KVCache`` contract over ``DecodeState.kv`` for slots [0, n): each slot's new row goes to its own
    position (``index_copy_`` into the flattened cache, HF ``StaticCache`` style); reads see the first ``keys`` rows.
    ``index`` (n·H,) is the flat row of each slot/head's new key in ``kv[layer, j, :n].view(-1, D)``.
    """

    def __init__(self, kv: torch.Tensor, n: int, index: torch.Tensor, keys: int) -> None:
        self.kv, self.n, self.index, self.keys = kv, n, index, keys

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for j, new in enumerate((key, value)):
            self.kv[layer, j, :self.n].view(-1, new.shape[-1]).index_copy_(0, self.index, new.reshape(-1, new.shape[-1]))
        return self.kv[layer, 0, :self.n, :, :self.keys], self.kv[layer, 1, :self.n, :, :self.keys]

    def advance(self, rows: int) -> None:
        """Nothing to do: the decoder advances each slot's length on the device."""


class TorchStep:
    """The frame step of ``model``'s own modules (see the module docstring); nothing to prepare or pack."""

    tile_arena = None
    local_loop = None  # the audio channels run channel by channel in the decoder (``cpu.step`` has a native loop)
    compiled = False
    compile_seconds = 0.0

    def __init__(self, model: NanoTTSModel) -> None:
        self.model = model
        self.attention = backend(model.device).step_attention

    def dispatch(self) -> str:
        return "torch"

    def pack(self, batched: bool) -> None:
        """Nothing to pack: the modules multiply as they are."""

    def threads(self, slots: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def rotation_table(self, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE rows (P, 2D) as ``run`` takes them: cos and ``signed_sin`` side by side."""
        return torch.cat([cos, signed_sin(sin)], dim=-1)

    def run(self, local: bool, x: torch.Tensor, rotation: torch.Tensor, kv: torch.Tensor, index: torch.Tensor,
            keys: int, mask: torch.Tensor | None, qkv: torch.Tensor | None = None) -> torch.Tensor:
        """Run (n, E) rows through the local or global decoder (``Decoder.step``); return (n, E)."""
        decoder = self.model.local_transformer if local else self.model.transformer
        cos, sin = rotation.chunk(2, dim=-1)
        return decoder.step(x[:, None], cos, sin, StaticKV(kv, x.shape[0], index, keys),
                            None if mask is None else mask[:, 0, 0], qkv=None if qkv is None else qkv[:, None],
                            attention=self.attention)[:, -1]

    def prefill(self, x: torch.Tensor, rotation: torch.Tensor, kv: torch.Tensor,
                segments: list[Segment]) -> torch.Tensor:
        """Run each prompt's new embedded rows (ΣL, E) through the global decoder into its slot's cache, after
        its first ``start`` rows; return each one's last hidden state (segments, E)."""
        out, offset = [], 0
        for seg in segments:
            cache = KVCache([k[None] for k in kv[:, 0, seg.slot]], [v[None] for v in kv[:, 1, seg.slot]],
                            length=seg.start)
            mask = torch.ones(1, seg.start + seg.rows, dtype=torch.bool, device=x.device)
            out.append(self.model.transformer(x[None, offset:offset + seg.rows], mask, cache)[0, -1])
            offset += seg.rows
        return torch.stack(out).to(self.model.dtype)

    def head(self, channel: int, x: torch.Tensor) -> torch.Tensor:
        return self.model.audio_lm_heads[channel](x)
