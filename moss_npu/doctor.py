"""A self-check of one device, for the first run on a new machine and for bug reports.

    python -m moss_npu.doctor --device npu:0 --json doctor.json
    python -m moss_npu.doctor --device cuda --model models/MOSS-TTS-Nano --codec models/MOSS-Audio-Tokenizer-Nano

Prints one line per check (``ok``, ``FAIL`` with its fix, or ``--``: not applicable or not asked for), and with
``--json`` writes them for an issue. It checks the installation and the device; with ``--model`` and ``--codec``
it also times frames (eager, and as device graphs where capture works), counts host reads per frame, and runs
eval_accuracy's tiers on two short texts against the CPU.

Exit codes: 0 nothing failed; 1 a check failed; 2 bad usage; 130 interrupted.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from moss_npu.cli import ArgumentParser, device_spec, run_cli
from moss_npu.device import parse_device
from moss_npu.errors import MossNpuError
from moss_npu.output import writable_file

TEXTS = ("Hello, this is a check.", "你好，这是一次检查。")
FRAMES = 12  # per timed run: enough frames for a steady per-frame time, few enough for a quick check


@dataclass
class Check:
    """One check's outcome: ``ok`` True, False (then ``fix`` says what to do) or None (not run: ``value`` says why)."""

    name: str
    ok: Optional[bool]
    value: Any
    fix: str = ""

    def line(self) -> str:
        mark = {True: "ok  ", False: "FAIL", None: "--  "}[self.ok]
        text = f"{mark} {self.name}: {_show(self.value)}"
        return f"{text} -> {self.fix}" if self.fix else text


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {_show(v)}" for k, v in value.items()) or "none"
    return str(value)


class Doctor:
    """Runs the checks in order; a check that raises becomes a FAIL line with the error's own fix."""

    def __init__(self) -> None:
        self.checks: list[Check] = []

    def run(self, name: str, body: Callable[[], Check]) -> Check:
        try:
            check = body()
        except MossNpuError as exc:
            check = Check(name, False, type(exc).__name__, str(exc))
        except (RuntimeError, OSError, ValueError, AttributeError, TypeError) as exc:  # what a driver raises
            check = Check(name, False, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
                          "attach this output to an issue")
        self.checks.append(check)
        return check

    @property
    def failed(self) -> bool:
        return any(c.ok is False for c in self.checks)


def installation(doctor: Doctor, spec: str):
    """Versions, the device itself and what it can do; return the resolved torch device, or None."""
    from moss_npu import device as devices

    torch = devices.import_torch()
    doctor.checks.append(Check("python", True, f"{platform.python_version()} on {platform.platform()}"))
    doctor.checks.append(Check("torch", True, torch.__version__))
    dev = None

    def resolve() -> Check:
        nonlocal dev
        dev = devices.resolve_device(spec)
        return Check("device", True, f"{dev} ({devices.backend(dev).name(dev.index or 0)})")

    if not doctor.run("device", resolve).ok:
        return None
    backend = devices.backend(dev)
    if backend.extension is not None:
        doctor.run("extension", lambda: _extension(backend))
    doctor.run("runtime", lambda: Check("runtime", None if backend.runtime_version() is None else True,
                                        backend.runtime_version() or "none under torch on this device"))
    doctor.run("process settings", lambda: Check("process settings", True, backend.apply_process_settings() or "none"))
    doctor.run("bfloat16", lambda: Check("bfloat16", True, "supported" if backend.supports_dtype(torch.bfloat16)
                                         else "not supported: float32 is used"))
    doctor.run("memory", lambda: _memory(backend, dev))
    doctor.run("graph capture", lambda: _graphs(backend, dev))
    return dev


def _extension(backend) -> Check:
    mismatch = backend.version_mismatch()
    version = backend.version() or "version unknown"
    return Check(backend.extension, mismatch is None, version, mismatch or "")


def _memory(backend, dev) -> Check:
    info = backend.mem_get_info(dev.index or 0)
    if info is None:
        return Check("memory", None, "this device does not report its memory")
    free, total = info
    return Check("memory", True, f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB")


def _graphs(backend, dev) -> Check:
    graphs = backend.graph_capture()
    if graphs is None:
        return Check("graph capture", None, "this device has no device graphs; frames run eagerly")
    broken = graphs.check(dev)
    if broken is not None:
        return Check("graph capture", False, broken, "frames run eagerly (--graph off); update the driver and "
                     "runtime if capture should work on this card")
    return Check("graph capture", True, "one capture replayed twice: it ran nothing at capture and added twice")


def model_checks(doctor: Doctor, dev, model: str, codec: str) -> None:
    """The pipeline loaded once; frames eager and replayed (the same weights, ``MossTTSNano.computing``), host
    reads per frame, and eval_accuracy's tiers on two short texts."""
    loaded: list = []
    if doctor.run("model", lambda: _load(dev, model, codec, loaded)).ok:
        codes: dict[str, Any] = {}
        doctor.run("frames, eager", lambda: _frames(loaded[0], dev, "off", codes))
        if next((c.ok for c in doctor.checks if c.name == "graph capture"), None):
            doctor.run("frames, device graphs", lambda: _frames(loaded[0], dev, "on", codes))
            if {"off", "on"} <= codes.keys():
                same = codes["off"] == codes["on"]
                fix = "" if same else "run with --graph off and attach this output"
                doctor.checks.append(Check("graphs equal eager", same,
                                           "identical greedy codes" if same else "the codes differ", fix))
    doctor.run("accuracy against the CPU", lambda: _accuracy(dev, model, codec))


def _load(dev, model: str, codec: str, loaded: list) -> Check:
    from moss_npu.tts import MossTTSNano

    start = time.perf_counter()
    loaded.append(MossTTSNano.from_pretrained(model, codec, device=str(dev)))
    return Check("model", True, f"{model} and {codec} loaded in {time.perf_counter() - start:.1f} s")


def _frames(tts, dev, graph: str, codes: dict) -> Check:
    from moss_npu import device as devices
    from moss_npu.tts import RunConfig

    name = "frames, eager" if graph == "off" else "frames, device graphs"
    way = tts.computing(graph=graph)
    settings = RunConfig(do_sample=False, seed=0, max_new_frames=FRAMES, host_rng=graph == "on")
    way.synthesize(TEXTS[0], settings=settings)  # warm-up: first-call allocations and captures
    backend = devices.backend(dev)
    with backend.counting_host_syncs() as waits:
        start = time.perf_counter()
        result = way.synthesize(TEXTS[0], settings=settings)
        devices.synchronize(dev)
        seconds = time.perf_counter() - start
    frames = max(1, len(result.codes))
    codes[graph] = result.codes.tolist()
    reads = "not reported on this device" if waits is None else f"{len(waits) / frames:.1f} host reads per frame"
    return Check(name, True, f"{1000 * seconds / frames:.1f} ms per frame over {frames} frames "
                              f"(text, codec and all), {reads}")


def _accuracy(dev, model: str, codec: str) -> Check:
    from moss_npu import device as devices
    from moss_npu.evaluation import EvalInput, EvalRequest, SideSpec, evaluate, generation_settings

    torch = devices.import_torch()
    reference = SideSpec("reference", "native", devices.resolve_device("cpu"), torch.float32, model, codec)
    target = SideSpec("target", "native", dev, torch.float32, model, codec)
    inputs = tuple(EvalInput(f"t{i}", text, None) for i, text in enumerate(TEXTS, 1))
    settings = generation_settings(reference, target, max_new_frames=FRAMES, seed=0, greedy=True)
    report = evaluate(EvalRequest(reference, target, inputs, settings))
    tiers = {f"tier {tier.tier}": "PASS" if tier.passed else "FAIL" for tier in report.tiers}
    return Check("accuracy against the CPU", report.passed, tiers,
                 "" if report.passed else "run eval_accuracy.py --device ... --report r.json and attach r.json")


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m moss_npu.doctor", description=__doc__.splitlines()[0])
    p.add_argument("--device", type=device_spec, default="auto", help="auto (default), cpu, cuda[:N], npu[:N], mps")
    p.add_argument("--model", help="a TTS model folder or hub id: also time frames and check accuracy")
    p.add_argument("--codec", help="the codec folder or hub id (with --model)")
    p.add_argument("--json", help="write the checks here as JSON, for a bug report")
    return p


def run(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.model is None) != (args.codec is None):
        parser.error("--model and --codec go together: give both, or neither for the installation checks alone")
    out = writable_file(args.json, "--json") if args.json else None
    parse_device(args.device)  # an unknown kind is bad usage (exit 2); an unavailable one is a failed check
    doctor = Doctor()
    dev = installation(doctor, args.device)
    if dev is not None and args.model:
        model_checks(doctor, dev, args.model, args.codec)
    elif dev is not None:
        doctor.checks.append(Check("frames and accuracy", None, "not run: add --model and --codec"))
    for check in doctor.checks:
        print(check.line(), flush=True)
    if out is not None:
        report = {"device": args.device, "passed": not doctor.failed, "checks": [asdict(c) for c in doctor.checks]}
        Path(out).write_text(json.dumps(report, indent=1, ensure_ascii=False, default=str) + "\n", encoding="utf-8")
        print(f"wrote {out}: attach it to an issue", file=sys.stderr)
    return 1 if doctor.failed else 0


def main(argv: Optional[list[str]] = None) -> int:
    return run_cli(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
