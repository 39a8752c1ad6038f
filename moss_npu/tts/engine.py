"""SERIAL STAND-IN for the batching engine: the same contract, one request at a time.

The frame-decoder work replaces this module with an engine that batches every active request per frame
(continuous batching over ``max_batch`` slots). Until then this stand-in keeps the contract so callers (the
server) can be written against it: ``Engine.submit`` queues a ``SpeechRequest`` and returns a
``RequestStream``; one background thread takes requests in order and runs each through
``MossTTSNano.synthesize_stream``. It holds no server logic.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from moss_npu.errors import MossNpuError
from moss_npu.tts.pipeline import AudioChunk, MossTTSNano, PromptAudio
from moss_npu.tts.settings import RunConfig


class Cancelled(MossNpuError):
    """The request was cancelled before it finished."""


@dataclass
class SpeechRequest:
    """One utterance to speak: text, an optional voice (recording or stored codes), and run settings."""

    text: str
    prompt_audio: Optional[PromptAudio] = None
    prompt_codes: Optional[torch.Tensor] = None  # (F, Q) CPU codes of a stored voice
    prompt_text: Optional[str] = None
    settings: RunConfig = field(default_factory=RunConfig)


_END = object()


class RequestStream:
    """The audio of one request as it is decoded: iterate for ``AudioChunk`` s; ``cancel()`` to stop early."""

    def __init__(self, request: SpeechRequest) -> None:
        self.request = request
        self.codes: Optional[torch.Tensor] = None
        self.first_audio_s: Optional[float] = None
        self._items: queue.Queue = queue.Queue()
        self._cancelled = threading.Event()
        self._submitted = time.perf_counter()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop generating; the slot is free after the frame in progress."""
        self._cancelled.set()

    def __iter__(self) -> Iterator[AudioChunk]:
        return self

    def __next__(self) -> AudioChunk:
        item = self._items.get()
        if item is _END:
            self._items.put(_END)
            raise StopIteration
        if isinstance(item, BaseException):
            self._items.put(item)
            raise item
        return item

    def _emit(self, chunk: AudioChunk) -> None:
        if self.first_audio_s is None:
            self.first_audio_s = time.perf_counter() - self._submitted
        self._items.put(chunk)

    def _finish(self, error: Optional[BaseException] = None) -> None:
        self._items.put(_END if error is None else error)


class _RequestView:
    """The pipeline seen by one request: stored voice codes stand for the reference, and every frame is
    recorded (for ``RequestStream.codes``) and checked for cancellation."""

    plan = MossTTSNano.plan
    synthesize_stream = MossTTSNano.synthesize_stream
    _stream_chunk = MossTTSNano._stream_chunk

    def __init__(self, tts: MossTTSNano, stream: RequestStream) -> None:
        self._tts, self._stream = tts, stream
        self.frames: list[torch.Tensor] = []

    def __getattr__(self, name: str):
        return getattr(self._tts, name)

    def reference_codes(self, path) -> torch.Tensor:
        codes = self._stream.request.prompt_codes
        return codes if codes is not None else self._tts.reference_codes(path)

    def _frames(self, *args, **kwargs):
        for event in self._tts._frames(*args, **kwargs):
            if self._stream.cancelled:
                raise Cancelled("request cancelled")
            # A non-finite frame is never kept: the pipeline's float32 fallback generates it again.
            if bool(event.active[0]) and (event.finite is None or bool(event.finite)):
                self.frames.append(event.codes[0].cpu())
            yield event


class Engine:
    """Runs submitted requests one after another on a background thread (serial stand-in)."""

    def __init__(self, tts: MossTTSNano, max_batch: int = 8) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch {max_batch}: use at least 1")
        self.tts, self.max_batch = tts, max_batch
        self._pending: queue.Queue = queue.Queue()
        self._active = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moss-npu-engine", daemon=True)
        self._thread.start()

    @property
    def active_slots(self) -> int:
        return self._active

    @property
    def queued(self) -> int:
        return self._pending.qsize()

    def submit(self, request: SpeechRequest) -> RequestStream:
        """Queue ``request``; its audio arrives on the returned stream."""
        if self._closed.is_set():
            raise MossNpuError("the engine is closed")
        stream = RequestStream(request)
        self._pending.put(stream)
        return stream

    def close(self) -> None:
        """Stop the background thread; requests still queued fail."""
        self._closed.set()
        self._pending.put(None)
        self._thread.join(timeout=10)
        while not self._pending.empty():
            stream = self._pending.get_nowait()
            if stream is not None:
                stream._finish(MossNpuError("the engine was closed"))

    def _run(self) -> None:
        while not self._closed.is_set():
            stream = self._pending.get()
            if stream is None:
                return
            if stream.cancelled:
                stream._finish(Cancelled("request cancelled"))
                continue
            self._active = 1
            try:
                self._serve(stream)
            finally:
                self._active = 0

    def _serve(self, stream: RequestStream) -> None:
        request, view = stream.request, _RequestView(self.tts, stream)
        audio = "<stored voice>" if request.prompt_codes is not None else request.prompt_audio
        try:
            for chunk in view.synthesize_stream(request.text, prompt_audio=audio, prompt_text=request.prompt_text,
                                                settings=request.settings):
                if stream.cancelled:
                    raise Cancelled("request cancelled")
                stream._emit(chunk)
            stream.codes = torch.stack(view.frames) if view.frames else torch.empty(0, self.tts.config.n_vq,
                                                                                    dtype=torch.long)
            stream._finish()
        except MossNpuError as exc:
            stream._finish(exc)
        except Exception as exc:  # noqa: BLE001 - the caller gets the failure, the engine keeps running
            stream._finish(MossNpuError(f"synthesis failed: {exc.__class__.__name__}: {exc}"))
