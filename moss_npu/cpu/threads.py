"""CPU threads: how many threads torch's intra-op pool, numpy's BLAS and the one-row kernels' pool (the CPU frame
step's matrix-vector products, ``cpu.matvec``) use. One process-wide setting, made by the command lines
(``--num-threads``).

Default (``--num-threads 0``): 1 thread on machines with at most 2 usable physical cores, else one per usable
physical core. On 2 cores the batch-1 frame is memory-bound, so a second thread adds little bandwidth, and
whenever another process takes the other core every parallel region of a 2-thread pool waits for the
descheduled thread. Whatever the setting, a one-slot CPU frame runs torch and numpy's BLAS on one thread
(``ThreadPools``): torch's spinning OpenMP workers and OpenBLAS's threads would otherwise fight over the cores,
while prefill and the codec, which are compute-bound, keep the setting. numpy's BLAS follows torch's count: left
at 2 threads, its still-spinning workers slow a stream's codec calls. The frame's products instead share their
tiles over the setting's threads in the kernels' own pool (``matvec.c``): each thread claims the next tile, so a
thread that another process has descheduled delays a product by one tile, not to the end; batches of several
slots keep those products on one thread (torch's pool is busy then). The default stays 1 thread on 2-core
machines because prefill and the codec still meet the stall above; ``--num-threads 2`` there buys the frames
what two cores read beyond one. The measurements behind each choice: docs/performance.md#threads.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
from threadpoolctl import ThreadpoolController, threadpool_limits


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


class ThreadPools:
    """This process's torch intra-op pool and numpy's BLAS pools, switched for a while and back (each switch
    costs about a microsecond)."""

    def __init__(self) -> None:
        self._blas = [lib for lib in ThreadpoolController().lib_controllers if lib.user_api == "blas"]

    @contextlib.contextmanager
    def limited(self, count: int) -> Iterator[None]:
        """Run the block with at most ``count`` threads in torch and in numpy's BLAS."""
        torch_before, blas_before = torch.get_num_threads(), [lib.num_threads for lib in self._blas]
        if torch_before > count:
            torch.set_num_threads(count)
        for lib, before in zip(self._blas, blas_before):
            if before > count:
                lib.set_num_threads(count)
        try:
            yield
        finally:
            if torch.get_num_threads() != torch_before:
                torch.set_num_threads(torch_before)
            for lib, before in zip(self._blas, blas_before):
                if before > count:
                    lib.set_num_threads(before)
