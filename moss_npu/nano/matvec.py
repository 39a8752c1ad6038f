"""One-row products y = x · W + b for the CPU frame step: float32, bf16 or int8 weights, float32 arithmetic.

A one-slot frame is bound by the bytes its ~116 matrix-vector products read, so its speed is how fast one core
streams them and how few there are. ``matvec.c`` stores each weight in tiles of 256 output columns, row after
row, and keeps a tile's sums in registers: the weights are read once, front to back, in one stream, at about
this core's read bandwidth (faster than numpy's OpenBLAS GEMV on a transposed copy, and than torch's ``linear``,
which goes to MKL's GEMM). bf16 (half the bytes) and int8 (a quarter, with
per-column scales) are widened to float32 in registers, so their sums and activations keep float32 precision;
neither torch nor oneDNN has a one-row kernel for them that beats the float32 GEMV on twice the bytes here,
and torch's int8 weight-only kernel rounds the activations to bf16.
int8's widening costs arithmetic where bf16's is two instructions. Measured figures:
docs/performance.md#measurements-behind-the-cpu-steps-choices.

The kernels are compiled at first use with the system C compiler and kept in the user cache (``moss_npu.native``:
``-O3 -march=native``, so AVX-512 where the CPU has it, portable C the compiler vectorizes elsewhere). Without a
compiler ``MatVecKernels.load`` raises ``KernelUnavailable`` saying why; the CPU step then keeps numpy's GEMV
(``BlasGemv``).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from moss_npu.native import FLAGS, load_library

SOURCE = Path(__file__).with_name("matvec.c")
TILE = 256  # output columns per tile (matvec.c): matrices are padded to a multiple
GROUP = 32  # bf16 columns interleaved together in a tile row (matvec.c)
_POINTER, _LONG = ctypes.c_void_p, ctypes.c_long
Allocate = Callable[[tuple, type], np.ndarray]  # (shape, dtype) -> an uninitialized array (np.empty's contract)


class MatVecKernels:
    """The compiled kernels of ``matvec.c`` (``load``), called by ``Fp32Tiles``, ``Bf16Tiles`` and ``Int8Tiles``."""

    def __init__(self, library: ctypes.CDLL, built: Optional[str] = None) -> None:
        self._library = library
        self.built = built  # where this load compiled them (PRIVATE: a temporary folder), None if cached
        self.f32, self.bf16, self.int8 = library.matvec_f32, library.matvec_bf16, library.matvec_int8
        for function in (self.f32, self.bf16):
            function.argtypes, function.restype = [_POINTER] * 5 + [_LONG, _LONG], None
        self.int8.argtypes, self.int8.restype = [_POINTER] * 6 + [_LONG, _LONG], None
        self.int8_rows = library.matvec_int8_rows
        self.int8_rows.argtypes, self.int8_rows.restype = [_POINTER] * 6 + [_LONG, _LONG, _LONG], None

    @classmethod
    def load(cls, cache: Optional[Path] = None, flags: tuple[str, ...] = FLAGS) -> "MatVecKernels":
        """Return the kernels, compiled with ``flags`` into ``cache/kernels`` (default: the user cache) unless
        already there (``native.load_library``: an unwritable or missing cache folder builds them in a temporary
        folder for this process). Raises KernelUnavailable where they cannot be built."""
        library, built = load_library(SOURCE, cache, flags)
        return cls(library, built)


def _padded(columns: int) -> int:
    return -(-columns // TILE) * TILE


def table_bytes(weight: torch.Tensor, itemsize: int) -> int:
    """Return the bytes of the kernel's table for an (out, in) ``weight`` of ``itemsize``-byte values."""
    return weight.shape[1] * _padded(weight.shape[0]) * itemsize


def _pad_vector(values: Optional[torch.Tensor], columns: int) -> np.ndarray:
    out = np.zeros(_padded(columns), np.float32)
    if values is not None:
        out[:columns] = values.detach().float().numpy()
    return out


def _fitted(residual: np.ndarray, length: int) -> np.ndarray:
    """Return ``residual`` (..., out) as contiguous float32 rows of the padded ``length`` (a copy only where
    needed)."""
    if residual.shape[-1] == length and residual.dtype == np.float32 and residual.flags.c_contiguous:
        return residual
    padded = np.zeros((*residual.shape[:-1], length), np.float32)
    padded[..., :residual.shape[-1]] = residual
    return padded


class _Tiles:
    """A weight in one of matvec.c's tiled formats, multiplied by one float32 row at a time (``__call__``).

    ``weight`` (out, in) holds the stored values (float32, bf16 bits, int8), copied once into memory from
    ``allocate`` (``cpu_step.PageArena``: huge pages) as tiles: (out / TILE, in, TILE), the columns padded with
    zeros; ``order`` rearranges each tile row's columns (bf16's interleave). ``extra`` are the kernel's
    per-column vectors before the bias (int8's scales).
    """

    def __init__(self, call, weight: torch.Tensor, bias: Optional[torch.Tensor], allocate: Allocate,
                 *extra: np.ndarray, order: Callable[[torch.Tensor], torch.Tensor] = lambda rows: rows) -> None:
        self.out_features, self.in_features = weight.shape
        self._columns = _padded(self.out_features)
        weight = weight.contiguous()
        if self._columns != self.out_features:
            weight = torch.cat([weight, weight.new_zeros(self._columns - self.out_features, self.in_features)])
        rows = order(weight.view(self._columns // TILE, TILE, self.in_features).transpose(1, 2))  # (tiles, in, TILE)
        bits = rows.dtype == torch.bfloat16
        self.values = allocate(tuple(rows.shape), np.uint16 if bits else rows.numpy().dtype)
        target = torch.from_numpy(self.values.view(np.int16) if bits else self.values)
        target.copy_(rows.view(torch.int16) if bits else rows)  # torch's blocked transpose: ~10x numpy's here
        self._vectors = (*extra, _pad_vector(bias, self.out_features))  # kept alive: the kernel reads them
        self._call, self._pointers = call, (self.values.ctypes.data, *(v.ctypes.data for v in self._vectors))

    def __call__(self, x: np.ndarray, residual: Optional[np.ndarray] = None) -> np.ndarray:
        """Return the (out,) product of a float32 row ``x`` (in,); ``residual`` (out,) is added."""
        x = np.ascontiguousarray(x, np.float32)
        y = np.empty(self._columns, np.float32)
        residual = None if residual is None else _fitted(residual, self._columns)
        self._call(x.ctypes.data, *self._pointers, None if residual is None else residual.ctypes.data,
                   y.ctypes.data, self.in_features, self._columns)
        return y[:self.out_features]


class Fp32Tiles(_Tiles):
    """``x @ weightᵀ + bias (+ residual)`` for one float32 row, the (out, in) weight in float32 tiles: one stream
    through the weights, at this core's read bandwidth."""

    def __init__(self, kernels: MatVecKernels, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 allocate: Allocate = np.empty) -> None:
        super().__init__(kernels.f32, weight.detach().float(), bias, allocate)


def _interleave(rows: torch.Tensor) -> torch.Tensor:
    """Each group of 32 columns of (tiles, in, TILE) ``rows`` as [c0, c16, c1, c17, ...] (matvec.c's bf16)."""
    tiles, in_features, _ = rows.shape
    return rows.reshape(tiles, in_features, TILE // GROUP, 2, GROUP // 2).transpose(3, 4)


class Bf16Tiles(_Tiles):
    """``x @ weightᵀ + bias (+ residual)`` for one float32 row, the weight held as bf16 (exact for a weight whose
    values are bf16 already, rounded to nearest otherwise)."""

    def __init__(self, kernels: MatVecKernels, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 allocate: Allocate = np.empty) -> None:
        super().__init__(kernels.bf16, weight.detach().to(torch.bfloat16), bias, allocate,
                         order=lambda rows: _interleave(rows).reshape(rows.shape))


class Int8Tiles(_Tiles):
    """``x @ (values · scale)ᵀ + bias (+ residual)`` for one float32 row, with int8 ``values`` (out, in) and
    per-output float32 ``scale``: the quantized weight (``nano.quantize``) in a quarter of the bytes."""

    def __init__(self, kernels: MatVecKernels, values: torch.Tensor, scale: torch.Tensor,
                 bias: Optional[torch.Tensor], allocate: Allocate = np.empty) -> None:
        super().__init__(kernels.int8, values, bias, allocate, _pad_vector(scale, values.shape[0]))
        self._rows = kernels.int8_rows

    def rows(self, x: np.ndarray, residual: Optional[np.ndarray] = None) -> np.ndarray:
        """Return the (n, out) products of n float32 rows ``x`` (n, in), each bit for bit what ``__call__`` gives
        for that row alone; ``residual`` (n, out) is added."""
        x = np.ascontiguousarray(x, np.float32)
        n = x.shape[0]
        y = np.empty((n, self._columns), np.float32)
        residual = None if residual is None else _fitted(residual, self._columns)
        self._rows(x.ctypes.data, *self._pointers, None if residual is None else residual.ctypes.data,
                   y.ctypes.data, n, self.in_features, self._columns)
        return y if self._columns == self.out_features else np.ascontiguousarray(y[:, :self.out_features])


class BlasGemv:
    """``x @ weight_t + bias (+ residual)`` for one float32 row through numpy's BLAS GEMV, ``weight_t`` (in, out)
    as the weight arena holds it: what one slot's products fall back to where the tiles' kernels cannot be built."""

    def __init__(self, weight_t: np.ndarray, bias: np.ndarray) -> None:
        self.weight_t, self.bias = weight_t, bias

    def __call__(self, x: np.ndarray, residual: Optional[np.ndarray] = None) -> np.ndarray:
        """Return the (out,) product of a float32 row ``x`` (in,); ``residual`` (out,) is added."""
        out = x @ self.weight_t
        out += self.bias
        if residual is not None:
            out += residual
        return out
