"""MOSS-TTS-Nano language model: global GPT-2/RoPE decoder over 17-wide rows + local decoder over channels.

Implements docs/architecture.md#weights, #blocks-and-rope and #rows: pre-norm GPT-2 blocks with plain
``nn.Linear`` weights ([out, in]), interleaved RoPE with
positions ``cumsum(mask) - 1``, attention through a name → function table with explicit boolean masks, tied
heads. Parameter names equal the official checkpoint keys. The KV cache is a preallocated ``KVCache`` owned by
the caller (``decoder.py``), not by the layers.
Shapes: B batch, L query rows, T key rows (cache + new), H heads, D head dim, E hidden, Q = n_vq channels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from moss_npu.checkpoint_layers import CheckpointLinear
from moss_npu.cpu.contract import BlockParts, DecoderParts
from moss_npu.errors import InputError
from moss_npu.nano.config import GPT2Config, NanoConfig


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    # Written out like transformers' NewGELUActivation (not F.gelu(approximate="tanh")) for bitwise-close parity.
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATION_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_new": gelu_new,
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}
# One-kernel forms used by decode steps (same function, differs from the written-out one by float rounding).
FUSED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


def sdpa_attention(q, k, v, mask, query_valid, scale):
    """Attention with ``scaled_dot_product_attention`` and an explicit boolean mask (upstream's "sdpa").

    A fully padded query row would give NaN, so upstream lets it see the key at its own absolute index and zeroes
    its output afterwards; that is done here without asking the host whether any row is padded. ``mask`` None
    means every key is visible, ``query_valid`` None that every query is real. ``scale`` is the config's
    (``scale_attn_weights``, ``scale_attn_by_inverse_layer_idx``), as in eager attention; for the official config
    it equals sdpa's default 1/sqrt(D).
    """
    if query_valid is None:  # every query is real: nothing to patch (decode steps of a full batch)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    lq, lk = q.shape[-2], k.shape[-2]
    own = torch.arange(lk, device=q.device)[None, :] == (torch.arange(lq, device=q.device) + (lk - lq))[:, None]
    mask = mask | (own[None, None] & ~query_valid[:, None, :, None])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out * query_valid[:, None, :, None].to(out.dtype)


def eager_attention(q, k, v, mask, query_valid, scale):
    """Attention written out: masked scores filled with the dtype's minimum, softmax, weighted sum."""
    scores = torch.matmul(q, k.transpose(-1, -2))
    if scale != 1.0:
        scores = scores * scale
    if mask is not None:
        scores.masked_fill_(~mask, torch.finfo(scores.dtype).min)
    return torch.matmul(torch.softmax(scores, dim=-1), v)


ATTENTION_FUNCTIONS = {"sdpa": sdpa_attention, "eager": eager_attention}


@dataclass
class KVCache:
    """Preallocated keys/values of one decoder, per layer ``(B, H, capacity, D)``, keys stored after RoPE.

    Contract: during one forward each layer calls ``update(layer, k, v)`` with the new rows; it writes them at
    ``length`` and returns the views over ``[0, length + new)``. The decoder then calls ``advance(new)``.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + key.shape[2]
        if end > self.capacity:
            raise InputError(f"KV cache full: {end} rows needed, capacity {self.capacity}; allocate a larger cache")
        self.keys[layer][:, :, self.length:end] = key
        self.values[layer][:, :, self.length:end] = value
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, rows: int) -> None:
        self.length += rows

    def reset(self) -> None:
        self.length = 0


class RotaryEmbedding(nn.Module):
    """Interleaved (GPT-J style) RoPE; ``inv_freq`` is a non-persistent buffer that follows the model's dtype."""

    def __init__(self, head_dim: int, base: float) -> None:
        super().__init__()
        self.head_dim, self.base = head_dim, base
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self) -> torch.Tensor:
        return 1.0 / (self.base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # Positions are cast to inv_freq's dtype: a bf16 model rounds positions > 256 exactly like upstream.
        freqs = positions.to(self.inv_freq.dtype)[..., None] * self.inv_freq
        cos = freqs.cos().repeat_interleave(2, dim=-1)[:, :, None, :].to(dtype)
        sin = freqs.sin().repeat_interleave(2, dim=-1)[:, :, None, :].to(dtype)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate feature pairs (2i, 2i+1) of (B, L, ..., D) by the position angle (cos/sin broadcast to x)."""
    return rotate(x, cos, signed_sin(sin))


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` (..., D) with its even features negated: the form ``rotate`` takes."""
    return torch.stack((-sin[..., ::2], sin[..., 1::2]), dim=-1).flatten(-2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` with ``signed_sin(sin)`` given: x·cos + x with each pair swapped·sin, the same values
    (x₁·(−s) is −(x₁·s) exactly) in four kernels where the stacked form takes five."""
    return x * cos + x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) * sin


class Attention(nn.Module):
    """Multi-head self-attention: fused ``c_attn`` (q | k | v), RoPE on q and k, ``c_proj``."""

    def __init__(self, cfg: GPT2Config, layer_idx: int) -> None:
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.c_attn = CheckpointLinear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = CheckpointLinear(cfg.n_embd, cfg.n_embd)
        scale = 1.0 / math.sqrt(self.head_dim) if cfg.scale_attn_weights else 1.0
        self.scale = scale / (layer_idx + 1) if cfg.scale_attn_by_inverse_layer_idx else scale

    def forward(self, x, cos, sin, mask, query_valid, attn_fn, cache: Optional[KVCache], layer_idx: int):
        """Attend (B, L, E) ``x``."""
        qkv = self.c_attn(x)
        b, l, e = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        qkv = qkv.view(b, l, 3, self.n_head, self.head_dim)
        # q and k rotate in one go (same element-wise math as two calls, half the kernel launches).
        qk = rotate(qkv[:, :, :2], cos[:, :, None], sin[:, :, None])
        q, k = qk[:, :, 0].transpose(1, 2), qk[:, :, 1].transpose(1, 2)  # (B, H, L, D)
        v = qkv[:, :, 2].transpose(1, 2)
        if cache is not None:
            k, v = cache.update(layer_idx, k, v)
        out = attn_fn(q, k, v, mask, query_valid, self.scale)
        return self.c_proj(out.transpose(1, 2).reshape(b, l, e))


class MLP(nn.Module):
    """``fc_in`` → activation (tanh GELU for the official model) → ``fc_out``."""

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.fc_in = CheckpointLinear(cfg.n_embd, cfg.inner_size)
        self.fc_out = CheckpointLinear(cfg.inner_size, cfg.n_embd)
        self.act = ACTIVATION_FUNCTIONS[cfg.activation_function]
        self.fused_act = FUSED_ACTIVATIONS.get(cfg.activation_function, self.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.act(self.fc_in(x)))


class Block(nn.Module):
    """Pre-norm GPT-2 block: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, cfg: GPT2Config, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = Attention(cfg, layer_idx)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, query_valid, attn_fn, cache, layer_idx):
        x = x + self.attn(self.ln_1(x), cos, sin, mask, query_valid, attn_fn, cache, layer_idx)
        return x + self.mlp(self.ln_2(x))


def _embedding(num: int, dim: int) -> nn.Embedding:
    # Uninitialised: weights always come from a checkpoint (skips a 16384-row normal_ init).
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


class Decoder(nn.Module):
    """GPT-2 style decoder without final projection (upstream ``MossTTSNanoGPT2Model``); ``wte`` optional."""

    def __init__(self, cfg: GPT2Config, n_layer: int, attn_impl: str, has_wte: bool) -> None:
        super().__init__()
        if attn_impl not in ATTENTION_FUNCTIONS:
            raise InputError(f"attention {attn_impl!r} is not available; use one of {list(ATTENTION_FUNCTIONS)}")
        self.cfg, self.attn_impl = cfg, attn_impl
        if has_wte:
            self.wte = _embedding(cfg.vocab_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg, i) for i in range(n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_base)

    def init_cache(self, batch_size: int, capacity: int) -> KVCache:
        """Allocate an empty cache for ``capacity`` rows on the decoder's device and dtype."""
        w = self.ln_f.weight
        shape = (batch_size, self.cfg.n_head, capacity, self.cfg.head_dim)
        return KVCache([w.new_zeros(shape) for _ in self.h], [w.new_zeros(shape) for _ in self.h])

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor, cache: Optional[KVCache] = None) -> torch.Tensor:
        """Run (B, L, E) inputs; ``attention_mask`` (B, T) bool covers cached + new rows. Return (B, L, E)."""
        lq, lk = x.shape[1], attention_mask.shape[1]
        query_valid = attention_mask[:, -lq:]
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(~attention_mask, 0)[:, -lq:]
        cos, sin = self.rotary(positions, x.dtype)
        sin = signed_sin(sin)
        # Causal mask aligned bottom-right (new rows are the last ones) combined with key validity.
        key_pos = torch.arange(lk, device=x.device)
        query_pos = torch.arange(lq, device=x.device) + (lk - lq)
        mask = (key_pos[None, :] <= query_pos[:, None])[None, None] & attention_mask[:, None, None, :]
        attn_fn = ATTENTION_FUNCTIONS[self.attn_impl]
        keep = query_valid[..., None].to(x.dtype)
        x = x * keep
        for i, block in enumerate(self.h):
            x = block(x, cos, sin, mask, query_valid, attn_fn, cache, i) * keep
        if cache is not None:
            cache.advance(lq)
        return self.ln_f(x) * keep

    def rope_table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return cos, sin (length, D) for positions 0..length-1: the values ``forward`` computes for them."""
        w = self.ln_f.weight
        cos, sin = self.rotary(torch.arange(length, device=w.device)[None], w.dtype)
        return cos[0, :, 0], sin[0, :, 0]


class NanoTTSModel(nn.Module):
    """``MossTTSNanoForCausalLM`` without the inference helpers: embeddings, two decoders, tied heads."""

    def __init__(self, config: NanoConfig, attn_impl: str = "sdpa") -> None:
        super().__init__()
        self.config = config
        self.quantization = "none"  # "int8" after cpu.quantize.quantize_int8 rounded the block weights
        self.weight_dtype = "float32"  # "bfloat16" after cpu.quantize.store_bf16 rounded every weight
        g, e = config.gpt2_config, config.hidden_size
        self.transformer = Decoder(g, g.n_layer, attn_impl, has_wte=True)
        self.audio_embeddings = nn.ModuleList(_embedding(n, e) for n in config.audio_codebook_sizes)
        self.text_lm_head = CheckpointLinear(e, g.vocab_size, bias=False)
        self.audio_lm_heads = nn.ModuleList(CheckpointLinear(e, n, bias=False) for n in config.audio_codebook_sizes)
        # The local decoder has no embedding table (upstream replaces its wte by Identity).
        self.local_transformer = Decoder(g, config.local_transformer_layers, attn_impl, has_wte=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the text head with ``transformer.wte`` and audio head k with audio embedding k."""
        self.text_lm_head.weight = self.transformer.wte.weight
        for head, table in zip(self.audio_lm_heads, self.audio_embeddings):
            head.weight = table.weight

    def parts(self) -> DecoderParts:
        """Return the decoders and audio heads as the CPU path reads them (``cpu.contract``)."""
        g = self.config.gpt2_config

        def blocks(decoder: Decoder) -> tuple[BlockParts, ...]:
            return tuple(BlockParts(b.ln_1, b.attn.c_attn, b.attn.c_proj, b.ln_2, b.mlp.fc_in, b.mlp.fc_out,
                                    b.attn.scale) for b in decoder.h)

        return DecoderParts(blocks(self.transformer), blocks(self.local_transformer), self.transformer.ln_f,
                            self.local_transformer.ln_f, tuple(self.audio_lm_heads), tuple(self.audio_embeddings),
                            g.n_head, g.layer_norm_epsilon,
                            g.activation_function == "gelu_new",
                            "int8" if self.quantization == "int8" else self.weight_dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.local_transformer.ln_f.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.local_transformer.ln_f.weight.device

    def embed_rows(self, rows: torch.Tensor, check: bool = True) -> torch.Tensor:
        """Embed (B, L, Q + 1) rows: ``wte[text] + Σ_k audio_embeddings[k][code_k]`` over non-pad codes."""
        cfg = self.config
        if rows.ndim != 3 or rows.shape[-1] != cfg.row_width:
            raise InputError(f"rows have shape {tuple(rows.shape)}; expected (batch, seq, {cfg.row_width})")
        x = self.transformer.wte(rows[..., 0])
        for k, table in enumerate(self.audio_embeddings):
            codes = rows[..., k + 1]
            valid = codes != cfg.audio_pad_token_id
            if check and bool((valid & ((codes < 0) | (codes >= table.num_embeddings))).any()):
                raise InputError(f"audio codes of channel {k} lie outside [0, {table.num_embeddings}) and are not "
                                 f"the pad id {cfg.audio_pad_token_id}; the codes must come from the matching codec")
            x = x + table(codes.masked_fill(~valid, 0)) * valid[..., None]
        return x

    def forward(self, rows: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None, check: bool = True) -> torch.Tensor:
        """Return the global hidden states after ``ln_f`` for (B, L, Q + 1) rows, (B, L, E).

        ``attention_mask`` (B, T) covers cached + new rows (all ones when None and no cache).
        """
        if attention_mask is None:
            attention_mask = torch.ones(rows.shape[:2], dtype=torch.bool, device=rows.device)
        return self.transformer(self.embed_rows(rows, check), attention_mask.to(torch.bool), cache)

    def first_qkv(self, rows: torch.Tensor) -> torch.Tensor:
        """Return the local decoder's first-layer ``c_attn(ln_1(rows))`` for (..., E) input rows, (..., 3E).

        Every local input after the first is an embedding row, so this can be tabulated once per weights.
        """
        block = self.local_transformer.h[0]
        return block.attn.c_attn(block.ln_1(rows))

    def local_hidden(self, seq: torch.Tensor, cache: Optional[KVCache] = None) -> torch.Tensor:
        """Run the local decoder over (B, S, E) (or only the new rows when ``cache`` holds the rest); last row."""
        total = seq.shape[1] + (cache.length if cache is not None else 0)
        mask = torch.ones(seq.shape[0], total, dtype=torch.bool, device=seq.device)
        return self.local_transformer(seq, mask, cache)[:, -1, :]
