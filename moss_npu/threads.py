"""CPU threads: how many threads torch's intra-op pool and numpy's BLAS (the CPU frame step's matrix-vector
products, ``nano.cpu_step``) use. One process-wide setting, made by the command lines (``--num-threads``).

Default (``--num-threads 0``): 1 thread on machines with at most 2 usable physical cores, else one per usable
physical core. Measured on a 2-vCPU VM (bench/README): the batch-1 frame is memory-bound, so a second thread
adds little bandwidth, and whenever another process takes the other core, every parallel region of a
2-thread pool waits for the descheduled thread (a 1M-element ``torch.add`` went from 0.1 ms to 2.4–7.7 ms,
a frame from 45 to 240 ms).
"""

from __future__ import annotations

import os

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


def limit_blas(count: int) -> None:
    """Limit numpy's BLAS (OpenBLAS in numpy's wheels) to ``count`` threads."""
    threadpool_limits(limits=count, user_api="blas")
