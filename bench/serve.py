"""Load benchmark of the speech server: aggregate audio seconds per wall second at several concurrency levels.

    python -m bench.serve --concurrency 1,4,8,16                 # starts a server on the real-size random checkpoint
    python -m bench.serve --url http://127.0.0.1:8000 --api-key KEY --concurrency 1,8

At each level, C clients each send ``--requests`` streaming PCM requests one after another (greedy,
``--frames`` frames each, every text numbered so no two share a prompt). Measured per request: time to first
audio (request sent → first audio bytes), RTF (wall time / audio seconds) and errors; per level: aggregate audio
seconds / wall second. With ``--rounds N`` the levels run N times in turn (1, 8, 1, 8, ...) and a level's
audio seconds / s is the median of its rounds, so a burst of other work on a shared machine skews one round,
not the result. Results go to ``bench/results/`` as JSON + Markdown; with two or more levels the last stdout
line is ``concurrency speedup C/1: X.XX`` (aggregate audio-seconds/s of the highest level over the lowest,
which should be 1). Exit codes: 0 done; 1 runtime failure (server did not start); 2 bad usage; 130
interrupted (the started server is stopped).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from bench.checkpoints import SIZES, ensure_checkpoints
from bench.run import RESULTS_DIR, SHORT, numbered, setup_line, write_atomic
from moss_npu.cli import run_cli

STARTUP_S = 600.0


@dataclass
class Sample:
    """One request: its level, status, audio seconds, time to first audio and wall time."""

    concurrency: int
    ok: bool
    audio_s: float
    ttfa_ms: Optional[float]
    wall_s: float
    error: Optional[str] = None
    round: int = 0


def _percentile(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


class Target:
    """A server to load: started here (and stopped at the end) or given by ``--url``."""

    def __init__(self, url: str, api_key: Optional[str], process: Optional[subprocess.Popen] = None,
                 voices: Optional[tempfile.TemporaryDirectory] = None, started: Optional[float] = None) -> None:
        self.url, self.api_key, self.process = url.rstrip("/"), api_key, process
        self.started = started  # time.monotonic() when the server command was started here
        self._voices = voices  # the started server's voice store, removed by stop()

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @classmethod
    def start(cls, model: Path, codec: Path, args: argparse.Namespace, log_path: Path) -> "Target":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        voices = tempfile.TemporaryDirectory(prefix="moss-npu-bench-voices-")
        command = [sys.executable, "-m", "moss_npu.serve", "--model", str(model), "--codec", str(codec),
                   "--device", args.device, "--port", str(port), "--max-batch", str(args.max_batch),
                   "--max-queue", "1024", "--voices-dir", voices.name,
                   "--log-level", "warning"]
        if args.num_threads:
            command += ["--num-threads", str(args.num_threads)]
        repo = Path(__file__).resolve().parents[1]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
        log = open(log_path, "wb")
        started = time.monotonic()
        process = subprocess.Popen(command, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)
        return cls(f"http://127.0.0.1:{port}", None, process, voices, started)

    def wait_ready(self, deadline_s: float) -> dict:
        import httpx

        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}")
            try:
                r = httpx.get(f"{self.url}/health", timeout=5)
                if r.status_code == 200:
                    return r.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.1)  # the ready time is reported to this resolution
        raise RuntimeError(f"the server at {self.url} was not ready within {deadline_s:.0f} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._voices is not None:
            self._voices.cleanup()
            self._voices = None


def speak(client, target: Target, text: str, frames: int, concurrency: int) -> Sample:
    """Send one streaming PCM request through ``client`` (an ``httpx.Client``: the client's own set-up, ~18 ms
    per new client here, is not the server's time) and time it from the moment it is sent."""
    import httpx

    body = {"model": "moss-tts-nano", "input": text, "response_format": "pcm", "greedy": True,
            "max_new_frames": frames}
    start = time.perf_counter()
    first, size = None, 0
    try:
        with client.stream("POST", f"{target.url}/v1/audio/speech", json=body, headers=target.headers) as r:
            if r.status_code != 200:
                return Sample(concurrency, False, 0.0, None, time.perf_counter() - start,
                              f"HTTP {r.status_code}: {r.read()[:200]!r}")
            rate, channels = int(r.headers["x-sample-rate"]), int(r.headers["x-channels"])
            for chunk in r.iter_bytes():
                if chunk and first is None:
                    first = time.perf_counter() - start
                size += len(chunk)
    except httpx.HTTPError as exc:
        return Sample(concurrency, False, 0.0, None, time.perf_counter() - start, f"{type(exc).__name__}: {exc}")
    return Sample(concurrency, True, size / (rate * channels * 2), None if first is None else first * 1e3,
                  time.perf_counter() - start)


def run_level(target: Target, concurrency: int, requests: int, frames: int, serial: list[int]) -> tuple[list, float]:
    """C clients × ``requests`` sequential requests each; return the samples and the level's wall time. The clients
    are made before the clock starts: making one costs ~15 ms of CPU here (its TLS context), which at eight clients
    a round took from the server it measures."""
    import httpx

    texts = []
    for _ in range(concurrency * requests):
        serial[0] += 1
        texts.append(numbered(serial[0], SHORT['en']))
    # one per client, as an application holds one
    clients = [httpx.Client(timeout=httpx.Timeout(600.0)) for _ in range(concurrency)]

    def client(index: int) -> list[Sample]:
        return [speak(clients[index], target, texts[index * requests + k], frames, concurrency)
                for k in range(requests)]

    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        start = time.perf_counter()
        samples = [s for batch in pool.map(client, range(concurrency)) for s in batch]
        return samples, time.perf_counter() - start
    finally:
        for http in clients:  # an interrupted level's requests end here, rather than run to their end
            http.close()
        pool.shutdown(wait=True)


def summarize(samples: list[Sample], walls: dict[int, list[float]]) -> list[dict]:
    """Per level: requests, errors, audio seconds/s (median of the rounds, and each round's), TTFA p50/p95,
    RTF p50/p95 (over every round's requests)."""
    rows = []
    for level, level_walls in walls.items():
        mine = [s for s in samples if s.concurrency == level]
        good = [s for s in mine if s.ok]
        ttfa = [s.ttfa_ms for s in good if s.ttfa_ms is not None]
        rtf = [s.wall_s / s.audio_s for s in good if s.audio_s > 0]
        rates = [sum(s.audio_s for s in good if s.round == r) / wall if wall > 0 else 0.0
                 for r, wall in enumerate(level_walls)]
        rows.append({"concurrency": level, "requests": len(mine), "errors": len(mine) - len(good),
                     "audio_s": sum(s.audio_s for s in good), "wall_s": sum(level_walls),
                     "audio_s_per_s": statistics.median(rates), "audio_s_per_s_rounds": rates,
                     "ttfa_p50_ms": _percentile(ttfa, 0.5), "ttfa_p95_ms": _percentile(ttfa, 0.95),
                     "rtf_p50": _percentile(rtf, 0.5), "rtf_p95": _percentile(rtf, 0.95)})
    return rows


def markdown(rows: list[dict]) -> str:
    def num(value, digits=1):
        return "–" if value is None else f"{value:.{digits}f}"

    lines = ["| concurrency | requests | errors | audio s | wall s | audio s / s | by round | TTFA p50 ms "
             "| TTFA p95 ms | RTF p50 | RTF p95 | load |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        rounds = " ".join(num(x, 2) for x in r["audio_s_per_s_rounds"])
        loads = r.get("load_avg_by_round") or []
        load = "–" if not loads else " ".join(num(x, 2) for x in loads)
        lines.append(f"| {r['concurrency']} | {r['requests']} | {r['errors']} | {num(r['audio_s'])} | "
                     f"{num(r['wall_s'])} | {num(r['audio_s_per_s'], 2)} | {rounds} | {num(r['ttfa_p50_ms'], 0)} | "
                     f"{num(r['ttfa_p95_ms'], 0)} | {num(r['rtf_p50'], 2)} | {num(r['rtf_p95'], 2)} | {load} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,4,8,16", help="comma-separated client counts")
    p.add_argument("--requests", type=int, default=2, help="sequential requests per client and level")
    p.add_argument("--frames", type=int, default=24, help="frames per request (12.5 per second of audio)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests first")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the levels this many times in turn; a level's audio s/s is the median of its rounds")
    p.add_argument("--url", help="load this server instead of starting one")
    p.add_argument("--api-key", help="Bearer key of the --url server")
    p.add_argument("--device", default="cpu", help="device(s) of the started server, e.g. cpu or npu:0,npu:1")
    p.add_argument("--max-batch", type=int, default=16, help="engine slots of the started server")
    p.add_argument("--num-threads", type=int, default=0, help="CPU threads per worker of the started server")
    p.add_argument("--model", help="model folder for the started server (default: the random real-size one)")
    p.add_argument("--codec", help="codec folder for the started server")
    p.add_argument("--size", choices=SIZES, default="real", help="size of the generated checkpoints")
    p.add_argument("--cache-dir", type=Path, help="where generated checkpoints are kept (default: system temp)")
    p.add_argument("--out", type=Path, help="output file stem (default bench/results/serve-<time>)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    return run_cli(lambda: bench(build_parser().parse_args(argv)))


def bench(args: argparse.Namespace) -> int:
    """Run the levels against the server ``args`` names or starts; write and print the results."""
    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1 or args.requests < 1 or args.frames < 1 or args.warmup < 0 or args.rounds < 1:
        print("error: --concurrency needs positive integers (e.g. 1,4,8,16); --requests, --frames and --rounds "
              ">= 1", file=sys.stderr)
        return 2
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    stem = args.out or RESULTS_DIR / time.strftime("serve-%Y%m%d-%H%M%S")
    target = Target(args.url, args.api_key) if args.url else None
    try:
        if target is None:
            made = (args.model, args.codec) if args.model and args.codec else ensure_checkpoints(args.size,
                                                                                                  args.cache_dir)
            stem.parent.mkdir(parents=True, exist_ok=True)
            target = Target.start(Path(made[0]), Path(made[1]), args, stem.with_suffix(".server.log"))
            log(f"bench: starting a server on {args.device} ({target.url})")
        health = target.wait_ready(STARTUP_S)
        startup_s = None if target.started is None else time.monotonic() - target.started
        for worker in health.get("workers", []):
            log(f"bench: worker {worker['index']} on {worker['device']}: {setup_line(worker.get('setup'))}")
        serial = [0]
        if args.warmup:
            run_level(target, 1, args.warmup, args.frames, serial)
        samples, walls, loads = [], {level: [] for level in levels}, {level: [] for level in levels}
        for round_index in range(args.rounds):
            for level in levels:
                loads[level].append(os.getloadavg()[0])  # other work on the machine skews the numbers: recorded
                got, wall = run_level(target, level, args.requests, args.frames, serial)
                for s in got:
                    s.round = round_index
                samples += got
                walls[level].append(wall)
                audio = sum(s.audio_s for s in got if s.ok)
                log(f"bench: round {round_index + 1}/{args.rounds}, concurrency {level}: {audio / wall:.2f} "
                    f"audio s/s, {sum(not s.ok for s in got)} errors")
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if target is not None:
            target.stop()
    rows = summarize(samples, walls)
    for row in rows:
        row["load_avg_by_round"] = loads[row["concurrency"]]
    report = {"server": target.url, "workers": health.get("workers"), "startup_s": startup_s, "frames": args.frames,
              "requests_per_client": args.requests, "rounds": args.rounds, "summary": rows, "samples": [asdict(s) for s in samples]}
    table = markdown(rows)
    write_atomic(stem.with_suffix(".json"), json.dumps(report, indent=2) + "\n")
    setup = "; ".join(f"worker {w['index']}: {setup_line(w.get('setup'))}" for w in health.get("workers", []))
    ready = "" if startup_s is None else f"/health ready {startup_s:.1f} s after the server command; "
    write_atomic(stem.with_suffix(".md"), f"{ready}{setup}\n\n{table}\n")
    print(f"{ready}{setup}; results: {stem}.json, {stem}.md")
    print(table)
    if len(rows) >= 2:
        low, high = min(rows, key=lambda r: r["concurrency"]), max(rows, key=lambda r: r["concurrency"])
        ratio = high["audio_s_per_s"] / low["audio_s_per_s"] if low["audio_s_per_s"] else 0.0
        print(f"concurrency speedup {high['concurrency']}/{low['concurrency']}: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
