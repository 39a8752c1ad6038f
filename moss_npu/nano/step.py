"""The frame step through the model's own torch modules: what a ``FrameDecoder`` runs its blocks through on any
device whose backend has no step of its own (``device.Backend.frame_step``; the float32 CPU has ``cpu.step``).

It has ``cpu.step.CpuStep``'s interface, so the decoder calls one step however it computes: rows in, hidden
states out, each slot's new key and value written into the decoder's static cache at its own position. A step is
one row per slot, so each layer is written with the fewest kernels (an eager NPU frame pays a launch for each,
docs/performance.md): q, k and v rotate together (v by the identity, q pre-scaled by the attention scale, both in
the rotation table), and k and v go into the cache in one write.
"""

from __future__ import annotations

import contextlib

import torch

from moss_npu.cpu.blocks import Segment
from moss_npu.device import backend
from moss_npu.nano.model import ATTENTION_FUNCTIONS, KVCache, NanoTTSModel, signed_sin


class TorchStep:
    """The frame step of ``model``'s own modules (see the module docstring); nothing to prepare or pack."""

    tile_arena = None
    local_loop = None  # the audio channels run channel by channel in the decoder (``cpu.step`` has a native loop)
    borrows = False  # ``lend`` adds nothing to its frames
    compiled = False
    compile_seconds = 0.0

    def __init__(self, model: NanoTTSModel) -> None:
        self.model = model
        self.attention = ATTENTION_FUNCTIONS[backend(model.device).step_attention or model.transformer.attn_impl]

    def dispatch(self) -> str:
        return "torch"

    def pack(self, batched: bool) -> None:
        """Nothing to pack: the modules multiply as they are."""

    def threads(self, slots: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def lend(self, threads: int) -> None:
        """The CPU step's threads for idle cores: an accelerator's frame has no use for them."""

    def rotation_table(self, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE rows (P, 6D) as ``run`` takes them: the factors of q, k and v for cos, then for ``signed_sin``; q's
        carry the first layer's attention scale (both decoders share it), v's rotate by the identity."""
        scale = self.model.transformer.h[0].attn.scale
        sin = signed_sin(sin)
        return torch.cat([cos * scale, cos, torch.ones_like(cos), sin * scale, sin, torch.zeros_like(sin)], dim=-1)

    def run(self, local: bool, x: torch.Tensor, rotation: torch.Tensor, kv: torch.Tensor, index: torch.Tensor,
            keys: int, mask: torch.Tensor | None, qkv: torch.Tensor | None = None) -> torch.Tensor:
        """Run (n, E) rows, one per slot, through the local or global decoder against its cache ``kv`` (N, 2, S,
        H, M, D), writing each row's key and value at ``index`` (n·H flat rows of ``kv[layer, j, :n]``) and
        attending the first ``keys`` where ``mask`` (n, 1, 1, keys) allows (None: all). ``qkv`` (n, 3E): the
        first layer's ``c_attn(ln_1(x))`` when known (``first_qkv``). Return the hidden states after ``ln_f``."""
        decoder = self.model.local_transformer if local else self.model.transformer
        n, (h, d) = x.shape[0], kv.shape[3::2]
        factors = rotation.view(n, 2, 3, 1, d)
        for i, block in enumerate(decoder.h):
            attn, mlp = block.attn, block.mlp
            row = (attn.c_attn(block.ln_1(x)) if qkv is None or i else qkv).view(n, 3, h, d)
            row = torch.addcmul(row * factors[:, 0], row.unflatten(-1, (-1, 2)).flip(-1).flatten(-2), factors[:, 1])
            kv[i].view(2, -1, d).index_copy_(1, index, row[:, 1:].transpose(0, 1).reshape(2, -1, d))
            q, k, v = row[:, 0, :, None], kv[i, 0, :n, :, :keys], kv[i, 1, :n, :, :keys]
            scale = attn.scale / self.model.transformer.h[0].attn.scale
            x = x + attn.c_proj(self.attention(q, k, v, mask, None, scale).reshape(n, -1))
            x = x + mlp.fc_out(mlp.fused_act(mlp.fc_in(block.ln_2(x))))
        return decoder.ln_f(x)

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
