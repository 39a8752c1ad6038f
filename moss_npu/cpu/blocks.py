"""The transformer block's math on the CPU, for the frame step (``cpu.step``): the same as ``model.Block``.

``block_step`` is one new row per slot in torch (functional, so that torch.compile can fuse its small ops),
``block_rows`` the new rows of one or more prompts (a prefill), ``row_block`` one slot's row in numpy (cheaper per
operation than torch at this size), where the C library is missing (with it: ``cpu.fused_block``). The decode
steps use the tanh GELU; results agree with the model's modules to float rounding.
Shapes: n slots, E hidden, H heads, D head dim, M cache rows, T keys attended.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

Matmul = Callable[..., torch.Tensor]


def blas_matmul(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor,
                residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Return ``x @ weight_t + bias (+ residual)`` for (n, in) fp32 ``x`` and (in, out) ``weight_t``: one row through
    numpy's GEMV (``gemv``: cheaper than torch ops at this size), several through torch's GEMM."""
    if x.shape[0] > 1:
        out = torch.addmm(bias, x, weight_t)
        return out if residual is None else out.add_(residual)
    return gemv(x, weight_t.numpy(), bias.numpy(), residual)


def gemv(x: torch.Tensor, weight_t: np.ndarray, bias: np.ndarray,
         residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Return ``x @ weight_t + bias (+ residual)`` (1, out) for one fp32 row ``x`` (1, in), numpy's GEMV with the
    additions in place on its result."""
    out = x.numpy()[0] @ weight_t
    out += bias
    if residual is not None:
        out += residual.numpy()[0]
    return torch.from_numpy(out)[None]


def rotations(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Return RoPE tables (P, D) as complex (P, D/2) rotations: multiplying pairs (2i, 2i+1) as complex numbers by
    them is ``model.apply_rope`` (real part x₀c − x₁s, imaginary x₁c + x₀s) in one kernel."""
    return torch.complex(cos[:, ::2].float(), sin[:, ::2].float())


def rotate_complex(pairs: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """RoPE of (n, 2, H, D/2, 2) feature pairs by a complex (n, D/2) ``rotation``: one complex multiply (eager)."""
    return torch.view_as_real(torch.view_as_complex(pairs) * rotation[:, None, None])


def rotate_real(pairs: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """The same rotation in real arithmetic by ``view_as_real(rotation)`` (n, D/2, 2), for inductor, which
    generates no code for complex operators."""
    cos, sin = rotation.unbind(-1)
    cos, sin, even, odd = cos[:, None, None], sin[:, None, None], pairs[..., 0], pairs[..., 1]
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


def block_step(x: torch.Tensor, rotation: torch.Tensor, kv: torch.Tensor, index: torch.Tensor,
               keys: int, mask: Optional[torch.Tensor], qkv: Optional[torch.Tensor], *weights: torch.Tensor,
               heads: int, eps: float, scale: float, matmul: Matmul,
               rotate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = rotate_complex) -> torch.Tensor:
    """One pre-norm GPT-2 block on one new row per slot; return (n, E).

    ``x`` (n, E); ``rotation`` (n, D/2) complex RoPE of each row's position; ``kv`` (2, S, H, M, D) the layer's
    cache, whose flattened rows ``index`` (n·H,) receive the new keys/values; its first ``keys`` rows are attended
    under ``mask`` (n, 1, 1, T) or None. ``qkv`` (n, 3E): ready-made ``c_attn(ln_1(x))`` or None.
    ``weights``: ln_1 w, b; c_attn wᵀ, b; c_proj wᵀ, b; ln_2 w, b; fc_in wᵀ, b; fc_out wᵀ, b.
    """
    ln1_w, ln1_b, attn_w, attn_b = weights[:4]
    n, e = x.shape
    d = e // heads
    if qkv is None:
        qkv = matmul(torch.layer_norm(x, (e,), ln1_w, ln1_b, eps), attn_w, attn_b)
    qkv = qkv.view(n, 3, heads, d)
    qk = rotate(qkv[:, :2].reshape(n, 2, heads, d // 2, 2), rotation).view(n, 2, heads, d)
    keys_all, values_all = kv[0, :n], kv[1, :n]
    keys_all.view(-1, d).index_copy_(0, index, qk[:, 1].reshape(-1, d))
    values_all.view(-1, d).index_copy_(0, index, qkv[:, 2].reshape(-1, d))
    out = F.scaled_dot_product_attention(qk[:, 0, :, None], keys_all[:, :, :keys], values_all[:, :, :keys],
                                         attn_mask=mask, scale=scale)
    return _block_tail(out.reshape(n, e), x, *weights[4:], eps=eps, matmul=matmul)


@dataclass(frozen=True)
class Segment:
    """One prompt's new rows in a prefill: ``rows`` rows written to ``slot``'s cache from position ``start``."""

    slot: int
    start: int
    rows: int


PROMPT_CHUNK = 64  # prompt rows attend chunk by chunk, over the keys up to their chunk's end (prompt_attention)
QUERY_BLOCK = 4  # torch's attention runs a block of 1-3 query rows through another product kernel than larger ones


def prompt_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                     scale: float) -> torch.Tensor:
    """Causal attention of L prompt rows at positions ``start``.. (queries (L, H, D)) over their slot's keys and
    values (H, >= start + L, D); return (L, H, D).

    A row gets the same bits whatever else its prefill holds (a prompt whose prefix came from the prefix cache,
    prompts admitted together, the thread count), since every call torch makes is alike for it. Its sums over
    the keys change with their count, so the rows attend chunk by chunk (``PROMPT_CHUNK`` positions), each over
    the keys up to its chunk's end (zeros past the prompt, all masked); and a last block of 1-3 query rows goes
    through another product than larger ones (a single row's keys are split between threads, too), so each
    call's rows are padded to a multiple of ``QUERY_BLOCK``.
    """
    rows, heads, dim = queries.shape
    end, out, first = start + rows, [], start
    while first < end:
        stop = (first // PROMPT_CHUNK + 1) * PROMPT_CHUNK  # the chunk's end: its rows' key count
        last = min(stop, end)
        spare = -(last - first) % QUERY_BLOCK
        q = F.pad(queries[first - start:last - start], (0, 0, 0, 0, 0, spare))
        k = F.pad(keys[:, :last], (0, 0, 0, stop - last))
        v = F.pad(values[:, :last], (0, 0, 0, stop - last))
        causal = torch.arange(stop)[None, :] <= torch.arange(first, last + spare)[:, None]  # padding rows: all keys
        attended = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=causal,
                                                  scale=scale)
        out.append(attended[0, :, :last - first].transpose(0, 1))
        first = last
    return out[0] if len(out) == 1 else torch.cat(out)


def block_rows(x: torch.Tensor, rotation: torch.Tensor, kv: torch.Tensor, segments: list[Segment],
               *weights: torch.Tensor, heads: int, eps: float, scale: float, matmul: Matmul,
               last_only: bool = False) -> torch.Tensor:
    """The same block on the new rows of one or more prompts (a prefill), one after another in ``x`` (ΣL, E);
    return their (ΣL, E), or with ``last_only`` (the final block, whose other rows only leave keys and values)
    each prompt's last row (segments, E).

    Each segment's keys/values are written to its slot of ``kv`` (2, S, H, M, D) at its positions, and each row
    attends to its slot's keys up to its own position. The products run once over all rows; only the attention
    is per segment. ``rotation`` (ΣL, D/2); ``weights`` as in ``block_step``.
    """
    ln1_w, ln1_b, attn_w, attn_b = weights[:4]
    total, e = x.shape
    d = e // heads
    qkv = matmul(torch.layer_norm(x, (e,), ln1_w, ln1_b, eps), attn_w, attn_b).view(total, 3, heads, d)
    qk = rotate_complex(qkv[:, :2].reshape(total, 2, heads, d // 2, 2), rotation).view(total, 2, heads, d)
    attended, lasts, offset = [], [], 0
    for seg in segments:
        part, end = slice(offset, offset + seg.rows), seg.start + seg.rows
        kv[0, seg.slot, :, seg.start:end] = qk[part, 1].transpose(0, 1)
        kv[1, seg.slot, :, seg.start:end] = qkv[part, 2].transpose(0, 1)
        first = end - 1 if last_only else seg.start  # the last row alone attends to every key
        queries = qk[offset + first - seg.start:offset + seg.rows, 0]
        out = prompt_attention(queries, kv[0, seg.slot, :, :end], kv[1, seg.slot, :, :end], first, scale)
        attended.append(out.reshape(-1, e))
        lasts.append(offset + seg.rows - 1)
        offset += seg.rows
    if last_only:
        x = x[lasts]
    out = attended[0] if len(attended) == 1 else torch.cat(attended)
    return _block_tail(out, x, *weights[4:], eps=eps, matmul=matmul)


def row_block(x: np.ndarray, rotation: np.ndarray, keys: np.ndarray, values: np.ndarray, position: int,
              attended: int, qkv: Optional[np.ndarray], block: "RowBlock", *, heads: int, eps: float,
              scale: float) -> np.ndarray:
    """``block_step`` for one slot's one new row, every operation in numpy; return (E,).

    ``x`` (E,); ``rotation`` (D/2,) complex64 RoPE of the row's position; ``keys``/``values`` (H, M, D) the slot's
    cache of this layer, which receives the row at ``position``; its first ``attended`` rows are attended.
    ``qkv`` (3E,) ready-made or None; ``block`` its norms and products.
    """
    e = x.shape[0]
    d = e // heads
    if qkv is None:
        qkv = block.attn(row_norm(x, block.ln1_w, block.ln1_b, eps))
    qk = (qkv[:2 * e].view(np.complex64).reshape(2, heads, d // 2) * rotation).view(np.float32)  # (2, H, D)
    keys[:, position] = qk[1]
    values[:, position] = qkv[2 * e:].reshape(heads, d)
    scores = np.matmul(keys[:, :attended], qk[0][:, :, None])[:, :, 0]  # (H, T)
    scores *= np.float32(scale)
    scores -= scores.max(axis=1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=1, keepdims=True)
    out = block.proj(np.matmul(scores[:, None], values[:, :attended]).reshape(e), x)
    hidden = block.fc_in(row_norm(out, block.ln2_w, block.ln2_b, eps))
    _gelu_tanh(hidden)
    return block.fc_out(hidden, out)


def row_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm of one row (E,) in float32."""
    count = np.float32(x.shape[0])
    centered = x - x.sum() / count  # the mean (ndarray.mean is a slower Python-level function)
    variance = np.dot(centered, centered) / count
    centered *= np.float32(1.0) / np.sqrt(variance + np.float32(eps))
    centered *= weight
    centered += bias
    return centered


def _gelu_tanh(x: np.ndarray) -> None:
    """The tanh GELU (``gelu_new``), in place: x · (1 + tanh(√(2/π) · (x + 0.044715 x³))) / 2."""
    inner = x * x
    inner *= x
    inner *= np.float32(0.044715)
    inner += x
    inner *= np.float32(math.sqrt(2.0 / math.pi))
    np.tanh(inner, out=inner)
    inner += np.float32(1.0)
    x *= np.float32(0.5)
    x *= inner


def _block_tail(attended: torch.Tensor, x: torch.Tensor, proj_w: torch.Tensor, proj_b: torch.Tensor,
                ln2_w: torch.Tensor, ln2_b: torch.Tensor, in_w: torch.Tensor, in_b: torch.Tensor,
                out_w: torch.Tensor, out_b: torch.Tensor, *, eps: float, matmul: Matmul) -> torch.Tensor:
    """The block after attention: ``x + c_proj(attended)``, plus the tanh-GELU MLP of its ``ln_2``; (rows, E)."""
    x = matmul(attended, proj_w, proj_b, x)
    e = x.shape[-1]
    hidden = F.gelu(matmul(torch.layer_norm(x, (e,), ln2_w, ln2_b, eps), in_w, in_b), approximate="tanh")
    return matmul(hidden, out_w, out_b, x)


@dataclass(frozen=True)
class RowBlock:
    """One block's norm weights (numpy) and its four one-row products (``matvec``), for ``row_block``."""

    ln1_w: np.ndarray
    ln1_b: np.ndarray
    attn: Callable[..., np.ndarray]
    proj: Callable[..., np.ndarray]
    ln2_w: np.ndarray
    ln2_b: np.ndarray
    fc_in: Callable[..., np.ndarray]
    fc_out: Callable[..., np.ndarray]
