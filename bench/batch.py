"""Batched decoding measures of the bench (``python -m bench.run --batch 1,4,8,16 [--graph on,off]``).

B requests of one case (each text numbered differently, so the prompts differ in length and content) are
admitted into one ``FrameDecoder`` at once and decoded together, greedy, ``--frames`` frames each. Per-slot
ms/frame is the wall time of one decoder step (every slot gets one frame per step); aggregate frames/s counts
the frames of all slots; RTF per request is the batch's whole wall time (prefill, frames, codec) over one
request's audio length, what each user of that batch waits per second of speech.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Optional

import torch

from bench.run import numbered
from moss_npu import device as devices
from moss_npu.nano.decoder import RequestParams
from moss_npu.tts.pipeline import MossTTSNano
from moss_npu.tts.settings import RunConfig


@dataclass
class BatchRecord:
    """Measurements of one batch of requests."""

    case: str
    batch: int
    graph: str
    graphs_active: bool
    threads: int
    frames: int
    prefill_ms: float
    slot_ms_per_frame: float
    aggregate_fps: float
    rtf: float
    codec_ms: float
    state_mib: float
    load_avg: float


def run_batch(tts: MossTTSNano, case: str, batch: int, frames: int, serial: int,
              request: tuple[str, object]) -> BatchRecord:
    """Decode ``batch`` requests of ``case`` together once; return the measures."""
    text, audio = request
    settings, graph = RunConfig(do_sample=False, max_new_frames=frames, host_rng=True), tts.graph
    prompts, plans = [], []
    for i in range(batch):
        plan = tts.preparer.plan(numbered(serial + i, text), settings, audio)
        plans.append(plan)
        prompts.append(tts.preparer.prompt_rows(plan, plan.chunks[0]))
    sync = devices.backend(tts.device).synchronize
    decoder = tts.decoder(batch, max(int(p.shape[0]) for p in prompts) + frames, "noise")
    load = os.getloadavg()[0]
    start = time.perf_counter()
    slots = [decoder.admit(p, RequestParams(settings.sampling(), plans[0].nq, frames)) for p in prompts]
    sync()
    prefill_s = time.perf_counter() - start
    codes: dict[int, list[torch.Tensor]] = {s: [] for s in slots}
    steps, t0 = 0, time.perf_counter()
    while decoder.active_slots:
        out = decoder.step()
        steps += 1
        for s in slots:
            if bool(out.active[s]):
                codes[s].append(out.codes[s])
    sync()
    frame_s = time.perf_counter() - t0
    for s in slots:
        decoder.release(s)
    t1 = time.perf_counter()
    for s in slots:
        if codes[s]:
            tts.codec.decode(torch.stack(codes[s])[:, :plans[0].nq].T[:, None, :].to(tts.device))
    sync()
    codec_s = time.perf_counter() - t1
    made = sum(len(c) for c in codes.values())
    audio_s = max(made / batch, 1) / tts.codec.frame_rate_hz
    return BatchRecord(case=case, batch=batch, graph=graph, graphs_active=decoder.graphs_active,
                       threads=torch.get_num_threads(), frames=made // batch, prefill_ms=prefill_s * 1e3,
                       slot_ms_per_frame=frame_s * 1e3 / max(steps, 1), aggregate_fps=made / frame_s,
                       rtf=(prefill_s + frame_s + codec_s) / audio_s, codec_ms=codec_s * 1e3,
                       state_mib=decoder.memory_bytes() / 2**20, load_avg=load)


def summarize_batches(records: list[BatchRecord]) -> list[dict]:
    """Median of every measure per (case, batch, graph), in first-seen order."""
    groups: dict[tuple, list[BatchRecord]] = {}
    for r in records:
        groups.setdefault((r.case, r.batch, r.graph), []).append(r)
    rows = []
    for (case, batch, graph), runs in groups.items():
        row = {"case": case, "batch": batch, "graph": graph, "runs": len(runs),
               "graphs_active": runs[-1].graphs_active, "threads": runs[0].threads, "frames": runs[0].frames,
               "state_mib": runs[0].state_mib, "load_avg": max(r.load_avg for r in runs)}
        for key in ("prefill_ms", "slot_ms_per_frame", "aggregate_fps", "rtf", "codec_ms"):
            row[key] = statistics.median(getattr(r, key) for r in runs)
        rows.append(row)
    return rows


def batch_speedup(rows: list[dict], graph: str) -> Optional[tuple[int, float]]:
    """Return (largest batch B, median over cases of aggregate frames/s at B over that at batch 1)."""
    by = {(r["case"], r["batch"]): r for r in rows if r["graph"] == graph}
    sizes = sorted({b for _, b in by})
    if len(sizes) < 2 or sizes[0] != 1:
        return None
    top = sizes[-1]
    ratios = [by[(c, top)]["aggregate_fps"] / by[(c, 1)]["aggregate_fps"] for c, b in by if b == 1 and (c, top) in by]
    return top, statistics.median(ratios)


def batch_markdown(rows: list[dict]) -> str:
    """Render the batch summary as a Markdown table."""
    lines = ["| case | batch | graph | threads | frames | slot ms/frame | aggregate frames/s | RTF/request | "
             "prefill ms | codec ms | state MiB | load |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        graph = r["graph"] + ("" if r["graphs_active"] or r["graph"] == "off" else " (eager)")
        lines.append(f"| {r['case']} | {r['batch']} | {graph} | {r['threads']} | {r['frames']} | "
                     f"{r['slot_ms_per_frame']:.1f} | {r['aggregate_fps']:.1f} | {r['rtf']:.2f} | "
                     f"{r['prefill_ms']:.0f} | {r['codec_ms']:.0f} | {r['state_mib']:.0f} | {r['load_avg']:.2f} |")
    return "\n".join(lines)
