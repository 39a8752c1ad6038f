"""One-row products y = x · W + b for the CPU frame step: float32, bf16 or int8 weights, float32 arithmetic.

A one-slot frame is bound by the bytes its ~116 matrix-vector products read, so its speed is how fast one core
streams them and how few there are. ``matvec.c`` stores each weight in tiles of 256 output columns, row after
row, and keeps a tile's sums in registers: the weights are read once, front to back, in one stream, at about
this core's read bandwidth (≈30 GB/s on a 2-vCPU EPYC, against ≈21 for numpy's OpenBLAS GEMV on a transposed
copy and ≈13 for torch's ``linear``, which goes to MKL's GEMM). bf16 (half the bytes) and int8 (a quarter, with
per-column scales) are widened to float32 in registers, so their sums and activations keep float32 precision;
neither torch nor oneDNN has a one-row kernel for them that beats the float32 GEMV on twice the bytes here,
and torch's int8 weight-only kernel rounds the activations to bf16.
Measured, real-size model, 1 thread, a frame's products: float32 23 ms (numpy's GEMV 27–31), bf16 10, int8 10
(its widening costs arithmetic where bf16's is two instructions).

The kernels are compiled at first use with the system C compiler (``$CC``, else ``cc``; ``-O3 -march=native``:
AVX-512 where the CPU has it, portable C the compiler vectorizes elsewhere; ``-mcpu=native`` or neither where the
compiler refuses it) into the user cache
(``moss_npu.cache_dir``, ``kernels/``), named by the source, the flags, the compiler and this CPU, and loaded
with ctypes (~0.4 s once, then milliseconds). Without a compiler ``MatVecKernels.load`` raises
``KernelUnavailable`` saying why; the CPU step then keeps numpy's GEMV (``BlasGemv``).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from moss_npu.cache_dir import default_cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("matvec.c")
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")
TILE = 256  # output columns per tile (matvec.c): matrices are padded to a multiple
GROUP = 32  # bf16 columns interleaved together in a tile row (matvec.c)
PRIVATE = "a temporary folder"  # MatVecKernels.built where the cache was unusable: compiled at every start
_POINTER, _LONG = ctypes.c_void_p, ctypes.c_long
Allocate = Callable[[tuple, type], np.ndarray]  # (shape, dtype) -> an uninitialized array (np.empty's contract)


class KernelUnavailable(RuntimeError):
    """The kernels could not be built or loaded here (no compiler, a failed build); the message says why."""


def _cpu_identity() -> str:
    """What ``-march=native`` depends on: the machine and, on Linux, the CPU's model and feature flags."""
    parts = [platform.machine()]
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part"):
                parts.append(line)
                if len(parts) > 4:
                    break
    except OSError:
        parts.append(platform.processor())
    return "\n".join(parts)


def _compiler() -> tuple[list[str], str]:
    """Return the C compiler command to use and its version line; raise KernelUnavailable without one.

    ``$CC`` is read as make reads it, a command that may carry options ("ccache gcc", "zig cc"); a path with
    spaces that names a program is taken whole.
    """
    name = os.environ.get("CC") or "cc"
    try:
        words = [name] if shutil.which(name) else shlex.split(name)
    except ValueError:  # unbalanced quotes: not a command
        words = [name]
    path = shutil.which(words[0]) if words else None
    if path is None:
        raise KernelUnavailable(f"no C compiler ({name!r} is not on PATH; install gcc or set $CC)")
    command = [path, *words[1:]]
    try:
        version = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"the C compiler {path} does not run ({exc})") from exc
    return command, (version.splitlines() or [""])[0]


def _native_variants(flags: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Return ``flags``, then, where they hold ``-march=native``, the same with ``-mcpu=native`` (gcc on POWER, which
    refuses ``-march``) and with neither (a compiler that knows no "this CPU"): tried in turn until one builds."""
    if "-march=native" not in flags:
        return [flags]
    swapped = tuple("-mcpu=native" if f == "-march=native" else f for f in flags)
    return [flags, swapped, tuple(f for f in flags if f != "-march=native")]


def _build(compiler: list[str], target: Path, flags: tuple[str, ...]) -> None:
    """Compile ``SOURCE`` into ``target`` through a temporary file beside it (readers never see half a file)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=target.parent, prefix=target.stem, suffix=".partial")
    os.close(handle)
    try:
        failures = []
        for variant in _native_variants(flags):
            done = subprocess.run([*compiler, *variant, "-o", partial, str(SOURCE)], capture_output=True, text=True,
                                  timeout=300)
            if done.returncode == 0:
                break
            failures.append(done)
        else:  # the first attempt's message: the others differ from it only by the flag
            first = (failures[0].stderr.strip().splitlines() or ["no message"])[0]
            raise KernelUnavailable(f"compiling {SOURCE.name} failed: {first}")
        os.chmod(partial, 0o755)  # mkstemp makes 0600: another user sharing the cache loads it too
        os.replace(partial, target)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"compiling {SOURCE.name} failed ({exc})") from exc
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


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
        already there.

        An unwritable or missing cache folder builds them in a temporary folder for this process instead.
        Raises KernelUnavailable where they cannot be built.
        """
        compiler, version = _compiler()
        key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(flags), " ".join(compiler), version,
                                        _cpu_identity()]).encode()).hexdigest()[:16]
        root = cache if cache is not None else default_cache_dir()
        if root is not None:
            target = Path(root) / "kernels" / f"matvec-{key}.so"
            try:
                if target.is_file():
                    try:
                        return cls(ctypes.CDLL(str(target)))
                    except OSError:  # a damaged file (truncated, overwritten): build it again
                        log.warning("kernel cache file %s is damaged; building it again", target)
                _build(compiler, target, flags)
                try:
                    return cls(ctypes.CDLL(str(target)), built=str(target.parent))
                except OSError:  # not loadable here (a folder mounted noexec, $CC for another machine): not kept
                    target.unlink(missing_ok=True)
                    raise
            except OSError as exc:  # an unwritable folder: build privately below
                log.debug("kernel cache %s unusable (%s); building in a temporary folder", target.parent, exc)
        with tempfile.TemporaryDirectory(prefix="moss-npu-kernels-") as folder:
            target = Path(folder) / f"matvec-{key}.so"
            _build(compiler, target, flags)
            try:
                return cls(ctypes.CDLL(str(target)), built=PRIVATE)  # the mapping outlives the file
            except OSError as exc:
                raise KernelUnavailable(f"the compiled {SOURCE.stem} library does not load ({exc})") from exc


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
    through the weights, at this core's read bandwidth (≈30 GB/s measured, against ≈21 for numpy's GEMV on the
    transposed weight)."""

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
