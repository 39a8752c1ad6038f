"""CPU threads: how many threads torch's intra-op pool, numpy's BLAS and the one-row kernels' pool (``cpu.matvec``)
use. One process-wide setting, made by the command lines (``--num-threads``).

Default (``--num-threads 0``): 1 thread on machines with at most 2 usable physical cores (the batch-1 frame is
memory-bound, and a 2-thread pool waits at every parallel region for a thread another process took), else one
per usable physical core. A one-slot frame runs torch on one thread in its own thread (``this_thread_limited``),
so torch's spinning workers leave the cores to the kernels' pool, which shares the frame's products tile by tile
over the setting's threads; prefill and the codec (compute-bound) keep the setting. numpy's BLAS has one count
per process, set once when the CPU step is built. The measurements behind each choice: docs/performance.md#threads.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
from threadpoolctl import threadpool_limits


def usable_physical_cores() -> int:
    """Return the physical cores this process may run on (logical CPUs when the count is unknown)."""
    try:
        import psutil

        physical = psutil.cpu_count(logical=False)
    except ImportError:
        physical = None
    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(physical or logical, logical))


def default_threads() -> int:
    """Return the thread count used when none is asked for (see the module docstring)."""
    cores = usable_physical_cores()
    return 1 if cores <= 2 else cores


def set_threads(count: int = 0) -> int:
    """Use ``count`` threads (0: ``default_threads()``) in torch and in numpy's BLAS; return the count used."""
    count = count or default_threads()
    torch.set_num_threads(count)
    limit_blas(count)
    return count


def use_threads(count: int) -> None:
    """Run this thread's torch ops on ``count`` intra-op threads. Call it first in every thread that runs torch
    ops: the count belongs to each OpenMP thread, so a thread started after ``set_threads`` otherwise runs its
    ops on OpenMP's default (every core) while ``torch.get_num_threads()`` still reports the setting."""
    torch.set_num_threads(count)


def limit_blas(count: int) -> None:
    """Limit numpy's BLAS (OpenBLAS in numpy's wheels) to ``count`` threads."""
    threadpool_limits(limits=count, user_api="blas")


@contextlib.contextmanager
def this_thread_limited(count: int) -> Iterator[None]:
    """Run the block with at most ``count`` torch intra-op threads in the calling thread only (an OpenMP thread's
    own count, ``use_threads``); numpy's BLAS has one count for the whole process, which other threads may be
    using, so it is set when the decoder is built (``cpu.step``), never around a frame."""
    before = torch.get_num_threads()
    if before <= count:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
