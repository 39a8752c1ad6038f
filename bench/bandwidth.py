"""A read-bandwidth probe beside the thread comparison: how fast the one-row kernels stream one float32 weight on
1 and on 2 threads, so that a frame's thread speedup can be judged against what the memory system gives on this
machine (a batch-1 frame is bound by these reads). The default weight (256 MiB) is far beyond any cache; a small
one (``--mib 28``, the size of one local layer) measures what a cache-resident part can read.

``python -m bench.bandwidth [--mib N] [--threads 1,2]`` prints the probe."""

from __future__ import annotations

import time
import argparse
from typing import Optional

import numpy as np
import torch

from moss_npu.cpu.matvec import Fp32Tiles, MatVecKernels
from moss_npu.native.library import KernelUnavailable

IN = 8192  # the weight's input width; its rows follow from the size asked for
DEFAULT_MIB = 256
REPEATS = 5


def read_bandwidth(threads: tuple[int, ...] = (1, 2), mib: int = DEFAULT_MIB) -> Optional[dict[int, float]]:
    """Return GB/s read by the fp32 tile kernel over a ``mib``-MiB weight at each thread count (the best of
    ``REPEATS`` products), or None where the kernels are not installed."""
    if mib < 1:
        raise ValueError(f"--mib {mib}: the probe needs at least 1 MiB")
    try:
        kernels = MatVecKernels.load(threads=max(threads))
    except KernelUnavailable:
        return None
    rows = max(64, (mib << 20) // (IN * 4) // 64 * 64)  # whole 64-column tiles
    weight = torch.empty(rows, IN).uniform_(-1, 1)
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


def bandwidth_line(rates: Optional[dict[int, float]], mib: int = DEFAULT_MIB) -> str:
    """One line for the report: the rates and the ratio of the last thread count to the first."""
    if rates is None:
        return "read bandwidth: not measured (the kernels are not installed)"
    counts = sorted(rates)
    parts = ", ".join(f"{n} thread{'s' if n > 1 else ''} {rates[n]:.1f} GB/s" for n in counts)
    return f"read bandwidth (fp32 tiles, {mib} MiB): {parts} (ratio {rates[counts[-1]] / rates[counts[0]]:.2f})"


def main(argv: Optional[list[str]] = None) -> int:
    """Print the probe for the sizes and thread counts asked for."""
    parser = argparse.ArgumentParser(prog="python -m bench.bandwidth", description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, action="append", help=f"weight size in MiB (repeatable; default {DEFAULT_MIB})")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated (default 1,2)")
    args = parser.parse_args(argv)
    try:
        threads = tuple(int(n) for n in args.threads.split(","))
    except ValueError:
        parser.error(f"--threads {args.threads}: give whole numbers separated by commas, e.g. 1,2")
    if not threads or min(threads) < 1:
        parser.error(f"--threads {args.threads}: each count must be at least 1")
    for mib in args.mib or [DEFAULT_MIB]:
        if mib < 1:
            parser.error(f"--mib {mib}: the probe needs at least 1 MiB")
        print(bandwidth_line(read_bandwidth(threads, mib), mib), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
