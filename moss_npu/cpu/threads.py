"""CPU threads: how many threads torch's intra-op pool, numpy's BLAS and the one-row kernels' pool (the CPU frame
step's matrix-vector products, ``cpu.matvec``) use. One process-wide setting, made by the command lines
(``--num-threads``).

Default (``--num-threads 0``): 1 thread on machines with at most 2 usable physical cores, else one per usable
physical core. On 2 cores the batch-1 frame is memory-bound, so a second thread adds little bandwidth, and
whenever another process takes the other core every parallel region of a 2-thread pool waits for the
descheduled thread. Whatever the setting, a one-slot CPU frame runs torch on one thread in the frame's
own thread (``this_thread_limited``): torch's spinning OpenMP workers would otherwise fight the kernels' threads
over the cores, while prefill and the codec, which are compute-bound, keep the setting. numpy's BLAS has one count
per process, set once when the CPU step is built: one thread where one-slot frames multiply through it (no
kernels), else torch's count (its still-spinning workers would slow a stream's codec calls). The frame's products instead share their
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
