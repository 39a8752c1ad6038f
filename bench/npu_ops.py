"""Device ops and host syncs per generated frame, on the stand-in npu of the tests (tests/npu_standin).

    PYTHONPATH=tests/npu_standin python -m bench.npu_ops                  # the nano-tiny fixture, eager and graphs
    PYTHONPATH=tests/npu_standin python -m bench.npu_ops --size real --frames 4,8   # bench.run's real-size checkpoint
    PYTHONPATH=tests/npu_standin python -m bench.npu_ops --model DIR --codec DIR --frames 8,24

An eager NPU frame pays one launch per device op (tens of µs each on Ascend), so the ops a frame dispatches are
the first-order model of its time there, and each host sync (a device->host copy, an ``.item()``) stalls the
launch queue; docs/performance.md states the model. The stand-in counts both: each mode (``eager``: graph off;
``graph``: --host-rng with device graphs on) runs warm-up requests of both lengths, then requests of F1 and F2 frames on the
same loaded pipeline, and the table shows (counts of F2 - counts of F1) / (frames of F2 - frames of F1): a frame's
steady-state cost, codec decode included, loading and capture excluded. The model is steered never to stop
(``bench.checkpoints.steer_to_continue``), so a request runs its frames. Not a timing: the stand-in runs CPU
kernels; speed is for a card.

Exit codes: 0 done; 2 the stand-in is not what ``import torch_npu`` finds (set PYTHONPATH as above), or bad flags.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Optional

from moss_npu.cli import ArgumentParser, run_cli
from moss_npu.errors import DeviceError, InputError

MODES = {"eager": "off", "graph": "on"}  # mode -> the pipeline's --graph (both draw on the host: --host-rng)
COLUMNS = ("ops", "host_syncs", "device_to_host", "items", "host_to_device", "replays")
TEXT = "The quick brown fox jumps over the lazy dog, again and again, until the evening comes."


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m bench.npu_ops", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="TTS folder (default: the checkpoint of --size)")
    p.add_argument("--codec", help="codec folder (default: the checkpoint of --size)")
    p.add_argument("--size", choices=("fixture", "real"), default="fixture",
                   help="fixture: the nano-tiny fixture; real: bench.run's real-size random checkpoint (written once)")
    p.add_argument("--frames", default="8,24", help="F1,F2: the two request lengths whose difference is measured")
    p.add_argument("--modes", default="eager,graph", help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--upstream-code", help="a folder holding the official *.py remote code: adds the official "
                   "code's column (--impl upstream; needs the upstream extra)")
    p.add_argument("--json", help="also write the table as JSON here")
    return p


def standin_npu():
    """The stand-in's ``torch.npu`` (it counts), or DeviceError naming how to put it on the path."""
    from moss_npu import device as devices

    dev = devices.resolve_device("npu:0")
    import torch

    if not hasattr(torch.npu, "counters"):
        raise DeviceError("torch_npu here is not the tests' stand-in (it has no counters): run with "
                          "PYTHONPATH=tests/npu_standin")
    return dev, torch.npu


def per_frame(tts, npu, mode: str, frames: tuple[int, int]) -> dict:
    """One mode's steady-state counts per generated frame (see the module)."""
    from moss_npu.tts.settings import RunConfig

    way = tts.computing(graph=MODES[mode])

    def run(n: int) -> tuple[dict, int]:
        settings = RunConfig(max_new_frames=n, seed=0, text_normalization=False, wetext=False, host_rng=True)
        npu.reset_counters()
        result = way.synthesize(TEXT, settings=settings)
        return npu.counters(), int(result.codes.shape[0])

    return _difference(run, frames)


def official_per_frame(up, npu, frames: tuple[int, int]) -> dict:
    """The official code's counts per generated frame (``--impl upstream``: its own ``generate``, greedy, then its
    codec on the codes), the same difference of two request lengths."""
    rows = up.prompt_rows(TEXT)

    def run(n: int) -> tuple[dict, int]:
        npu.reset_counters()
        codes = up.generate_codes(rows, max_new_frames=n).codes
        up.decode_codes(codes)
        return npu.counters(), int(codes.shape[0])

    return _difference(run, frames)


def _difference(run, frames: tuple[int, int]) -> dict:
    run(frames[0]), run(frames[1])  # warm-up: captures, and the prompt caches as both lengths leave them
    (c1, f1), (c2, f2) = run(frames[0]), run(frames[1])
    if f2 <= f1:
        raise InputError(f"--frames {frames[0]},{frames[1]}: the requests ran {f1} and {f2} frames; raise F2")

    def total(c: dict, key: str) -> int:
        if key == "ops":
            return sum(c["ops"].values())
        if key == "host_syncs":
            return c["device_to_host"] + c["items"]
        return c[key]

    return {key: (total(c2, key) - total(c1, key)) / (f2 - f1) for key in COLUMNS}


def table(rows: dict[str, dict]) -> str:
    """The Markdown table of ``rows`` (mode -> counts per frame)."""
    lines = ["| mode | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for mode, row in rows.items():
        lines.append(f"| {mode} | " + " | ".join(f"{row[key]:.2f}" for key in COLUMNS) + " |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """Print the per-frame table (and write it as JSON with ``--json``)."""
    return run_cli(lambda: bench(build_parser().parse_args(argv)))


def bench(args: argparse.Namespace) -> int:
    from bench.checkpoints import ensure_checkpoints, steered_copy
    from moss_npu_verify import goldens
    from moss_npu.tts.pipeline import MossTTSNano

    try:
        frames = tuple(int(x) for x in args.frames.split(","))
    except ValueError:
        raise InputError(f"--frames {args.frames}: use two integers F1,F2, e.g. 8,24") from None
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if len(frames) != 2 or not 0 < frames[0] < frames[1] or unknown:
        raise InputError(f"--frames {args.frames} --modes {args.modes}: use F1,F2 with 0 < F1 < F2 and modes of "
                         f"{', '.join(MODES)}")
    dev, npu = standin_npu()
    nano = goldens.fixtures_root() / "nano-tiny"
    model, codec = ensure_checkpoints("real") if args.size == "real" else (nano / "tts", nano / "codec")
    with tempfile.TemporaryDirectory(prefix="npu_ops_") as work:
        # Both implementations read one steered copy of the checkpoint: a request runs all its frames.
        steered = steered_copy(Path(args.model or model), Path(work))
        tts = MossTTSNano.from_pretrained(str(steered), args.codec or str(codec), device=str(dev))
        rows = {mode: per_frame(tts, npu, mode, frames) for mode in modes}
        if args.upstream_code:
            from moss_npu.upstream import load_upstream

            with load_upstream(str(steered), args.codec or str(codec), device=dev,
                               code_dir=args.upstream_code) as up:
                rows["official eager"] = official_per_frame(up, npu, frames)
    print(f"{args.model or model} on the stand-in npu, requests of {frames[0]} and {frames[1]} frames:")
    print(table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model": str(args.model or model), "frames": frames, "per_frame": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
