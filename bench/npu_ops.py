"""Device ops and host syncs per generated frame, on the stand-in npu of the tests (tests/npu_standin).

    PYTHONPATH=tests/npu_standin python -m bench.npu_ops                  # the nano-tiny fixture, eager and graphs
    PYTHONPATH=tests/npu_standin python -m bench.npu_ops --size real --frames 4,8   # bench.run's real-size checkpoint
    PYTHONPATH=tests/npu_standin python -m bench.npu_ops --model DIR --codec DIR --frames 8,24

An eager NPU frame pays one launch per device op (tens of µs each on Ascend), so the ops a frame dispatches are
the first-order model of its time there, and each host sync (a device->host copy, an ``.item()``) stalls the
launch queue; docs/performance.md states the model. The stand-in counts both: each mode (``eager``: graph off;
``graph``: --host-rng with device graphs on) runs a warm-up request, then requests of F1 and F2 frames on the
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
from typing import Optional

from moss_npu.cli import ArgumentParser, run_cli
from moss_npu.errors import DeviceError, InputError

MODES = {"eager": {"graph": "off", "host_rng": True}, "graph": {"graph": "on", "host_rng": True}}
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

    def run(n: int) -> tuple[dict, int]:
        settings = RunConfig(max_new_frames=n, seed=0, text_normalization=False, wetext=False, **MODES[mode])
        npu.reset_counters()
        result = tts.synthesize(TEXT, settings=settings)
        counted = npu.counters()
        return counted, int(result.codes.shape[0])

    run(frames[1])  # warm-up: capture, caches
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
    from bench.checkpoints import ensure_checkpoints, steer_to_continue
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
    tts = MossTTSNano.from_pretrained(args.model or str(model), args.codec or str(codec), device=str(dev))
    steer_to_continue(tts.model)
    rows = {mode: per_frame(tts, npu, mode, frames) for mode in modes}
    print(f"{args.model or model} on the stand-in npu, requests of {frames[0]} and {frames[1]} frames:")
    print(table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"model": str(args.model or model), "frames": frames, "per_frame": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
