"""Linear weights pre-packed for oneDNN: the fastest fp32 CPU product of a few rows by a weight matrix.

The packed copy (one more copy of the weight, so callers pack only what they multiply that way) goes through the
operators inductor's weight freezing emits (``torch.ops.mkldnn``); a torch without them has ``packing_available()
== False`` and callers keep their plain product. A frame's one row is not packed: the one-row kernels stream plain
weights faster (docs/performance.md#cpu-speed). A prompt's rows are, however few: a row's sums here do not depend on
how many rows share the product.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from moss_npu.checkpoint_layers import CheckpointLinear


def packing_available() -> bool:
    """Whether this torch can pack fp32 weights for oneDNN: it has inductor's packing operators and computes a
    small packed product right (a build without the kernel for this CPU fails this probe, not a request)."""
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")):
        return False
    weight, x = torch.linspace(-1, 1, 24 * 16).view(24, 16), torch.linspace(-2, 2, 5 * 16).view(5, 16)
    try:
        with torch.no_grad():
            return torch.allclose(packed_matmul(x, pack_linear(weight), None), F.linear(x, weight), atol=1e-4)
    except RuntimeError:
        return False


MIN_ROWS = 4  # fewer rows are padded up to this many: oneDNN runs one and two rows through a slower kernel
ROWS_HINT = 16  # the row count every packing is laid out for (as fast as an exact hint at 2-32 rows)


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """Return (out, in) fp32 ``weight`` reordered into oneDNN's blocked layout for ``packed_matmul``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ROWS_HINT)


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Return ``x @ weightᵀ + bias`` for (n, in) fp32 ``x`` and a weight packed by ``pack_linear``."""
    rows = x.shape[0]
    if rows < MIN_ROWS:
        x = torch.cat((x, x.new_zeros(MIN_ROWS - rows, x.shape[1])))
    out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return out if rows >= MIN_ROWS else out[:rows]


class PackedLinear(nn.Module):
    """An ``nn.Linear``'s parameters (the same tensors and names) multiplied through a packed copy of the weight,
    packed again after the weight changes (its version counter or storage moves). Inputs that are not fp32 on the
    CPU, a product that needs gradients (no backward) and an inference-mode weight (no version counter) take
    ``F.linear``."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        # (the weight packed from: holding it keeps its storage's address unique; its version; the packed copy),
        # one attribute so that a thread reads a consistent triple
        self._cache: Optional[tuple[torch.Tensor, int, torch.Tensor]] = None

    def pack(self) -> None:
        """Pack the weight now (at load), so that the first product does not wait for it; nothing for a weight
        that ``forward`` would not pack."""
        w = self.weight
        if w.dtype == torch.float32 and w.device.type == "cpu" and not w.is_inference():
            self._cache = (w.detach(), w._version, pack_linear(w))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.dtype != torch.float32 or w.device.type != "cpu" or w.is_inference():
            self._cache = None  # the weight moved or changed dtype: a packing of its old storage only holds memory
            return F.linear(x, w, self.bias)
        if x.dtype != torch.float32 or x.device.type != "cpu" or (
                torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)):
            return F.linear(x, w, self.bias)
        cache = self._cache
        if cache is None or cache[0].data_ptr() != w.data_ptr() or cache[1] != w._version:
            cache = self._cache = (w.detach(), w._version, pack_linear(w))
        rows = x.reshape(-1, self.in_features)
        return packed_matmul(rows, cache[2], self.bias).view(*x.shape[:-1], self.out_features)

    def __getstate__(self) -> dict:
        """Pickled and deep-copied without the packed copy (an opaque oneDNN tensor has no storage to copy)."""
        return {**self.__dict__, "_cache": None}


def pack_linears(module: nn.Module) -> int:
    """Replace every ``nn.Linear`` inside ``module`` by a ``PackedLinear`` on the same parameters (the state dict is
    unchanged); return how many. Call it only where ``packing_available()``."""
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) in (nn.Linear, CheckpointLinear):
                setattr(parent, name, PackedLinear(child))
                swapped += 1
    return swapped
