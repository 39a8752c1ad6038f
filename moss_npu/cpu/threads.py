"""CPU threads: how many threads torch's intra-op pool, numpy's BLAS and the one-row kernels' pool (``cpu.matvec``)
use. One process-wide setting, made by the command lines (``--num-threads``; 0: ``default_threads``).

A one-slot frame runs torch on one thread in its own thread (``this_thread_limited``) while the kernels' pool
shares the products over the setting's threads; prefill and the codec keep the setting (the engine's prefill
takes its audio thread's count too while that thread is idle, and a codec call of several streams the frame
thread's while no request is decoding). The frames' products borrow the idle cores (``spare_cores``) too: the
engine's while its audio thread has nothing to decode, a pipeline's under the default setting while its frames
run (the codec between them takes them back). numpy's BLAS runs on one thread, set when the CPU step is built: it
multiplies only single rows there, and with more its spinning workers fought torch's OpenMP workers for the
cores. Why: docs/performance.md#threads.
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


def spare_cores(count: int) -> int:
    """Return the cores that a thread of ``count`` threads may borrow from a second one of the same count while
    that one is idle: up to ``count`` more, within the usable physical cores."""
    return max(0, min(count, usable_physical_cores() - count))


def borrowed_cores(setting: int) -> int:
    """Return the cores a lone thread (a pipeline's frames) borrows under the thread ``setting`` in force
    (``set_threads``'s argument): the spare ones under the default (0), none under an explicit count, which keeps
    the run to it."""
    return 0 if setting else spare_cores(torch.get_num_threads())


def set_threads(count: int = 0) -> int:
    """Use ``count`` threads (0: ``default_threads()``) in torch's intra-op pool; return the count used. numpy's
    BLAS is left to the CPU step (the module docstring)."""
    count = count or default_threads()
    torch.set_num_threads(count)
    return count


def use_threads(count: int) -> None:
    """Run this thread's torch ops on ``count`` intra-op threads. Call it first in every thread that runs torch
    ops: the count is each OpenMP thread's own, and a new thread would otherwise use every core."""
    torch.set_num_threads(count)


def limit_blas(count: int) -> None:
    """Limit numpy's BLAS (OpenBLAS in numpy's wheels) to ``count`` threads."""
    threadpool_limits(limits=count, user_api="blas")


@contextlib.contextmanager
def this_thread_using(count: int) -> Iterator[None]:
    """Run the block with ``count`` torch intra-op threads in the calling thread only, then give its count back."""
    before = torch.get_num_threads()
    if before == count:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def this_thread_limited(count: int) -> contextlib.AbstractContextManager:
    """Run the block with at most ``count`` torch intra-op threads in the calling thread only (``use_threads``);
    numpy's BLAS count is process-wide, so it is set when the decoder is built, never around a frame."""
    return this_thread_using(min(count, torch.get_num_threads()))
