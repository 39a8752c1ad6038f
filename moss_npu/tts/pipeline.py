"""Text to waveform: the MOSS-TTS-Nano pipeline (docs/architecture.md#synthesis, #streaming).

text → chunks (voice clone: the official long-text splitter) → prompt rows → LM codes (F, Q) → codec →
waveform (C, S) at 48 kHz. Reference recordings are encoded once per file content and cached. On devices
that batch by default, voice-clone chunks are generated in batches sized from free device memory; the
streaming path generates one chunk at a time so the first audio comes as early as possible.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from moss_npu import device as devices
from moss_npu.codec.checkpoint import load_codec
from moss_npu.codec.model import NanoCodec
from moss_npu.codec.rows import CodecRows
from moss_npu.errors import InputError, NumericalError
from moss_npu.hub import DEFAULT_CODEC, DEFAULT_MODEL, resolve_model_dir
from moss_npu.nano.checkpoint import load_model
from moss_npu.origin import weights_state
from moss_npu.nano.decoder import FrameDecoder
from moss_npu.nano.frames import PhaseTimer, left_pad, phase, trim_codes
from moss_npu.nano.model import NanoTTSModel
from moss_npu.nano.prepared import DecoderWeights
from moss_npu.cpu.quantize import check_int8, dtype_name, quantize_int8, store_bf16
from moss_npu.nano.reference import reference_generate
from moss_npu.nano.reuse import PrefixCache
from moss_npu.nano.tokenizer import TextTokenizer
from moss_npu.output import save_audio
from moss_npu.cpu.threads import borrowed_cores, set_threads
from moss_npu.tts.loop import FrameLoop, Job
from moss_npu.tts.prepare import Plan, PreparedRequest, Preparer, PromptAudio, SpeechRequest
from moss_npu.tts.settings import LoadConfig, RunConfig
from moss_npu.tempo import stretch
from moss_npu.tts.streamer import AudioChunk, AudioStreamer
from moss_npu.tts.timeline import Timestamp, at_speed, pause, whole_timestamps

__all__ = ["AudioChunk", "AudioStreamer", "MossTTSNano", "Plan", "PromptAudio", "SynthesisResult"]

log = logging.getLogger(__name__)

# (chunk index, frame index) after every generated frame: drives progress bars.
FrameCallback = Callable[[int, int], None]


@dataclass(frozen=True)
class SynthesisResult:
    """A finished utterance: ``waveform`` (C, S) float32 on the CPU and the codes (ΣF, Q) it was decoded from."""

    waveform: torch.Tensor
    sample_rate: int
    codes: torch.Tensor
    text_chunks: list[str]
    mode: str
    batch_size: int
    timestamps: tuple[Timestamp, ...] = ()  # each text chunk's start and end in ``waveform`` (speed included)
    warnings: tuple[str, ...] = ()  # each text chunk that gave no audio (``tts.loop``), in words

    def save(self, path: str | Path, *, wav_subtype: Optional[str] = None) -> Path:
        """Write the waveform to ``path`` atomically, in the format its extension names (see ``moss_npu.output``).

        Raises:
            InputError: unknown extension, or a path that is not a regular file in a writable folder.
            OutputError: the write failed (e.g. no space left); no partial file remains.
        """
        return save_audio(path, self.waveform, self.sample_rate, wav_subtype=wav_subtype)


class MossTTSNano:
    """The native MOSS-TTS-Nano pipeline on one device."""

    def __init__(self, model: NanoTTSModel, tokenizer: TextTokenizer, codec: NanoCodec, *,
                 name: str = "the model", weights: Optional[DecoderWeights] = None, decoder: str = "optimized",
                 graph: str = "auto", compile: str = "auto") -> None:
        """Prepare what the frame decoder derives from the weights now, unless ``weights`` holds them already
        (``nano.prepared``; on the CPU from the prepared-weights cache, built there once per checkpoint, which a
        line naming ``name`` says), so that the first synthesis costs what the second does. ``decoder``,
        ``graph`` and ``compile`` say how the decoder computes (``LoadConfig``); another way is another pipeline
        (cheap over the same model and ``weights``)."""
        LoadConfig(decoder=decoder, graph=graph, compile=compile)  # validates
        self.model, self.tokenizer, self.codec = model, tokenizer, codec
        self.config = model.config
        self.preparer = Preparer(tokenizer, self.config, codec)  # text preparation and the reference cache
        self._name, self.algorithm, self.graph, self.compile = name, decoder, graph, compile
        self.weights = (weights if weights is not None and weights.current(model, compile)
                        else DecoderWeights.build(model, compile, cache=True, label=name))
        self._decoder: Optional[FrameDecoder] = None
        self._idle_stream_codec: Optional[CodecRows] = None  # the last stream's codec state, for the next one
        # Cores the frames' products borrow while they run (cpu.threads.borrowed_cores): from_pretrained with
        # num_threads=0 (the default policy, as the CLI passes it) lends them; an explicit count or None does not.
        self.spare_threads = 0

    @classmethod
    def from_pretrained(cls, model: str = DEFAULT_MODEL, codec: str = DEFAULT_CODEC, *, device: str = "auto",
                        dtype: Optional[str] = None, attn_implementation: Optional[str] = None,
                        num_threads: Optional[int] = None, quantize: str = "none", decoder: str = "optimized",
                        graph: str = "auto", compile: str = "auto") -> "MossTTSNano":
        """Load the LM and codec from local folders or hub ids onto ``device`` (``auto``, ``cpu``, ``npu:0``, …).

        These are the load-time settings (``LoadConfig``'s fields: ``from_pretrained(m, c, **asdict(load))``);
        every call's own settings are a ``RunConfig``. The LM computes in ``dtype`` (default fp32); the codec
        stays fp32 as in the official code. ``num_threads`` sets torch's intra-op threads and numpy's BLAS
        threads (``moss_npu.cpu.threads``; 0: its default policy; None: leave them), which are process-wide. ``quantize="int8"`` rounds the LM's block
        weights to int8 (CPU, float32; ``moss_npu.cpu.quantize``). On the CPU ``dtype="bfloat16"`` means bf16
        weights with float32 arithmetic (``cpu.quantize.store_bf16``).
        """
        load = LoadConfig(device=device or "auto", dtype=dtype or "auto",
                          attn_implementation=attn_implementation or "sdpa", num_threads=num_threads or 0,
                          quantize=quantize or "none", decoder=decoder, graph=graph, compile=compile)
        dev = devices.resolve_device(load.device)
        dt = devices.resolve_dtype(dev, load.dtype)
        attn = devices.attention_impl(load.attn_implementation)
        if num_threads is not None:
            set_threads(load.num_threads)
        if load.quantize == "int8":
            check_int8(dev, dt)  # before minutes of loading
        model_dir = resolve_model_dir(model, required=("config.json", "tokenizer.model"), role="TTS model")
        codec_dir = resolve_model_dir(codec, required=("config.json",), role="codec", example=DEFAULT_CODEC)
        rounded = devices.backend(dev).rounds_weights_only(dt)  # bf16 weights, float32 arithmetic (cpu.quantize)
        codec_loader = functools.partial(load_codec, codec_dir, device=dev, attention=attn)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="moss-npu-codec-load") as beside:
            # On the CPU the codec loads on another thread while the LM and its prepared weights load here (a
            # second core starts the process ~0.1 s sooner); a device keeps one thread.
            codec_future = beside.submit(codec_loader) if devices.backend(dev).host else None
            lm = load_model(model_dir, device=dev, dtype=torch.float32 if rounded else dt, attn_impl=attn)
            if rounded:
                store_bf16(lm)
            if load.quantize == "int8":
                quantize_int8(lm)
            weights = DecoderWeights.build(lm, compile, cache=True, label=str(model_dir))
            codec_model = codec_loader() if codec_future is None else codec_future.result()
        tts = cls(lm, TextTokenizer.from_dir(model_dir), codec_model, name=str(model_dir), weights=weights,
                  decoder=decoder, graph=graph, compile=compile)
        if num_threads is not None:
            tts.spare_threads = borrowed_cores(load.num_threads)
        return tts

    @property
    def device(self) -> torch.device:
        return self.model.device

    def setup(self) -> dict:
        """What this pipeline runs, for reports beside their numbers: the LM's dtype, the frame step
        (``cpu.step``'s dispatch: label and instruction set; ``torch`` elsewhere), torch's intra-op threads, and
        where the prepared weights came from (``nano.prepared``: ``cache``, ``built``, ...)."""
        return {"dtype": dtype_name(self.model), "step": self.weights.frame_step.dispatch(),
                "threads": torch.get_num_threads(), "prepared_weights": self.weights.source}

    @property
    def normalizer(self):
        """The official text preparation (``moss_npu.text.TextNormalizer``) this pipeline's requests go through."""
        return self.preparer.normalizer

    @property
    def sample_rate(self) -> int:
        return self.codec.sample_rate

    def reference_codes(self, source: PromptAudio) -> torch.Tensor:
        """Encode a reference recording into codes (F, Q) on the CPU; cached by content (``Preparer``)."""
        return self.preparer.reference_codes(source)

    def computing(self, decoder: Optional[str] = None, graph: Optional[str] = None,
                  compile: Optional[str] = None) -> "MossTTSNano":
        """This pipeline, or one over the same model, codec, weights and text preparation whose decoder computes
        another way (``LoadConfig``: decoder, graph, compile), for comparing ways in one process."""
        way = (decoder or self.algorithm, graph or self.graph, compile or self.compile)
        if way == (self.algorithm, self.graph, self.compile):
            return self
        LoadConfig(decoder=way[0], graph=way[1], compile=way[2])  # validates
        other = copy.copy(self)
        other.algorithm, other.graph, other.compile = way
        other._decoder, other._idle_stream_codec = None, None
        return other

    def decoder(self, slots: int, max_len: int, sampler: str = "official") -> FrameDecoder:
        """Return this pipeline's frame decoder, rebuilt when it is too small or computes another way.

        The decoder keeps its prompt-prefix cache across calls (the template; a voice reference across the
        chunks of a text), handed on to a rebuilt one. Sizes grow in steps so that few rebuilds happen.
        """
        current, graph, compile = self._decoder, self.graph, self.compile
        if not self.weights.current(self.model, compile):  # edited weights
            if current is not None and current.prefix_cache is not None and self.weights.state != weights_state(
                    self.model):
                current.prefix_cache.clear()  # keys and values of the old weights
            self.weights = DecoderWeights.build(self.model, compile, cache=True, label=self._name)
        if (current is None or current.slots < slots or current.state.max_len < max_len
                or current.sampler != sampler or current.graph_mode != graph or current.compile_mode != compile
                or current.dtype != self.model.dtype or current.weights is not self.weights):
            cache = current.prefix_cache if current is not None and current.dtype == self.model.dtype else None
            size = max(slots, current.slots if current is not None else 1)
            length = -(-max(max_len, current.state.max_len if current is not None else 0) // 256) * 256
            self._decoder = None  # free the old state before allocating the new one
            self._decoder = FrameDecoder(self.model, slots=size, max_len=length, sampler=sampler, graph=graph,
                                         prefix_cache=cache if cache is not None else PrefixCache(), compile=compile,
                                         weights=self.weights)
        return self._decoder

    def _generator(self, settings: RunConfig, generator: Optional[torch.Generator]) -> Optional[torch.Generator]:
        """Return the caller's generator, else one seeded from ``settings.seed`` (host or device), else None.

        A device generator seeded with ``seed`` draws what the official ``torch.manual_seed(seed)`` run draws,
        without touching the process-wide generators.
        """
        if generator is not None or settings.seed is None:
            return generator
        place = torch.device("cpu") if settings.host_rng else self.device
        return torch.Generator(device=place).manual_seed(settings.seed)

    def _prepare(self, text: str, settings: RunConfig, prompt_audio: Optional[PromptAudio],
                 prompt_text: Optional[str]) -> PreparedRequest:
        return self.preparer.prepare(SpeechRequest(text, prompt_audio, None, prompt_text, settings))

    def _run(self, job: Job, settings: RunConfig, timer: Optional[PhaseTimer]) -> Iterator[tuple]:
        """Run ``job`` through a frame loop on this thread; yield its events (``tts.loop``, the one frame driver).

        Raises the job's error (NumericalError for non-finite logits the fallback could not cure).
        """
        if self._decoder is not None and self._decoder.free_slots < self._decoder.slots:
            raise InputError("this MossTTSNano is already generating (a synthesize_stream that is still open, or "
                             "a call from another thread): finish or close that stream first, or use one "
                             "MossTTSNano per thread (moss_npu.serve batches concurrent requests)")
        length = max(int(rows.shape[0]) for rows in job.prepared.rows) + settings.max_new_frames
        decoder = self.decoder(job.batch, length, "noise" if settings.host_rng else "official")
        decoder.timer = timer
        try:
            yield from self._lent_while_running(FrameLoop(decoder).run(job), decoder)
        finally:
            decoder.timer = None

    def _lent_while_running(self, events: Iterator[tuple], decoder: FrameDecoder) -> Iterator[tuple]:
        """Yield ``events``, lending the frames' products ``spare_threads`` more threads while the loop runs to the
        next event and taking them back while the caller handles it (the codec, on this thread's own count).
        Leaving early closes ``events`` at once, as ``yield from`` would (the loop frees its slots)."""
        with contextlib.closing(events):
            while True:
                decoder.frame_step.lend(self.spare_threads)
                try:
                    event = next(events, None)
                finally:
                    decoder.frame_step.lend(0)
                if event is None:
                    return
                yield event

    def _oracle(self, prepared: PreparedRequest, settings: RunConfig, generator: Optional[torch.Generator],
                batch: int, timer: Optional[PhaseTimer]) -> Iterator[torch.Tensor]:
        """Every chunk's codes from the official algorithm (``nano.reference``), ``batch`` left-padded chunks at
        a time; non-finite logits generate the batch again with a float32 copy (and the later ones too)."""
        lm = self.model
        for start in range(0, len(prepared.rows), batch):
            prompts = prepared.rows[start:start + batch]
            rows, mask = (prompts[0], None) if len(prompts) == 1 else left_pad(prompts, self.config)
            while True:
                try:
                    result = reference_generate(lm, rows.to(self.device), mask, sampling=settings.sampling(),
                                                nq=prepared.plan.nq, max_new_frames=settings.max_new_frames,
                                                generator=generator, host_rng=bool(settings.host_rng), timer=timer)
                    break
                except NumericalError as exc:
                    if not settings.stability_fallback or lm.dtype == torch.float32:
                        raise
                    log.warning("%s: generating again with a float32 copy of the language model", exc)
                    lm = copy.deepcopy(lm).float()
            yield from (c.cpu() for c in result.codes)

    def _decode(self, codes: torch.Tensor, nq: int, skip_frames: int = 0,
                timer: Optional[PhaseTimer] = None) -> torch.Tensor:
        """Decode codes (F, Q) in one call; return (C, S) on the CPU without the first ``skip_frames`` frames."""
        if codes.shape[0] == 0:
            return torch.zeros(self.codec.channels, 0)
        with phase(timer, "codec"):
            audio, lengths = self.codec.decode(codes[:, :nq].T[:, None, :])
            return audio[0, :, skip_frames * self.codec.frame_size: int(lengths[0])].cpu()

    def synthesize(self, text: str, *, prompt_audio: Optional[PromptAudio] = None, prompt_text: Optional[str] = None,
                   settings: RunConfig = RunConfig(), generator: Optional[torch.Generator] = None,
                   on_frame: Optional[FrameCallback] = None, timer: Optional[PhaseTimer] = None) -> SynthesisResult:
        """Speak ``text`` (optionally in the voice of ``prompt_audio``); return the whole waveform.

        ``timer`` collects wall time per phase (the frame loop's, plus "codec") for benchmarks.
        """
        prepared = self._prepare(text, settings, prompt_audio, prompt_text)
        plan, generator, batch = prepared.plan, self._generator(settings, generator), 1
        if plan.mode == "voice_clone":
            batch = devices.chunk_batch_size(self.device, len(plan.chunks),
                                             settings.voice_clone_max_memory_per_sample_gb, settings.tts_max_batch_size)
        job = Job(prepared, generator, batch=batch)
        if self.algorithm == "reference":
            chunk_codes = list(self._oracle(prepared, settings, generator, batch, timer))
        else:
            for event in self._run(job, settings, timer):
                for _, chunk, codes, _ in (event[1] if event[0] == "frame" and on_frame is not None else ()):
                    if codes is not None:
                        on_frame(chunk, len(job.frames[chunk]) - 1)
            chunk_codes = [trim_codes(c, plan.nq, self.config) for c in job.chunk_codes(self.config.n_vq)]
            _warn(job)

        if plan.mode == "continuation" and plan.prompt_codes is not None:
            # Decode the prompt audio too, so the continuation starts from the right codec context.
            full = torch.cat([plan.prompt_codes, chunk_codes[0]], dim=0)
            waveform = self._decode(full, plan.nq, skip_frames=plan.prompt_codes.shape[0], timer=timer)
            lengths = [waveform.shape[-1]]
        else:
            pieces, lengths = [], []
            for i, (chunk, codes) in enumerate(zip(plan.chunks, chunk_codes)):
                pieces.append(self._decode(codes, plan.nq, timer=timer))
                if i < len(plan.chunks) - 1:
                    pieces.append(torch.zeros(self.codec.channels, pause(chunk, self.sample_rate)))
                lengths.append(sum(p.shape[-1] for p in pieces) - sum(lengths))
            waveform = torch.cat(pieces, dim=1)
        if settings.speed != 1.0:
            waveform = torch.from_numpy(stretch(waveform.numpy(), self.sample_rate, settings.speed))
        stamps = whole_timestamps(plan.chunks, lengths, self.sample_rate, settings.speed, waveform.shape[-1])
        silent = {chunk for chunk, _ in job.warnings}
        stamps = tuple(dataclasses.replace(s, no_audio=True) if s.index in silent else s for s in stamps)
        return SynthesisResult(waveform, self.sample_rate, torch.cat(chunk_codes, dim=0), plan.chunks, plan.mode, batch,
                               stamps, tuple(message for _, message in job.warnings))

    def synthesize_stream(self, text: str, *, prompt_audio: Optional[PromptAudio] = None,
                          prompt_text: Optional[str] = None, settings: RunConfig = RunConfig(),
                          generator: Optional[torch.Generator] = None,
                          clock: Callable[[], float] = time.perf_counter,
                          timer: Optional[PhaseTimer] = None) -> Iterator[AudioChunk]:
        """Speak ``text`` and yield audio as it is decoded, following the playback-lead schedule.

        The codec keeps its transformer state between calls, so each call decodes only the new frames; the
        concatenated chunks equal ``synthesize``'s waveform up to float rounding. The first call decodes as
        soon as one frame exists (budget 1), which sets the time to first audio.

        Every frame is checked finite before the codec sees it. Audio already yielded cannot be taken back, so
        the stability fallback continues the text chunk in float32 from the frames generated so far (their
        repetition-penalty history starts again there) instead of generating the chunk again.

        A ``settings.speed`` other than 1.0 runs the whole stream through one stretcher (``moss_npu.tempo``):
        no restart at chunk joins, and the same length as ``synthesize`` at that speed.
        """
        prepared = self._prepare(text, settings, prompt_audio, prompt_text)
        generator = self._generator(settings, generator)
        yield from at_speed(self._stream_plan(prepared, settings, generator, clock, timer), settings.speed,
                            self.sample_rate, self.codec.channels)

    def _stream_plan(self, prepared: PreparedRequest, settings: RunConfig, generator: Optional[torch.Generator],
                     clock: Callable[[], float], timer: Optional[PhaseTimer]) -> Iterator[AudioChunk]:
        """``synthesize_stream``'s audio at the model's own pace."""
        rows = self._stream_codec(max(settings.schedule().budgets), timer)
        audio, job = AudioStreamer(prepared.plan, settings, rows, clock), Job(prepared, generator, resume=True)
        try:
            if self.algorithm == "reference":  # the oracle: each chunk's codes at once
                for index, codes in enumerate(self._oracle(prepared, settings, generator, 1, timer)):
                    audio.start_chunk(index)
                    for frame in codes:
                        yield from audio.push(frame)
                    yield from audio.end_chunk(prepared.plan.chunks[index])
                return
            for event in self._run(job, settings, timer):
                if event[0] == "start":
                    audio.start_chunk(event[2])
                for _, chunk, codes, final in (event[1] if event[0] == "frame" else ()):
                    if codes is not None:
                        yield from audio.push(codes)
                    if final:
                        yield from audio.end_chunk(prepared.plan.chunks[chunk])
            _warn(job)
        finally:
            self._idle_stream_codec = rows

    def _stream_codec(self, frames_per_step: int, timer: Optional[PhaseTimer]) -> CodecRows:
        """Return a one-row streaming codec state for a new stream: the last stream's, once it is over and if
        it fits (a new state costs allocation and zeroing before the first audio; ``start_chunk``
        resets the row), else a new one. A stream holds its state until it ends, so two open streams never
        share one."""
        rows, self._idle_stream_codec = self._idle_stream_codec, None
        if rows is None or rows.max_frames_per_step != frames_per_step:
            rows = CodecRows(self.codec, 1, frames_per_step)
        rows.timer = timer
        return rows


def _warn(job: Job) -> None:
    """Log each text chunk that gave no audio (the command line shows ``warning:`` lines), unless none gave any:
    then the whole call failed, which its caller says once."""
    if any(job.frames.values()):
        for _, message in job.warnings:
            log.warning(message)
