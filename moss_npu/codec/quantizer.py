"""Residual LFQ quantizer of the Nano codec (docs/architecture.md#quantizer): codes <-> 768-dim latents, always in fp32.

The official weight-normed 1x1 convolutions are plain ``nn.Conv1d`` here under the official names: the loader
folds their weights (``moss_npu.codec.checkpoint``). Shapes: B batch, F frames, Q codebooks, D channels.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from moss_npu.codec.config import QuantizerConfig


def _projection(dim_in: int, dim_out: int) -> nn.Module:
    """A 1x1 conv with bias, or identity when the widths match (as the official model builds it)."""
    return nn.Conv1d(dim_in, dim_out, kernel_size=1) if dim_in != dim_out else nn.Identity()


class LFQ(nn.Module):
    """One codebook: project to ``codebook_dim``, pick the nearest code by cosine, project back."""

    def __init__(self, input_dim: int, codebook_size: int, codebook_dim: int) -> None:
        super().__init__()
        self.in_proj = _projection(input_dim, codebook_dim)
        self.out_proj = _projection(codebook_dim, input_dim)
        self.codebook = nn.Embedding(codebook_size, codebook_dim)

    def quantize(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(out_proj(z_q) (B, D, F), indices (B, F))`` for ``z (B, D, F)``."""
        z_e = self.in_proj(z.float()).float()  # (B, Dc, F)
        flat = F.normalize(z_e.transpose(1, 2).reshape(-1, z_e.shape[1]).float())
        codebook = F.normalize(self.codebook.weight.float())
        # Same expression as the official squared distance, so ties and near-ties resolve identically.
        dist = (flat.pow(2).sum(1, keepdim=True) - 2 * flat @ codebook.t()
                + codebook.pow(2).sum(1, keepdim=True).t())
        indices = (-dist).max(1)[1].reshape(z.shape[0], -1)
        z_q = self.codebook.weight[indices].transpose(1, 2).float()  # raw (un-normalised) code vectors
        z_q = z_e + (z_q - z_e)  # the official straight-through form; kept for bit-identical residuals
        return self.out_proj(z_q).float(), indices

    def decode(self, indices: torch.Tensor) -> torch.Tensor:
        """Map indices ``(B, F)`` to ``(B, D, F)``."""
        return self.out_proj(F.embedding(indices, self.codebook.weight).transpose(1, 2).float()).float()


class ResidualLFQ(nn.Module):
    """``input_proj`` -> Q residual LFQ stages -> ``output_proj``."""

    def __init__(self, config: QuantizerConfig) -> None:
        super().__init__()
        self.config = config
        self.input_proj = _projection(config.input_dim, config.rvq_dim)
        self.output_proj = _projection(config.rvq_dim, config.output_dim)
        self.quantizers = nn.ModuleList(LFQ(config.rvq_dim, config.codebook_size, config.codebook_dim)
                                        for _ in range(config.num_quantizers))

    @torch.no_grad()
    def encode(self, hidden: torch.Tensor, lengths: torch.Tensor, nq: Optional[int] = None) -> torch.Tensor:
        """Quantize encoder output ``(B, D, F)`` with ``lengths (B,)`` into codes ``(Q, B, F)`` int64."""
        nq = nq or self.config.num_quantizers
        z = self.input_proj(hidden.float()).float()
        b, _, f = z.shape
        mask = (torch.arange(f, device=z.device).expand(b, f) < lengths.unsqueeze(1)).unsqueeze(1)
        residual = z.clone()
        codes = []
        for quantizer in list(self.quantizers)[:nq]:
            y, indices = quantizer.quantize(residual * mask)
            residual = residual - y * mask
            codes.append(indices)
        if not codes:
            return torch.empty(0, b, f, device=z.device, dtype=torch.long)
        return torch.stack(codes)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Sum the first Q codebooks' projections for ``codes (Q, B, F)`` and project: ``(B, D_out, F)`` fp32."""
        nq, b, f = codes.shape
        emb = torch.zeros(b, self.config.rvq_dim, f, device=codes.device, dtype=torch.float32)
        for i, quantizer in enumerate(list(self.quantizers)[:nq]):
            emb += quantizer.decode(codes[i])
        return self.output_proj(emb).float()
