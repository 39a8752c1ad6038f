"""The frame loop: the one driver of the frame decoder, for the pipeline's calls and the engine's requests alike.

A ``Job`` is one prepared request. ``FrameLoop.frame`` runs one frame boundary: it drops jobs that were
cancelled, admits the next text chunks of waiting jobs into free slots (up to ``job.batch`` chunks of a job at
once: chunk batching; a job's next chunks wait until its running ones end), steps every decoder that has work,
and returns what happened as events, in order:

* ``("start", job, chunk, slot)``: text chunk ``chunk`` of ``job`` begins in ``slot`` (also its codec row);
* ``("frame", [(job, chunk, codes or None, final), ...])``: one frame of every running chunk of one decoder;
* ``("warning", job, chunk, message)``: a chunk gave no audio, even after its retry;
* ``("end", job, error)``: the job is over; with no error ``job.chunk_codes()`` holds its codes.

Non-finite logits in a bf16/fp16 decoder (the official stability fallback): the chunk moves to a float32 copy
of the model, built on first need and dropped when no job uses it, keeping its slot number (so its codec row).
With ``job.resume`` (a stream: audio already out cannot be taken back) it continues from its frames so far,
their repetition-penalty history starting again there; otherwise the job's running chunks are generated again.
The job's later chunks stay in float32; the loaded model keeps its dtype.

A chunk whose model stops before its first frame is generated once more with the next seed (sampled runs: a
greedy one would stop again); if it still gives nothing, a warning names it, so no words vanish unsaid.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from moss_npu.cpu.threads import this_thread_using
from moss_npu.errors import MossNpuError
from moss_npu.limits import MAX_SEED
from moss_npu.nano.decoder import FrameDecoder, RequestParams
from moss_npu.nano.frames import GenerationResult, LogitsHook, PhaseTimer, check_budget, trim_codes, unpad
from moss_npu.nano.model import NanoTTSModel
from moss_npu.sampling import SamplingParams
from moss_npu.tts.prepare import Plan, PreparedRequest
from moss_npu.tts.settings import RunConfig

log = logging.getLogger(__name__)


class Cancelled(MossNpuError):
    """The request was cancelled before it finished (what its stream raises after ``cancel()``)."""


@dataclass(eq=False)
class Job:
    """One prepared request in the frame loop: how its chunks run and what they produced.

    ``generator``: the sampler's generator (the noise sampler's CPU one, the official sampler's device one; None:
    torch's default). ``batch``: chunks decoded at once. ``resume``: continue a chunk after a fallback instead of
    generating it again.
    """

    prepared: PreparedRequest
    generator: Optional[torch.Generator] = None
    batch: int = 1
    resume: bool = False
    todo: deque = field(default_factory=deque)  # chunk indices still to run, in order
    frames: dict = field(default_factory=dict)  # chunk -> its codes (Q,) so far
    slots: dict = field(default_factory=dict)  # slot -> chunk, for the chunks running now
    float32: bool = False  # its chunks run on the float32 copy
    retry: bool = True  # a chunk that gave no audio runs once more (not for ``generate``, the model's own API)
    retries: dict = field(default_factory=dict)  # chunk -> the generator of its retry
    warnings: list = field(default_factory=list)  # (chunk, message) of the chunks that gave no audio
    done: bool = False

    def __post_init__(self) -> None:
        self.todo.extend(range(len(self.prepared.plan.chunks)))

    def dropped(self) -> bool:
        """Whether the job's owner gave it up (the engine: cancelled, or its audio failed)."""
        return False

    def chunk_codes(self, n_vq: int) -> list[torch.Tensor]:
        """The codes (F, Q) of every text chunk, in order."""
        return [torch.stack(f) if f else torch.empty(0, n_vq, dtype=torch.long)
                for f in (self.frames.get(i, []) for i in range(len(self.prepared.plan.chunks)))]


class FrameLoop:
    """Drive ``decoder`` (and the float32 copy of a fallback) over jobs (see the module docstring).

    ``lock`` guards the waiting jobs, which other threads add to (``add``); ``frame`` runs on one thread.
    """

    def __init__(self, decoder: FrameDecoder, lock: Optional[threading.Condition] = None,
                 prefill_threads: Optional[Callable[[], int]] = None) -> None:
        """``prefill_threads()``, asked before each prefill, says how many torch threads it runs on in this thread
        (None: the thread's own count)."""
        self.decoder = decoder
        self.prefill_threads = prefill_threads or torch.get_num_threads
        self.fallback: Optional[FrameDecoder] = None
        self.lock = lock if lock is not None else threading.RLock()
        self.waiting: deque[Job] = deque()
        self.running: dict[int, tuple[Job, FrameDecoder]] = {}  # slot -> its job and the decoder it runs on

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def add(self, job: Job) -> None:
        """Queue ``job`` for slots (thread-safe)."""
        with self.lock:
            self.waiting.append(job)

    def frame(self) -> list[tuple]:
        """Run one frame boundary; return its events."""
        events: list[tuple] = []
        self._drop(events)
        self._admit(events)
        for decoder in (self.decoder, self.fallback):
            if decoder is not None and any(d is decoder for _, d in self.running.values()):
                self._step(decoder, events)
        return events

    def run(self, job: Job) -> Iterator[tuple]:
        """Run ``job`` alone on this thread; yield its events; raise its error. Leaving early frees its slots."""
        self.add(job)
        try:
            while not job.done:
                for event in self.frame():
                    if event[0] == "end" and event[2] is not None:
                        raise event[2]
                    yield event
        finally:
            self.abandon(job)

    def abandon(self, job: Job) -> None:
        """Stop ``job`` without an event (its caller left): free its slots, forget it."""
        self._release(job)
        with self.lock:
            if job in self.waiting:
                self.waiting.remove(job)
        job.done = True
        self._drop_fallback()

    def fail_all(self, error: BaseException) -> list[tuple]:
        """End every job with ``error`` (the engine closes); return the end events."""
        events: list[tuple] = []
        with self.lock:
            jobs = list(self.waiting) + [job for job, _ in self.running.values()]
        for job in dict.fromkeys(jobs):
            self._fail(job, error, events)
        return events

    # ---- admission ------------------------------------------------------------------------------------------

    def _drop(self, events: list) -> None:
        with self.lock:
            jobs = [job for job in self.waiting if job.dropped()]
        jobs += [job for job, _ in self.running.values() if job.dropped()]
        for job in dict.fromkeys(jobs):
            self._fail(job, Cancelled("request cancelled"), events)

    def _admit(self, events: list) -> None:
        """Admit waiting jobs' next chunks, first come first served, each decoder's in one prefill."""
        free = [s for s in range(self.decoder.slots) if s not in self.running]
        chosen: dict[bool, list] = {False: [], True: []}  # float32 -> [(job, chunk, slot)]
        with self.lock:
            while self.waiting:
                job = self.waiting[0]
                count = min(job.batch, len(job.todo))
                if count > len(free):
                    break
                self.waiting.popleft()
                for _ in range(count):
                    chosen[job.float32].append((job, job.todo.popleft(), free.pop(0)))
        for float32, entries in chosen.items():
            if entries:
                self._start(self._decoder(float32), entries, events)

    def _start(self, decoder: FrameDecoder, entries: list, events: list) -> None:
        """Prefill (job, chunk, slot) ``entries`` into ``decoder`` together; a bad one fails its job alone."""
        checked = []  # (job, chunk, slot, (rows, params))
        for job, chunk, slot in entries:
            if job.done:  # a bad chunk failed its job: its other chunks go with it
                continue
            try:
                request = self._request(job, chunk, decoder)
                decoder.check_request(*request)
            except Exception as exc:  # bad input (MossNpuError) or a bug: this job fails, the others go on
                self._fail(job, exc, events)
                continue
            checked.append((job, chunk, slot, request))
        checked = [entry for entry in checked if not entry[0].done]
        if not checked:
            return
        decoder.generator = self._official_generator(decoder, checked[0][0], checked[0][1])
        try:
            with this_thread_using(self.prefill_threads()):
                decoder.admit_many([request for *_, request in checked], into=[slot for _, _, slot, _ in checked])
        except Exception as exc:  # checked above, so a device failure or a bug: these jobs fail alone
            for job in dict.fromkeys(job for job, *_ in checked):
                self._fail(job, exc, events)
            return
        for job, chunk, slot, _ in checked:
            job.slots[slot] = chunk
            self.running[slot] = (job, decoder)
            events.append(("start", job, chunk, slot))

    @staticmethod
    def _official_generator(decoder: FrameDecoder, job: Job, chunk: int) -> Optional[torch.Generator]:
        """The device generator the official sampler draws from for ``job``'s chunk (one job at a time)."""
        return job.retries.get(chunk, job.generator) if decoder.sampler == "official" else None

    def _request(self, job: Job, chunk: int, decoder: FrameDecoder) -> tuple[torch.Tensor, RequestParams]:
        """The prompt rows and decoding parameters of ``job``'s chunk: after a resumed fallback, its prompt plus
        the rows its frames so far fed back, and what is left of its frame budget."""
        settings, rows = job.prepared.settings, job.prepared.rows[chunk]
        done = job.frames.get(chunk, []) if job.resume else []
        if done:
            generated = torch.stack(done)
            token = decoder.model.config.audio_assistant_slot_token_id
            rows = torch.cat([rows, torch.cat([generated.new_full((len(done), 1), token), generated], dim=1)])
        else:
            job.frames[chunk] = []
        generator = job.retries.get(chunk, job.generator) if decoder.sampler == "noise" else None
        return rows, RequestParams(settings.sampling(), job.prepared.plan.nq, settings.max_new_frames - len(done),
                                   generator)

    def _decoder(self, float32: bool) -> FrameDecoder:
        """The main decoder, or the float32 copy's (built now if there is none)."""
        if not float32:
            return self.decoder
        if self.fallback is None:
            main = self.decoder
            self.fallback = FrameDecoder(copy.deepcopy(main.model).float(), slots=main.slots,
                                         max_len=main.state.max_len, sampler=main.sampler, graph=main.graph_mode,
                                         compile=main.compile_mode, timer=main.timer, logits_hook=main.logits_hook)
        return self.fallback

    # ---- frames ---------------------------------------------------------------------------------------------

    def _step(self, decoder: FrameDecoder, events: list) -> None:
        """Step ``decoder`` once; record the new codes; free a job's slots once all its running chunks ended (a
        batch holds its slots to the end, so the official sampler draws for it as the official batch does)."""
        mine = {slot: job for slot, (job, d) in self.running.items() if d is decoder}
        try:
            batch = decoder.step()
        except Exception as exc:  # a bug or a device failure: fail its jobs, keep serving
            log.exception("frame step failed")
            error = exc if isinstance(exc, MossNpuError) else MossNpuError(
                f"generation failed: {type(exc).__name__}: {exc}")
            for job in dict.fromkeys(mine.values()):
                self._fail(job, error, events)
            return
        for slot, job in mine.items():
            if bool(batch.non_finite[slot]) and not job.done:
                self._non_finite(job, slot, decoder, decoder.non_finite_error(slot, batch.step_index), events)
        frame = []
        for slot, job in mine.items():
            if job.done or self.running.get(slot, (None, None))[1] is not decoder:
                continue  # failed, or moved to the float32 copy just now
            chunk, codes = job.slots[slot], None
            if bool(batch.active[slot]):
                codes = batch.codes[slot]
                job.frames[chunk].append(codes)
            if codes is not None or bool(batch.finished[slot]):
                frame.append((job, chunk, codes, bool(batch.finished[slot]) and self._over(job, chunk, decoder,
                                                                                          events)))
        events.append(("frame", frame))
        for job in dict.fromkeys(mine.values()):
            if not job.done and job.slots and all(decoder.is_done(s) for s in job.slots):
                self._release(job)
                self._next(job, events)
        self._drop_fallback()

    def _over(self, job: Job, chunk: int, decoder: FrameDecoder, events: list) -> bool:
        """Whether a chunk that ended is over: one that gave no audio runs once more (queued here), or is named
        in a warning."""
        if job.frames[chunk] or not job.retry:
            return True
        settings = job.prepared.settings
        if chunk not in job.retries and settings.do_sample:
            job.retries[chunk] = self._retry_generator(job, decoder)
            job.todo = deque(sorted([*job.todo, chunk]))
            return False
        text = job.prepared.plan.chunks[chunk]
        message = (f"text chunk {chunk + 1} ({text[:40] + '...' if len(text) > 40 else text!r}) gave no audio: "
                   f"the model stopped before its first frame{', also with the next seed' if settings.do_sample else ''}; "
                   "try another seed or reword it")
        job.warnings.append((chunk, message))
        events.append(("warning", job, chunk, message))
        return True

    def _retry_generator(self, job: Job, decoder: FrameDecoder) -> Optional[torch.Generator]:
        """The generator of a chunk's retry: seeded with the next seed, or the job's own going on (no seed)."""
        seed = job.prepared.settings.seed
        if seed is None:
            return job.generator
        place = torch.device("cpu") if decoder.sampler == "noise" else decoder.device
        return torch.Generator(device=place).manual_seed((seed + 1) % (MAX_SEED + 1))

    def _next(self, job: Job, events: list) -> None:
        """After a job's running chunks ended: queue its next ones first in line, or end it."""
        if job.todo:
            with self.lock:
                self.waiting.appendleft(job)
        else:
            job.done = True
            events.append(("end", job, None))

    def _non_finite(self, job: Job, slot: int, decoder: FrameDecoder, error: MossNpuError, events: list) -> None:
        """Move ``job`` to the float32 copy (see the module docstring), or fail it when that cannot help."""
        if decoder.dtype == torch.float32 or not job.prepared.settings.stability_fallback:
            self._fail(job, error, events)
            return
        log.warning("%s: generating again with a float32 copy of the language model", error)
        job.float32 = True
        fallback = self._decoder(True)
        if job.resume:  # this chunk alone, in the same slot
            chunk = job.slots[slot]
            decoder.release(slot)
            try:
                fallback.generator = self._official_generator(fallback, job, chunk)
                fallback.admit_many([self._request(job, chunk, fallback)], into=[slot])
            except Exception as exc:  # noqa: BLE001 - the job fails, the others go on
                del job.slots[slot], self.running[slot]
                self._fail(job, exc, events)
                return
            self.running[slot] = (job, fallback)
            return
        for chunk in sorted(job.slots.values(), reverse=True):
            job.todo.appendleft(chunk)
        self._release(job)
        with self.lock:
            self.waiting.appendleft(job)

    def _release(self, job: Job) -> None:
        for slot in list(job.slots):
            self.running.pop(slot)[1].release(slot)
        job.slots.clear()

    def _fail(self, job: Job, error: BaseException, events: list) -> None:
        if job.done:
            return
        self._release(job)
        with self.lock:
            if job in self.waiting:
                self.waiting.remove(job)
        job.done = True
        events.append(("end", job, error))

    def _drop_fallback(self) -> None:
        """Free the float32 copy once no job uses it."""
        if self.fallback is None:
            return
        with self.lock:
            waiting = any(job.float32 for job in self.waiting)
        if not waiting and not any(d is self.fallback for _, d in self.running.values()):
            self.fallback = None


def generate(model: NanoTTSModel, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
             sampling: SamplingParams = SamplingParams(), nq: Optional[int] = None, max_new_frames: int = 300,
             generator: Optional[torch.Generator] = None, host_rng: bool = False, graph: str = "off",
             logits_hook: Optional[LogitsHook] = None, timer: Optional[PhaseTimer] = None) -> GenerationResult:
    """The model's own generation API through the frame loop: every prompt of (B, L, Q + 1) / (L, Q + 1) rows
    (left-padded where ``attention_mask`` is False) in one batch of a fresh decoder; return the trimmed codes.

    ``host_rng`` selects the noise-fed sampler with uniforms from ``generator`` (a CPU generator); otherwise the
    official sampler draws from ``generator`` (a device generator). Non-finite logits raise NumericalError (no
    fallback, no retry: this is what the official ``generate`` does, for conformance checks).
    """
    prompts = unpad(input_ids, attention_mask)
    cfg = model.config
    nq = check_budget(nq, max_new_frames, cfg)
    settings = RunConfig(**dataclasses.asdict(sampling), nq=nq, max_new_frames=max_new_frames, host_rng=host_rng,
                         stability_fallback=False)
    decoder = FrameDecoder(model, slots=len(prompts), max_len=max(int(p.shape[0]) for p in prompts) + max_new_frames
                           + 1, sampler="noise" if host_rng else "official", graph=graph, logits_hook=logits_hook,
                           timer=timer)
    job = Job(PreparedRequest(Plan("continuation", [""] * len(prompts), None, None, nq), prompts, settings),
              generator, batch=len(prompts), retry=False)
    for _ in FrameLoop(decoder).run(job):
        pass
    codes = job.chunk_codes(cfg.n_vq)
    frames = torch.full((len(codes), max(len(c) for c in codes), cfg.n_vq), cfg.audio_pad_token_id, dtype=torch.long)
    for b, c in enumerate(codes):
        frames[b, :len(c)] = c
    stopped = torch.tensor([len(c) < max_new_frames for c in codes])
    return GenerationResult([trim_codes(c, nq, cfg).to(model.device) for c in codes], frames.to(model.device),
                            stopped)
