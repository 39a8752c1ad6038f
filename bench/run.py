"""Speed benchmark of the native MOSS-TTS-Nano pipeline: RTF, time to first audio, per-frame split, memory.

    python -m bench.run --device cpu                              # real-size random checkpoint (cached)
    python -m bench.run --compare reference,optimized --cases short-en
    python -m bench.run --compare optimized@1,optimized@2         # intra-op threads 1 vs 2
    python -m bench.run --batch 1,4,8,16 --cases short-en         # batched decoding (see bench/batch.py)
    python -m bench.run --device cuda --batch 1,8,32 --graph on,off
    python -m bench.run --compare reference@1,optimized@1 --quantize int8  # int8 weight-only CPU step
    python -m bench.run --cases stream-en                         # what `inference.py --stream` runs

Every run of a ``short``/``long`` case is greedy with a fixed frame count per text chunk (``--frames``, default
24), so runs compare like with like. A ``stream`` case is what ``inference.py --stream`` runs with its defaults:
the long text, sampled, text normalization on, up to 375 frames (``--frames`` if given), streamed through
``synthesize_stream``; its RTF is the CLI's, the model loaded.
A configuration is ``DECODER[@THREADS]`` (``moss_npu.tts.settings.DECODERS``); with ``--compare`` the
configurations run alternately in one process, and the last stdout line is ``speedup B/A: X.XX``: the median
over cases of (median per-frame time of A) / (median per-frame time of B), so > 1 means B is faster.
Per-frame time = the frame phase (local decisions, sampling, global step; prefill and codec excluded).
Every case (not ``--batch``) reports the frame split: global, local, codec and host (the wall time per frame
left over: Python and bookkeeping) and each part's floor (``bench/floor.py``: bytes read per frame over a bandwidth probe of that part's size, on the same threads).
A configuration without ``@THREADS`` runs the default thread setting as the CLI does: its frames' products borrow
the idle cores (``moss_npu.cpu.threads.borrowed_cores``), which its ``threads`` column counts.
With ``--batch B1,B2,...`` each case runs as batches of those sizes instead (``bench/batch.py``), per
``--graph`` mode; the last stdout line is then ``batch speedup B/1: X.XX`` (aggregate frames/s of the largest
batch over batch 1, median over cases, first graph mode).
Results go to ``bench/results/`` as JSON + Markdown. Exit codes: 0 done; 1 runtime failure; 2 bad usage; 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from moss_npu_verify import goldens
from moss_npu.cli import ArgumentParser, run_cli
from moss_npu.errors import InputError
from moss_npu.output import writable_file

if TYPE_CHECKING:
    from moss_npu.tts.pipeline import MossTTSNano
# torch and the pipeline are imported on use, so `python -m bench.run` answers --help, bad flags, Ctrl-C and a
# machine without torch (moss_npu.extras) with one line under the exit-code policy.
SIZES = ("real", "tiny")  # bench.checkpoints.SIZES, named here so the parser needs no torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SHORT = {"en": "Hello there, my friend.", "zh": "今天天气很好，我们去公园散步吧。"}
LONG = {
    "en": ("The old lighthouse stood at the edge of the cliff for more than a century. Every night its keeper "
           "climbed the narrow stairs, trimmed the wick and watched the beam sweep across the dark water. Ships "
           "passing far out at sea trusted that light to guide them home. When the storms came in autumn, the "
           "waves rose higher than the rocks, and the keeper wrote long letters to his sister in the city, "
           "describing the sound of the wind and the colour of the sky at dawn."),
    "zh": ("清晨的阳光洒在安静的小镇上，街道两旁的店铺陆续开门。面包店里飘出刚出炉的香味，孩子们背着书包走向学校。"
           "老人们在公园里打太极拳，湖面上有几只白鹭轻轻掠过。到了中午，市场里热闹起来，商贩们大声吆喝，顾客们挑选着新鲜"
           "的蔬菜和水果。下午的时候，天空飘来几朵白云，微风吹过树梢，带来一丝凉意。傍晚，家家户户亮起灯光，饭菜的香气"
           "从窗户里飘出来，一天的忙碌渐渐归于平静。夜深了，星星挂满天空，小镇进入了甜美的梦乡。"),
}
REFERENCES = {"en": "en_3.wav", "zh": "zh_1.wav"}
GREEDY_CASES = [f"{length}-{lang}{ref}" for ref in ("", "+ref") for length in ("short", "long")
                for lang in ("en", "zh")]
STREAM_CASES = ["stream-en", "stream-zh"]  # the CLI's defaults, streamed
CASES = GREEDY_CASES + STREAM_CASES
DEFAULT_FRAMES = 24
PHASES = ("prefill", "frame", "codec")


@dataclass(frozen=True)
class BenchConfig:
    """One configuration under test: a decoder algorithm and the intra-op thread count (0: leave torch's)."""

    decoder: str
    threads: int = 0

    @property
    def label(self) -> str:
        return self.decoder if self.threads == 0 else f"{self.decoder}@{self.threads}"

    @classmethod
    def parse(cls, text: str) -> "BenchConfig":
        from moss_npu.tts.settings import DECODERS

        decoder, _, threads = text.strip().partition("@")
        if decoder not in DECODERS or (threads and not threads.isdigit()):
            raise ValueError(f"configuration {text!r}; use DECODER[@THREADS] with DECODER one of {DECODERS}")
        return cls(decoder, int(threads or 0))


@dataclass
class RunRecord:
    """Measurements of one synthesis (plus one streamed start for the time to first audio)."""

    case: str
    config: str
    threads: int  # the frames' threads: torch's in this thread plus those borrowed
    chunks: int
    frames: int
    wall_s: float
    rtf: float
    ttfa_ms: Optional[float]
    frame_ms: float
    codec_ms: float
    prefill_ms: float
    peak_memory_bytes: Optional[int]
    load_avg: float
    dtype: str = "float32"
    step: str = "torch"  # the frame step: cpu-fp32/avx2 (cpu.step's label / its kernels' instruction set), torch, reference
    compile_s: float = 0.0  # time the CPU step spent compiling graphs so far (first compile; 0 when eager)
    local_ms: Optional[float] = None  # per frame: the 17 local steps with their decisions
    global_ms: Optional[float] = None  # per frame: the global step
    host_ms: Optional[float] = None  # per frame: wall time outside global, local, codec and prefill
    prompt_rows: int = 0  # the longest chunk's prompt rows (for the global floor's keys and values)
    borrowed: int = 0  # threads the frames borrowed (``MossTTSNano.spare_threads``); the codec runs without them
    codec_calls: int = 0
    phases_s: dict = field(default_factory=dict)


def numbered(serial: int, text: str) -> str:
    """Return ``text`` with ``serial`` in front, so that two runs share no more of their prompts than the template
    and the prefix cache leaves the whole text to prefill, as for a new request. ``11: `` and not ``11. ``: the
    text preparation drops a numbered-list marker (``moss_npu.text.robust``), which made every run's prompt the
    same, so the cache skipped all of a prompt but its last row."""
    return f"{serial}: {text}"


def case_request(case: str) -> tuple[str, Optional[Path]]:
    """Return the text and the reference recording (or None) of a case name like ``long-zh+ref``."""
    name, ref = case.removesuffix("+ref"), case.endswith("+ref")
    length, lang = name.split("-")  # a stream case speaks the long text
    text = (SHORT if length == "short" else LONG)[lang]
    audio = goldens.fixtures_root() / "audio" / REFERENCES[lang] if ref else None
    return text, audio


def run_once(tts: MossTTSNano, case: str, config: BenchConfig, frames: Optional[int], stream: bool,
             serial: int) -> RunRecord:
    """Synthesize ``case`` once under ``config``; optionally time a streamed start too (a stream case is timed
    streamed, as the CLI runs it).

    The text gets the number ``serial`` (and ``serial + 1`` for the stream) in front, so no run meets a prompt
    it has seen: the prompt cache of the optimized path reuses only what a new request shares (the template).
    """
    from moss_npu import device as devices
    from moss_npu.nano.frames import PhaseTimer
    from moss_npu.cpu.threads import borrowed_cores, set_threads
    from moss_npu.tts.settings import RunConfig

    set_threads(config.threads)  # 0: the default policy, whose frames borrow the idle cores as the CLI's do
    tts.spare_threads = borrowed_cores(config.threads)
    text, audio = case_request(case)
    if case in STREAM_CASES:  # the CLI's defaults
        settings = RunConfig() if frames is None else RunConfig(max_new_frames=frames)
    else:  # the model's speed; bench.text_norm times the text normalization
        settings = RunConfig(do_sample=False, max_new_frames=frames or DEFAULT_FRAMES, text_normalization=False,
                             wetext=False)
    back = devices.backend(tts.device)
    back.reset_peak_memory_stats()
    timer = PhaseTimer(sync=back.synchronize)
    load = os.getloadavg()[0]
    request = dict(prompt_audio=audio, settings=settings)
    prompt_rows = max(int(r.shape[0]) for r in tts._prepare(numbered(serial, text), settings, audio, None).rows)
    start, ttfa = time.perf_counter(), None
    if case in STREAM_CASES:
        samples, chunks, voiced = 0, set(), 0
        for chunk in tts.synthesize_stream(numbered(serial, text), timer=timer, **request):
            if ttfa is None and not chunk.is_pause:
                ttfa = (time.perf_counter() - start) * 1e3
            samples += chunk.waveform.shape[-1]
            voiced += 0 if chunk.is_pause else chunk.waveform.shape[-1]
            chunks.add(chunk.chunk_index)
        wall = time.perf_counter() - start
        n_frames, n_chunks, audio_s = voiced // tts.codec.frame_size, len(chunks), samples / tts.sample_rate
    else:
        result = tts.synthesize(numbered(serial, text), timer=timer, **request)
        wall = time.perf_counter() - start
        if stream:
            start = time.perf_counter()
            chunks = tts.synthesize_stream(numbered(serial + 1, text), **request)
            next(chunks)
            ttfa = (time.perf_counter() - start) * 1e3
            chunks.close()
        n_frames, n_chunks = int(result.codes.shape[0]), len(result.text_chunks)
        audio_s = n_frames / tts.codec.frame_rate_hz  # the frames' audio, pauses not counted
    return record(tts, case, config, timer, wall, n_frames, n_chunks, audio_s, ttfa, load,
                  prompt_rows=prompt_rows)


def record(tts: MossTTSNano, case: str, config: BenchConfig, timer, wall: float, n_frames: int, n_chunks: int,
           audio_s: float, ttfa: Optional[float], load: float, prompt_rows: int) -> RunRecord:
    """One run's record: per-frame times of the parts and what is left of the wall time (the host)."""
    import torch

    from moss_npu import device as devices
    from moss_npu.cpu.quantize import dtype_name

    sec = dict(timer.seconds)
    per_frame = {k: sec.get(k, 0.0) * 1e3 / max(n_frames, 1) for k in ("frame", "codec", "local", "global", "prefill")}
    frame_step = tts._decoder.frame_step if tts.algorithm != "reference" else None
    step = "reference" if frame_step is None else frame_step.dispatch()
    borrowed = tts.spare_threads if frame_step is not None and frame_step.borrows else 0
    return RunRecord(
        case=case, config=config.label, threads=torch.get_num_threads() + borrowed, borrowed=borrowed,
        chunks=n_chunks, frames=n_frames,
        wall_s=wall, rtf=wall / max(audio_s, 1e-9), ttfa_ms=ttfa,
        frame_ms=per_frame["frame"], codec_ms=per_frame["codec"],
        prefill_ms=sec.get("prefill", 0.0) * 1e3 / max(timer.calls.get("prefill", 0), 1),
        peak_memory_bytes=devices.backend(tts.device).max_memory_allocated(), load_avg=load,
        dtype=dtype_name(tts.model), step=step,
        compile_s=frame_step.compile_seconds if frame_step is not None else 0.0,
        local_ms=per_frame["local"] if "local" in sec else None,
        global_ms=per_frame["global"] if "global" in sec else None,
        host_ms=wall * 1e3 / max(n_frames, 1) - sum(per_frame[k] for k in ("local", "global", "prefill", "codec")),
        prompt_rows=prompt_rows, codec_calls=timer.calls.get("codec", 0), phases_s=sec)


def setup_line(setup: Optional[dict]) -> str:
    """One line of what a run ran (``MossTTSNano.setup``, plus how long loading took where known)."""
    if not setup:
        return "setup unknown (a server that does not report it)"
    line = (f"dtype {setup['dtype']}, step {setup['step']}, {setup['threads']} threads, prepared weights: "
            f"{setup['prepared_weights']}")
    return line + (f", loaded in {setup['load_s']:.2f} s" if "load_s" in setup else "")


def summarize(records: list[RunRecord]) -> list[dict]:
    """Median of every measure per (case, configuration), in first-seen order."""
    groups: dict[tuple[str, str], list[RunRecord]] = {}
    for r in records:
        groups.setdefault((r.case, r.config), []).append(r)
    rows = []
    for (case, config), runs in groups.items():
        row = {"case": case, "config": config, "runs": len(runs), "threads": runs[0].threads,
               "borrowed": runs[0].borrowed,
               "chunks": runs[0].chunks, "frames": runs[0].frames, "dtype": runs[0].dtype, "step": runs[-1].step,
               "compile_s": max(r.compile_s for r in runs),
               "prompt_rows": runs[0].prompt_rows}
        for key in ("rtf", "ttfa_ms", "frame_ms", "local_ms", "global_ms", "codec_ms", "host_ms", "prefill_ms",
                    "wall_s", "codec_calls"):
            values = [getattr(r, key) for r in runs if getattr(r, key) is not None]
            row[key] = statistics.median(values) if values else None
        row["peak_memory_mib"] = max((r.peak_memory_bytes or 0) for r in runs) / 2**20 or None
        row["load_avg"] = max(r.load_avg for r in runs)
        rows.append(row)
    return rows


def add_floors(rows: list[dict], tts: MossTTSNano) -> None:
    """Add each row's parts' floors (``bench.floor``), probing the bandwidth on the threads each part ran on: the
    frames' (borrowed ones included) for global and local, the codec's own."""
    from bench.floor import Probe, floors, part_bytes

    probe = Probe()
    for row in rows:
        parts = part_bytes(tts, row["prompt_rows"], row["frames"], round(row["codec_calls"] or 0))
        frames, codec = row["threads"], row["threads"] - row["borrowed"]
        row["floor"] = floors(parts, {"global": frames, "local": frames, "codec": codec}, probe)


def speedups(rows: list[dict], base: str, other: str) -> dict[str, float]:
    """Per case: median frame time of ``base`` / that of ``other`` (> 1: ``other`` is faster)."""
    by = {(r["case"], r["config"]): r for r in rows}
    return {case: by[(case, base)]["frame_ms"] / by[(case, other)]["frame_ms"]
            for case, config in by if config == base and (case, other) in by and by[(case, other)]["frame_ms"]}


def markdown(rows: list[dict], ratios: dict[str, float], base: Optional[str], other: Optional[str]) -> str:
    """Render the summary as a Markdown table (one row per case and configuration)."""
    def num(value, digits=1):
        return "–" if value is None else f"{value:.{digits}f}"

    def floor(r, part):
        return num((r.get("floor") or {}).get(part, {}).get("floor_ms"))

    lines = ["| case | config | threads | dtype | step | compile s | chunks | frames | RTF | TTFA ms | frame ms "
             "| global ms (floor) | local ms (floor) | codec ms/frame (floor) | host ms | prefill ms | peak RSS MiB "
             "| load |",
             "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['config']} | {r['threads']} | {r['dtype']} | {r['step']} | "
                     f"{num(r['compile_s'])} | {r['chunks']} | {r['frames']} | "
                     f"{num(r['rtf'], 2)} | {num(r['ttfa_ms'], 0)} | {num(r['frame_ms'])} | "
                     f"{num(r['global_ms'])} ({floor(r, 'global')}) | {num(r['local_ms'])} ({floor(r, 'local')}) | "
                     f"{num(r['codec_ms'])} ({floor(r, 'codec')}) | {num(r['host_ms'])} | "
                     f"{num(r['prefill_ms'], 0)} | {num(r['peak_memory_mib'], 0)} | {num(r['load_avg'], 2)} |")
    if ratios:
        lines += ["", f"| case | speedup {other}/{base} |", "|---|---:|"]
        lines += [f"| {case} | {ratio:.2f} |" for case, ratio in ratios.items()]
    return "\n".join(lines)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file in the same folder, then rename (no partial file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m bench.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu (default), cuda[:N], npu[:N], auto")
    p.add_argument("--dtype", help="LM dtype (default float32; bfloat16 on the CPU: bf16 weights, float32 arithmetic)")
    p.add_argument("--model", help="MOSS-TTS-Nano folder (default: a random real-size one the bench writes)")
    p.add_argument("--codec", help="codec folder (default: a random real-size one the bench writes)")
    p.add_argument("--size", choices=SIZES, default="real", help="size of the generated checkpoints")
    p.add_argument("--cache-dir", type=Path, help="where generated checkpoints are kept (default: system temp)")
    p.add_argument("--force-frames", action="store_true",
                   help="bias a --model checkpoint in memory so greedy never stops early (bench only; noise audio)")
    p.add_argument("--frames", type=int, help=f"frames generated per text chunk (12.5 per second; default "
                   f"{DEFAULT_FRAMES}, a stream case the CLI's 375)")
    p.add_argument("--runs", type=int, default=3, help="measured runs per case and configuration (median)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first")
    p.add_argument("--cases", help=f"comma-separated, from {','.join(CASES)} (default all; with --batch the "
                   "greedy ones)")
    p.add_argument("--decoder", default="optimized", help="single configuration DECODER[@THREADS]")
    p.add_argument("--compare", help="two configurations A,B run alternately; prints 'speedup B/A: X.XX'")
    p.add_argument("--threads", type=int, default=0, help="default intra-op threads for configs without @N")
    p.add_argument("--no-stream", action="store_true",
                   help="skip the greedy cases' streamed start (time to first audio)")
    p.add_argument("--batch", help="batch sizes B1,B2,... decoded together (prints 'batch speedup B/1: X.XX')")
    p.add_argument("--graph", default="off", help="with --batch: graph modes to run, e.g. on,off (default off)")
    p.add_argument("--quantize", default="none", choices=("none", "int8"),
                   help="int8: the LM's block weights rounded to int8 (both configurations use the rounded weights)")
    p.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                   help="torch.compile the float32 CPU frame step of the optimized configs (default auto: eager)")
    p.add_argument("--out", type=Path, help="output file stem (default bench/results/bench-<time>)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def parse_sizes(text: Optional[str]) -> list[int]:
    """Parse ``--batch 1,4,8`` into sizes (ValueError on anything but positive integers)."""
    sizes = [int(x) for x in text.split(",")] if text else []
    if any(b < 1 for b in sizes):
        raise ValueError(f"--batch {text}: use positive sizes, e.g. 1,4,8,16")
    return sizes


def load_pipeline(args) -> tuple[MossTTSNano, str, str]:
    """Load the model under test (a generated random checkpoint unless --model/--codec are given)."""
    from bench.checkpoints import ensure_checkpoints, steer_to_continue
    from moss_npu.tts.pipeline import MossTTSNano

    model_dir, codec_dir = args.model, args.codec
    if model_dir is None or codec_dir is None:
        made = ensure_checkpoints(args.size, args.cache_dir)
        model_dir, codec_dir = model_dir or made[0], codec_dir or made[1]
    tts = MossTTSNano.from_pretrained(str(model_dir), str(codec_dir), device=args.device, dtype=args.dtype,
                                      quantize=args.quantize)
    if args.force_frames:
        steer_to_continue(tts.model)
    return tts, str(model_dir), str(codec_dir)


def measure(tts: MossTTSNano, args, cases: list[str], configs: list[BenchConfig], sizes: list[int],
            graphs: list[str], log) -> list:
    """Run warm-up and measured rounds, alternating configurations (drifting load hits each alike)."""
    from bench.batch import run_batch
    from moss_npu.cpu.threads import set_threads

    records: list = []
    serial, ways = 0, {}  # a pipeline per way of computing (LoadConfig's decoder, graph, compile)
    set_threads(args.threads)  # 0: the default policy (moss_npu.cpu.threads)
    for round_index in range(args.warmup + args.runs):
        measured = round_index >= args.warmup
        for case in cases:
            if sizes:
                for size in sizes:
                    for graph in graphs:
                        serial += size
                        ways[graph] = ways.get(graph) or tts.computing(graph=graph)
                        record = run_batch(ways[graph], case, size, args.frames or DEFAULT_FRAMES, serial,
                                           case_request(case))
                        log(f"bench: {'run' if measured else 'warm-up'} {case} batch {size} graph {graph}: "
                            f"{record.slot_ms_per_frame:.1f} ms/frame, {record.aggregate_fps:.1f} frames/s")
                        if measured:
                            records.append(record)
                continue
            for config in configs:
                serial += 2
                way = (config.decoder, args.compile)
                ways[way] = ways.get(way) or tts.computing(decoder=config.decoder, compile=args.compile)
                record = run_once(ways[way], case, config, args.frames, not args.no_stream, serial)
                log(f"bench: {'run' if measured else 'warm-up'} {case} {config.label}: "
                    f"{record.frame_ms:.1f} ms/frame, RTF {record.rtf:.2f}, load {record.load_avg:.2f}")
                if measured:
                    records.append(record)
    return records


def main(argv: Optional[list[str]] = None) -> int:
    """Run the benchmark under the CLI exit-code policy (moss_npu.cli)."""
    return run_cli(lambda: run(argv))


def run(argv: Optional[list[str]] = None) -> int:
    """Parse flags, time every case and configuration, write the reports, print the table."""
    args = build_parser().parse_args(argv)
    import torch

    from bench.batch import batch_markdown, batch_speedup, summarize_batches
    from moss_npu import device as devices

    try:
        configs = [BenchConfig.parse(c) for c in (args.compare or args.decoder).split(",")]
        sizes = parse_sizes(args.batch)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    configs = [c if c.threads or not args.threads else BenchConfig(c.decoder, args.threads) for c in configs]
    graphs = [g.strip() for g in args.graph.split(",") if g.strip()]
    cases = [c.strip() for c in args.cases.split(",") if c.strip()] if args.cases else (
        GREEDY_CASES if sizes else CASES)
    unknown = [c for c in cases if c not in (GREEDY_CASES if sizes else CASES)]
    if (unknown or (args.compare and len(configs) != 2) or (args.frames or 1) < 1 or args.runs < 1
            or args.warmup < 0 or any(g not in ("auto", "on", "off") for g in graphs) or (sizes and args.compare)):
        raise InputError(f"check --cases (unknown{' with --batch' if sizes else ''}: {unknown}), --compare (two "
                         "configurations, not with --batch), --graph (auto/on/off), --frames/--runs >= 1")
    if args.no_stream and set(cases) <= set(STREAM_CASES):
        raise InputError("--no-stream: the stream cases are always streamed; drop it or add a greedy case")
    if any(c.endswith("+ref") for c in cases) and not (goldens.fixtures_root() / "audio").is_dir():
        print(f"bench: no reference audio under {goldens.fixtures_root()}; skipping the +ref cases", file=sys.stderr)
        cases = [c for c in cases if not c.endswith("+ref")]
    stem = args.out or RESULTS_DIR / time.strftime("bench-%Y%m%d-%H%M%S")
    if args.out is not None:  # the reports are written after minutes of timing: check their paths first
        try:
            stem.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"--out {stem}: cannot create folder {stem.parent} ({exc.strerror})") from None
        for suffix in (".json", ".md"):
            writable_file(stem.with_suffix(suffix), "--out")
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    loading = time.perf_counter()
    tts, model_dir, codec_dir = load_pipeline(args)
    setup = {**tts.setup(), "load_s": round(time.perf_counter() - loading, 3)}  # as loaded: before any run
    log(f"bench: {setup_line(setup)}")
    records = measure(tts, args, cases, configs, sizes, graphs, log)
    info = devices.describe(tts.device)
    report = {"device": info, "frames_per_chunk": args.frames or DEFAULT_FRAMES, "runs": args.runs,
              "warmup": args.warmup,
              "threads": torch.get_num_threads(), "model": model_dir, "codec": codec_dir, "setup": setup,
              "records": [asdict(r) for r in records]}
    if sizes:
        rows = summarize_batches(records)
        table, speedup = batch_markdown(rows), batch_speedup(rows, graphs[0])
        report.update(summary=rows, batch_speedup=None if speedup is None else {"batch": speedup[0],
                                                                                 "ratio": speedup[1]})
        last = None if speedup is None else f"batch speedup {speedup[0]}/1: {speedup[1]:.2f}"
    else:
        rows = summarize(records)
        if tts.device.type == "cpu":
            add_floors(rows, tts)
        base, other = (configs[0].label, configs[1].label) if args.compare else (None, None)
        ratios = speedups(rows, base, other) if args.compare else {}
        table = markdown(rows, ratios, base, other)
        report.update(summary=rows, speedups=ratios)
        last = f"speedup {other}/{base}: {statistics.median(ratios.values()):.2f}" if args.compare else None
        if args.compare and {c.threads for c in configs} == {1, 2} and tts.device.type == "cpu":
            from bench.bandwidth import bandwidth_line, read_bandwidth

            report["read_bandwidth_gb_s"] = read_bandwidth()
            table += "\n\n" + bandwidth_line(report["read_bandwidth_gb_s"])
    write_atomic(stem.with_suffix(".json"), json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    write_atomic(stem.with_suffix(".md"), f"Device: {info['name']} ({info['device']}), torch {info['torch']}; "
                 f"{setup_line(setup)}\n\n" + table + "\n")
    print(f"device: {info['name']} ({info['device']}), torch {info['torch']}; {setup_line(setup)}; results: "
          f"{stem}.json, {stem}.md")
    print(table)
    if last is not None:
        print(last)
    return 0


if __name__ == "__main__":
    sys.exit(main())
