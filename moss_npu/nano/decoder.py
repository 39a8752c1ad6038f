"""The frame decoder: MOSS-TTS-Nano generation for S slots at once over a static ``DecodeState``
(docs/architecture.md#frame-decoder: admit, step, release, and what a frame computes).

Run eagerly, a frame's global step is deferred to the start of the next ``step`` (or the next ``admit``,
``release`` or ``refresh``, which need it done; a failure there is raised by the next ``step``, as a failed frame):
``step`` returns a frame's codes as soon as they are decided, so a stream's first audio is decoded before the row
that prepares frame 2 runs, and a frame after which every slot is done skips it. ``reference_generate``
(``nano.reference``) is the official algorithm this must match.
S slots, L prompt rows, M max_len, Q channels, V codebook size, E hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from moss_npu.errors import InputError
from moss_npu.nano.frames import FrameBatch, LogitsHook, PhaseTimer, check_budget, non_finite_error, phase
from moss_npu.nano.graphs import FrameGraphs, resolve_graph
from moss_npu.cpu.blocks import Segment
from moss_npu.nano.model import KVCache, NanoTTSModel
from moss_npu.nano.prepared import DecoderWeights
from moss_npu.nano.reuse import LocalTables, PrefixCache
from moss_npu.nano.state import DecodeState
from moss_npu.sampling import SamplingParams, TokenParams, sample_token

SAMPLERS = ("official", "noise")


@dataclass(frozen=True)
class RequestParams:
    """How one admitted request decodes."""

    sampling: SamplingParams = SamplingParams()
    nq: Optional[int] = None  # channels to generate (default Q); the others are pad
    max_new_frames: int = 300
    # Noise-fed sampler: the CPU generator of this request's uniforms (None: torch's default CPU generator), so
    # a request draws the same numbers alone or in any batch.
    generator: Optional[torch.Generator] = None


class FrameDecoder:
    """Generate frames for up to ``slots`` requests at once on one model (see the module docstring).

    A request needs prompt rows + max_new_frames <= ``max_len``. ``sampler``: "official" (device RNG,
    ``torch.multinomial`` as upstream: the sampled goldens; ``generator``, None for torch's default) or "noise"
    (host-drawn uniforms per request, tensor ops only: the same on every device, capturable). ``graph`` captures the
    frame as a device graph (the noise sampler and a capture API needed; auto: where the backend has one);
    ``compile`` torch.compiles the float32 CPU step (auto: eager). ``prefix_cache`` starts prefills from shared
    prompt prefixes; ``logits_hook`` sees every row the sampler sees and ``timer`` times phases (eager only).
    ``weights``: the parts derived from the weights (``nano.prepared``), built here when None or another model's.
    The weights are read at construction: after editing them call ``refresh()``.
    """

    def __init__(self, model: NanoTTSModel, *, slots: int = 1, max_len: int = 1024, sampler: str = "official",
                 graph: str = "off", generator: Optional[torch.Generator] = None,
                 prefix_cache: Optional[PrefixCache] = None, logits_hook: Optional[LogitsHook] = None,
                 timer: Optional[PhaseTimer] = None, compile: str = "auto",
                 weights: Optional[DecoderWeights] = None) -> None:
        if sampler not in SAMPLERS:
            raise InputError(f"sampler {sampler!r} is unknown; use one of {', '.join(SAMPLERS)}")
        if slots < 1 or max_len < 2:
            raise InputError(f"slots={slots}, max_len={max_len}: use at least 1 slot and 2 rows")
        self.model, self.sampler, self.generator = model, sampler, generator
        self.prefix_cache, self.logits_hook, self.timer = prefix_cache, logits_hook, timer
        cfg = model.config
        self.pad = cfg.audio_pad_token_id
        self.compile_mode = compile
        current = weights is not None and weights.current(model, compile)
        self.weights = weights if current else DecoderWeights.build(model, compile)
        with torch.inference_mode():
            self.state = DecodeState.allocate(model, slots, max_len)
            self.tables = LocalTables.build(model, max_len, self.weights.audio_qkv)
            self._key_range = torch.arange(max_len, device=model.device)
            self._channel_range = torch.arange(cfg.n_vq, device=model.device)
            self._pad_codes = torch.full((cfg.n_vq,), self.pad, device=model.device)
            # Flattened cache row of each (slot, head) at position 0 (+ position: its new key), local and global.
            heads = torch.arange(slots * cfg.gpt2_config.n_head, device=model.device)
            local = self.state.local_kv.shape[4]  # (position, slot/head) -> its new key's flat row in the local cache
            self._local_rows = heads * local + torch.arange(local, device=model.device)[:, None]
            self._global_rows = (heads * max_len).view(slots, -1)
        self.frame_step = self.weights.frame_step
        self._params: list[Optional[tuple[TokenParams, TokenParams]]] = [None] * slots
        self._generators: list[Optional[torch.Generator]] = [None] * slots
        self._lengths, self._nq = [0] * slots, [cfg.n_vq] * slots
        self._held, self._done = [False] * slots, [False] * slots
        self.frame_index = 0
        self._pending: Optional[tuple] = None  # the last eager frame's global step (_run_pending)
        # A deferred step that failed outside ``step`` and the slots it was for: the next ``step`` raises it.
        self._failed: Optional[tuple[Exception, set[int]]] = None
        self.graph_mode, self.dtype = graph, model.dtype
        capture = resolve_graph(graph, model.device, sampler, logits_hook is not None)
        self.graphs = None if capture is None else FrameGraphs(capture, self._static_frame, slots)

    # ---- requests -------------------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def slots(self) -> int:
        return self.state.slots

    @property
    def free_slots(self) -> int:
        return self._held.count(False)

    @property
    def active_slots(self) -> list[int]:
        """Slots whose request is still decoding."""
        return [s for s in range(self.slots) if self._held[s] and not self._done[s]]

    def is_done(self, slot: int) -> bool:
        """Return whether ``slot``'s request has ended (stop token, frame budget or non-finite logits)."""
        return self._done[slot]

    @property
    def graphs_active(self) -> bool:
        """Whether frames are replayed from captured device graphs (False: eager, or capture failed)."""
        return self.graphs is not None and self.graphs.capture.broken is None

    def non_finite_error(self, slot: int, step: int):
        """Return the NumericalError for ``slot`` whose logits were not finite by frame ``step``."""
        text_ok = bool(self.state.finite[slot, 0])
        return non_finite_error("audio logits" if text_ok else "text logits", step, self.model.dtype)

    def memory_bytes(self) -> int:
        """Return the bytes of the preallocated state (the global KV cache dominates)."""
        return self.state.nbytes()

    @torch.inference_mode()
    def admit(self, prompt_rows: torch.Tensor, params: RequestParams = RequestParams()) -> int:
        """Prefill one request's prompt rows (L, Q + 1) into the lowest free slot; return the slot.

        Raises InputError when no slot is free or the prompt plus its frame budget exceeds ``max_len``.
        """
        return self.admit_many([(prompt_rows, params)])[0]

    @torch.inference_mode()
    def admit_many(self, requests: list[tuple[torch.Tensor, RequestParams]],
                   into: Optional[list[int]] = None) -> list[int]:
        """Prefill several requests' prompt rows (L, Q + 1) together into the lowest free slots (or the free
        slots ``into``, one per request); return their slots, in order. On the CPU their prompts share each pass
        over the weights (``cpu.step``), so requests arriving together reach their first frame about as soon as one
        alone; each request's state is what ``admit`` alone gives it, on the CPU bit for bit (also after a cached
        prefix, ``cpu.blocks.prompt_attention``), elsewhere to float rounding.

        Raises InputError, admitting none, when a request is bad (``admit``) or fewer slots are free than asked.
        """
        checked = [self.check_request(rows, params) for rows, params in requests]
        free = [s for s in range(self.slots) if not self._held[s]]
        if not free:
            raise InputError(f"all {self.slots} decoder slots are busy; release one or build more slots")
        if len(free) < len(requests):
            raise InputError(f"{len(requests)} requests but {len(free)} free decoder slots; admit fewer at once")
        slots = free[:len(requests)]
        if into is not None:
            if len(into) != len(requests) or not set(into) <= set(free) or len(set(into)) != len(into):
                raise InputError(f"slots {into}: name one free slot per request (free: {free})")
            slots = list(into)
        self._run_pending(hold=True)
        st = self.state
        for slot in slots:
            st.reset_slot(slot, self.pad)
        with phase(self.timer, "prefill"):
            hidden = self._prefill(slots, [rows for rows, _ in checked])
        for slot, (rows, nq), (_, params), last in zip(slots, checked, requests, hidden):
            st.hidden[slot] = last
            text, audio = params.sampling.text(), params.sampling.audio()
            st.text.set(slot, text)
            st.audio.set(slot, audio)
            st.lengths[slot], st.nq[slot], st.max_frames[slot] = rows.shape[0], nq, params.max_new_frames
            st.active[slot] = params.max_new_frames > 0
            self._params[slot], self._generators[slot] = (text, audio), params.generator
            self._lengths[slot], self._nq[slot] = rows.shape[0], nq
            self._held[slot], self._done[slot] = True, False
        return slots

    def check_request(self, prompt_rows: torch.Tensor, params: RequestParams) -> tuple[torch.Tensor, int]:
        """Return a request's rows on the device and its channel count; raise InputError for one that ``admit``
        would refuse (its slot count aside)."""
        cfg = self.model.config
        nq = check_budget(params.nq, params.max_new_frames, cfg)
        rows = prompt_rows.to(self.device)
        if rows.ndim != 2 or rows.shape[-1] != cfg.row_width or rows.shape[0] < 1:
            raise InputError(f"prompt rows have shape {tuple(rows.shape)}; expected (rows >= 1, {cfg.row_width})")
        if rows.shape[0] + params.max_new_frames > self.state.max_len:
            raise InputError(f"prompt of {rows.shape[0]} rows + {params.max_new_frames} frames exceeds the decoder's "
                             f"max_len {self.state.max_len}; shorten the text or build the decoder with a larger "
                             f"max_len")
        return rows, nq

    def release(self, slot: int) -> None:
        """Free ``slot`` (its request finished or was cancelled); a new request can be admitted at once."""
        if not 0 <= slot < self.slots or not self._held[slot]:
            raise InputError(f"slot {slot} holds no request")
        with torch.inference_mode():
            self._run_pending(hold=True, leaving=slot)
            self.state.reset_slot(slot, self.pad)
        self._held[slot], self._done[slot], self._params[slot], self._generators[slot] = False, False, None, None
        self._lengths[slot] = 0
        if self._failed is not None:
            self._failed[1].discard(slot)
            if not self._failed[1]:
                self._failed = None  # no request is left to tell

    def refresh(self) -> None:
        """Rebuild the weight-derived tables and forget cached prompts (call after editing the weights)."""
        with torch.inference_mode():
            self._run_pending(hold=True)
            self.weights = DecoderWeights.build(self.model, self.compile_mode)
            self.tables = LocalTables.build(self.model, self.state.max_len, self.weights.audio_qkv)
        self.frame_step = self.weights.frame_step
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        if self.graphs is not None:
            self.graphs.reset()

    @property
    def frame_step(self):
        """What the blocks run through (``Backend.frame_step``: ``cpu.step`` or ``nano.step``)."""
        return self._frame_step

    @frame_step.setter
    def frame_step(self, step) -> None:
        """Take ``step``, its weights packed for a batch of slots where this decoder has several, and its RoPE rows."""
        self._frame_step = step
        step.pack(batched=self.slots > 1)
        self._rotations = (step.rotation_table(*self.tables.global_rope), step.rotation_table(*self.tables.local_rope))

    def _prefill(self, slots: list[int], prompts: list[torch.Tensor]) -> torch.Tensor:
        """Run each prompt through the global decoder into its slot's cache rows, after the prefix it shares with
        a cached prompt; return each one's last hidden state (n, E)."""
        shared = [self._reuse_prefix(slot, rows) for slot, rows in zip(slots, prompts)]
        embed = torch.cat([self.model.embed_rows(rows[None, n:])[0] for rows, n in zip(prompts, shared)])
        rotation = torch.cat([self._rotations[0][n:rows.shape[0]] for rows, n in zip(prompts, shared)])
        segments = [Segment(slot, n, rows.shape[0] - n) for slot, rows, n in zip(slots, prompts, shared)]
        hidden = self.frame_step.prefill(embed, rotation, self.state.kv, segments)
        if self.prefix_cache is not None:
            for slot, rows in zip(slots, prompts):
                self.prefix_cache.store(rows, self.state.kv[:, :, slot, :, :rows.shape[0]])
        return hidden

    def _reuse_prefix(self, slot: int, rows: torch.Tensor) -> int:
        """Copy the keys/values of the longest cached prefix of ``rows`` into ``slot``; return its length."""
        shared, cached = (0, None) if self.prefix_cache is None else self.prefix_cache.lookup(rows)
        if shared:
            self.state.kv[:, :, slot, :, :shared] = cached[:, :, :, :shared]
        return shared

    # ---- frames ---------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> FrameBatch:
        """Produce one frame for every slot; return the codes and which slots produced or finished."""
        n = max((s + 1 for s in range(self.slots) if self._held[s]), default=0)  # frames run over slots [0, n)
        if n == 0:
            raise InputError("no request admitted; admit one before stepping")
        if self._failed is not None:
            failure, self._failed = self._failed[0], None
            raise failure
        with phase(self.timer, "frame"):
            self._draw_noise(n)
            if self.graphs is not None:
                self.graphs.run(n)
            else:
                nq = [self._nq[s] for s in range(n) if self._held[s]]
                self._run_pending()
                with self.frame_step.threads(n):
                    self._pending = self._frame(n, max(self._lengths[:n]) + 1, max(nq), exact=n == 1,
                                                masked=min(nq) < max(nq), defer=True)
            st = self.state
            flags = torch.cat([st.produced[:n, None], st.active[:n, None], st.finite[:n]], dim=1)
            packed = torch.cat([st.codes[:n], flags.long()], dim=1).cpu()  # the one host sync of the frame
        return self._bookkeep(packed, n)

    def _run_pending(self, hold: bool = False, leaving: Optional[int] = None) -> None:
        """Run the last frame's deferred global step, unless every slot it covers is done or ``leaving`` (being
        released: a cancelled request needs no next row) — then none will read it.

        ``hold``: a failure is the frame's, not the caller's (``admit``/``release``/``refresh``): keep it for the
        next ``step`` to raise, unless every slot it was for is released before.
        """
        if self._pending is None:
            return
        embed, n, keys, exact = self._pending
        self._pending = None
        waiting = {s for s in range(n) if self._held[s] and not self._done[s] and s != leaving}
        if not waiting:
            return
        try:
            with self.frame_step.threads(n), phase(self.timer, "global"):
                self._global_step(embed, n, keys, exact)
        except Exception as exc:  # noqa: BLE001 - whatever failed the frame, its step reports it
            if not hold:
                raise
            self._failed = (exc, waiting)

    def _draw_noise(self, n: int) -> None:
        """Copy one uniform per decision of each decoding slot, from its own CPU generator, into the state."""
        if self.sampler != "noise":
            return
        width = self.state.noise.shape[1]
        rows = [torch.rand(width, generator=self._generators[s]) if self._held[s] and not self._done[s]
                else torch.zeros(width) for s in range(n)]
        self.state.noise[:n].copy_(torch.stack(rows), non_blocking=True)

    def _bookkeep(self, packed: torch.Tensor, n: int) -> FrameBatch:
        """Update the host's view of the slots from the frame's packed codes and flags (n, Q + 4) on the CPU."""
        q = self.model.config.n_vq
        codes = torch.full((self.slots, q), self.pad, dtype=torch.long)
        codes[:n] = packed[:, :q]
        flags = torch.zeros(4, self.slots, dtype=torch.bool)  # produced, finished, non-finite, unused
        for s, (produced, active, text_ok, audio_ok) in enumerate(packed[:, q:].tolist()):
            flags[0, s] = bool(produced)
            self._lengths[s] += int(produced)
            if self._held[s] and not self._done[s] and not active:
                self._done[s] = True
                flags[1, s], flags[2, s] = True, not (text_ok and audio_ok)
        self.frame_index += 1
        return FrameBatch(self.frame_index - 1, codes, flags[0], flags[1], flags[2])

    def _static_frame(self, n: int) -> None:
        """The frame as captured: fixed shapes (all M keys under a mask, all Q channels)."""
        self._frame(n, self.state.max_len, self.model.config.n_vq, exact=False, masked=True)

    def _frame(self, n: int, keys: int, channels: int, exact: bool, masked: bool,
               defer: bool = False) -> Optional[tuple]:
        """Advance slots [0, n) by one frame on the device, reading and writing only ``self.state``.

        ``keys``: global key rows attended (every slot's length < keys); ``channels``: audio channels computed
        (>= every slot's nq); ``exact``: one slot whose keys are exactly its rows (no key mask needed);
        ``masked``: some slot's nq is below ``channels`` (its upper channels are forced to pad). ``defer``:
        return the global step's arguments instead of running it (``_run_pending`` runs them).
        """
        st, t = self.state, self.tables
        split = self.timer if self.graphs is None else None  # a captured frame has no host-side phases
        local = KVCache([st.local_kv[i, 0, :n] for i in range(st.local_kv.shape[0])],
                        [st.local_kv[i, 1, :n] for i in range(st.local_kv.shape[0])])
        with phase(split, "local"):  # the 17 local steps and their decisions
            u = self._local_step(local, st.hidden[:n], None)
            candidates = F.linear(u, t.text_rows)  # only the 2 candidates are read; a non-finite u poisons the rest
            text_finite = torch.isfinite(torch.cat([u, candidates], dim=-1)).all(-1)
            self._hook("text", self.frame_index, candidates)
            pick = self._sample(candidates, self._rows(0, n, 2, None), 0)  # 0 = continue, 1 = stop
            frame, embed, audio_finite = self._audio(local, pick, n, channels, masked)
            self._commit(n, pick, frame, torch.stack([text_finite, audio_finite], dim=1))
        if defer:
            return embed, n, keys, exact
        with phase(split, "global"):
            self._global_step(embed, n, keys, exact)
        return None

    def _audio(self, local: KVCache, pick: torch.Tensor, n: int, channels: int, masked: bool):
        """Decide the audio channels; return the frame (n, Q), the next global row's embedding (n, E), finiteness.

        The next row [slot, code_0 … code_{nq-1}, pad …] embeds to wte[slot] + Σ emb_c[code_c] (pad adds exact
        zeros), summed here in ``embed_rows``' order: the same values, no re-embedding.
        """
        native = self._native_audio(local, pick, n, channels)
        if native is not None:
            return native
        st, t, model = self.state, self.tables, self.model
        within = self._channel_range[None, :channels] < st.nq[:n, None] if masked else None  # (n, channels)
        prev = t.text_embed.index_select(0, pick)
        qkv, embed = t.text_qkv.index_select(0, pick), prev
        rows = {}  # codebook size -> the audio decisions' parameters, derived once per frame
        sums, codes = [], []  # per channel: each row's logits summed (non-finite iff a logit is), the codes
        for c in range(channels):
            u = self._local_step(local, prev, qkv)
            logits = self.frame_step.head(c, u)
            sums.append(logits.sum(-1, dtype=torch.float32))
            self._hook("audio", c, logits)
            vocab = logits.shape[-1]
            if vocab not in rows:
                rows[vocab] = self._rows(1, n, vocab, st.seen[:n, :channels, :vocab])
            code = self._sample(logits, rows[vocab], c + 1)
            codes.append(code)
            prev = model.audio_embeddings[c](code).to(model.dtype)
            embed = embed + (prev if within is None else prev * within[:, c, None].to(model.dtype))
            if c + 1 < channels:
                qkv = t.audio_qkv[c].index_select(0, code)
        ok, decided = torch.isfinite(torch.stack(sums, dim=1)), torch.stack(codes, dim=1)  # (n, channels)
        if within is not None:
            ok, decided = ok | ~within, torch.where(within, decided, self._pad_codes[:channels])
        if channels < model.config.n_vq:
            decided = torch.cat([decided, self._pad_codes[channels:].expand(n, -1)], dim=1)
        return decided, embed, ok.all(-1)

    def _native_audio(self, local: KVCache, pick: torch.Tensor, n: int, channels: int) -> Optional[tuple]:
        """``_audio``'s result from the CPU step's one library call per frame (``CpuStep.local_audio``), or None
        where it does not apply: a step without the library's loop (``TorchStep``, or no kernels), or a logits hook
        (it sees each channel's logits)."""
        step = self.frame_step
        if step.local_loop is None or self.logits_hook is not None:
            return None
        exponential = self._official_draws(n, channels, step.local_loop.vocab) if self.sampler == "official" else None
        start, t = local.length, self.tables
        local.advance(channels)
        return step.local_audio(t.text_embed.index_select(0, pick), t.text_qkv.index_select(0, pick), t.audio_qkv,
                                self._rotations[1], self.state, n, start, channels, self.pad, exponential)

    def _official_draws(self, n: int, channels: int, vocab: list[int]) -> Optional[torch.Tensor]:
        """The Exp(1) variates (n, Q, max V) that ``_sample`` would draw for slots [0, n) of a frame's channels, drawn
        here in its order, or None where no slot samples. ``torch.multinomial`` draws one sample as the first
        largest p / q, q Exp(1) variates of the probabilities' shape: one (n, V) draw per channel where every slot
        has the same parameters, else (1, V) per sampling slot, channel by channel, slot by slot."""
        tokens, _ = self._rows(1, n, 0, None)
        if not any(p.do_sample for p in tokens):
            return None
        exponential = torch.ones(n, len(vocab), max(vocab))
        alike = all(p == tokens[0] for p in tokens)
        for c in range(channels):
            if alike:
                exponential[:, c, :vocab[c]] = torch.empty(n, vocab[c]).exponential_(generator=self.generator)
                continue
            for s in (s for s in range(n) if tokens[s].do_sample):
                exponential[s, c, :vocab[c]] = torch.empty(1, vocab[c]).exponential_(generator=self.generator)
        return exponential

    def _commit(self, n: int, pick: torch.Tensor, frame: torch.Tensor, finite: torch.Tensor) -> None:
        """Record the frame's outcome per slot (``pick``: the text decision, 0 = continue): codes, presence mask,
        step count, stop, finiteness, activity."""
        st = self.state
        active = st.active[:n]
        live = active & finite.all(-1)
        produce = torch.logical_and(live, pick == 0, out=st.produced[:n])
        codes = torch.where(produce[:, None], frame, self._pad_codes, out=st.codes[:n])
        # The pad id lies past every codebook (config), so clamping sends it to the absorbing last column.
        st.seen[:n].scatter_(2, codes.clamp(max=st.seen.shape[-1] - 1)[:, :, None], True)
        st.stopped[:n] |= live ^ produce  # live and chose to stop
        st.finite[:n] &= finite | ~active[:, None]
        st.steps[:n] += active.long()
        torch.logical_and(produce, st.steps[:n] < st.max_frames[:n], out=st.active[:n])

    def _global_step(self, embed: torch.Tensor, n: int, keys: int, exact: bool) -> None:
        """Run each slot's new row (n, E) through the global decoder at its own position; store the hidden state."""
        st = self.state
        positions = st.lengths[:n]
        key_mask = None if exact else self._key_range[None, :keys] <= positions[:, None]
        index = (self._global_rows[:n] + positions[:, None]).view(-1)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        rotation = self._rotations[0].index_select(0, positions)
        st.hidden[:n] = self.frame_step.run(False, embed, rotation, st.kv, index, keys, mask)
        st.lengths[:n] += st.produced[:n].long()

    def _local_step(self, local: KVCache, x: torch.Tensor, qkv: Optional[torch.Tensor]) -> torch.Tensor:
        """Append (n, E) ``x`` to the local sequence; return the local hidden state there (n, E)."""
        p, n = local.length, x.shape[0]
        index = self._local_rows[p, :n * self.state.local_kv.shape[3]]
        local.advance(1)
        return self.frame_step.run(True, x, self._rotations[1][p:p + 1].expand(n, -1), self.state.local_kv, index,
                                   p + 1, None, qkv)

    def _rows(self, which: int, n: int, vocab: int, seen: Optional[torch.Tensor]):
        """The parameters of the text (``which`` 0) or audio (1) decisions of this frame for slots [0, n): the
        noise sampler's ``RowSampling`` (an eager frame leaves out the filters no held slot asks for), or the
        official sampler's ``TokenParams`` per slot with ``seen``."""
        params = (self.state.text, self.state.audio)[which]
        if self.sampler == "noise":
            # A captured frame must serve any mix of requests; an eager one skips sampling nobody asked for.
            tokens = None if self.graphs is not None else [p[which] for p in self._params[:n] if p is not None]
            return params.rows(n, vocab, self.model.dtype, seen, tokens)
        fallback = next(p for p in self._params if p is not None)
        return [(self._params[s] or fallback)[which] for s in range(n)], seen

    def _sample(self, logits: torch.Tensor, rows, column: int) -> torch.Tensor:
        """Choose one id per slot for decision ``column`` (0: the text decision, c + 1: channel c): the
        noise-fed sampler, or the official one per group of equal parameters."""
        if self.sampler == "noise":
            return rows.sample(logits, self.state.noise[:logits.shape[0], column], max(column - 1, 0))
        token, seen = rows
        seen = None if seen is None else seen[:, column - 1, :logits.shape[-1]]
        if all(p == token[0] for p in token):
            return sample_token(logits, token[0], seen=seen, generator=self.generator)
        out = torch.empty(len(token), dtype=torch.long, device=logits.device)
        for s in range(len(token)):  # mixed parameters: one official draw per slot, in slot order
            out[s:s + 1] = sample_token(logits[s:s + 1], token[s], seen=None if seen is None else seen[s:s + 1],
                                        generator=self.generator)
        return out

    def _hook(self, kind: str, index: int, logits: torch.Tensor) -> None:
        if self.logits_hook is not None:
            self.logits_hook(kind, index, logits)

