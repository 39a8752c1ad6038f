"""The HTTP API: OpenAI's ``/v1/audio/speech`` plus voices, models, health, metrics and the WebSocket session.

A request is checked completely (off the event loop, once the edge has bounded its size) before it takes a slot,
and its first audio is awaited before the status line goes out, so every failure before audio gets its status;
after it a failure cuts the stream (docs/serving.md#request-body). A client that leaves frees its slot.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable, Optional

import torch
from fastapi import FastAPI, File, Form, Request, UploadFile, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from moss_npu.errors import AudioError, AudioTooLong
from moss_npu.serve import live
from moss_npu.serve.drain import Deadline, Drain
from moss_npu.serve.edge import Edge, EdgePolicy
from moss_npu.serve.errors import ApiError, from_engine
from moss_npu.serve.formats import MEDIA_TYPES, StreamConverter, encode_file, pcm16, wav_stream_header
from moss_npu.serve.metrics import Metrics
from moss_npu.serve.pool import Ticket, WorkerPool
from moss_npu.serve.schema import (DEFAULT_VOICE, SpeechBody, check_body, check_text, decode_ref_audio, parse_json,
                                   run_config, speech_body, validation_error)
from moss_npu.serve.voices import VoiceStore
from moss_npu.wavfile import probe

log = logging.getLogger("moss_npu.serve")
STATIC = Path(__file__).resolve().parent / "static"


@dataclass(frozen=True, kw_only=True)
class ServerConfig(EdgePolicy):
    """Limits and names of one server, beside what its edge enforces (``EdgePolicy``)."""

    voices_dir: Path
    model_names: tuple[str, ...] = ("moss-tts-nano",)
    max_input_chars: int = 4096
    max_new_frames: int = 375
    request_timeout_s: float = 300.0
    max_voice_seconds: float = 30.0


class Disconnected(Exception):
    """The client went away while its request was waiting."""


def create_app(config: ServerConfig, pool: WorkerPool, metrics: Metrics,
               health_extra: Optional[Callable[[], dict]] = None, drain: Optional[Drain] = None) -> FastAPI:
    """Build the application around a worker pool (started and stopped with the app).

    ``health_extra`` adds fields to ``/health`` (run off the event loop): a Ray replica adds its id and its
    deployment's replica states. ``drain`` is the stop the server's signal handling starts (none: never).
    """
    store = VoiceStore(config.voices_dir)
    drain = drain or Drain()

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        pool.start()
        try:
            yield
        finally:
            await asyncio.to_thread(pool.close)

    app = FastAPI(title="moss-npu speech server", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    _install_error_handlers(app)
    app.add_middleware(Edge, policy=config, metrics=metrics, drain=drain)
    if config.cors_origins:  # outermost: preflights are answered, and refusals carry the CORS headers
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"],
                           allow_headers=["Authorization", "Content-Type"],
                           expose_headers=["X-Sample-Rate", "X-Channels", "X-Audio-Frames", "X-Codes-SHA256"])

    @app.get("/health")
    async def health() -> JSONResponse:
        ready = pool.ready and not drain.draining
        status = "draining" if drain.draining else "ready" if ready else "starting"
        extra = await asyncio.to_thread(health_extra) if health_extra is not None else {}
        return JSONResponse({"status": status, "workers": [w.describe() for w in pool.workers], **extra},
                            200 if ready else 503)

    @app.get("/favicon.ico")
    async def favicon() -> Response:
        return Response(status_code=204)  # browsers ask on every page load; the page has no icon

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "moss-npu"} for name in config.model_names]})

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.workers_ready.set(sum(w.state == "ready" for w in pool.workers))
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/audio/voices")
    async def list_voices() -> JSONResponse:
        voices = await asyncio.to_thread(store.list)
        return JSONResponse({"object": "list", "data": [v.public() for v in voices]})

    @app.get("/v1/audio/voices/{voice_id}")
    async def get_voice(voice_id: str) -> JSONResponse:
        check_text(voice_id, "voice_id")
        voice, _ = await asyncio.to_thread(store.find, voice_id)
        return JSONResponse(voice.public())

    @app.delete("/v1/audio/voices/{voice_id}")
    async def delete_voice(voice_id: str) -> JSONResponse:
        check_text(voice_id, "voice_id")
        voice = await asyncio.to_thread(store.delete, voice_id)
        return JSONResponse({"id": voice.id, "name": voice.name, "object": "voice", "deleted": True})

    @app.post("/v1/audio/voices")
    async def add_voice(name: str = Form(...), audio: UploadFile = File(...),
                        transcript: Optional[str] = Form(None)) -> JSONResponse:
        check_text(name, "name")
        check_text(transcript, "transcript")
        data = await audio.read(config.max_upload_bytes + 1)
        if len(data) > config.max_upload_bytes:
            raise ApiError(413, f"audio is larger than {config.max_upload_bytes // 2**20} MiB", param="audio",
                           code="file_too_large")
        duration = await asyncio.to_thread(probe_recording, data, config.max_voice_seconds, param="audio")
        codes = await pool.encode(data, config.request_timeout_s)
        voice = await asyncio.to_thread(store.add, name, torch.from_numpy(codes), duration, transcript)
        return JSONResponse(voice.public())

    @app.post("/v1/audio/speech")
    async def speech(request: Request) -> Response:
        arrived = time.perf_counter()
        raw = await request.body()  # bounded by the edge
        rate, channels = pool.audio_format()
        body, job = await asyncio.to_thread(_parse_and_check, raw, request.headers.get("content-type"), store,
                                            config, rate, channels)
        ticket = pool.submit(job)
        deadline = Deadline(asyncio.get_running_loop().time() + config.request_timeout_s, drain)
        watcher = asyncio.ensure_future(_watch_disconnect(request, ticket))
        try:
            head = await _first_audio(ticket, deadline)
        except BaseException:
            watcher.cancel()
            ticket.abandon()
            raise
        if body.streams():  # Starlette's streaming response reads the channel from here: ASGI allows one reader
            watcher.cancel()
            await asyncio.wait({watcher})
        reply = _Reply(body, ticket, rate, channels, arrived, deadline, metrics, watcher)
        headers = {"X-Sample-Rate": str(reply.out_rate), "X-Channels": str(reply.out_channels)}
        if body.stream_format == "sse":
            return StreamingResponse(reply.sse(head), media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache"})
        if body.streams():
            return StreamingResponse(reply.audio(head), media_type=MEDIA_TYPES[body.response_format],
                                     headers=headers)
        try:
            data, info = await reply.whole(head)
        finally:
            reply.close()
        headers.update({"X-Audio-Frames": str(info["frames"]), "X-Codes-SHA256": info["codes_sha256"]})
        return Response(data, media_type=MEDIA_TYPES[body.response_format], headers=headers)

    @app.websocket("/v1/audio/speech/stream")
    async def speech_stream(ws: WebSocket) -> None:
        await ws.accept()  # the edge already checked host, origin and key
        await live.Session(ws, pool, lambda body: _job(body, store, config), config, drain).run()

    @app.get("/")
    async def page() -> FileResponse:  # try voices in a browser: static/ holds the page (no build step, no CDN)
        return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8",
                            headers={"Cache-Control": "no-cache"})

    @app.get("/page/config.json")
    async def page_config() -> JSONResponse:  # what the page must know before it calls the API
        return JSONResponse({"key_required": config.api_key is not None, "models": list(config.model_names),
                             "max_input_chars": config.max_input_chars})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def _parse_and_check(raw: bytes, content_type: Optional[str], store: VoiceStore, config: ServerConfig, rate: int,
                     channels: int) -> tuple[SpeechBody, dict]:
    """Parse and check a ``POST /v1/audio/speech`` body and build its job (off the event loop: all of it takes
    time in proportion to the body)."""
    if content_type is not None and not _is_json(content_type):
        raise ApiError(400, "the body must be JSON; send it with Content-Type: application/json", code="invalid_json")
    body = speech_body(parse_json(raw, "the body"))
    check_body(body, model_names=config.model_names, max_chars=config.max_input_chars, sample_rate=rate,
               channels=channels)
    return body, _job(body, store, config)


def _is_json(content_type: str) -> bool:
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def _job(body: SpeechBody, store: VoiceStore, config: ServerConfig) -> dict:
    """Turn a checked body into the worker's job: text, voice (stored codes or a recording) and settings."""
    job: dict = {"text": body.input, "prompt_text": body.ref_text}
    if body.voice_name != DEFAULT_VOICE:
        voice, codes = store.find(body.voice_name)
        job["prompt_codes"] = codes.numpy()
        job["prompt_text"] = body.ref_text if body.ref_text is not None else voice.transcript
    elif body.ref_audio is not None:
        audio = decode_ref_audio(body.ref_audio, config.max_upload_bytes)
        probe_recording(audio, config.max_voice_seconds, param="ref_audio")
        job["prompt_audio"] = audio
    has_voice = "prompt_codes" in job or "prompt_audio" in job
    mode = "continuation" if job["prompt_text"] is not None or not has_voice else "voice_clone"
    job["settings"] = run_config(body, mode=mode, max_new_frames=config.max_new_frames)
    return job


def probe_recording(data: bytes, max_seconds: float, *, param: str) -> float:
    """Return an uploaded recording's duration in seconds; 400 when it is not audio a worker can decode, 413 when
    too long. Only its header is read (``moss_npu.wavfile.probe``, the check the worker's decoding repeats)."""
    try:
        return probe(io.BytesIO(data), param, max_seconds).seconds
    except AudioTooLong as exc:
        raise ApiError(413, str(exc), param=param, code="audio_too_long") from None
    except AudioError as exc:
        raise ApiError(400, str(exc), param=param, code="invalid_audio") from None


async def _watch_disconnect(request: Request, ticket: Ticket) -> None:
    """Wait for the client's ``http.disconnect`` and then stop its request (its slot frees at the next frame)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            ticket.gone()
            return


async def _first_audio(ticket: Ticket, deadline: Deadline) -> list[tuple]:
    """The events up to the first audible chunk (or the end); raise the request's failure as an answer.

    A request whose model stops before any audio is refused here (422), before a status line goes out: a
    success is never empty.
    """
    head: list[tuple] = []
    while True:
        event = await deadline.next_event(ticket)
        if event[0] == "gone":
            raise Disconnected()
        if event[0] == "error":
            raise from_engine(event[1], event[2])
        if event[0] == "done" and int(event[1]["frames"]) == 0:
            raise ApiError(422, "the model stopped before any audio; try another seed or reword the text",
                           code="no_audio")
        head.append(event)
        if event[0] == "done" or (event[0] == "chunk" and not event[2]):
            return head


class _Reply:
    """The audio of one answered request, in the asked format, rate and channels."""

    def __init__(self, body: SpeechBody, ticket: Ticket, rate: int, channels: int, arrived: float, deadline: Deadline,
                 metrics: Metrics, watcher: asyncio.Future) -> None:
        self.body, self.ticket, self.rate, self.metrics = body, ticket, rate, metrics
        self.out_rate = body.sample_rate or rate
        self.out_channels = channels if body.channels is None else body.channels
        self.converter = StreamConverter(rate, self.out_rate, self.out_channels)
        self.arrived, self.deadline, self.watcher = arrived, deadline, watcher
        self.samples = 0  # at the model's rate, for RTF

    def close(self) -> None:
        """Stop watching the client and stop the request if it still runs."""
        self.watcher.cancel()
        self.ticket.abandon()

    def _convert(self, samples) -> torch.Tensor:
        wave = torch.from_numpy(samples)
        if self.samples == 0:
            self.metrics.ttfa.observe(time.perf_counter() - self.arrived)
        self.samples += wave.shape[1]
        return self.converter.push(wave)

    def _finish(self) -> None:
        seconds = self.samples / self.rate
        if seconds > 0:
            self.metrics.rtf.observe((time.perf_counter() - self.arrived) / seconds)
        self.metrics.audio_seconds.inc(seconds)

    async def _events(self, head: list[tuple]) -> AsyncIterator[tuple]:
        """The request's events from the first ones (``head``) to its end; stops quietly when the client left."""
        try:
            for event in head:
                yield event
            event = head[-1]
            while event[0] not in ("done", "error"):
                event = await self.deadline.next_event(self.ticket)
                if event[0] == "gone":
                    return
                yield event
        finally:
            self.close()

    async def _stream(self, head: list[tuple]) -> AsyncIterator[tuple]:
        """The request's events with each chunk made ``("pcm", bytes)``: a streaming WAV header first for ``wav``,
        the resampler's tail before ``done``."""
        if self.body.response_format == "wav":
            yield "pcm", wav_stream_header(self.out_rate, self.out_channels)
        async for event in self._events(head):
            if event[0] == "chunk":
                yield "pcm", pcm16(self._convert(event[1]))
                continue
            if event[0] == "done":
                self._finish()
                yield "pcm", pcm16(self.converter.flush())
            yield event

    async def audio(self, head: list[tuple]) -> AsyncIterator[bytes]:
        """Raw PCM chunks (after a streaming WAV header for ``wav``)."""
        async for event in self._stream(head):
            if event[0] == "pcm" and event[1]:
                yield event[1]
            elif event[0] == "error":
                log.warning("stream cut: %s", event[2])
                raise ConnectionAbortedError(event[2])

    async def sse(self, head: list[tuple]) -> AsyncIterator[bytes]:
        """``speech.audio.delta`` events (base64 audio), then ``speech.audio.done`` with usage."""
        try:
            async for event in self._stream(head):
                if event[0] == "pcm" and event[1]:
                    yield _sse({"type": "speech.audio.delta", "audio": base64.b64encode(event[1]).decode("ascii")})
                elif event[0] == "done":
                    for message in event[1].get("warnings", ()):  # a text chunk the model spoke nothing of
                        yield _sse({"type": "speech.audio.warning", "message": message})
                    tokens, frames = int(event[1]["input_tokens"]), int(event[1]["frames"])
                    yield _sse({"type": "speech.audio.done", "usage": {
                        "input_tokens": tokens, "output_tokens": frames, "total_tokens": tokens + frames}})
                elif event[0] == "timestamp":  # a text chunk's start and end in this audio (speed included)
                    yield _sse({"type": "speech.audio.timestamp", **event[1]})
                elif event[0] == "error":
                    yield _sse({"type": "error", **from_engine(event[1], event[2]).body()})
        except ApiError as exc:  # the timeout, or the end of the drain
            yield _sse({"type": "error", **exc.body()})

    async def whole(self, head: list[tuple]) -> tuple[bytes, dict]:
        """Collect the whole utterance and encode it; return (file bytes, the worker's summary)."""
        pieces = []
        async for event in self._events(head):
            if event[0] == "chunk":
                pieces.append(self._convert(event[1]))
        if event[0] == "error":
            raise from_engine(event[1], event[2])
        if event[0] != "done":  # the events stopped early: the client left
            raise Disconnected()
        pieces.append(self.converter.flush())
        self._finish()
        wave = torch.cat(pieces, dim=1)
        return await asyncio.to_thread(encode_file, wave, self.out_rate, self.body.response_format,
                                       self.body.sample_format), event[1]


def _sse(obj: dict) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _install_error_handlers(app: FastAPI) -> None:
    """Every failure answers in the OpenAI error shape; no traceback reaches a client."""

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), exc.status, exc.headers)

    @app.exception_handler(RequestValidationError)  # a voice upload's form: FastAPI's loc starts "body"
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return await api_error(_request, validation_error([{**p, "loc": p["loc"][1:]} for p in exc.errors()]))

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return await api_error(_request, ApiError(exc.status_code, str(exc.detail), code=code, headers=exc.headers))

    @app.exception_handler(Disconnected)
    async def gone(_request: Request, _exc: Disconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; it marks the request in the metrics

    @app.exception_handler(Exception)
    async def internal(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return await api_error(_request, ApiError(500, "internal server error; see the server log",
                                                  code="internal_error"))
