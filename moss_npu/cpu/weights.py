"""The CPU step's linear weights behind one interface (``linear(layer) -> (weight, bias)``) in each layout its
products read (transposed float32, the model's own, int8 for torch's kernel or the tiles), and the int8 products.
"""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np
import torch
import torch.nn as nn

from moss_npu.cpu.matvec import Int8Tiles, Prepare, filled
from moss_npu.cpu.prepared import PageArena
from moss_npu.cpu.quantize import int8_rows
from moss_npu.cpu.contract import BlockParts


def layer_bias(layer: nn.Linear) -> torch.Tensor:
    """Return a copy of ``layer``'s bias, or zeros for a layer without one (the products always add one)."""
    return torch.zeros(layer.weight.shape[0]) if layer.bias is None else layer.bias.detach().clone()


class WeightArena:
    """Transposed (in, out) float32 copies of linear weights in one ``PageArena``, in the order a frame reads
    them."""

    def __init__(self, layers: list[nn.Linear]) -> None:
        self._pages = PageArena(sum(PageArena.room(layer.weight.numel() * 4) for layer in layers))
        self._views: dict[nn.Linear, torch.Tensor] = {}
        for layer in layers:
            out_features, in_features = layer.weight.shape
            view = torch.from_numpy(self._pages.array((in_features, out_features), np.float32))
            view.copy_(layer.weight.detach().t())
            self._views[layer] = view

    def linear(self, layer: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``layer``'s transposed weight (a view into the arena) and its bias."""
        return self._views[layer], layer_bias(layer)

    def nbytes(self) -> int:
        return self._pages.nbytes()


class ModelWeights:
    """The model's own linear weights as transposed (in, out) views, no copy: ``WeightArena``'s interface for a
    CPU step whose one-row products have their own tiles (``matvec``)."""

    def linear(self, layer: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``layer``'s weight as an (in, out) view and its bias."""
        return layer.weight.detach().t(), layer_bias(layer)

    def nbytes(self) -> int:
        return 0


class Int8Weights:
    """The int8 values, float32 scales and bias of each block linear of an int8-quantized model, for
    ``int8_matmul``; values and scales are arrays from ``prepare``, rounded only where it fills them."""

    def __init__(self, layers: list[nn.Linear], prepare: Prepare = filled) -> None:
        self._weights = {}
        for layer in layers:
            # the rounded weights give back their own grid
            rounded = functools.cache(lambda layer=layer: int8_rows(layer.weight.detach()))
            out_features, in_features = layer.weight.shape
            values = prepare((out_features, in_features), np.int8,
                             lambda out, rounded=rounded: torch.from_numpy(out).copy_(rounded()[0]))
            scale = prepare((out_features,), np.float32,
                            lambda out, rounded=rounded: torch.from_numpy(out).copy_(rounded()[1]))
            unit = torch.ones(out_features, dtype=torch.bfloat16)
            self._weights[layer] = (torch.from_numpy(values), torch.from_numpy(scale), unit)

    @staticmethod
    def arena_bytes(layers: list[nn.Linear]) -> int:
        """Return the arena bytes the values and scales of ``layers`` take."""
        return sum(PageArena.room(layer.weight.numel()) + PageArena.room(layer.weight.shape[0] * 4)
                   for layer in layers)

    def linear(self, layer: nn.Linear) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Return ``layer``'s (values, scales, unit scales) and its bias."""
        return self._weights[layer], layer_bias(layer)

    def nbytes(self) -> int:
        return sum(v.numel() + s.numel() * 4 + u.numel() * 2 for v, s, u in self._weights.values())


def int8_matmul(x: torch.Tensor, weight: tuple[torch.Tensor, ...], bias: torch.Tensor,
                residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Return ``x @ (values · scale)ᵀ + bias (+ residual)`` with int8 ``values``: bf16 activations into torch's
    int8 weight-only kernel (unit scales), the float32 scales applied to its output."""
    values, scale, unit = weight
    out = torch.addcmul(bias, torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), values, unit).float(), scale)
    return out if residual is None else out.add_(residual)


class Int8TileWeights:
    """``Int8Weights``' interface over the one-slot frames' int8 tiles (``matvec.Int8Tiles``, bias included), so
    that several rows get row for row the same sums."""

    def __init__(self, tiles: dict) -> None:
        self._tiles = tiles

    def linear(self, layer: nn.Linear) -> tuple[Int8Tiles, torch.Tensor]:
        return self._tiles[layer], layer_bias(layer)

    def nbytes(self) -> int:
        return 0  # the tiles are counted with the tile arena


def int8_tile_matmul(x: torch.Tensor, tiles: Int8Tiles, bias: torch.Tensor,
                     residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Return ``x @ (values · scale)ᵀ + bias (+ residual)`` for (n, in) rows through the int8 tiles (which hold
    the bias): float32 activations, each row what a one-slot frame computes for it."""
    rows = np.ascontiguousarray(x.detach().numpy())
    return torch.from_numpy(tiles.rows(rows, None if residual is None else np.ascontiguousarray(residual.numpy())))


def block_weights(block: BlockParts, weights) -> tuple:
    return (block.ln_1.weight.detach(), block.ln_1.bias.detach(), *weights.linear(block.c_attn),
            *weights.linear(block.c_proj), block.ln_2.weight.detach(), block.ln_2.bias.detach(),
            *weights.linear(block.fc_in), *weights.linear(block.fc_out))
