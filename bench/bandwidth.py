"""A read-bandwidth probe beside the thread comparison: how fast the one-row kernels stream one large float32
weight (256 MiB, far beyond any cache) on 1 and on 2 threads, so that a frame's thread speedup can be judged
against what the memory system gives on this machine (a batch-1 frame is bound by these reads)."""

from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch

from moss_npu.cpu.matvec import Fp32Tiles, MatVecKernels
from moss_npu.native.library import KernelUnavailable

IN, OUT = 8192, 8192  # 256 MiB of float32 weights
REPEATS = 5


def read_bandwidth(threads: tuple[int, ...] = (1, 2)) -> Optional[dict[int, float]]:
    """Return GB/s read by the fp32 tile kernel at each thread count (the best of ``REPEATS`` products), or None
    where the kernels are not installed."""
    try:
        kernels = MatVecKernels.load(threads=max(threads))
    except KernelUnavailable:
        return None
    weight = torch.empty(OUT, IN).uniform_(-1, 1)
    tiles = Fp32Tiles(kernels, weight, None)
    del weight
    x = np.ones(IN, np.float32)
    rates = {}
    for count in threads:
        kernels.threads.use(count)
        best = float("inf")
        for _ in range(REPEATS):
            start = time.perf_counter()
            tiles(x)
            best = min(best, time.perf_counter() - start)
        rates[count] = tiles.values.nbytes / best / 1e9
    return rates


def bandwidth_line(rates: Optional[dict[int, float]]) -> str:
    """One line for the report: the rates and the ratio of the last thread count to the first."""
    if rates is None:
        return "read bandwidth: not measured (the kernels are not installed)"
    counts = sorted(rates)
    parts = ", ".join(f"{n} thread{'s' if n > 1 else ''} {rates[n]:.1f} GB/s" for n in counts)
    return f"read bandwidth (fp32 tiles, 256 MiB): {parts} (ratio {rates[counts[-1]] / rates[counts[0]]:.2f})"
