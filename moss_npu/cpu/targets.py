"""Which of the C library's instruction sets the one-row kernels run (``matvec.c``'s targets): the fastest this CPU
runs, or the one ``$MOSS_NPU_KERNEL_TARGET`` names."""

from __future__ import annotations

import ctypes
import os

from moss_npu.errors import ConfigError
from moss_npu.native.library import KernelUnavailable, load_library

TARGET_ENV = "MOSS_NPU_KERNEL_TARGET"  # force one of the library's instruction sets (tests, measurements)
TARGETS = ("portable", "avx2", "avx512", "neon")  # matvec.c's numbering
PREFERENCE = ("avx512", "avx2", "neon", "portable")  # the fastest first


def runnable_targets(library: ctypes.CDLL) -> list[str]:
    """Return the instruction sets of ``library``'s kernels that this CPU runs, the fastest first."""
    library.moss_targets.restype, library.moss_targets.argtypes = ctypes.c_int, []
    mask = library.moss_targets()
    return [name for name in PREFERENCE if mask >> TARGETS.index(name) & 1]


def choose_target(library: ctypes.CDLL) -> str:
    """Return the instruction set the kernels run: ``$MOSS_NPU_KERNEL_TARGET`` where set (ConfigError if this CPU or
    library has no such set), else the fastest this CPU runs."""
    runnable = runnable_targets(library)
    forced = os.environ.get(TARGET_ENV, "")
    if forced and forced not in runnable:
        raise ConfigError(f"${TARGET_ENV}={forced!r}: this CPU runs {', '.join(runnable)} (of {', '.join(TARGETS)})")
    return forced or runnable[0]


def kernels_in_use() -> str:
    """Return the instruction set the CPU kernels run in this process (``choose_target``), or ``none`` where the
    library does not load: for reports (eval_accuracy, bench)."""
    try:
        return choose_target(load_library()[0])
    except KernelUnavailable:
        return "none"
