"""The server's side of the workers: one process per device, admission, least-loaded dispatch, restarts.

Each request gets a ``Ticket``: an asyncio queue the worker's events land in (from the pipe's reader thread).
Admission is bounded: ``workers × max_batch`` requests can hold a slot and ``max_queue`` more may wait; past
that a request is refused with 429. A worker whose pipe closes (it died) fails its requests with 503 at once
and is started again after a delay that doubles with each crash in a row (``Backoff``); after
``Backoff.limit`` crashes in a row it stays down as ``crash_loop``, with the cause in ``/health`` and the log.
One that fails to load the first time is not restarted (its error is fatal for the server).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from moss_npu.device import get_backend, parse_device
from moss_npu.serve.errors import INTERNAL, WORKER_LOST, ApiError, from_engine
from moss_npu.serve.metrics import Metrics
from moss_npu.serve.spec import WorkerSpec

log = logging.getLogger("moss_npu.serve")


@dataclass(frozen=True)
class Backoff:
    """When a dead worker is started again: ``first_s`` after the first crash, doubling up to ``max_s``; a
    worker that stayed up ``stable_s`` has its count reset; ``limit`` crashes in a row stop the restarts."""

    first_s: float = 0.5
    max_s: float = 30.0
    stable_s: float = 60.0
    limit: int = 5

    def delay(self, crashes: int) -> float:
        """Seconds to wait before restart number ``crashes`` (1-based) of a crash series."""
        return min(self.max_s, self.first_s * 2 ** (crashes - 1))


class Ticket:
    """One request in flight on a worker: its events as they arrive, and a way to stop it."""

    def __init__(self, pool: "WorkerPool", worker: "Worker", rid: int, loop: asyncio.AbstractEventLoop) -> None:
        self.pool, self.worker, self.rid, self.loop = pool, worker, rid, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self._cancel_sent = False
        self._getter: Optional[asyncio.Future] = None

    def deliver(self, event: tuple) -> None:
        """Called from the reader thread."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    async def next(self, timeout: Optional[float]) -> tuple:
        """The next event: ``("chunk", samples, is_pause)``, ``("done", info)``, ``("error", kind, message, info)``,
        ``("encoded", codes)``, or ``("gone",)`` once the client disconnected.

        Raises ``asyncio.TimeoutError`` after ``timeout`` seconds; the event is not lost, the next call gets it.
        """
        if self._getter is None:
            self._getter = asyncio.ensure_future(self.events.get())
        done, _ = await asyncio.wait({self._getter}, timeout=timeout)
        if not done:
            raise asyncio.TimeoutError
        event, self._getter = self._getter.result(), None
        return event

    def gone(self) -> None:
        """The client disconnected (called on the event loop): stop the request and wake whoever waits on it."""
        self._cancel()
        self.events.put_nowait(("gone",))

    def abandon(self) -> None:
        """The client is gone or answered: stop the request if it still runs (its slot frees within a frame)."""
        if self._getter is not None:
            self._getter.cancel()
            self._getter = None
        self._cancel()

    def _cancel(self) -> None:
        if not self.finished and not self._cancel_sent:
            self._cancel_sent = True
            self.worker.send("cancel", self.rid)


class Worker:
    """A worker process and what the server knows about it."""

    def __init__(self, index: int, spec: WorkerSpec) -> None:
        self.index, self.spec = index, spec
        self.state = "stopped"  # starting, ready, dead, failed, stopped
        self.info: dict[str, Any] = {}
        self.tickets: dict[int, Ticket] = {}
        self.active = self.queued = 0
        self.restarts = 0
        self.crashes = 0  # crashes in a row (reset once the worker stays up Backoff.stable_s)
        self.cause: Optional[str] = None  # why it is down (dead, crash_loop, failed)
        self.started_at = 0.0
        self.process: Optional[multiprocessing.process.BaseProcess] = None
        self._conn = None
        self._lock = threading.Lock()

    @property
    def load(self) -> int:
        return len(self.tickets)

    def describe(self) -> dict:
        """What ``/health`` shows of this worker: its state and load, never process details."""
        # the device the worker resolved ("auto" becomes e.g. "cpu") once it has loaded
        state = {"index": self.index, "device": self.info.get("device", self.spec.device), "state": self.state, "in_flight": self.load,
                 "active_slots": self.active, "queued": self.queued, "restarts": self.restarts}
        if self.cause is not None:
            state["cause"] = self.cause
        if self.state == "ready" and "setup" in self.info:
            state["setup"] = self.info["setup"]  # dtype, frame step, threads, prepared weights: no process details
        return state

    def send(self, *message: Any) -> bool:
        with self._lock:
            if self._conn is None:
                return False
            try:
                self._conn.send(message)
                return True
            except (OSError, EOFError, BrokenPipeError):
                return False


class WorkerPool:
    """Starts one worker per device spec and routes requests to them."""

    def __init__(self, specs: list[WorkerSpec], *, max_queue: int, metrics: Metrics,
                 on_fatal: Callable[[str, bool], None] = lambda message, user_fault: None,
                 backoff: Backoff = Backoff(), target: Optional[Callable] = None) -> None:
        """``target(conn, spec)`` is a worker process's entry point (an importable function: workers are spawned;
        default ``run_worker``)."""
        self.workers = [Worker(i, spec) for i, spec in enumerate(specs)]
        self.max_queue, self.metrics, self.on_fatal, self.backoff = max_queue, metrics, on_fatal, backoff
        self.target = run_worker if target is None else target
        self._ids = itertools.count(1)
        self._closing = False
        self._started = False
        self._context = multiprocessing.get_context("spawn")

    @property
    def capacity(self) -> int:
        return sum(w.spec.max_batch for w in self.workers) + self.max_queue

    @property
    def in_flight(self) -> int:
        return sum(w.load for w in self.workers)

    @property
    def ready(self) -> bool:
        return any(w.state == "ready" for w in self.workers)

    def audio_format(self) -> tuple[int, int]:
        """(sample rate, channels) the model speaks, from the first ready worker (48 kHz stereo before that)."""
        for w in self.workers:
            if w.info:
                return int(w.info["sample_rate"]), int(w.info["channels"])
        return 48000, 2

    def start(self) -> None:
        """Spawn the workers; a second call does nothing (an owner may start the pool before the app's lifespan)."""
        if self._started:
            return
        self._started = True
        for w in self.workers:
            self._spawn(w)

    def _spawn(self, w: Worker) -> None:
        parent, child = self._context.Pipe(duplex=True)
        w.process = self._context.Process(target=self.target, args=(child, w.spec), daemon=True,
                                          name=f"moss-npu-worker-{w.index}")
        w.state, w.active, w.queued = "starting", 0, 0
        w.started_at = time.monotonic()
        w.process.start()
        child.close()  # the worker's death must close the pipe for the reader
        w._conn = parent
        threading.Thread(target=self._read, args=(w, parent), name=f"moss-npu-reader-{w.index}",
                         daemon=True).start()

    def _read(self, w: Worker, conn) -> None:
        """Dispatch one worker's messages until its pipe closes."""
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            self._on_message(w, message)
        self._on_exit(w, conn)

    def _on_message(self, w: Worker, message: tuple) -> None:
        kind = message[0]
        if kind == "ready":
            w.info, w.state, w.cause = message[1], "ready", None
            age = w.info.get("process_s")
            log.info("worker %d ready on %s (pid %s, loaded in %.1f s%s; %s)", w.index, w.info["device"],
                     w.info["pid"], w.info["load_s"], "" if age is None else f", {age:.1f} s after its process started",
                     ", ".join(f"{k} {v}" for k, v in w.info.get("setup", {}).items()))
        elif kind == "failed":
            w.state, w.cause = "failed", f"loading failed: {message[2]}"
            if w.restarts == 0:  # a first load: the server cannot serve as configured
                self.on_fatal(f"worker {w.index} ({w.spec.device}): {message[2]}", message[1] != INTERNAL)
            else:
                log.error("worker %d (%s) failed to load again, stays down: %s", w.index, w.spec.device, message[2])
        elif kind == "stats":
            w.active, w.queued = message[1], message[2]
            self.metrics.set_load(sum(x.active for x in self.workers), sum(x.queued for x in self.workers))
        else:
            ticket = w.tickets.get(message[1])
            if ticket is None:
                return
            if kind in ("done", "error", "encoded"):
                self._release(w, ticket)
                if kind != "encoded":
                    self.metrics.frames.inc(int(message[-1].get("frames", 0)))
            ticket.deliver((kind, *message[2:]))

    def _release(self, w: Worker, ticket: Ticket) -> None:
        ticket.finished = True
        w.tickets.pop(ticket.rid, None)
        self.metrics.set_in_flight(self.in_flight)

    def _on_exit(self, w: Worker, conn) -> None:
        """The pipe closed: fail every request of this worker with 503, then start it again if it had served."""
        with w._lock:
            w._conn = None
        conn.close()
        if w.process is not None:
            w.process.join(timeout=5)
        lost = list(w.tickets.values())
        for ticket in lost:
            self._release(w, ticket)
            ticket.deliver(("error", WORKER_LOST, f"worker {w.index} ({w.spec.device}) stopped while serving "
                                                   "this request; retry it"))
        if self._closing or w.state == "failed":
            w.state = "stopped" if self._closing else w.state
            return
        was_ready = w.state == "ready"
        code = w.process.exitcode if w.process is not None else None
        cause = f"exited with code {code}" if code is None or code >= 0 else f"killed by signal {-code}"
        log.warning("worker %d (%s) %s with %d requests in flight", w.index, w.spec.device, cause, len(lost))
        if not was_ready and w.restarts == 0:
            w.state, w.cause = "failed", f"{cause} while loading"
            self.on_fatal(f"worker {w.index} ({w.spec.device}) {cause} while loading", False)
            return
        if time.monotonic() - w.started_at >= self.backoff.stable_s:
            w.crashes = 0
        w.crashes += 1
        if w.crashes > self.backoff.limit:
            w.state, w.cause = "crash_loop", f"{cause}; {self.backoff.limit} restarts in a row failed, not restarted"
            log.error("worker %d (%s) is crash-looping (%s): not restarted", w.index, w.spec.device, cause)
            return
        delay = self.backoff.delay(w.crashes)
        w.state, w.cause = "dead", f"{cause}; restarting in {delay:g} s"
        self.metrics.worker_restarts.inc()
        w.restarts += 1
        time.sleep(delay)
        if not self._closing:
            self._spawn(w)

    def _pick(self) -> Worker:
        ready = [w for w in self.workers if w.state == "ready"]
        if not ready:
            raise ApiError(503, "no worker is ready (warming up or restarting); retry shortly",
                           code="worker_unavailable", headers={"Retry-After": "1"})
        if self.in_flight >= self.capacity:
            raise ApiError(429, f"the server is at capacity ({self.capacity} requests in flight or queued); retry "
                           "later", code="queue_full", headers={"Retry-After": "1"})
        return min(ready, key=lambda w: (w.load / w.spec.max_batch, w.index))

    def _open(self, *message_head: Any) -> Ticket:
        w = self._pick()
        rid = next(self._ids)
        ticket = Ticket(self, w, rid, asyncio.get_running_loop())
        w.tickets[rid] = ticket
        self.metrics.set_in_flight(self.in_flight)
        if not w.send(message_head[0], rid, *message_head[1:]):
            self._release(w, ticket)
            raise ApiError(503, f"worker {w.index} is not reachable; retry", code="worker_unavailable")
        return ticket

    def submit(self, job: dict) -> Ticket:
        """Send a synthesis job to the least-loaded ready worker; 429 when full, 503 when none is ready."""
        return self._open("submit", job)

    async def encode(self, audio: bytes, timeout: float) -> Any:
        """Encode a recording to codes (F, Q) numpy on a worker (it shares the queue with synthesis)."""
        ticket = self._open("encode", audio)
        try:
            event = await ticket.next(timeout)
        except asyncio.TimeoutError:
            ticket.abandon()
            raise ApiError(504, "encoding the voice took longer than the server's timeout", code="timeout") from None
        if event[0] == "error":
            raise from_engine(event[1], event[2])
        return event[1]

    def close(self) -> None:
        """Stop every worker (they finish the frame in progress and exit); later calls do nothing."""
        if self._closing:
            return
        self._closing = True
        for w in self.workers:
            if w.state == "starting" and w.process is not None:
                w.process.terminate()  # still loading: it would read "stop" only once loaded
            else:
                w.send("stop")
        for w in self.workers:
            if w.process is not None:
                w.process.join(timeout=10)
                if w.process.is_alive():
                    w.process.kill()
                    w.process.join(timeout=5)
            w.state = "stopped"


def run_worker(conn, spec: WorkerSpec) -> None:
    """A worker process's entry point: the worker module (torch, the model) is imported inside the spawned
    process only, so that the server's own process spawns its workers without paying for it first.

    An installed torch_npu that breaks ``import torch`` breaks it in the server too, which says so in one line:
    the worker exits without a traceback."""
    from moss_npu.device import import_torch
    from moss_npu.errors import DeviceError

    try:
        import_torch()
    except DeviceError as exc:
        raise SystemExit(exc.exit_code) from None
    from moss_npu.serve import worker

    worker.main(conn, spec)


def cpu_threads(workers: int, cores: int) -> int:
    """Intra-op threads per CPU worker: the cores but one, shared evenly (at least 1).

    One core stays with the HTTP server and the workers' own threads: an intra-op pool on every core waits at
    each op for the thread the server preempted, which costs more than the core it gains.
    """
    return max(1, (cores - 1) // max(1, workers))


def usable_cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def specs_for(devices: list[str], base: WorkerSpec) -> list[WorkerSpec]:
    """One spec per device; CPU workers share the cores but one (``cpu_threads``) unless a thread count was given."""
    kinds = {d: parse_device(d)[0] for d in devices}  # "auto" is resolved in the worker: not counted as the host
    host = [d for d in devices if kinds[d] != "auto" and get_backend(kinds[d]).host]
    threads = base.num_threads or (cpu_threads(len(host), usable_cores()) if host else 0)
    return [replace(base, device=d, num_threads=threads if d in host else base.num_threads) for d in devices]
