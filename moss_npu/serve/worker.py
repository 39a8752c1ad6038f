"""One worker process: loads the model on its device, warms up, and runs an ``Engine`` for the server.

It talks to the server over one duplex pipe. In: ``("submit", rid, job)``, ``("cancel", rid)``,
``("encode", rid, audio bytes)``, ``("stop",)``. Out: ``("ready", info)`` or ``("failed", kind, message)`` once,
then ``("chunk", rid, samples (C, n) float32, is_pause)`` (at the request's speed), ``("timestamp", rid, times)``
after each text chunk, ``("done", rid, info)``, ``("error", rid, kind, message, info)``,
``("encoded", rid, codes (F, Q) int64)`` and ``("stats", active_slots, queued)``. ``info`` holds at least
``frames``: what the request generated, also when it failed or was cancelled midway. The server owns restarts;
a worker ignores Ctrl-C (the server stops it) and exits when the pipe closes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from moss_npu.cli import process_seconds
from moss_npu.device import settings_report
from moss_npu.errors import MossNpuError
from moss_npu.serve.errors import kind_of
from moss_npu.serve.spec import WorkerSpec
from moss_npu.tts.engine import Engine, RequestStream, SpeechRequest
from moss_npu.tts.pipeline import MossTTSNano
from moss_npu.tts.settings import RunConfig
from moss_npu.tts.timeline import Timestamp, timestamped

log = logging.getLogger("moss_npu.serve.worker")
WARMUP_TEXT = "Hello."
STATS_INTERVAL_S = 0.05


def codes_digest(codes: torch.Tensor) -> str:
    """A short fingerprint of codes (F, Q), so clients can compare runs without receiving the codes."""
    return hashlib.sha256(codes.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:16]


class _Channel:
    """The worker's end of the pipe: sends from any thread, one message at a time."""

    def __init__(self, conn: Connection) -> None:
        self.conn, self._lock = conn, threading.Lock()

    def send(self, *message: Any) -> None:
        with self._lock:
            try:
                self.conn.send(message)
            except (OSError, EOFError, BrokenPipeError):
                pass  # the server is gone; the main loop ends on its next receive


class WorkerLoop:
    """Serves the pipe's commands against one engine."""

    def __init__(self, tts: MossTTSNano, engine: Engine, channel: _Channel) -> None:
        self.tts, self.engine, self.channel = tts, engine, channel
        self.streams: dict[int, RequestStream] = {}
        self._stop = threading.Event()

    def run(self) -> None:
        threading.Thread(target=self._report_stats, daemon=True).start()
        while True:
            try:
                message = self.channel.conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "stop":
                break
            if kind == "submit":
                self._submit(message[1], message[2])
            elif kind == "cancel":
                stream = self.streams.get(message[1])  # one look-up: its pump thread may remove it at any time
                if stream is not None:
                    stream.cancel()
            elif kind == "encode":
                self._encode(*message[1:])
        self._stop.set()
        for stream in list(self.streams.values()):
            stream.cancel()
        self.engine.close()

    def _submit(self, rid: int, job: dict) -> None:
        codes = job.get("prompt_codes")
        request = SpeechRequest(text=job["text"], prompt_audio=job.get("prompt_audio"),
                                prompt_codes=None if codes is None else torch.from_numpy(codes),
                                prompt_text=job.get("prompt_text"), settings=job["settings"])
        try:
            stream = self.engine.submit(request)
        except MossNpuError as exc:
            self.channel.send("error", rid, kind_of(exc), str(exc), {"frames": 0})
            return
        self.streams[rid] = stream
        threading.Thread(target=self._pump, args=(rid, stream), daemon=True).start()

    def _pump(self, rid: int, stream: RequestStream) -> None:
        """Forward one request's chunks at its speed and each text chunk's timestamp, then its summary or failure."""
        try:
            for item in timestamped(stream, stream.speed, self.tts.sample_rate):
                if isinstance(item, Timestamp):
                    self.channel.send("timestamp", rid, item.public())
                    continue
                wave = item.waveform.detach().to("cpu", torch.float32)
                self.channel.send("chunk", rid, wave.numpy(), item.is_pause)
            codes = stream.codes
            if codes is None:  # an engine may end a cancelled stream without raising
                self.channel.send("error", rid, "Cancelled", "request cancelled", {"frames": stream.frames})
                return
            spoken = stream.prepared.plan.chunks
            self.channel.send("done", rid, {"frames": int(codes.shape[0]), "codes_sha256": codes_digest(codes),
                                            "first_audio_s": stream.first_audio_s, "warnings": stream.warnings,
                                            "input_tokens": sum(self.tts.tokenizer.count(c) for c in spoken)})
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the waiting client
            if kind_of(exc) == "Internal":
                log.exception("request %d failed", rid)
            self.channel.send("error", rid, kind_of(exc), str(exc), {"frames": stream.frames})
        finally:
            self.streams.pop(rid, None)

    def _encode(self, rid: int, audio: bytes) -> None:
        """Encode a recording (a file's bytes) to codes (F, Q) for the voice store, on the preparation thread."""

        def reply(future) -> None:
            if future.cancelled():  # the worker is stopping
                return
            exc = future.exception()
            if exc is None:
                self.channel.send("encoded", rid, future.result().to(torch.int64).numpy())
                return
            if kind_of(exc) == "Internal":
                log.error("encoding %d failed", rid, exc_info=exc)
            self.channel.send("error", rid, kind_of(exc), str(exc), {"frames": 0})

        self.engine.encode(audio).add_done_callback(reply)

    def _report_stats(self) -> None:
        last = None
        while not self._stop.wait(STATS_INTERVAL_S):
            now = (self.engine.active_slots, self.engine.queued)
            if now != last:
                self.channel.send("stats", *now)
                last = now


def warm_up(engine: Engine, frames: int) -> None:
    """Run one short greedy request through the engine, so the first client does not pay for lazy setup."""
    stream = engine.submit(SpeechRequest(WARMUP_TEXT, settings=RunConfig(do_sample=False, max_new_frames=frames)))
    for _ in stream:
        pass


def main(conn: Connection, spec: WorkerSpec) -> None:
    """Entry point of a worker process (spawned by the server's pool)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"worker {spec.device} (pid {os.getpid()}): %(message)s")
    channel = _Channel(conn)
    try:
        started = time.perf_counter()
        tts = MossTTSNano.from_pretrained(spec.model, spec.codec, device=spec.device, dtype=spec.dtype,
                                          num_threads=spec.num_threads)
        engine = Engine(tts, max_batch=spec.max_batch, max_len=spec.max_len)
        warm_up(engine, spec.warmup_frames)
    except Exception as exc:  # noqa: BLE001 - the server reports it and exits
        if kind_of(exc) == "Internal":
            log.exception("loading failed")
        channel.send("failed", kind_of(exc), f"{exc}" if isinstance(exc, MossNpuError)
                     else f"{exc.__class__.__name__}: {exc}")
        return
    channel.send("ready", {"device": str(tts.device), "sample_rate": tts.sample_rate,
                           "channels": tts.codec.channels, "frame_rate_hz": tts.codec.frame_rate_hz,
                           "load_s": time.perf_counter() - started, "process_s": process_seconds(),
                           "setup": {**tts.setup(), **settings_report(tts.device)}, "pid": os.getpid()})
    WorkerLoop(tts, engine, channel).run()
