"""Text to waveform: the MOSS-TTS-Nano pipeline (docs/architecture.md#synthesis, #streaming).

text → chunks (voice clone: the official long-text splitter) → prompt rows → LM codes (F, Q) → codec →
waveform (C, S) at 48 kHz. Reference recordings are encoded once per file content and cached. On devices
that batch by default, voice-clone chunks are generated in batches sized from free device memory; the
streaming path generates one chunk at a time so the first audio comes as early as possible.
"""

from __future__ import annotations

import contextlib
import copy
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
from moss_npu.nano.decoder import FrameDecoder, RequestParams
from moss_npu.nano.frames import PhaseTimer, left_pad, trim_codes
from moss_npu.nano.model import NanoTTSModel
from moss_npu.nano.prepared import DecoderWeights
from moss_npu.cpu.quantize import check_int8, dtype_name, quantize_int8, store_bf16
from moss_npu.nano.reference import reference_generate
from moss_npu.nano.reuse import PrefixCache
from moss_npu.nano.text import pause_samples
from moss_npu.nano.tokenizer import TextTokenizer
from moss_npu.output import save_audio
from moss_npu.cpu.threads import set_threads
from moss_npu.tts.prepare import Plan, Preparer, PromptAudio
from moss_npu.tts.settings import LoadConfig, RunConfig
from moss_npu.tempo import stretch
from moss_npu.tts.streamer import AudioChunk, AudioStreamer
from moss_npu.tts.timeline import Timestamp, at_speed, whole_timestamps

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
                 name: str = "the model", weights: Optional[DecoderWeights] = None) -> None:
        """Prepare what the frame decoder derives from the weights now, unless ``weights`` holds them already
        (``nano.prepared``; on the CPU from the prepared-weights cache, built there once per checkpoint, which a
        line naming ``name`` says), so that the first synthesis costs what the second does."""
        self.model, self.tokenizer, self.codec = model, tokenizer, codec
        self.config = model.config
        self.preparer = Preparer(tokenizer, self.config, codec)  # text preparation and the reference cache
        self._name = name
        self.weights = (weights if weights is not None and weights.current(model, "auto")
                        else DecoderWeights.build(model, cache=True, label=name))
        self._decoder: Optional[FrameDecoder] = None
        self._idle_stream_codec: Optional[CodecRows] = None  # the last stream's codec state, for the next one

    @classmethod
    def from_pretrained(cls, model: str = DEFAULT_MODEL, codec: str = DEFAULT_CODEC, *, device: str = "auto",
                        dtype: Optional[str] = None, attn_implementation: Optional[str] = None,
                        num_threads: int = 0, quantize: str = "none") -> "MossTTSNano":
        """Load the LM and codec from local folders or hub ids onto ``device`` (``auto``, ``cpu``, ``npu:0``, …).

        These are the load-time settings (``LoadConfig``'s fields: ``from_pretrained(m, c, **asdict(load))``);
        every call's own settings are a ``RunConfig``. The LM computes in ``dtype`` (default fp32); the codec
        stays fp32 as in the official code. ``num_threads`` > 0 sets torch's intra-op threads and numpy's
        BLAS threads (``moss_npu.cpu.threads``), which are process-wide. ``quantize="int8"`` rounds the LM's block
        weights to int8 (CPU, float32; ``moss_npu.cpu.quantize``). On the CPU ``dtype="bfloat16"`` means bf16
        weights with float32 arithmetic (``cpu.quantize.store_bf16``).
        """
        load = LoadConfig(device=device or "auto", dtype=dtype or "auto",
                          attn_implementation=attn_implementation or "sdpa", num_threads=num_threads,
                          quantize=quantize or "none")
        dev = devices.resolve_device(load.device)
        dt = devices.resolve_dtype(dev, load.dtype)
        attn = devices.attention_impl(dev, dt, load.attn_implementation)
        if load.num_threads > 0:
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
            codec_future = beside.submit(codec_loader) if devices.is_host(dev) else None
            lm = load_model(model_dir, device=dev, dtype=torch.float32 if rounded else dt, attn_impl=attn)
            if rounded:
                store_bf16(lm)
            if load.quantize == "int8":
                quantize_int8(lm)
            weights = DecoderWeights.build(lm, cache=True, label=str(model_dir))
            codec_model = codec_loader() if codec_future is None else codec_future.result()
        return cls(lm, TextTokenizer.from_dir(model_dir), codec_model, name=str(model_dir), weights=weights)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def setup(self) -> dict:
        """What this pipeline runs, for reports beside their numbers: the LM's dtype, the frame step
        (``cpu.step``'s dispatch: label and instruction set; ``torch`` elsewhere), torch's intra-op threads, and
        where the prepared weights came from (``nano.prepared``: ``cache``, ``built``, ...)."""
        step = self.weights.cpu_step
        return {"dtype": dtype_name(self.model), "step": "torch" if step is None else step.dispatch(),
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

    def plan(self, text: str, settings: RunConfig, prompt_audio: Optional[PromptAudio] = None,
             prompt_text: Optional[str] = None, prompt_codes: Optional[torch.Tensor] = None) -> Plan:
        """Normalize a request's texts and decide its mode, chunks and prompt codes (``Preparer.plan``)."""
        return self.preparer.plan(text, settings, prompt_audio, prompt_text, prompt_codes)

    def prompt_rows(self, plan: Plan, chunk: str) -> torch.Tensor:
        """Return the prompt rows (L, Q + 1) of one text chunk of ``plan``."""
        return self.preparer.prompt_rows(plan, chunk)

    def decoder(self, slots: int, max_len: int, sampler: str = "official", graph: str = "auto",
                compile: str = "auto") -> FrameDecoder:
        """Return this pipeline's frame decoder, rebuilt when it is too small or computes another way.

        The decoder keeps its prompt-prefix cache across calls (the template; a voice reference across the
        chunks of a text), handed on to a rebuilt one. Sizes grow in steps so that few rebuilds happen.
        """
        current = self._decoder
        if not self.weights.current(self.model, compile):  # edited weights, or another --compile
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

    def _fallback(self, exc: NumericalError, settings: RunConfig, lm: NanoTTSModel) -> NanoTTSModel:
        """Return a float32 copy of ``lm`` to generate again with (the official stability fallback), or re-raise.

        The copy serves the rest of this call only: the loaded model keeps its dtype, so a later call (or one
        running at the same time) is not changed by this one. Re-raises ``exc`` when the fallback is off or
        ``lm`` already is float32 (the error then says what to do instead).
        """
        if not settings.stability_fallback or lm.dtype == torch.float32:
            raise exc
        log.warning("%s: generating again with a float32 copy of the language model", exc)
        return copy.deepcopy(lm).float()

    def _generator(self, settings: RunConfig, generator: Optional[torch.Generator]) -> Optional[torch.Generator]:
        """Return the caller's generator, else one seeded from ``settings.seed`` (host or device), else None.

        A device generator seeded with ``seed`` draws what the official ``torch.manual_seed(seed)`` run draws,
        without touching the process-wide generators.
        """
        if generator is not None or settings.seed is None:
            return generator
        place = torch.device("cpu") if settings.host_rng else self.device
        return torch.Generator(device=place).manual_seed(settings.seed)

    def _generate_batch(self, lm: NanoTTSModel, prompts: list[torch.Tensor], first_chunk: int, plan: Plan,
                        settings: RunConfig, generator: Optional[torch.Generator], on_frame: Optional[FrameCallback],
                        timer: Optional[PhaseTimer]) -> list[torch.Tensor]:
        """Generate a batch of prompts with ``lm`` (decoder slots, or the oracle's left-padded batch); return each
        one's trimmed codes (F, Q) on the CPU."""
        if settings.decoder == "reference":
            rows, mask = (prompts[0], None) if len(prompts) == 1 else left_pad(prompts, self.config)
            result = reference_generate(lm, rows.to(self.device), mask, sampling=settings.sampling(), nq=plan.nq,
                                        max_new_frames=settings.max_new_frames, generator=generator,
                                        host_rng=settings.host_rng, timer=timer)
            return [c.cpu() for c in result.codes]
        frames: list[list[torch.Tensor]] = [[] for _ in prompts]
        for index, codes in self._decode_frames(lm, prompts, settings.max_new_frames, plan, settings, generator,
                                                timer):
            frames[index].append(codes)
            if on_frame is not None:
                on_frame(first_chunk + index, len(frames[index]) - 1)
        empty = torch.empty(0, self.config.n_vq, dtype=torch.long)
        return [trim_codes(torch.stack(f) if f else empty, plan.nq, self.config) for f in frames]

    def _decode_frames(self, lm: NanoTTSModel, prompts: list[torch.Tensor], max_frames: int, plan: Plan,
                       settings: RunConfig, generator: Optional[torch.Generator], timer: Optional[PhaseTimer]
                       ) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield (prompt index, codes (Q,) on the CPU) for every frame of every prompt, run as one batch.

        Raises NumericalError (before yielding it) for a frame whose logits were not finite.
        """
        sampler = "noise" if settings.host_rng else "official"
        length = max(int(p.shape[0]) for p in prompts) + max_frames
        if lm is self.model:
            if self._decoder is not None and self._decoder.free_slots < self._decoder.slots:
                raise InputError("this MossTTSNano is already generating (a synthesize_stream that is still open, or "
                                 "a call from another thread): finish or close that stream first, or use one "
                                 "MossTTSNano per thread (moss_npu.serve batches concurrent requests)")
            decoder = self.decoder(len(prompts), length, sampler, settings.graph, settings.compile)
        else:  # the float32 copy of a stability fallback: for this call only
            decoder = FrameDecoder(lm, slots=len(prompts), max_len=length, sampler=sampler, graph=settings.graph,
                                   compile=settings.compile)
        decoder.generator, decoder.timer = (None if settings.host_rng else generator), timer
        params = RequestParams(settings.sampling(), plan.nq, max_frames, generator if settings.host_rng else None)
        slots: list[int] = []
        try:
            for rows in prompts:
                slots.append(decoder.admit(rows, params))
            while any(not decoder.is_done(s) for s in slots):
                batch = decoder.step()
                for index, slot in enumerate(slots):
                    if bool(batch.non_finite[slot]):
                        raise decoder.non_finite_error(slot, batch.step_index)
                    if bool(batch.active[slot]):
                        yield index, batch.codes[slot]
        finally:
            for slot in slots:
                decoder.release(slot)
            decoder.timer = None

    def _decode(self, codes: torch.Tensor, nq: int, skip_frames: int = 0,
                timer: Optional[PhaseTimer] = None) -> torch.Tensor:
        """Decode codes (F, Q) in one call; return (C, S) on the CPU without the first ``skip_frames`` frames."""
        if codes.shape[0] == 0:
            return torch.zeros(self.codec.channels, 0)
        with _phase(timer, "codec"):
            audio, lengths = self.codec.decode(codes[:, :nq].T[:, None, :])
            return audio[0, :, skip_frames * self.codec.frame_size: int(lengths[0])].cpu()

    def synthesize(self, text: str, *, prompt_audio: Optional[PromptAudio] = None, prompt_text: Optional[str] = None,
                   settings: RunConfig = RunConfig(), generator: Optional[torch.Generator] = None,
                   on_frame: Optional[FrameCallback] = None, timer: Optional[PhaseTimer] = None) -> SynthesisResult:
        """Speak ``text`` (optionally in the voice of ``prompt_audio``); return the whole waveform.

        ``timer`` collects wall time per phase (the frame loop's, plus "codec") for benchmarks.
        """
        plan = self.plan(text, settings, prompt_audio, prompt_text)
        generator = self._generator(settings, generator)
        batch = 1
        if plan.mode == "voice_clone":
            batch = devices.chunk_batch_size(self.device, len(plan.chunks),
                                             settings.voice_clone_max_memory_per_sample_gb, settings.tts_max_batch_size)
        chunk_codes: list[torch.Tensor] = []
        lm = self.model
        for start in range(0, len(plan.chunks), batch):
            prompts = [self.prompt_rows(plan, c) for c in plan.chunks[start:start + batch]]
            try:
                codes = self._generate_batch(lm, prompts, start, plan, settings, generator, on_frame, timer)
            except NumericalError as exc:
                # As the official inference: generate this batch again in float32 (and the later ones too).
                lm = self._fallback(exc, settings, lm)
                codes = self._generate_batch(lm, prompts, start, plan, settings, generator, on_frame, timer)
            chunk_codes.extend(codes)

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
                    pieces.append(torch.zeros(self.codec.channels, pause_samples(chunk, self.sample_rate)))
                lengths.append(sum(p.shape[-1] for p in pieces) - sum(lengths))
            waveform = torch.cat(pieces, dim=1)
        if settings.speed != 1.0:
            waveform = torch.from_numpy(stretch(waveform.numpy(), self.sample_rate, settings.speed))
        stamps = whole_timestamps(plan.chunks, lengths, self.sample_rate, settings.speed, waveform.shape[-1])
        return SynthesisResult(waveform, self.sample_rate, torch.cat(chunk_codes, dim=0), plan.chunks, plan.mode, batch,
                               stamps)

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
        plan = self.plan(text, settings, prompt_audio, prompt_text)
        generator = self._generator(settings, generator)
        yield from at_speed(self._stream_plan(plan, settings, generator, clock, timer), settings.speed,
                            self.sample_rate, self.codec.channels)

    def _stream_plan(self, plan: Plan, settings: RunConfig, generator: Optional[torch.Generator],
                     clock: Callable[[], float], timer: Optional[PhaseTimer]) -> Iterator[AudioChunk]:
        """``synthesize_stream``'s audio at the model's own pace."""
        rows = self._stream_codec(max(settings.schedule().budgets), timer)
        audio = AudioStreamer(plan, settings, rows, clock)
        lm = self.model
        try:
            for index, chunk in enumerate(plan.chunks):
                audio.start_chunk(index)
                prompt, done = self.prompt_rows(plan, chunk), []
                while True:
                    try:
                        for codes in self._chunk_frames(lm, prompt, done, plan, settings, generator, timer):
                            done.append(codes)
                            yield from audio.push(codes)
                        break
                    except NumericalError as exc:
                        lm = self._fallback(exc, settings, lm)
                yield from audio.end_chunk(chunk)
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

    def _chunk_frames(self, lm: NanoTTSModel, prompt: torch.Tensor, done: list[torch.Tensor], plan: Plan,
                      settings: RunConfig, generator: Optional[torch.Generator], timer: Optional[PhaseTimer]
                      ) -> Iterator[torch.Tensor]:
        """Yield the codes (Q,) of one text chunk's frames after the ``done`` ones (their rows extend the prompt)."""
        rows = prompt
        if done:
            generated = torch.stack(done)
            slot = generated.new_full((generated.shape[0], 1), self.config.audio_assistant_slot_token_id)
            rows = torch.cat([prompt, torch.cat([slot, generated], dim=1)])  # the rows those frames fed back
        if settings.decoder == "reference":
            yield from self._generate_batch(lm, [rows], 0, plan, settings, generator, None, timer)[0]
            return
        for _, codes in self._decode_frames(lm, [rows], settings.max_new_frames - len(done), plan, settings,
                                            generator, timer):
            yield codes


def _phase(timer: Optional[PhaseTimer], name: str):
    return timer.phase(name) if timer is not None else contextlib.nullcontext()
