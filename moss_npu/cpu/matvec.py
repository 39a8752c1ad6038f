"""One-row products y = x · W + b for the CPU frame step: float32, bf16 or int8 weights, float32 arithmetic.

A one-slot frame is bound by the bytes its products read. ``matvec.c`` stores each weight in tiles of 64 output
columns, row after row, and keeps a tile's sums in registers, so the weights stream once, front to back; bf16 and
int8 are widened to float32 in registers. Why and by how much: docs/performance.md#cpu-speed. The kernels live in
the package's C library (``moss_npu.native``), which picks the instruction set this CPU runs and shares a
product's tiles over its own thread pool (``KernelThreads``). Without the library ``MatVecKernels.load`` raises
``KernelUnavailable`` and the CPU step keeps numpy's GEMV (``BlasGemv``).
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from moss_npu.cpu.targets import TARGETS, choose_target
from moss_npu.native.library import line_aligned, load_library, require
from moss_npu.cpu.prepared import PageArena
from moss_npu.cpu.quantize import int8_rows

TILE = 64  # output columns per tile (matvec.h): matrices are padded to a multiple
GROUP = 32  # bf16 columns interleaved together in a tile row (matvec_tiles.c)
FORMATS = {"float32": 0, "bfloat16": 1, "int8": 2}  # matvec.c's numbering
_POINTER, _LONG, _INT = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
STORED = {"float32": np.float32, "bfloat16": np.uint16, "int8": np.int8}  # the tiles' numpy dtype per format
# (shape, dtype, fill) -> an array holding the values fill writes (``prepared.PreparedArena.array``'s contract)
Prepare = Callable[[tuple, type, Callable[[np.ndarray], None]], np.ndarray]


class KernelThreads:
    """The library's pool of threads that shares a product's tiles out (``matvec.c``): ``size`` threads, the caller
    included, of which the products use ``use(n)`` plus what ``lend`` adds; grown on demand, freed with this
    object; one caller thread (``lend`` may come from any)."""

    def __init__(self, library: ctypes.CDLL, size: int) -> None:
        self._library = library
        library.moss_pool_new.argtypes, library.moss_pool_new.restype = [_INT], _POINTER
        library.moss_pool_free.argtypes, library.moss_pool_free.restype = [_POINTER], None
        library.moss_pool_threads.argtypes, library.moss_pool_threads.restype = [_POINTER], _INT
        library.moss_pool_use.argtypes, library.moss_pool_use.restype = [_POINTER, _INT], None
        self._lock = threading.Lock()  # lend's thread against the caller's: the handle, the counts
        self.handle, self.size, self.own, self.lent, self.lendable = None, 0, 1, 0, True
        self._retired: list[int] = []  # pools outgrown: freed with this object, as a product may still run on one
        self._start(max(1, size))
        self.use(1)

    def _start(self, size: int) -> None:
        """Replace the pool by one of ``size`` threads; where they cannot start, keep the old one and raise. The old
        one stays until this object goes (its workers asleep): another thread's product may be running on it."""
        handle = self._library.moss_pool_new(size)
        if not handle:
            raise MemoryError(f"cannot start {size} kernel threads")
        if self.handle:
            self._retired.append(self.handle)
        self.handle, self.size = handle, self._library.moss_pool_threads(handle)

    def _stop(self) -> None:
        handles, self.handle, self._retired = [self.handle, *self._retired], None, []
        for handle in handles:
            if handle:
                self._library.moss_pool_free(handle)

    @property
    def wanted(self) -> int:
        """The threads the products ask for: their own, plus those lent where they take them."""
        return self.own + (self.lent if self.lendable else 0)

    @property
    def used(self) -> int:
        """The threads the next product is shared over: as many as wanted, within the pool."""
        return min(self.size, self.wanted)

    def use(self, count: int, lendable: bool = True) -> None:
        """Share the products that follow over ``count`` threads (at least 1), plus those lent (``lend``) unless
        not ``lendable``; the pool grows to that many (from the caller's thread only: a pool is restarted to grow)."""
        with self._lock:
            self.own, self.lendable = max(1, count), lendable
            if self.wanted > self.size:
                self._start(self.wanted)
            self._library.moss_pool_use(self.handle, self.used)

    def lend(self, count: int) -> None:
        """Add ``count`` threads (0: none) to the products from the next one on, from any thread, up to the pool's
        size (the caller's next ``use`` grows it): cores that another thread of the process leaves idle, taken
        back with ``lend(0)`` before that thread needs them (a worker left out sleeps until taken in, ``matvec.c``)."""
        with self._lock:
            self.lent = max(0, count)
            self._library.moss_pool_use(self.handle, self.used)

    def __del__(self) -> None:
        if getattr(self, "handle", None):
            self._stop()


class MatVecKernels:
    """The C library's kernels (``load``) behind the ``Tiles``: ``target`` is the instruction set they run
    (``targets.choose_target``), ``threads`` the pool they share products over."""

    def __init__(self, library: ctypes.CDLL, built: Optional[str] = None, threads: int = 1) -> None:
        self.library = library
        self.built = built  # where this load compiled them (PRIVATE: a temporary folder), None if installed/cached
        self.target = choose_target(library)
        self.target_index = TARGETS.index(self.target)
        self._call = library.moss_matvec
        self._call.argtypes = [_POINTER, _INT, _INT] + [_POINTER] * 6 + [_LONG] * 3
        self._call.restype = _INT
        # fused_block.c's (``cpu.fused_block``): pool, block, x, rotation, keys, values, rows, position,
        # attended, qkv, scratch
        library.moss_row_block.argtypes = [_POINTER, _POINTER] + [_POINTER] * 4 + [_LONG] * 3 + [_POINTER] * 2
        library.moss_row_block.restype = _INT
        library.moss_row_block_scratch.argtypes, library.moss_row_block_scratch.restype = [_POINTER, _LONG], _LONG
        self.threads = KernelThreads(library, threads)

    @classmethod
    def load(cls, cache: Optional[Path] = None, threads: int = 1) -> "MatVecKernels":
        """Return the kernels of ``native.library.load_library(cache)`` with a pool of ``threads`` threads; raises
        KernelUnavailable where there is no library."""
        library, built = load_library(cache)
        return cls(library, built, threads)

    def multiply(self, format: str, x: np.ndarray, table: np.ndarray, vectors: tuple, residual: Optional[np.ndarray],
                 y: np.ndarray, rows: int, in_features: int, columns: int) -> None:
        """Run the product of checked arrays: ``y`` (rows, columns) = ``x`` (rows, in) times the ``format`` tiles of
        ``table``, finished with ``vectors`` (scale, bias: int8; bias otherwise) and ``residual``."""
        scale, bias = vectors if len(vectors) == 2 else (None, vectors[0])
        status = self._call(self.threads.handle, self.target_index, FORMATS[format], x.ctypes.data, table.ctypes.data,
                            None if scale is None else scale.ctypes.data, bias.ctypes.data,
                            None if residual is None else residual.ctypes.data, y.ctypes.data, rows, in_features,
                            columns)
        if status != 0:
            raise ValueError(f"the {format} kernel refused a product of {rows} × {in_features} → {columns}")


def _padded(columns: int) -> int:
    return -(-columns // TILE) * TILE


def tile_bytes(weight: torch.Tensor, format: str) -> int:
    """Return the arena bytes of ``weight``'s tiles in ``format``, int8's scales included."""
    table = PageArena.room(weight.shape[1] * _padded(weight.shape[0]) * np.dtype(STORED[format]).itemsize)
    return table + (PageArena.room(_padded(weight.shape[0]) * 4) if format == "int8" else 0)


def filled(shape: tuple, dtype, fill: Callable[[np.ndarray], None]) -> np.ndarray:
    """``Prepare`` without an arena: a new array, filled by ``fill``."""
    out = np.empty(shape, dtype)
    fill(out)
    return out


def _pad_vector(values: Optional[torch.Tensor], columns: int) -> np.ndarray:
    out = np.zeros(_padded(columns), np.float32)
    if values is not None:
        out[:columns] = values.detach().float().numpy()
    return out


def _fitted(residual: np.ndarray, length: int) -> np.ndarray:
    """Return ``residual`` (..., out) as contiguous float32 rows of the padded ``length`` (copied where needed)."""
    if residual.shape[-1] == length and residual.dtype == np.float32 and residual.flags.c_contiguous:
        return residual
    padded = np.zeros((*residual.shape[:-1], length), np.float32)
    padded[..., :residual.shape[-1]] = residual
    return padded


class Tiles:
    """A weight in one of the library's tiled formats, multiplied by one float32 row at a time (``__call__``).

    ``values()`` gives the (out, in) stored values, laid out as zero-padded tiles (out / TILE, in, TILE) in an
    array from ``prepare`` (a cached arena holds them already: ``values`` is then never called); ``order``
    rearranges each tile row's columns (bf16's interleave); ``extra`` are per-column vectors before the bias.
    """

    def __init__(self, kernels: MatVecKernels, format: str, shape: tuple[int, int],
                 values: Callable[[], torch.Tensor], bias: Optional[torch.Tensor], prepare: Prepare,
                 *extra: np.ndarray, order: Callable[[torch.Tensor], torch.Tensor] = lambda rows: rows) -> None:
        self.out_features, self.in_features = shape
        self._columns = _padded(self.out_features)
        tiled = (self._columns // TILE, self.in_features, TILE)

        def fill(out: np.ndarray) -> None:
            weight = values().contiguous()
            if self._columns != self.out_features:
                weight = torch.cat([weight, weight.new_zeros(self._columns - self.out_features, self.in_features)])
            rows = order(weight.view(tiled[0], TILE, self.in_features).transpose(1, 2))  # (tiles, in, TILE)
            bits = rows.dtype == torch.bfloat16
            target = torch.from_numpy(out.view(np.int16) if bits else out)
            target.copy_(rows.view(torch.int16) if bits else rows)  # torch's blocked transpose: faster than numpy's

        self.values = prepare(tiled, STORED[format], fill)
        require(self.values, STORED[format], tiled, "tiles")
        self._vectors = (*extra, _pad_vector(bias, self.out_features))  # kept alive: the kernel reads them
        self._kernels, self.format = kernels, format

    def fields(self) -> tuple[int, Optional[int], int, int, int]:
        """Return what ``fused_block`` reads of this product: the addresses of the tiles, the scales (int8) or None
        and the bias, the inputs and the padded outputs."""
        scale = self._vectors[0].ctypes.data if len(self._vectors) == 2 else None
        return self.values.ctypes.data, scale, self._vectors[-1].ctypes.data, self.in_features, self._columns

    def __call__(self, x: np.ndarray, residual: Optional[np.ndarray] = None) -> np.ndarray:
        """Return the (out,) product of a float32 row ``x`` (in,); ``residual`` (out,) is added. Both must be
        C-contiguous float32 (ValueError otherwise)."""
        return self._product(x, residual, ())

    def _product(self, x: np.ndarray, residual: Optional[np.ndarray], rows: tuple[int, ...]) -> np.ndarray:
        """The products of ``x`` (*rows, in), ``rows`` () for one row or (n,) for n."""
        require(x, np.float32, (*rows, self.in_features), "x")
        if residual is not None:
            require(residual, np.float32, (*rows, self.out_features), "residual")
            residual = _fitted(residual, self._columns)
        count = math.prod(rows)
        y = line_aligned(count * self._columns).reshape(*rows, self._columns)  # the threads' tiles
        self._kernels.multiply(self.format, x, self.values, self._vectors, residual, y, count, self.in_features,
                               self._columns)
        return y if self._columns == self.out_features else np.ascontiguousarray(y[..., :self.out_features])


class Fp32Tiles(Tiles):
    """``x @ weightᵀ + bias (+ residual)`` for one float32 row, the (out, in) weight in float32 tiles."""

    def __init__(self, kernels: MatVecKernels, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 prepare: Prepare = filled) -> None:
        super().__init__(kernels, "float32", tuple(weight.shape), lambda: weight.detach().float(), bias, prepare)


def _interleave(rows: torch.Tensor) -> torch.Tensor:
    """Each group of 32 columns of (tiles, in, TILE) ``rows`` as [c0, c16, c1, c17, ...] (matvec.c's bf16)."""
    tiles, in_features, _ = rows.shape
    return rows.reshape(tiles, in_features, TILE // GROUP, 2, GROUP // 2).transpose(3, 4)


class Bf16Tiles(Tiles):
    """``x @ weightᵀ + bias (+ residual)`` for one float32 row, the weight held as bf16 (exact for a weight whose
    values are bf16 already, rounded to nearest otherwise)."""

    def __init__(self, kernels: MatVecKernels, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 prepare: Prepare = filled) -> None:
        super().__init__(kernels, "bfloat16", tuple(weight.shape), lambda: weight.detach().to(torch.bfloat16), bias,
                         prepare, order=lambda rows: _interleave(rows).reshape(rows.shape))


class Int8Tiles(Tiles):
    """``x @ (values · scale)ᵀ + bias (+ residual)`` for one float32 row, with int8 ``values`` (out, in) and
    per-output float32 ``scale``: the quantized weight (``cpu.quantize``) in a quarter of the bytes."""

    def __init__(self, kernels: MatVecKernels, values: torch.Tensor, scale: torch.Tensor,
                 bias: Optional[torch.Tensor], prepare: Prepare = filled) -> None:
        self._tile(kernels, tuple(values.shape), lambda: (values, scale), bias, prepare)

    @classmethod
    def rounded(cls, kernels: MatVecKernels, weight: torch.Tensor, bias: Optional[torch.Tensor],
                prepare: Prepare = filled) -> "Int8Tiles":
        """Return the tiles of float ``weight`` rounded to int8 (``quantize.int8_rows``) where ``prepare`` fills
        them."""
        tiles = cls.__new__(cls)
        tiles._tile(kernels, tuple(weight.shape), functools.cache(lambda: int8_rows(weight.detach())), bias, prepare)
        return tiles

    def _tile(self, kernels: MatVecKernels, shape: tuple[int, int],
              quantized: Callable[[], tuple[torch.Tensor, torch.Tensor]], bias: Optional[torch.Tensor],
              prepare: Prepare) -> None:
        def fill(out: np.ndarray) -> None:
            out[:] = _pad_vector(quantized()[1], shape[0])

        scale = prepare((_padded(shape[0]),), np.float32, fill)
        super().__init__(kernels, "int8", shape, lambda: quantized()[0], bias, prepare, scale)

    def rows(self, x: np.ndarray, residual: Optional[np.ndarray] = None) -> np.ndarray:
        """Return the (n, out) products of n float32 rows ``x`` (n, in), each bit for bit what ``__call__`` gives
        for that row alone; ``residual`` (n, out) is added. Both must be C-contiguous float32."""
        if not isinstance(x, np.ndarray) or x.ndim != 2:
            raise ValueError(f"x: (n, {self.in_features}) rows expected, got {getattr(x, 'shape', type(x))}")
        return self._product(x, residual, x.shape[:1])


class BlasGemv:
    """``x @ weight_t + bias (+ residual)`` for one float32 row through numpy's GEMV, ``weight_t`` (in, out): one
    slot's products where the kernels cannot be built."""

    def __init__(self, weight_t: np.ndarray, bias: np.ndarray) -> None:
        self.weight_t, self.bias = weight_t, bias

    def __call__(self, x: np.ndarray, residual: Optional[np.ndarray] = None) -> np.ndarray:
        """Return the (out,) product of a float32 row ``x`` (in,); ``residual`` (out,) is added."""
        out = x @ self.weight_t
        out += self.bias
        if residual is not None:
            out += residual
        return out
