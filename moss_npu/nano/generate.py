"""Frame-by-frame generation of audio codes with MOSS-TTS-Nano (spec §7, upstream ``_iter_generation_events``).

Per frame: one global step (prefill at frame 0, then one row with the KV cache) → local text decision
(continue = ``audio_assistant_slot_token_id`` vs stop = ``audio_end_token_id``) → ``nq`` local audio decisions.
``iter_frames`` streams ``FrameEvent``s; ``generate`` collects them and trims each row.
B batch, L prompt rows, F frames, Q = n_vq channels, V codebook size, E hidden.

Host syncs: one per frame (the stop test); with ``host_rng`` also one per decision. ``SpeedOptions`` chooses
how to compute: the official algorithm (local decoder recomputed per channel, full text head, generic forward per
global step) or the fast path (local KV cache, single-row decode steps with precomputed RoPE, the 2 candidate
rows of the text head); both give the same codes up to float rounding.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F

from moss_npu.errors import InputError, NumericalError
from moss_npu.nano.config import NanoConfig
from moss_npu.nano.model import NanoTTSModel
from moss_npu.nano.reuse import local_qkv_tables, reuse_prompt_prefix
from moss_npu.sampling import SamplingParams, sample_token

# (kind, index, logits): kind "text" gives the (B, 2) candidate logits [continue, stop] of frame ``index``;
# kind "audio" gives the (B, V) logits of channel ``index``. Used by conformance checks and diagnostics.
LogitsHook = Callable[[str, int, torch.Tensor], None]


@dataclass(frozen=True)
class FrameEvent:
    """One generated frame: ``codes`` (B, Q) with pad for inactive rows and channels >= nq."""

    step_index: int
    codes: torch.Tensor
    active: torch.Tensor  # (B,) bool: the row produced audio in this frame
    finished: torch.Tensor  # (B,) bool: the row has chosen the stop token
    # () bool on the device: every audio logit up to this frame was finite. The loop checks it at the next
    # frame's host sync; a consumer that uses a frame earlier (a stream decoding it) reads it where it syncs anyway.
    finite: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class GenerationResult:
    """Codes of every row: ``codes[b]`` (F_b, Q) trimmed; ``frames`` (B, F, Q) untrimmed; ``stopped`` (B,) bool."""

    codes: list[torch.Tensor]
    frames: torch.Tensor
    stopped: torch.Tensor


class PhaseTimer:
    """Wall time per phase of the frame loop ("prefill", "global", "local", "sample").

    Pass ``sync`` (e.g. ``moss_npu.device.backend(dev).synchronize``) for device-honest times; that adds host
    syncs, so use it for benchmarks only.
    """

    def __init__(self, sync: Optional[Callable[[], None]] = None) -> None:
        self.sync = sync
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.sync is not None:
            self.sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync is not None:
                self.sync()
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1


_NO_TIMER = contextlib.nullcontext()


def left_pad(rows: Sequence[torch.Tensor], config: NanoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack prompts (L_b, Q + 1) into (B, L, Q + 1) rows padded on the left with [pad, pad codes…]; + mask (B, L)."""
    if not rows:
        raise InputError("no prompts to batch; pass at least one prompt")
    length = max(int(r.shape[0]) for r in rows)
    batch = torch.full((len(rows), length, config.row_width), config.audio_pad_token_id, dtype=torch.long,
                       device=rows[0].device)
    batch[:, :, 0] = config.pad_token_id
    mask = torch.zeros(len(rows), length, dtype=torch.bool, device=rows[0].device)
    for b, r in enumerate(rows):
        batch[b, length - r.shape[0]:] = r
        mask[b, length - r.shape[0]:] = True
    return batch, mask


def trim_codes(frames: torch.Tensor, nq: int, config: NanoConfig) -> torch.Tensor:
    """Pad channels >= nq and drop trailing frames whose first nq codes are all pad, for (F, Q) codes of one row."""
    frames = frames.clone()
    frames[:, nq:] = config.audio_pad_token_id
    valid = (frames[:, :nq] != config.audio_pad_token_id).any(dim=-1)
    nonzero = valid.nonzero()
    return frames[: int(nonzero[-1]) + 1] if nonzero.numel() else frames[:0]


@dataclass(frozen=True)
class SpeedOptions:
    """How the frame loop computes, never what: every combination gives the same codes up to float rounding.

    ``SpeedOptions()`` turns everything on; ``SpeedOptions.reference()`` is the official algorithm (local decoder
    recomputed per channel, full text head, every global step through the generic forward, ``no_grad``), kept
    so that the speed-up can be measured in one process (``python -m bench.run --compare reference,optimized``).
    """

    local_kv_cache: bool = True  # cache the local decoder's keys/values instead of recomputing it per channel
    decode_steps: bool = True  # single-row steps: RoPE tables, no mask building, next global input summed on the fly
    text_candidates_only: bool = True  # project onto the 2 candidate rows of the text head, not the whole vocab
    # Tabulate the local decoder's first-layer q|k|v of every embedding row it can be fed (all but the first
    # input): one row lookup instead of a 3E x E projection per channel; costs ·V·3E values (~140 MB fp32).
    local_qkv_table: bool = True
    presence_mask: bool = True  # repetition penalty from a running (B, Q, V) presence mask, not the whole history
    # Start the prefill from the global keys/values of the longest prefix shared with the previous prompt on this
    # model (the prompt template; a voice-clone reference across the chunks of a text). Single prompts only.
    prompt_cache: bool = True
    inference_mode: bool = True  # torch.inference_mode (no autograd bookkeeping at all) instead of no_grad

    @classmethod
    def reference(cls) -> "SpeedOptions":
        """Return the official algorithm with every optimisation off."""
        return cls(local_kv_cache=False, decode_steps=False, text_candidates_only=False, local_qkv_table=False,
                   presence_mask=False, prompt_cache=False, inference_mode=False)

    @classmethod
    def named(cls, name: str) -> "SpeedOptions":
        """Return the options called ``name``: one of ``SPEED_PRESETS``."""
        if name not in SPEED_PRESETS:
            raise InputError(f"speed {name!r} is unknown; use one of {', '.join(SPEED_PRESETS)}")
        return cls() if name == "optimized" else cls.reference()


SPEED_PRESETS = ("optimized", "reference")


def iter_frames(
    model: NanoTTSModel,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    sampling: SamplingParams = SamplingParams(),
    nq: Optional[int] = None,
    max_new_frames: int = 300,
    use_kv_cache: bool = True,
    local_kv_cache: Optional[bool] = None,
    speed: SpeedOptions = SpeedOptions(),
    generator: Optional[torch.Generator] = None,
    host_rng: bool = False,
    timer: Optional[PhaseTimer] = None,
    logits_hook: Optional[LogitsHook] = None,
) -> Iterator[FrameEvent]:
    """Yield one ``FrameEvent`` per generated frame until every row stops or ``max_new_frames`` is reached.

    Args:
        input_ids: (B, L, Q + 1) or (L, Q + 1) prompt rows on the model's device (left-padded for B > 1).
        attention_mask: (B, L) bool, False on left padding; None = all rows valid.
        sampling: greedy by default (official model API); ``SamplingParams.runtime_defaults()`` for the runtime.
        nq: channels to generate (1..Q, default Q); the others are pad.
        use_kv_cache: False re-feeds the whole sequence every frame (upstream's option; slow).
        local_kv_cache: when given, overrides ``speed.local_kv_cache``.
        speed: how to compute (``SpeedOptions``); the results do not depend on it beyond float rounding.
        generator / host_rng: random source of the draws (see ``moss_npu.sampling``).
        timer: optional per-phase timing; logits_hook: optional view of every logits row the sampler sees.
    """
    if local_kv_cache is not None:
        speed = replace(speed, local_kv_cache=local_kv_cache)
    if not use_kv_cache:
        speed = replace(speed, decode_steps=False)  # single-row steps need the global cache
    if not (speed.local_kv_cache and speed.decode_steps):
        speed = replace(speed, local_qkv_table=False)  # the table feeds Decoder.step
    # The decorators re-enter the grad mode around each resumption, so it never leaks into the caller.
    loop = (torch.inference_mode() if speed.inference_mode else torch.no_grad())(_frame_loop)
    return loop(model, input_ids, attention_mask, sampling, nq, max_new_frames, use_kv_cache, speed, generator,
                host_rng, timer, logits_hook)


def _frame_loop(model, input_ids, attention_mask, sampling, nq, max_new_frames, use_kv_cache, speed, generator,
                host_rng, timer, logits_hook) -> Iterator[FrameEvent]:
    cfg = model.config
    nq = cfg.n_vq if nq is None else int(nq)
    if not 1 <= nq <= cfg.n_vq:
        raise InputError(f"nq={nq} is outside [1, {cfg.n_vq}]; use a count of codebooks in that range")
    if max_new_frames < 0:
        raise InputError(f"max_new_frames={max_new_frames} is negative; use a frame count >= 0 (12.5 per second)")
    if input_ids.ndim == 2:
        input_ids = input_ids[None]
    device = model.device
    input_ids = input_ids.to(device)
    batch, prompt_len = input_ids.shape[:2]
    mask = torch.zeros(batch, prompt_len + max_new_frames, dtype=torch.bool, device=device)
    mask[:, :prompt_len] = True if attention_mask is None else attention_mask.to(device=device, dtype=torch.bool)
    # Decode steps skip all mask work while every key and query is real (no left padding, no stopped row).
    all_valid = attention_mask is None or bool(mask[:, :prompt_len].all())
    rows = input_ids
    if not use_kv_cache:
        rows = torch.cat([input_ids, input_ids.new_zeros(batch, max_new_frames, cfg.row_width)], dim=1)
    cache = model.transformer.init_cache(batch, prompt_len + max_new_frames) if use_kv_cache else None
    history = torch.full((batch, max_new_frames, cfg.n_vq), cfg.audio_pad_token_id, dtype=torch.long, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    candidates = torch.tensor([cfg.audio_assistant_slot_token_id, cfg.audio_end_token_id], device=device)
    text_rows = model.text_lm_head.weight.index_select(0, candidates) if speed.text_candidates_only else None
    rope = model.transformer.rope_table(prompt_len + max_new_frames) if speed.decode_steps else None
    text_params, audio_params = sampling.text(), sampling.audio()
    draw = dict(generator=generator, host_rng=host_rng)
    phase = timer.phase if timer is not None else (lambda name: _NO_TIMER)
    dtype = model.dtype
    audio_finite = torch.ones((), dtype=torch.bool, device=device)
    pad_row = torch.tensor([cfg.pad_token_id] + [cfg.audio_pad_token_id] * cfg.n_vq, device=device)
    local = LocalSequence(model, batch, speed)
    next_embed: Optional[torch.Tensor] = None  # (B, E) embedding of the next global row (decode steps)
    text_qkv, audio_qkv = local_qkv_tables(model) if speed.local_qkv_table else (None, None)
    seen = None  # (B, Q, V + 1) bool: which ids each channel has produced; the last slot absorbs the pad id
    vocab = max(cfg.audio_codebook_sizes)
    if speed.presence_mask and audio_params.repetition_penalty != 1.0:
        seen = torch.zeros(batch, cfg.n_vq, vocab + 1, dtype=torch.bool, device=device)

    for step in range(max_new_frames):
        total = prompt_len + step
        with phase("prefill" if step == 0 else "global"):
            if step == 0 and speed.prompt_cache and use_kv_cache and batch == 1 and all_valid:
                g = reuse_prompt_prefix(model, input_ids, cache)[:, -1, :].to(dtype)
            elif step == 0 or rope is None:
                new_rows = (input_ids if step == 0 else rows) if use_kv_cache else rows[:, :total]
                g = model(new_rows, mask[:, :total], cache, check=step == 0)[:, -1, :].to(dtype)
            else:
                g = _global_step(model, next_embed, mask, total, rope, cache, all_valid)

        local.start()
        with phase("local"):
            u = local.push(g)
            if text_rows is not None:
                # Only the 2 candidates are ever read; a non-finite hidden state is what would poison the rest.
                candidate_logits = F.linear(u, text_rows)
                text_finite = torch.isfinite(u).all() & torch.isfinite(candidate_logits).all()
            else:
                text_logits = model.text_lm_head(u)
                candidate_logits = text_logits.index_select(-1, candidates)
                text_finite = torch.isfinite(text_logits).all()
        if logits_hook is not None:
            logits_hook("text", step, candidate_logits)
        with phase("sample"):
            pick = sample_token(candidate_logits, text_params, **draw)
            next_text = candidates[pick]
        active = (next_text == cfg.audio_assistant_slot_token_id) & ~finished
        finished = finished | (next_text == cfg.audio_end_token_id)
        # The one host sync per frame: stop test, finiteness of this frame's text and last frame's audio.
        state = torch.stack([active.any(), text_finite, audio_finite, active.all()]).tolist()
        _raise_if_non_finite(state[1:3], step, dtype)
        if not state[0]:
            break
        all_valid = all_valid and state[3]

        frame = torch.full((batch, cfg.n_vq), cfg.audio_pad_token_id, dtype=torch.long, device=device)
        prev = model.transformer.wte(next_text).to(dtype)
        # The next global row [slot, code_0 … code_{nq-1}, pad …] embeds to wte[slot] + Σ emb_c[code_c]
        # (pad channels add exact zeros), summed here in embed_rows' order: the same values, no re-embedding.
        next_embed = prev
        qkv = None if text_qkv is None else text_qkv.index_select(0, pick)
        for c in range(nq):
            with phase("local"):
                logits = model.audio_lm_heads[c](local.push(prev, qkv))
            audio_finite = audio_finite & torch.isfinite(logits).all()
            if logits_hook is not None:
                logits_hook("audio", c, logits)
            with phase("sample"):
                code = sample_token(logits, audio_params, history[:, :step, c], **draw,
                                    seen=None if seen is None else seen[:, c, :logits.shape[-1]])
                frame[:, c] = code
            if c + 1 < nq or rope is not None:
                prev = model.audio_embeddings[c](code).to(dtype)
                if rope is not None:
                    next_embed = next_embed + prev
                if audio_qkv is not None and c + 1 < nq:
                    qkv = audio_qkv[c].index_select(0, code)

        frame = frame.masked_fill(~active[:, None], cfg.audio_pad_token_id)
        history[:, step] = frame
        if seen is not None:
            seen.scatter_(2, frame.masked_fill(frame == cfg.audio_pad_token_id, vocab)[:, :, None], True)
        mask[:, total] = active
        if rope is None:
            next_row = torch.where(active[:, None], torch.cat([candidates[:1].expand(batch, 1), frame], dim=1),
                                   pad_row)
            if use_kv_cache:
                rows = next_row[:, None, :]
            else:
                rows[:, total] = next_row
        yield FrameEvent(step, frame, active.clone(), finished.clone(), audio_finite)
    else:
        _raise_if_non_finite([True, bool(audio_finite)], max_new_frames, dtype)


def _global_step(model: NanoTTSModel, embed: torch.Tensor, mask: torch.Tensor, total: int,
                 rope: tuple[torch.Tensor, torch.Tensor], cache, all_valid: bool) -> torch.Tensor:
    """Run the newest global row (index ``total - 1``, embedded as (B, E) ``embed``) through the cache; (B, E)."""
    cos, sin = rope
    if all_valid:  # every row holds its own index as position
        return model.transformer.step(embed[:, None], cos[total - 1:total], sin[total - 1:total], cache)[:, -1]
    # Positions count the real rows before (as forward's cumsum); a padded new row is zeroed inside step.
    positions = mask[:, :total].sum(dim=-1) - 1
    cos, sin = cos.index_select(0, positions), sin.index_select(0, positions)
    hidden = model.transformer.step(embed[:, None], cos, sin, cache, mask[:, :total], mask[:, total - 1:total])
    return hidden[:, -1]


class LocalSequence:
    """The local decoder's input of one frame: [global hidden, wte[text], emb_0[code_0], …] (spec §7 steps 3, 5).

    Without a cache every ``push`` reruns the local decoder over the whole sequence (the official algorithm);
    with one it runs only the new position against cached keys/values, through ``Decoder.step`` when
    ``speed.decode_steps``. The cache is allocated once per generation and rewound by ``start``.
    """

    def __init__(self, model: NanoTTSModel, batch: int, speed: SpeedOptions) -> None:
        self.model = model
        length = model.config.n_vq + 1
        self.cache = model.local_transformer.init_cache(batch, length) if speed.local_kv_cache else None
        self.rope = model.local_transformer.rope_table(length) if speed.local_kv_cache and speed.decode_steps else None
        self.seq: Optional[torch.Tensor] = None

    def start(self) -> None:
        """Begin the next frame's sequence."""
        self.seq = None
        if self.cache is not None:
            self.cache.reset()  # stale rows past ``length`` are overwritten before anything reads them

    def push(self, x: torch.Tensor, qkv: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Append (B, E) ``x``; return the local decoder's hidden state at the new last position, (B, E).

        ``qkv`` (B, 3E): ``model.first_qkv(x)`` when already known (decode steps only).
        """
        if self.rope is not None:
            p = self.cache.length
            return self.model.local_transformer.step(x[:, None, :], self.rope[0][p:p + 1], self.rope[1][p:p + 1],
                                                     self.cache, qkv=None if qkv is None else qkv[:, None])[:, -1]
        if self.cache is not None:
            return self.model.local_hidden(x[:, None, :], self.cache)
        self.seq = x[:, None, :] if self.seq is None else torch.cat([self.seq, x[:, None, :]], dim=1)
        return self.model.local_hidden(self.seq)


def _raise_if_non_finite(finite: list, step: int, dtype: torch.dtype) -> None:
    """Raise like upstream (its message starts "Non-finite", which its fp32 fallback looks for).

    ``finite`` is [this frame's text, the audio so far]; the audio is named first, being the earlier cause.
    """
    for ok, what in ((finite[1], "audio logits"), (finite[0], "text logits")):
        if not ok:
            raise NumericalError(non_finite_message(what, step, dtype))


def non_finite_message(what: str, step: int, dtype: torch.dtype) -> str:
    """Say what became non-finite and the fix: float32 for low precision; in float32 precision is not the cause."""
    if dtype == torch.float32:
        return (f"Non-finite {what} by frame {step} in float32, so precision is not the cause: the model weights "
                "are likely damaged (NaN/inf); download the model folder again")
    return f"Non-finite {what} by frame {step} (dtype {dtype}); run the model in float32 (--dtype float32)"


def generate(
    model: NanoTTSModel,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    sampling: SamplingParams = SamplingParams(),
    nq: Optional[int] = None,
    max_new_frames: int = 300,
    use_kv_cache: bool = True,
    local_kv_cache: Optional[bool] = None,
    speed: SpeedOptions = SpeedOptions(),
    generator: Optional[torch.Generator] = None,
    host_rng: bool = False,
    timer: Optional[PhaseTimer] = None,
    logits_hook: Optional[LogitsHook] = None,
) -> GenerationResult:
    """Run ``iter_frames`` to the end and return every row's trimmed codes (arguments as ``iter_frames``)."""
    cfg = model.config
    batch = 1 if input_ids.ndim == 2 else input_ids.shape[0]
    frames: list[torch.Tensor] = []
    finished = torch.zeros(batch, dtype=torch.bool, device=model.device)
    for event in iter_frames(model, input_ids, attention_mask, sampling=sampling, nq=nq,
                             max_new_frames=max_new_frames, use_kv_cache=use_kv_cache, local_kv_cache=local_kv_cache,
                             speed=speed, generator=generator, host_rng=host_rng, timer=timer, logits_hook=logits_hook):
        frames.append(event.codes)
        finished = event.finished
    # The loop ends early only when every row has chosen the stop token (that frame yields no event).
    stopped = finished | (len(frames) < max_new_frames)
    stacked = (torch.stack(frames, dim=1) if frames else
               torch.empty(batch, 0, cfg.n_vq, dtype=torch.long, device=model.device))
    nq = cfg.n_vq if nq is None else int(nq)
    return GenerationResult([trim_codes(stacked[b], nq, cfg) for b in range(batch)], stacked, stopped)
