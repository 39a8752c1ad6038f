"""Check a deployment's accuracy: the same inputs on a reference (CPU fp32) and a target device, one after the other.

    python eval_accuracy.py --device npu:0 --model MODEL_DIR --codec CODEC_DIR --report npu.json
    python eval_accuracy.py --device npu:0 --dtype bfloat16 --max-mse 1e-3 --max-rel 5e-2 --min-token-agreement 0
    python eval_accuracy.py --device npu:0 --against upstream --greedy     # native vs official code, same device

Tiers: A module parity under teacher forcing (hidden states, logits, one cached decode step, codec decoder);
B the reference's codes decoded on both sides; C free-running generation with shared random numbers (token
agreement; waveforms only where every token agrees). The reference model is freed before the target loads.

Exit codes: 0 every tier passed; 1 a threshold failed or the run failed; 2 bad usage or input (unknown device,
bad threshold, missing model folder, official code unavailable); 130 interrupted (Ctrl-C, SIGTERM). stdout
carries the table; progress and the one error line go to stderr. MOSS_NPU_DEBUG=1 adds tracebacks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from moss_npu.cli import ArgumentParser, check_utf8_text, device_spec, finite_float, int_in, read_utf8, run_cli
from moss_npu.errors import InputError
from moss_npu.hub import DEFAULT_CODEC, DEFAULT_MODEL
from moss_npu.output import refuse_own_inputs, writable_file, write_json


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser."""
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("inputs")
    src.add_argument("--text", action="append", help="a sentence to compare (repeatable; default: one zh, one en)")
    src.add_argument("--text-file", help="UTF-8 file with one sentence per line")
    src.add_argument("--prompt-audio-path", help="voice reference (wav/flac/mp3): every input runs as voice clone")

    side = p.add_argument_group("model and devices")
    side.add_argument("--model", default=DEFAULT_MODEL, help="TTS folder or hub id")
    side.add_argument("--codec", default=DEFAULT_CODEC, help="codec folder or hub id")
    side.add_argument("--device", type=device_spec, default="auto", help="target device: auto (default), cpu, cuda[:N], npu[:N], mps")
    side.add_argument("--dtype", default="float32", help="target LM dtype: float32 (default), bfloat16, float16 "
                      "(CPU bfloat16: bf16 weights, float32 math)")
    side.add_argument("--quantize", choices=("none", "int8"), default="none",
                      help="target LM: int8 rounds its block weights to int8 (CPU, float32; see README CPU speed)")
    side.add_argument("--reference-device", type=device_spec, help="reference device (default cpu); the reference runs float32")
    side.add_argument("--impl", choices=("native", "upstream"), default="native",
                      help="code on the target side: native (default) or the official code with the patch set")
    side.add_argument("--against", choices=("reference", "upstream"), default="reference",
                      help="upstream: compare native (reference) with the official code on --device in --dtype")
    side.add_argument("--upstream-code", help="--impl/--against upstream: folder holding the official *.py code "
                      "(default: the model folders themselves, as a hub download has them)")

    gen = p.add_argument_group("generation (tier C)")
    gen.add_argument("--max-new-frames", type=int_in(1, 7500), default=50, help="frame limit per input (12.5 per second)")
    gen.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0, help="seed of the shared random numbers and fixed inputs")
    gen.add_argument("--greedy", action="store_true", help="argmax decoding instead of sampling")

    th = p.add_argument_group("pass thresholds")
    th.add_argument("--max-mse", type=finite_float, default=1e-6, help="largest mean squared error (tensors, waveforms)")
    th.add_argument("--max-rel", type=finite_float, default=1e-3, help="largest relative error ||a-b||/||b|| (tensors)")
    th.add_argument("--min-snr", type=finite_float, default=40.0, help="smallest waveform SNR in dB")
    th.add_argument("--min-token-agreement", type=finite_float, default=1.0,
                    help="smallest fraction of equal tokens (default 1: every token identical)")

    p.add_argument("--report", help="write the JSON report here (atomically)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def read_inputs(args: argparse.Namespace):
    """Return the inputs from --text / --text-file (default: the built-in zh and en sentences)."""
    from moss_npu.evaluation import DEFAULT_INPUTS, EvalInput

    texts = list(args.text or [])
    if args.text_file:
        path = Path(args.text_file)
        if not path.is_file():
            raise InputError(f"--text-file {path}: file not found; pass a UTF-8 file with one sentence per line")
        texts += [line.strip() for line in read_utf8(path, "--text-file").splitlines() if line.strip()]
        if not texts:
            raise InputError(f"--text-file {path}: holds no text; put one sentence per line")
    if any(not t.strip() for t in texts):
        raise InputError("--text is empty; pass the words to speak")
    for text in texts:
        check_utf8_text(text, "--text")
    audio = None
    if args.prompt_audio_path:
        audio = Path(args.prompt_audio_path)
        if not audio.is_file():
            raise InputError(f"--prompt-audio-path {audio}: file not found; pass a wav/flac/mp3 recording")
    if not texts:
        return tuple(EvalInput(i.label, i.text, audio) for i in DEFAULT_INPUTS)
    return tuple(EvalInput(f"t{n}", t, audio) for n, t in enumerate(texts, 1))


def check_report_path(args: argparse.Namespace) -> Optional[Path]:
    """Fail before loading any model when the report cannot be written or would replace an input file."""
    if args.report is None:
        return None
    real = writable_file(args.report, "--report")
    refuse_own_inputs(real, args.report, {"--text-file": args.text_file, "--prompt-audio-path": args.prompt_audio_path},
                      "--report")
    return real


def build_request(args: argparse.Namespace):
    """Resolve devices, dtype, sides, inputs, generation and thresholds; raise MossNpuError on bad input."""
    from moss_npu import device as devices

    torch = devices.import_torch()
    from moss_npu.evaluation import EvalRequest, SideSpec, Thresholds, generation_settings

    thresholds = Thresholds(args.max_mse, args.max_rel, args.min_snr, args.min_token_agreement)
    inputs = read_inputs(args)
    dev = devices.resolve_device(args.device)
    dtype = devices.resolve_dtype(dev, args.dtype)
    if args.against == "upstream":
        if args.quantize != "none":
            raise InputError("--quantize compares a quantized target with the float32 reference; drop --against "
                             "upstream")
        if args.impl == "upstream" or args.reference_device:
            raise InputError("--against upstream runs native and official code on --device; drop --impl and "
                             "--reference-device")
        reference = SideSpec("reference", "native", dev, dtype, args.model, args.codec)
        target = SideSpec("target", "upstream", dev, dtype, args.model, args.codec, args.upstream_code)
    else:
        ref_dev = devices.resolve_device(args.reference_device or "cpu")
        reference = SideSpec("reference", "native", ref_dev, torch.float32, args.model, args.codec)
        if args.upstream_code and args.impl != "upstream":
            raise InputError("--upstream-code: only used with --impl upstream or --against upstream; drop it")
        target = SideSpec("target", args.impl, dev, dtype, args.model, args.codec, args.upstream_code,
                          args.quantize)
    settings = generation_settings(reference, target, max_new_frames=args.max_new_frames, seed=args.seed,
                                   greedy=args.greedy)
    if target.impl == "upstream":
        from moss_npu.upstream import import_transformers

        import_transformers()  # fail now, not after the reference run
    return EvalRequest(reference, target, inputs, settings, thresholds)


def main(argv: Optional[list[str]] = None) -> int:
    """``run`` under the exit-code policy: one ``error:`` line and the error class's exit code on failure."""
    return run_cli(lambda: run(argv))


def run(argv: Optional[list[str]] = None) -> int:
    """Parse flags, run the serial comparison, print the table, write the report; return the exit code."""
    from moss_npu.evaluation import evaluate

    args = build_parser().parse_args(argv)
    out = check_report_path(args)
    request = build_request(args)

    def progress(what: str, spec) -> None:
        if not args.quiet and what in ("load", "released"):
            verb = "loading" if what == "load" else "released"
            dtype = str(spec.dtype).replace("torch.", "")
            weights = f" with {spec.quantize} weights" if spec.quantize != "none" else ""
            print(f"{verb} {spec.role}: {spec.impl} {dtype}{weights} on {spec.device}", file=sys.stderr, flush=True)

    report = evaluate(request, on_event=progress)
    print(report.format_table(), flush=True)
    if out is not None:
        write_json(out, report.to_dict())
        if not args.quiet:
            print(f"wrote {out}", file=sys.stderr)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
