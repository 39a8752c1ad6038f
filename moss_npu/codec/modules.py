"""Codec building blocks: patch/unpatch, RoPE, sliding-window causal attention, transformer stages.

Parameter names are the official checkpoint keys; every stage maps ``(x (B, D, T), lengths (B,))`` to the same
pair, like the official modules. A transformer runs offline (windowed mask) or one chunk at a time against
``KVCache`` rings: the same attention, so streaming equals one-shot decoding up to float rounding.
Shapes: B batch, T steps, D channels, H heads, Dh head size. See docs/architecture.md#codec-stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from moss_npu.checkpoint_layers import CheckpointLinear
from moss_npu.codec.config import TransformerStage
from moss_npu.codec.streaming import CodecDecodeState, KVCache


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Masked attention through ``F.scaled_dot_product_attention`` (the official path)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=0.0)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Masked attention written out (for backends whose SDPA rejects boolean masks)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)


# Offline attention over more steps than this runs in blocks of ATTENTION_BLOCK_STEPS queries (same result).
FULL_ATTENTION_MAX_STEPS = 4096
ATTENTION_BLOCK_STEPS = 1024

ATTENTION_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {"sdpa": sdpa_attention, "eager": eager_attention}


Rope = tuple[torch.Tensor, torch.Tensor]


def rope_angles(positions: torch.Tensor, head_dim: int, max_period: float) -> Rope:
    """Return cos, sin ``(B, 1, T, Dh/2)`` fp32 of angle pos * freq_i for ``positions`` ``(B, T)`` or ``(1, T)``.

    Frequencies follow the official ``exp(i * -ln(P) * 2/Dh)``.
    """
    ds = torch.arange(head_dim // 2, device=positions.device, dtype=torch.float32)
    freqs = torch.exp(ds * (-math.log(max_period) * 2 / head_dim))
    angles = freqs * positions.to(torch.float32)[:, None, :, None]
    return torch.cos(angles), torch.sin(angles)


def rotate_pairs(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of ``x`` ``(B, H, T, Dh)`` by ``rope_angles``, in fp32."""
    cos, sin = rope
    pairs = x.view(*x.shape[:-1], x.shape[-1] // 2, 2)
    real, imag = pairs[..., 0].float(), pairs[..., 1].float()
    out = torch.stack([(real * cos - imag * sin).to(x.dtype), (real * sin + imag * cos).to(x.dtype)], dim=-1)
    return out.view(x.shape)


@dataclass
class StreamChunk:
    """What every layer of a stage shares for one streamed chunk: its steps' positions, which of them are real,
    their RoPE angles, and the attention mask over the ring, made by the first layer after its write. The
    layers' rings move in lockstep (written by the same calls), so the mask is the same for all of them."""

    positions: torch.Tensor  # (B, T)
    valid: torch.Tensor  # (B, T) bool
    rope: Rope
    allowed: Optional[torch.Tensor] = None  # (B, 1, T, n) bool over the ring's filled slots

    @classmethod
    def start(cls, cache: KVCache, lengths: torch.Tensor, steps: int, head_dim: int,
              max_period: float) -> "StreamChunk":
        """The chunk of ``steps`` steps per row (``lengths`` real ones) that ``cache``'s ring takes next."""
        positions = cache.next_positions(lengths.shape[0], steps)
        return cls(positions, valid_mask(lengths, steps), rope_angles(positions, head_dim, max_period))


def valid_mask(lengths: torch.Tensor, steps: int) -> torch.Tensor:
    """``(B, T)`` bool: step t of row b is real (t < lengths[b])."""
    return torch.arange(steps, device=lengths.device).view(1, -1) < lengths.view(-1, 1)


class PatchedPretransform(nn.Module):
    """Patch ``(B, D, T) -> (B, D*h, T/h)`` (encoder) or unpatch the inverse (decoder); no parameters.

    Output channel ``c*h + j`` at step t holds input channel c at time ``t*h + j``. Encoder lengths floor.
    """

    def __init__(self, patch_size: int, is_downsample: bool) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.is_downsample = is_downsample

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, d, t = x.shape
        h = self.patch_size
        if self.is_downsample:
            return x.reshape(b, d, t // h, h).transpose(2, 3).reshape(b, d * h, t // h), lengths // h
        return x.reshape(b, d // h, h, t).transpose(2, 3).reshape(b, d // h, t * h), lengths * h


class LayerScale(nn.Module):
    """Per-channel scale on channel-last input (key ``scale``)."""

    def __init__(self, channels: int, init: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((channels,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class MultiheadAttention(nn.Module):
    """Causal self-attention over a sliding window of ``context`` steps, RoPE on q and k."""

    def __init__(self, embed_dim: int, num_heads: int, context: int, max_period: float, attention: str) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.context = context
        self.max_period = max_period
        self.attend = ATTENTION_FUNCTIONS[attention]
        self.in_proj = CheckpointLinear(embed_dim, 3 * embed_dim, bias=False)
        self.out_proj = CheckpointLinear(embed_dim, embed_dim, bias=False)
        self.window = None  # a streamed chunk's attention in one kernel call (``cpu.window_attention``), if set

    def forward(self, x: torch.Tensor, lengths: torch.Tensor, cache: Optional[KVCache] = None,
                chunk: Optional[StreamChunk] = None) -> torch.Tensor:
        """Attend ``x (B, T, D)``; offline when ``cache`` is None, else as the next chunk of a stream (``chunk``:
        what the stage's layers share for it, ``StreamChunk.start``; given with every ``cache``)."""
        b, t, d = x.shape
        qkv = self.in_proj(x)
        if cache is not None:
            return self._stream(qkv, lengths, cache, chunk)
        q, k, v = qkv.reshape(b, t, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        valid = valid_mask(lengths, t)
        pos = torch.arange(t, device=x.device)
        rope = rope_angles(pos.view(1, t), d // self.num_heads, self.max_period)
        q, k = rotate_pairs(q, rope), rotate_pairs(k, rope)
        # Short sequences take the official single masked call; long ones go in query blocks that
        # see only their window, so memory and work grow with T * context instead of T * T.
        block = t if t <= FULL_ATTENTION_MAX_STEPS else ATTENTION_BLOCK_STEPS
        outs = []
        for start in range(0, t, block):
            end, first = min(t, start + block), max(0, start - self.context + 1) if block < t else 0
            delta = pos[start:end].view(-1, 1) - pos[first:end].view(1, -1)
            allowed = (delta >= 0) & (delta < self.context) & valid[:, None, first:end]
            outs.append(self.attend(q[:, :, start:end], k[:, :, first:end], v[:, :, first:end], allowed[:, None]))
        out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
        return self._finish(out, valid)

    def _stream(self, qkv: torch.Tensor, lengths: torch.Tensor, cache: KVCache, chunk: StreamChunk) -> torch.Tensor:
        """``forward`` for the next chunk of a stream, from its in_proj rows ``qkv`` ``(B, T, 3D)``."""
        b, t, _ = qkv.shape
        q = self._write(qkv, cache, chunk, lengths)
        # Until the ring wraps, only its leading slots hold keys: attending to the rest would add exact zeros.
        keys, values, positions = cache.filled(b)
        if self.window is not None:
            out = self.window(q, cache.keys, cache.values, cache.positions, keys.shape[2], chunk.positions,
                              lengths, self.context)
            if out is not None:  # padded steps are zero already
                return self.out_proj(out)
        if chunk.allowed is None:
            delta = chunk.positions.view(b, t, 1) - positions.view(b, 1, -1)
            chunk.allowed = ((positions.view(b, 1, -1) >= 0) & (delta >= 0) & (delta < self.context))[:, None]
        return self._finish(self.attend(q, keys, values, chunk.allowed), chunk.valid)

    def _write(self, qkv: torch.Tensor, cache: KVCache, chunk: StreamChunk, lengths: torch.Tensor) -> torch.Tensor:
        """Write the chunk's rotated keys and its values into the ring; return its rotated queries ``(B, H, T, Dh)``.
        With the CPU library (``window``) in one call, else with torch."""
        b, t, three_d = qkv.shape
        if self.window is not None:
            cache.check_chunk(t)
            q = self.window.write_chunk(qkv, chunk.rope, chunk.positions, lengths, cache.keys, cache.values,
                                        cache.positions)
            if q is not None:
                cache.advance(chunk.valid)
                return q
        q, k, v = qkv.reshape(b, t, 3, self.num_heads, three_d // (3 * self.num_heads)).permute(2, 0, 3, 1, 4)
        cache.write(rotate_pairs(k, chunk.rope), v, chunk.valid, chunk.positions)
        return rotate_pairs(q, chunk.rope)

    def _finish(self, out: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The output projection of the attention ``out`` ``(B, H, T, Dh)``, padded steps (not ``valid``) zero."""
        b, h, t, dh = out.shape
        # Padded query rows may be fully masked (NaN in some kernels): zero them with where, not a multiply. In a
        # stream their keys/values stay in the ring under position -1, where a NaN would poison later steps.
        out = torch.where(valid.view(b, 1, t, 1), out, torch.zeros((), device=out.device, dtype=out.dtype))
        return self.out_proj(out.transpose(1, 2).reshape(b, t, h * dh))


class TransformerLayer(nn.Module):
    """Pre-norm layer: ``x + s1 * attn(LN1 x)`` then ``x + s2 * ffn(LN2 x)``; exact-erf GELU FFN."""

    def __init__(self, stage: TransformerStage, context: int, attention: str) -> None:
        super().__init__()
        d = stage.d_model
        self.self_attn = MultiheadAttention(d, stage.num_heads, context, stage.max_period, attention)
        self.norm1 = nn.LayerNorm(d, eps=1e-5)
        self.norm2 = nn.LayerNorm(d, eps=1e-5)
        self.ffn = nn.Sequential(CheckpointLinear(d, stage.dim_feedforward, bias=False), nn.GELU(),
                                 CheckpointLinear(stage.dim_feedforward, d, bias=False))
        scale = stage.layer_scale
        self.layer_scale_1 = LayerScale(d, scale) if scale is not None else nn.Identity()
        self.layer_scale_2 = LayerScale(d, scale) if scale is not None else nn.Identity()

    def forward(self, x: torch.Tensor, lengths: torch.Tensor, cache: Optional[KVCache] = None,
                chunk: Optional[StreamChunk] = None) -> torch.Tensor:
        x = x + self.layer_scale_1(self.self_attn(self.norm1(x), lengths, cache, chunk))
        return x + self.layer_scale_2(self.ffn(self.norm2(x)))


class Transformer(nn.Module):
    """A stack of layers sharing one RoPE; no final norm (the official model has none)."""

    def __init__(self, stage: TransformerStage, context: int, attention: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(stage, context, attention) for _ in range(stage.num_layers))

    def forward(self, x: torch.Tensor, lengths: torch.Tensor, caches: Optional[list[KVCache]] = None) -> torch.Tensor:
        """Run ``x (B, T, D)``; with ``caches`` (one ring per layer) as the next chunk of a stream."""
        chunk = None
        if caches is not None:
            attn = self.layers[0].self_attn
            chunk = StreamChunk.start(caches[0], lengths, x.shape[1], x.shape[-1] // attn.num_heads, attn.max_period)
        for i, layer in enumerate(self.layers):
            x = layer(x, lengths, None if caches is None else caches[i], chunk)
        return x


class ProjectedTransformer(nn.Module):
    """``input_proj`` -> transformer -> ``output_proj`` on ``(B, D, T)`` tensors (conv layout)."""

    def __init__(self, stage: TransformerStage, context: int, attention: str) -> None:
        super().__init__()
        self.stage = stage
        self.context = context
        self.input_proj = CheckpointLinear(stage.input_dimension, stage.d_model, bias=False)
        self.transformer = Transformer(stage, context, attention)
        self.output_proj = CheckpointLinear(stage.d_model, stage.output_dimension, bias=False)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor,
                caches: Optional[list[KVCache]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.transformer(self.input_proj(x.transpose(1, 2)), lengths, caches)  # (B, T, d_model)
        return self.output_proj(h).transpose(1, 2), lengths

    def init_caches(self, prefix: str, batch_size: int, chunk_capacity: int, device: torch.device,
                    dtype: torch.dtype) -> dict[str, KVCache]:
        """Preallocate one ring per layer, named ``{prefix}.transformer.layers.{j}``."""
        heads = self.stage.num_heads
        head_dim = self.stage.d_model // heads
        return {f"{prefix}.transformer.layers.{j}": KVCache.empty(batch_size, heads, head_dim, self.context,
                                                                   chunk_capacity, device, dtype)
                for j in range(len(self.transformer.layers))}

    def stream(self, x: torch.Tensor, lengths: torch.Tensor, prefix: str,
               state: CodecDecodeState) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the next chunk of a stream through this stage, updating its layers' caches."""
        caches = [state.cache(f"{prefix}.transformer.layers.{j}") for j in range(len(self.transformer.layers))]
        return self.forward(x, lengths, caches)
