"""The engine: many speech requests at once on one pipeline, for the server.

``Engine.submit`` takes a ``SpeechRequest`` and returns its ``RequestStream`` at once. The request is first
prepared (``tts.prepare``: text, chunks, reference codes, prompt rows) on the engine's preparation thread, so a
slow reference never delays a frame; a ``PreparedRequest`` skips that step. The frame thread runs the frame loop
(``tts.loop``: admission at frame boundaries, continuous batching, the float32 fallback, the silent-chunk
retry). The audio thread owns the codec: it turns the new codes of every request whose playback schedule asks
for audio into audio with one streaming codec call per frame (``CodecRows``: codec row = decoder slot) while the
frame thread computes the next frame, so the two run on two cores. It takes the loop's events in order and alone
writes to the streams, so each stream's audio, pauses and end come in order; a stream yields them at its
request's speed. A request's chunks run one after another; different requests share the batch. Every request
samples with the noise-fed sampler from its own host generator (seeded by ``settings.seed``), so its audio does
not depend on what else is in the batch.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator, Optional, Union

import torch

from moss_npu.codec.rows import CodecRows
from moss_npu.errors import InputError, MossNpuError
from moss_npu.nano.decoder import FrameDecoder
from moss_npu.nano.reuse import PrefixCache
from moss_npu.cpu.threads import spare_cores, this_thread_using, use_threads
from moss_npu.tts.loop import Cancelled, FrameLoop, Job
from moss_npu.tts.pipeline import MossTTSNano
from moss_npu.tts.prepare import PreparedRequest, PromptAudio, SpeechRequest
from moss_npu.tts.settings import RunConfig
from moss_npu.tts.streamer import AudioChunk, AudioStreamer
from moss_npu.tts.timeline import at_speed

__all__ = ["Cancelled", "Engine", "PreparedRequest", "RequestStream", "SpeechRequest"]

log = logging.getLogger(__name__)
_END = object()


class RequestStream:
    """The audio of one request as it is produced, at its speed (``timeline.at_speed``): iterate for
    ``AudioChunk``s (blocking).

    Iteration raises the request's ``MossNpuError`` if it failed. ``cancel()`` frees its slot within one frame;
    the iteration then raises ``Cancelled``. After a normal end, ``codes`` holds the generated (ΣF, Q) codes
    (None after a failure or a cancel).
    """

    def __init__(self, engine: "Engine", speed: float = 1.0) -> None:
        self._engine, self.speed = engine, speed
        self._items: "queue.Queue[object]" = queue.Queue()
        self._chunks = at_speed(self._produced(), speed, engine.tts.sample_rate, engine.tts.codec.channels)
        self._failure: Optional[BaseException] = None
        self._cancelled = threading.Event()
        self._submitted = time.perf_counter()
        self.codes: Optional[torch.Tensor] = None
        self.first_audio_s: Optional[float] = None  # seconds from submit to the first audio chunk
        self.prepared: Optional[PreparedRequest] = None  # once preparation is done
        self.frames = 0  # frames generated so far (also for a request cancelled or failed midway)
        self.warnings: list[str] = []  # a text chunk that gave no audio (``tts.loop``), known by the stream's end

    def __iter__(self) -> "RequestStream":
        return self

    def __next__(self) -> AudioChunk:
        if self._failure is not None:  # later calls fail the same way
            raise self._failure
        try:
            return next(self._chunks)
        except StopIteration:
            raise
        except BaseException as exc:
            self._failure = exc
            raise

    def _produced(self) -> Iterator[AudioChunk]:
        """The chunks at the model's pace, as the audio thread hands them over."""
        while (item := self._items.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        """Stop generating this request; its slot is freed at the next frame boundary."""
        self._cancelled.set()
        self._engine._wake()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _put(self, chunk: AudioChunk) -> None:
        if self.first_audio_s is None and not chunk.is_pause:
            self.first_audio_s = time.perf_counter() - self._submitted
        self._items.put(chunk)

    def _end(self, error: Optional[BaseException] = None) -> None:
        self._items.put(_END if error is None else error)


class _Job(Job):
    """The engine's bookkeeping of one prepared request: its stream and its audio."""

    def __init__(self, prepared: PreparedRequest, stream: RequestStream, audio: AudioStreamer,
                 generator: torch.Generator) -> None:
        super().__init__(prepared, generator, resume=True)
        self.stream, self.audio = stream, audio
        self.failed = False  # its audio failed (set by the audio thread): the frame thread frees its slot

    def dropped(self) -> bool:
        return self.stream.cancelled or self.failed


class Engine:
    """Drive one ``FrameDecoder`` of ``max_batch`` slots over ``tts`` from a background thread.

    ``prepare_threads`` threads prepare requests (and encode voices, ``encode``) beside the frame thread.
    The decoder computes as ``tts`` was loaded to (``LoadConfig``: graph, compile).
    """

    def __init__(self, tts: MossTTSNano, max_batch: int = 8, *, max_len: int = 1024, prepare_threads: int = 1) -> None:
        if tts.algorithm != "optimized":
            raise InputError(f"the engine runs the frame decoder; this pipeline was loaded with decoder={tts.algorithm}")
        self.tts = tts
        self._threads = torch.get_num_threads()
        self._preparing = ThreadPoolExecutor(max_workers=max(1, prepare_threads), thread_name_prefix="moss-npu-prepare",
                                             initializer=use_threads, initargs=(self._threads,))
        self._unprepared: set[RequestStream] = set()  # submitted, preparation not finished
        self._cond = threading.Condition()
        self.decoder = FrameDecoder(tts.model, slots=max_batch, max_len=max_len, sampler="noise", graph=tts.graph,
                                    prefix_cache=PrefixCache(), weights=tts.weights, compile=tts.compile)
        self.loop = FrameLoop(self.decoder, self._cond, prefill_threads=self._prefill_threads)
        self.audio = CodecRows(tts.codec, max_batch, max(RunConfig().schedule().budgets))
        self._closed = False
        self._events: "queue.Queue[tuple]" = queue.Queue()  # frame thread -> audio thread, in order
        # The audio thread lends its cores to the frames' products while it has nothing to decode; the frame
        # thread takes them back as it hands it work. The lock orders the two (no lend after work was handed).
        self._lending = threading.Lock()
        self._spare = spare_cores(self._threads)
        self._thread = threading.Thread(target=self._loop, name="moss-npu-engine", daemon=True)
        self._audio_thread = threading.Thread(target=self._audio_loop, name="moss-npu-audio", daemon=True)
        self._thread.start()
        self._audio_thread.start()

    @property
    def active_slots(self) -> int:
        """Requests decoding right now."""
        return len(self.loop.running)

    @property
    def queued(self) -> int:
        """Requests waiting for a slot, or for their preparation."""
        return len(self.loop.waiting) + len(self._unprepared)

    def check(self, settings: RunConfig) -> None:
        """Refuse the settings this engine would not act on (it honours every other one)."""
        one_by_one = "the engine streams a request's chunks one after another (its slots batch requests)"
        refusals = {
            "host_rng": (settings.host_rng is False, "the engine draws each request's noise from its own host "
                         "generator, so that requests in a batch do not change each other; leave it unset"),
            "tts_max_batch_size": (settings.tts_max_batch_size > 1, one_by_one),
            "voice_clone_max_memory_per_sample_gb": (settings.voice_clone_max_memory_per_sample_gb != RunConfig(
                ).voice_clone_max_memory_per_sample_gb, one_by_one),
        }
        for name, (refused, why) in refusals.items():
            if refused:
                raise InputError(f"{name}: {why}")

    def submit(self, request: Union[SpeechRequest, PreparedRequest]) -> RequestStream:
        """Queue ``request`` (prepared first on the preparation thread); return its stream at once (thread-safe)."""
        self.check(request.settings)
        stream = RequestStream(self, request.settings.speed)
        with self._cond:  # held until the request is handed over: close() then ends it or comes after
            if self._closed:
                raise MossNpuError("the engine is closed; create a new one to submit requests")
            if not isinstance(request, PreparedRequest):
                self._unprepared.add(stream)
                self._preparing.submit(self._prepare, stream, request)
                return stream
        self._enqueue(stream, request)
        return stream

    def encode(self, source: PromptAudio) -> "Future[torch.Tensor]":
        """Encode a reference recording to codes (F, Q) on the preparation thread (``MossTTSNano.reference_codes``)."""
        return self._preparing.submit(self.tts.reference_codes, source)

    def _prepare(self, stream: RequestStream, request: SpeechRequest) -> None:
        try:
            if stream.cancelled:
                stream._end(Cancelled("request cancelled"))
                return
            prepared = self.tts.preparer.prepare(request, max_rows=self.decoder.state.max_len)
        except Exception as exc:  # bad input (MossNpuError) or a bug: this request fails, the engine serves on
            if not isinstance(exc, MossNpuError):
                log.exception("preparing a request failed")
            stream._end(exc)
            return
        finally:
            with self._cond:
                self._unprepared.discard(stream)
        self._enqueue(stream, prepared)

    def _enqueue(self, stream: RequestStream, prepared: PreparedRequest) -> None:
        """Queue a prepared request for a slot."""
        settings = prepared.settings
        seed = settings.seed if settings.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        stream.prepared = prepared
        job = _Job(prepared, stream, AudioStreamer(prepared.plan, settings, rows=self.audio),
                   torch.Generator().manual_seed(seed))
        with self._cond:
            if self._closed:
                stream._end(MossNpuError("the engine was closed before the request started"))
                return
            self.loop.add(job)
            self._cond.notify()

    def close(self) -> None:
        """Stop the engine thread; requests not finished end with an error."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._preparing.shutdown(wait=True, cancel_futures=True)
        self._thread.join()
        for event in self.loop.fail_all(MossNpuError("the engine was closed before the request finished")):
            self._send(event)
        self._events.put(("stop",))
        self._audio_thread.join()
        self.decoder.frame_step.lend(0)  # the frame step outlives the engine (the pipeline's weights hold it)
        for stream in list(self._unprepared):
            stream._end(MossNpuError("the engine was closed before the request started"))
        self._unprepared.clear()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _loop(self) -> None:
        use_threads(self._threads)
        while True:
            with self._cond:
                while not self._closed and self.loop.idle:
                    self._cond.wait()
                if self._closed:
                    return
            for event in self.loop.frame():
                self._send(event)

    def _send(self, event: tuple) -> None:
        """Hand a frame-loop event to the audio thread (a request's end with its codes), taking back the cores it
        lent the frames."""
        if event[0] == "end":
            job, error = event[1], event[2]
            codes = None if error is not None else torch.cat(job.chunk_codes(self.tts.config.n_vq))
            event = ("end", job, error, codes)
        elif event[0] == "frame":
            for job, _, codes, _ in event[1]:
                job.stream.frames += codes is not None
        with self._lending:
            self.decoder.frame_step.lend(0)
            self._events.put(event)

    # ---- the audio thread -----------------------------------------------------------------------------------

    def _audio_loop(self) -> None:
        """Run the frame thread's events in order: start a chunk's codec row, decode a frame's due codes, end
        a request's stream."""
        use_threads(self._threads)
        while True:
            event = self._events.get()
            if event[0] == "stop":
                return
            try:
                self._audio_event(event)
            finally:
                self._events.task_done()  # unfinished_tasks: 0 when this thread has nothing to do
            with self._lending:
                if not self._events.unfinished_tasks:
                    self.decoder.frame_step.lend(self._spare)

    def _audio_event(self, event: tuple) -> None:
        """Run one of the frame thread's events (``FrameLoop``'s, a frame's with its codes)."""
        kind = event[0]
        if kind == "start":
            self._audio_start(*event[1:])
        elif kind == "warning":
            event[1].stream.warnings.append(event[3])
        elif kind == "frame":
            self._audio_frame(event[1])
        else:
            _, job, error, codes = event
            if not job.failed:
                job.stream.codes = codes
                job.stream._end(error)

    def _prefill_threads(self) -> int:
        """Torch threads for a prefill on the frame thread: the audio thread's too (up to the physical cores)
        while it has no event to run, which stays so until the prefill ends (only the frame thread sends it work);
        else the thread's own. A prompt's bits do not depend on the count (``cpu.blocks.prompt_attention``)."""
        return self._threads if self._events.unfinished_tasks else self._both_threads()

    def _codec_threads(self, streams: int) -> int:
        """Torch threads for a codec call of ``streams`` streams on the audio thread: the frame thread's too (up to
        the physical cores) while the frame loop has no request and the call has several streams, else the
        thread's own. A request arriving meanwhile prefills on its own count while the call ends. A one-stream
        call (~9 ms) stays on one thread: a lone request's first audio measured no better with it (4-10 ms later,
        within the noise of a shared VM)."""
        return self._both_threads() if streams > 1 and self.loop.idle else self._threads

    def _both_threads(self) -> int:
        """The engine's threads for both its threads' work: twice a thread's own, up to the physical cores."""
        return self._threads + spare_cores(self._threads)

    def _audio_frame(self, frame: list) -> None:
        """Add one frame's codes to each request's audio, decode what is due in one codec call, hand each its
        audio, and the pause after a chunk that ended."""
        due, ended = {}, []
        for job, _, codes, final in frame:
            if job.failed:
                continue
            if codes is not None:
                job.audio.add(codes)
            ready = job.audio.due(final)
            if ready is not None:
                due[job.audio.row] = (job, ready)
            if final:
                ended.append(job)
        if due:
            try:
                with this_thread_using(self._codec_threads(len(due))):
                    waves = self.audio.decode({row: codes for row, (_, codes) in due.items()})
            except Exception as exc:  # e.g. the codec failed: the requests in this call fail, the others go on
                log.exception("decoding audio failed")
                for job, _ in due.values():
                    self._fail_audio(job, exc)
                waves = {}
            for row, wave in waves.items():
                job = due[row][0]
                job.stream._put(job.audio.emit(wave))
        for job in ended:
            if not job.failed:
                pause = job.audio.pause(job.prepared.plan.chunks[job.audio.index])
                if pause is not None:
                    job.stream._put(pause)

    def _audio_start(self, job: _Job, chunk: int, slot: int) -> None:
        """Begin ``job``'s text chunk ``chunk`` in codec row ``slot``; a failure fails the request alone."""
        if job.failed:
            return
        try:
            job.audio.start_chunk(chunk, slot)
        except Exception as exc:  # noqa: BLE001 - the request fails, the engine serves on
            log.exception("starting a request's audio failed")
            self._fail_audio(job, exc)

    def _fail_audio(self, job: _Job, error: BaseException) -> None:
        """End ``job``'s stream with ``error`` now; the frame thread frees its slot at the next frame boundary."""
        job.failed = True
        job.stream._end(error)
        self._wake()
