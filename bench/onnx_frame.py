"""Our fp32 greedy frame against onnxruntime running the official model split as the official ONNX runtime runs it.

    python -m bench.onnx_frame --upstream-code DIR                     # real-size random checkpoint, 48 frames
    python -m bench.onnx_frame --upstream-code DIR --size tiny --frames 4 --rounds 1 --warmup 0

The published ONNX graphs of MOSS-TTS-Nano (what the official ``ort_cpu_runtime.py`` loads) are not on this
machine and their export script is not public. So this exports the official PyTorch modules (the remote code in
``--upstream-code``, loaded as ``--impl upstream`` loads it) with ``torch.onnx.export`` into the graphs that
runtime runs for a greedy request, with its input and output names: ``prefill`` (prompt rows -> the last hidden
state and K/V per layer), ``decode_step`` (one frame row, ``past_valid_lengths`` and the K/V cache -> the next
hidden state and the cache one row longer) and ``local_greedy_frame`` (hidden state, ``repetition_seen_mask``,
``repetition_penalty`` -> ``should_continue`` and the frame's codes: the local transformer's 17 steps unrolled,
with the repetition penalty and the argmax inside). A stand-in for the published graphs, not them.
``--local`` picks how that graph runs the local transformer, which the published graph does not say: ``cached``
(its own K/V cache, the cheaper way, hence the stricter comparison; default) or ``recompute`` (the whole local
sequence at every step, as the official ``generate`` does).

Each round runs, one after the other, our optimized fp32 frame and onnxruntime (CPUExecutionProvider with the
official session options) at 1 and 2 intra-op threads: the same prompt rows, ``--frames`` greedy frames, the
cache growing as the official runtime drives it; ms/frame is the frame loop's (prefill and codec excluded),
median over the rounds. Every run's codes must equal ours, else the times compare different work: exit 1.
The last two lines are the ratios docs/performance.md targets: ``fp32@1 / onnx@1`` and ``fp32@2 / onnx best``.
Before the table, ``bench.bandwidth``'s probe over a buffer of the global stack's size, taken before and after the
rounds: a batch-1 frame is bound by these reads, and on a VM the rate two threads get can change between runs
(docs/performance.md#against-the-official-onnx-runtime), so the ratios are read beside it.

Exit codes: 0 done; 1 the codes differ, or a runtime failure; 2 bad usage, or onnxruntime / transformers missing.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Optional

from moss_npu.cli import ArgumentParser, run_cli
from moss_npu.errors import InputError

from bench.bandwidth import bandwidth_line, read_bandwidth
from bench.floor import part_bytes
from bench.run import SHORT, SIZES

THREADS = (1, 2)
TEXT = SHORT["en"]
LOCAL_MODES = ("cached", "recompute")
OPSET = 17
# What the official loader (AutoTokenizer with remote code) needs to find the tokenizer class; official folders have
# this file, the bench's random checkpoints carry tokenizer.model only.
TOKENIZER_CLASS = "MossTTSNanoSentencePieceTokenizer"
TOKENIZER_CONFIG = {"auto_map": {"AutoTokenizer": [f"tokenization_moss_tts_nano.{TOKENIZER_CLASS}", None]},
                    "tokenizer_class": TOKENIZER_CLASS}


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m bench.onnx_frame", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--upstream-code", required=True, help="a folder holding the official *.py remote code")
    p.add_argument("--size", choices=SIZES, default="real", help="the generated checkpoint (bench.checkpoints)")
    p.add_argument("--cache-dir", type=Path, help="where generated checkpoints are kept (default: system temp)")
    p.add_argument("--frames", type=int, default=48, help="greedy frames per run")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds (median)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first")
    p.add_argument("--local", choices=LOCAL_MODES, default="cached", help="how the frame graph runs the local "
                   "transformer (see above)")
    return p


def official_view(model_dir: Path, work: Path) -> Path:
    """A folder in ``work`` that links ``model_dir``'s files beside ``TOKENIZER_CONFIG``: the bench checkpoint as
    the official loader reads it."""
    view = work / "tts"
    view.mkdir()
    for item in model_dir.iterdir():
        (view / item.name).symlink_to(item.resolve())
    (view / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG), encoding="utf-8")
    return view


def export_graphs(model, rows, folder: Path, local: str) -> dict[str, Path]:
    """Export the official ``model``'s prefill, decode step and greedy frame graphs into ``folder``; ``rows``
    (L, Q + 1) are the example prompt."""
    import torch

    class Graph(torch.nn.Module):
        def __init__(self, step) -> None:
            super().__init__()
            self.model, self.step = model, step

        def forward(self, *args):
            return self.step(self.model, *args)

    layers = len(model.transformer.h)
    past = [f"past_{kind}_{i}" for i in range(layers) for kind in ("key", "value")]
    present = [name.replace("past_", "present_") for name in past]
    config = model.config
    width = len(config.audio_codebook_sizes)
    with torch.no_grad():
        ids = rows[None].to(torch.int32)
        mask = torch.ones(ids.shape[:2], dtype=torch.int32)
        states, *cache = prefill(model, ids, mask)
        row = torch.full((1, 1, width + 1), config.audio_pad_token_id, dtype=torch.int32)
        row[0, 0, 0] = config.audio_assistant_slot_token_id
        seen = torch.zeros((1, width, config.audio_codebook_sizes[0]), dtype=torch.int32)
        graphs = {  # name: (function, example inputs, input names, output names, dynamic axes)
            "prefill": (prefill, (ids, mask), ["input_ids", "attention_mask"], ["global_hidden", *present],
                        {name: {1: "rows"} for name in ["input_ids", "attention_mask", "global_hidden", *present]}),
            "decode_step": (decode_step, (row, torch.tensor([ids.shape[1]], dtype=torch.int32), *cache),
                            ["input_ids", "past_valid_lengths", *past], ["global_hidden", *present],
                            {**{name: {1: "past"} for name in past}, **{name: {1: "rows"} for name in present}}),
            "local_greedy_frame": (lambda m, *a: greedy_frame(m, *a, cached=local == "cached"),
                                   (states[:, -1], seen, torch.tensor([1.2])),
                                   ["global_hidden", "repetition_seen_mask", "repetition_penalty"],
                                   ["should_continue", "frame_token_ids"], {}),
        }
        paths = {name: folder / f"{name}.onnx" for name in graphs}
        torch.onnx.register_custom_op_symbolic("aten::repeat_interleave", repeat_last_symbolic(), OPSET)
        try:
            # Quiet: the exporter's deprecation notice, and the tracer's notes that the official code's checks of
            # its inputs (codes in range, no padded row) keep their traced outcome, which holds for all fed here.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for name, (step, args, inputs, outputs, axes) in graphs.items():
                    torch.onnx.export(Graph(step), args, str(paths[name]), input_names=inputs, output_names=outputs,
                                      dynamic_axes=axes, opset_version=OPSET, **legacy_exporter(torch))
        finally:
            torch.onnx.unregister_custom_op_symbolic("aten::repeat_interleave", OPSET)
    return paths


def legacy_exporter(torch) -> dict:
    """The TorchScript exporter's switch where ``torch.onnx.export`` defaults to dynamo (it needs onnxscript)."""
    return {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters else {}


def repeat_last_symbolic():
    """The ONNX translation of ``x.repeat_interleave(r, dim=-1)`` (how the official rotary embedding widens its
    angles): unsqueeze, concatenate r copies, reshape. torch's own translation leaves a wrong rank behind (torch
    2.13): a later ``stack(dim=-1)`` in the rotary code is then exported on the wrong axis and the keys come out
    wrong at every position but the first."""
    import torch
    from torch.onnx import symbolic_helper

    @symbolic_helper.parse_args("v", "i", "i", "none")
    def repeat_last(g, x, repeats, dim, output_size):
        if dim != -1:
            raise NotImplementedError(f"bench.onnx_frame exports repeat_interleave on the last dim only, not {dim}")
        const = lambda *values: g.op("Constant", value_t=torch.tensor(values))  # noqa: E731
        copies = g.op("Concat", *[g.op("Unsqueeze", x, const(-1))] * repeats, axis_i=-1)
        shape = g.op("Concat", g.op("Slice", g.op("Shape", x), const(0), const(-1)), const(-1), axis_i=0)
        return g.op("Reshape", copies, shape)

    return repeat_last


def prefill(model, input_ids, attention_mask):
    """The prompt through the official global transformer: hidden states (1, L, H) and K/V per layer."""
    out = model(input_ids=input_ids.long(), attention_mask=attention_mask.bool(), use_cache=True)
    return (out.global_hidden_states, *[t for kv in out.past_key_values for t in kv])


def decode_step(model, input_ids, past_valid_lengths, *past):
    """One frame row (1, 1, Q + 1) on top of the K/V cache; the first ``past_valid_lengths`` cached rows are seen."""
    import torch

    mask = (torch.arange(past[0].shape[1] + 1) <= past_valid_lengths.long())[None]
    out = model(input_ids=input_ids.long(), attention_mask=mask, past_key_values=tuple(zip(past[0::2], past[1::2])),
                use_cache=True)
    return (out.global_hidden_states, *[t for kv in out.past_key_values for t in kv])


def greedy_frame(model, hidden, seen, penalty, cached: bool):
    """One greedy frame of the official local decoder: continue or stop, then each channel's code, its logits
    penalized where ``seen`` (1, Q, V) marks codes the channel produced before."""
    import torch

    inputs, past = [hidden[:, None]], None

    def last_hidden():
        nonlocal past
        if not cached:
            return model._decode_local_last_hidden_state(torch.cat(inputs, 1))
        out = model.local_transformer(inputs_embeds=inputs[-1], past_key_values=past, use_cache=True,
                                      attention_mask=torch.ones((1, len(inputs)), dtype=torch.bool))
        past = out.past_key_values
        return out.last_hidden_state[:, -1]

    text = model._sample_next_assistant_text_token(model.text_lm_head(last_hidden()), do_sample=False,
                                                   temperature=1.0)
    inputs.append(model.transformer.wte(text)[:, None])
    codes = []
    for channel, head in enumerate(model.audio_lm_heads):
        logits = head(last_hidden())
        logits = torch.where(seen[:, channel].bool(), torch.where(logits < 0, logits * penalty, logits / penalty),
                             logits)
        codes.append(logits.argmax(-1))
        if channel + 1 < len(model.audio_lm_heads):
            inputs.append(model.audio_embeddings[channel](codes[-1])[:, None])
    slot = model.config.audio_assistant_slot_token_id
    return text.eq(slot).to(torch.int32), torch.stack(codes, -1).to(torch.int32)


def session(path: Path, threads: int):
    """An onnxruntime CPU session with the official runtime's options at ``threads`` intra-op threads."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def onnx_frames(sessions: dict, rows, frames: int, penalty: float, config):
    """Greedy frames as the official runtime drives its graphs; return (ms per frame, codes (F, Q))."""
    import numpy as np

    ids = rows[None].numpy().astype(np.int32)
    states, *cache = sessions["prefill"].run(None, {"input_ids": ids, "attention_mask": np.ones(ids.shape[:2],
                                                                                                  np.int32)})
    names = [i.name for i in sessions["decode_step"].get_inputs()][2:]
    width, length = len(config.audio_codebook_sizes), ids.shape[1]
    seen = np.zeros((1, width, config.audio_codebook_sizes[0]), np.int32)
    feeds = {"repetition_penalty": np.array([penalty], np.float32), "repetition_seen_mask": seen}
    codes = []
    start = time.perf_counter()
    for _ in range(frames):
        go, frame = sessions["local_greedy_frame"].run(None, {"global_hidden": states[:, -1], **feeds})
        if not go.reshape(-1)[0]:
            break
        codes.append(frame.reshape(-1))
        seen[0, np.arange(width), codes[-1]] = 1
        row = np.concatenate([[config.audio_assistant_slot_token_id], codes[-1]]).astype(np.int32)[None, None]
        states, *cache = sessions["decode_step"].run(None, {"input_ids": row, **dict(zip(names, cache)),
                                                            "past_valid_lengths": np.array([length], np.int32)})
        length += 1
    elapsed = time.perf_counter() - start
    return elapsed * 1e3 / max(len(codes), 1), np.array(codes, dtype=np.int64).reshape(-1, width)


def our_frames(tts, text: str, settings, threads: int):
    """Our optimized frame on ``threads`` threads; return (ms per frame, codes (F, Q))."""
    from moss_npu.cpu.threads import set_threads
    from moss_npu.nano.frames import PhaseTimer

    set_threads(threads)
    timer = PhaseTimer()
    codes = tts.synthesize(text, settings=settings, timer=timer).codes
    return timer.seconds["frame"] * 1e3 / max(len(codes), 1), codes.numpy()


def main(argv: Optional[list[str]] = None) -> int:
    """Print the comparison table, the codes check and the two ratios."""
    return run_cli(lambda: bench(build_parser().parse_args(argv)))


def bench(args: argparse.Namespace) -> int:
    if args.frames < 1 or args.rounds < 1 or args.warmup < 0:
        raise InputError(f"--frames {args.frames} --rounds {args.rounds} --warmup {args.warmup}: use frames and "
                         "rounds >= 1, warmup >= 0")
    import onnxruntime  # a missing one fails here, before minutes of loading (run_cli names the extra)

    tts, rows, sessions, model_dir = load(args)
    mib = stack_mib(tts)
    before = read_bandwidth(THREADS, mib)
    ms, codes, runs = measure(tts, rows, sessions, args)
    after = read_bandwidth(THREADS, mib)
    print(f"{model_dir}: {rows.shape[0]} prompt rows, {args.frames} greedy frames, {args.rounds} rounds after "
          f"{args.warmup} warm-up; onnxruntime {onnxruntime.__version__} on the official modules exported "
          f"(--local {args.local}), a stand-in for the published graphs")
    print(f"before the rounds, {bandwidth_line(before, mib)}")
    print(f"after the rounds, {bandwidth_line(after, mib)}")
    print("| runtime | " + " | ".join(f"{n} thread{'s' * (n > 1)}" for n in THREADS) + " |")
    print("|---|" + "---:|" * len(THREADS))
    for runtime, label in (("onnx", "onnxruntime, greedy frame graph"), ("fp32", "moss-npu fp32")):
        print(f"| {label} | " + " | ".join(f"{ms[f'{runtime}@{n}']:.1f}" for n in THREADS) + " |")
    if codes is None:
        print("error: the codes differ (above): the times compare different work", file=sys.stderr)
        return 1
    print(f"codes agree: {codes.size}/{codes.size} in each of {runs} runs")
    best = min(THREADS, key=lambda n: ms[f"onnx@{n}"])
    print(f"fp32@1 / onnx@1: {ms['fp32@1'] / ms['onnx@1']:.2f}")
    print(f"fp32@2 / onnx best (@{best}): {ms['fp32@2'] / ms[f'onnx@{best}']:.2f}")
    return 0


def stack_mib(tts) -> int:
    """Return the MiB of the global stack's weights as the kernels read them: the probe's buffer size."""
    return max(1, round(part_bytes(tts, 0, 1, 0)["global"][1] / 2**20))


def load(args: argparse.Namespace):
    """Our pipeline on the bench checkpoint, the prompt rows of the text, and onnxruntime sessions per thread count
    over the graphs exported from the official code on the same checkpoint."""
    import torch

    from bench.checkpoints import ensure_checkpoints
    from moss_npu.tts.pipeline import MossTTSNano
    from moss_npu.upstream import load_upstream

    model_dir, codec_dir = ensure_checkpoints(args.size, args.cache_dir)
    tts = MossTTSNano.from_pretrained(str(model_dir), str(codec_dir), device="cpu")
    (rows,) = tts._prepare(TEXT, greedy(args.frames), None, None).rows
    with tempfile.TemporaryDirectory(prefix="onnx_frame_") as work:
        with load_upstream(str(official_view(model_dir, Path(work))), str(codec_dir), device=torch.device("cpu"),
                           code_dir=args.upstream_code) as up:
            paths = export_graphs(up.model, rows, Path(work), args.local)
        prefill_session = session(paths.pop("prefill"), 1)  # untimed: one is enough
        sessions = {n: {"prefill": prefill_session, **{name: session(path, n) for name, path in paths.items()}}
                    for n in THREADS}
    return tts, rows, sessions, model_dir


def greedy(frames: int):
    """The run settings of every run: greedy with the runtime's repetition penalty, ``frames`` frames."""
    from moss_npu.tts.settings import RunConfig

    return RunConfig(do_sample=False, max_new_frames=frames, text_normalization=False, wetext=False)


def measure(tts, rows, sessions: dict, args: argparse.Namespace):
    """Alternate the runs (ours, then onnxruntime, at each thread count) for the rounds; return the median
    ms/frame per ``runtime@threads``, the codes (None where any run's codes differed from our first run's) and
    the number of runs."""
    import numpy as np

    settings = greedy(args.frames)
    times: dict[str, list[float]] = {}
    reference, agreed, runs = None, True, 0
    for round_index in range(args.warmup + args.rounds):
        for n in THREADS:
            for runtime, run in (("fp32", lambda: our_frames(tts, TEXT, settings, n)),
                                 ("onnx", lambda: onnx_frames(sessions[n], rows, args.frames,
                                                              settings.audio_repetition_penalty, tts.config))):
                ms, codes = run()
                reference = codes if reference is None else reference
                if codes.shape != reference.shape or not np.array_equal(codes, reference):
                    agreed = False
                    equal = int((codes == reference).sum()) if codes.shape == reference.shape else 0
                    print(f"error: {runtime}@{n} round {round_index}: codes {codes.shape}, {equal}/{reference.size} "
                          f"equal to ours {reference.shape}", file=sys.stderr)
                runs += 1
                if round_index >= args.warmup:
                    times.setdefault(f"{runtime}@{n}", []).append(ms)
    return {label: statistics.median(values) for label, values in times.items()}, reference if agreed else None, runs


if __name__ == "__main__":
    sys.exit(main())
