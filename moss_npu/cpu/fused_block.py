"""One slot's transformer block on one new row in one call of the package's C library (``fused_block.c``).

``FusedRowBlock`` is ``blocks.row_block`` with its small operations (norms, RoPE, the cache write, attention, GELU)
in C beside the four products, which go through the same tiles and pool (``matvec``); the attention is shared
over the pool head by head (docs/performance.md#cpu-speed). Results agree with ``row_block`` to float rounding.
Shapes: E hidden, H heads, D head dim, F inner, M cache rows.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import numpy as np

from moss_npu.cpu.blocks import RowBlock
from moss_npu.cpu.matvec import FORMATS, MatVecKernels, Tiles
from moss_npu.native.library import line_aligned, require

_POINTER, _LONG, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float


class _Product(ctypes.Structure):
    """fused_block.c's Product: one product's tiles, per-column vectors and sizes."""

    _fields_ = [("w", _POINTER), ("scale", _POINTER), ("bias", _POINTER), ("in_features", _LONG),
                ("columns", _LONG)]


class _Block(ctypes.Structure):
    """fused_block.c's Block: what the call needs of one block besides the row and the cache."""

    _fields_ = [("target", _INT), ("format", _INT), ("embed", _LONG), ("heads", _LONG), ("inner", _LONG),
                ("eps", _FLOAT), ("scale", _FLOAT), ("ln1_w", _POINTER), ("ln1_b", _POINTER), ("ln2_w", _POINTER),
                ("ln2_b", _POINTER), ("attn", _Product), ("proj", _Product), ("fc_in", _Product),
                ("fc_out", _Product), ("final_w", _POINTER), ("final_b", _POINTER)]


class _Places(ctypes.Structure):
    """fused_block.h's Places: each new row's position, attended rows and rotation (stride 1: a row each)."""

    _fields_ = [("positions", _POINTER), ("attended", _POINTER), ("rotation", _POINTER), ("stride", _LONG)]


class FusedRowBlock:
    """``blocks.row_block`` for one block whose four products are ``matvec`` tiles of one format, in one C call.

    ``block`` is kept alive here (the library reads its arrays); ``final`` is the decoder's final norm (weight,
    bias) after its last block, or None. ValueError for a block it cannot run (no tiles, mixed formats, shapes
    that do not chain).
    """

    def __init__(self, kernels: MatVecKernels, block: RowBlock, *, heads: int, eps: float, scale: float,
                 final: Optional[tuple[np.ndarray, np.ndarray]] = None) -> None:
        products = (block.attn, block.proj, block.fc_in, block.fc_out)
        if not all(isinstance(p, Tiles) for p in products):
            raise ValueError("a fused block needs every product in tiles (the kernels)")
        formats = {p.format for p in products}
        if len(formats) != 1:
            raise ValueError(f"a fused block needs one tile format, got {sorted(formats)}")
        e, f = block.attn.in_features, block.fc_in.out_features
        shapes = [(p.out_features, p.in_features) for p in products]
        if shapes != [(3 * e, e), (e, e), (f, e), (e, f)] or e % heads or (e // heads) % 2:
            raise ValueError(f"block products {shapes} with {heads} heads do not chain as a GPT-2 block")
        norms = (block.ln1_w, block.ln1_b, block.ln2_w, block.ln2_b, *(final or ()))
        for name, array in zip(("ln_1 weight", "ln_1 bias", "ln_2 weight", "ln_2 bias", "final norm weight",
                                "final norm bias"), norms):
            require(array, np.float32, (e,), name)
        self._kernels, self._kept = kernels, (block, final)
        self.embed, self.heads, self.dim = e, heads, e // heads
        self._spec = _Block(kernels.target_index, FORMATS[formats.pop()], e, heads, f, eps, scale,
                            *(a.ctypes.data for a in norms[:4]), *(_Product(*p.fields()) for p in products),
                            *((a.ctypes.data for a in final) if final else (None, None)))
        self._library = kernels.library  # MatVecKernels typed its other fused-block entries
        self._library.moss_block_rows.argtypes = [_POINTER, _POINTER, _LONG] + [_POINTER] * 4 + [_LONG] * 2 + [
            _POINTER] * 2
        self._library.moss_block_rows.restype = _INT

    def __call__(self, x: np.ndarray, rotation: np.ndarray, keys: np.ndarray, values: np.ndarray, position: int,
                 attended: int, qkv: Optional[np.ndarray] = None) -> np.ndarray:
        """Return the block's output (E,) for the row ``x`` (E,), writing its key and value at ``position`` of
        ``keys``/``values`` (H, M, D) and attending to their first ``attended`` rows; ``rotation`` (D/2,)
        complex64, ``qkv`` (3E,) as in ``row_block``. Every array and index is checked first (ValueError)."""
        e = self.embed
        require(x, np.float32, (e,), "x")
        if not isinstance(keys, np.ndarray) or keys.ndim != 3:
            raise ValueError(f"keys: an (H, M, D) cache expected, got {getattr(keys, 'shape', type(keys))}")
        rows = self._check(rotation, keys, values, qkv, (3 * e,), position, attended)
        spec = ctypes.byref(self._spec)
        scratch = line_aligned(self._library.moss_row_block_scratch(spec, attended))
        out = x.copy()
        status = self._library.moss_row_block(self._kernels.threads.handle, spec, out.ctypes.data,
                                              rotation.ctypes.data, keys.ctypes.data, values.ctypes.data, rows,
                                              position, attended, None if qkv is None else qkv.ctypes.data,
                                              scratch.ctypes.data)
        if status != 0:
            raise ValueError(f"the fused block refused a row of {e} at {position} attending {attended}")
        return out

    def rows(self, x: np.ndarray, rotation: np.ndarray, keys: np.ndarray, values: np.ndarray,
             positions: np.ndarray, attended: np.ndarray, qkv: Optional[np.ndarray] = None) -> np.ndarray:
        """``__call__`` for n rows ``x`` (n, E), row r in slot r of ``keys``/``values`` (S >= n, H, M, D) at its
        own ``positions[r]`` attending its first ``attended[r]`` rows (both (n,) int64), rotated by ``rotation``
        (n, D/2) complex64; ``qkv`` (n, 3E) or None. Each tile is read once for all rows, and each row gets the
        bits it gets alone."""
        e, heads, dim = self.embed, self.heads, self.dim
        n = x.shape[0] if getattr(x, "ndim", 0) == 2 else -1
        require(x, np.float32, (n, e), "x")
        if not isinstance(keys, np.ndarray) or keys.ndim != 4 or keys.shape[0] < n:
            raise ValueError(f"keys: an (S >= {n}, H, M, D) cache expected, got {getattr(keys, 'shape', type(keys))}")
        require(positions, np.int64, (n,), "positions")
        require(attended, np.int64, (n,), "attended")
        require(rotation, np.complex64, (n, dim // 2), "rotation")
        rows = self._check(rotation[0], keys, values, qkv, (n, 3 * e), int(positions.min()), int(attended.max()))
        if not (positions < attended).all():
            raise ValueError(f"rows at {positions.tolist()} attending {attended.tolist()}: each must attend itself")
        places = _Places(positions.ctypes.data, attended.ctypes.data, rotation.ctypes.data, 1)
        spec = ctypes.byref(self._spec)
        scratch = line_aligned(n * self._library.moss_row_block_scratch(spec, int(attended.max())))
        out = x.copy()
        status = self._library.moss_block_rows(self._kernels.threads.handle, spec, n, out.ctypes.data,
                                               ctypes.byref(places), keys.ctypes.data, values.ctypes.data,
                                               heads * rows * dim, rows, None if qkv is None else qkv.ctypes.data,
                                               scratch.ctypes.data)
        if status != 0:
            raise ValueError(f"the fused block refused {n} rows of {e} at {positions.tolist()}")
        return out

    def _check(self, rotation: np.ndarray, keys: np.ndarray, values: np.ndarray, qkv: Optional[np.ndarray],
               qkv_shape: tuple[int, ...], position: int, attended: int) -> int:
        """Check the arrays besides the rows (ValueError); return the cache's rows M."""
        require(rotation, np.complex64, (self.dim // 2,), "rotation")
        rows = keys.shape[-2]
        require(keys, np.float32, (*keys.shape[:-3], self.heads, rows, self.dim), "keys")
        require(values, np.float32, keys.shape, "values")
        if qkv is not None:
            require(qkv, np.float32, qkv_shape, "qkv")
        if not 0 <= position < attended <= rows:
            raise ValueError(f"row {position} attending {attended} rows does not fit a cache of {rows}")
        return rows
