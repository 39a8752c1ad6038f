"""Streaming decode state and the official decode schedule (docs/architecture.md#streaming, #streaming-decode).

``CodecDecodeState`` holds a ``KVCache`` ring per decoder layer (``NanoCodec.init_decode_state`` makes it,
``decode_step`` takes it). ``DecodeSchedule`` decides from the playback lead how many frames to decode now; its
thresholds are data, so device presets can change them. Shapes: B batch, H heads, N ring slots, Dh head size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from moss_npu.device import backend
from moss_npu.errors import ConfigError


@dataclass
class KVCache:
    """Sliding-window keys/values of one causal attention layer, stored as a ring.

    Position ``p`` lives in slot ``p % N`` with ``N = context + chunk_capacity``, so a chunk of up to
    ``chunk_capacity`` new steps can be written before attending without evicting anything the chunk's
    queries still see. ``positions`` is -1 for empty slots; the attention mask is built from it.
    """

    keys: torch.Tensor  # (B, H, N, Dh), after RoPE
    values: torch.Tensor  # (B, H, N, Dh)
    positions: torch.Tensor  # (B, N) int64, -1 = empty
    offsets: torch.Tensor  # (B,) int64, position of the next step per row
    context: int
    chunk_capacity: int
    written: list[int] = field(default_factory=list)  # steps written per row (host): slots >= it are empty

    @classmethod
    def empty(cls, batch_size: int, num_heads: int, head_dim: int, context: int, chunk_capacity: int,
              device: torch.device, dtype: torch.dtype) -> "KVCache":
        """Preallocate an empty ring for ``batch_size`` rows."""
        slots = context + chunk_capacity
        shape, place = (batch_size, num_heads, slots, head_dim), backend(torch.device(device))
        return cls(keys=place.zeros(shape, dtype, device), values=place.zeros(shape, dtype, device),
                   positions=torch.full((batch_size, slots), -1, device=device, dtype=torch.long),
                   offsets=torch.zeros(batch_size, device=device, dtype=torch.long),
                   context=context, chunk_capacity=chunk_capacity, written=[0] * batch_size)

    def next_positions(self, rows: int, steps: int) -> torch.Tensor:
        """Return the positions ``(rows, steps)`` the next ``steps`` steps of rows [0, rows) will take."""
        return self.offsets[:rows].view(-1, 1) + torch.arange(steps, device=self.offsets.device).view(1, -1)

    def write(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor) -> None:
        """Store a chunk of new steps of rows [0, B) at ``positions`` ``(B, T)`` (``next_positions``).

        ``valid`` ``(B, T)`` marks real steps; padded steps (a row with fewer frames this call) get
        position -1 so no query ever sees them, and they only overwrite slots already out of every
        future window. Rows past B are untouched (a call may carry only the leading rows).
        """
        batch = keys.shape[0]
        self.check_chunk(keys.shape[2])
        slots = positions % self.keys.shape[2]
        # Indexed assignment, not scatter_: the same copies, a third of the time for a stage's 32 steps a frame.
        rows = torch.arange(batch, device=slots.device).view(batch, 1)
        self.keys[rows, :, slots] = keys.transpose(1, 2).to(self.keys.dtype)
        self.values[rows, :, slots] = values.transpose(1, 2).to(self.values.dtype)
        self.positions[rows, slots] = torch.where(valid, positions, torch.full_like(positions, -1))
        self.advance(valid)

    def check_chunk(self, steps: int) -> None:
        """Refuse a chunk of more steps than the ring takes before attending (ValueError): its writes would evict
        keys its own queries still see."""
        if steps > self.chunk_capacity:
            raise ValueError(f"chunk of {steps} steps exceeds the cache chunk capacity {self.chunk_capacity}")

    def advance(self, valid: torch.Tensor) -> None:
        """Count a chunk written at ``next_positions`` into rows [0, B) (by ``write``, or by the CPU library's
        ``WindowAttention.write_chunk``): ``valid`` ``(B, T)`` marks its real steps."""
        batch, steps = valid.shape
        self.offsets[:batch] += valid.sum(dim=1)
        for row in range(batch):  # a row's offset grows by at most `steps`, so this bounds its used slots
            self.written[row] += steps

    def filled(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return keys, values ``(rows, H, n, Dh)`` and positions ``(rows, n)`` of the leading slots that may hold a key
        of rows [0, rows): the rest are empty, so attention skips them."""
        n = min(max(self.written[:rows], default=0), self.keys.shape[2])
        return self.keys[:rows, :, :n], self.values[:rows, :, :n], self.positions[:rows, :n]

    def reset_row(self, row: int) -> None:
        """Forget row ``row`` only (a new stream starts there; the other rows go on). Only the slots its last stream
        may have written are cleared (those past ``written`` are zero already), so a row's pages are first touched
        as a stream writes them, not all at once before its first audio (docs/performance.md#serving-under-load)."""
        used = min(self.written[row], self.keys.shape[2])
        if not used:
            return
        self.keys[row, :, :used].zero_()
        self.values[row, :, :used].zero_()
        self.positions[row, :used].fill_(-1)
        self.offsets[row] = 0
        self.written[row] = 0

    def copy_row(self, row: int, source: "KVCache", source_row: int = 0) -> None:
        """Make row ``row`` continue the stream held in ``source``'s row ``source_row`` (same ring size)."""
        if source.keys.shape[1:] != self.keys.shape[1:]:
            raise ValueError(f"cannot copy a ring of shape {tuple(source.keys.shape[1:])} into one of "
                             f"{tuple(self.keys.shape[1:])}; make both states with the same max_frames_per_step")
        self.keys[row].copy_(source.keys[source_row])
        self.values[row].copy_(source.values[source_row])
        self.positions[row].copy_(source.positions[source_row])
        self.offsets[row] = source.offsets[source_row]
        self.written[row] = source.written[source_row]


@dataclass
class CodecDecodeState:
    """Everything the streaming decoder remembers between ``decode_step`` calls: a ``KVCache`` per layer by module
    name (``decoder.1.transformer.layers.0``). Each row is its own stream, reset or loaded alone, so one state
    serves requests that join and leave. ``frames_processed`` counts frame columns decoded (O(new frames) work)."""

    batch_size: int
    max_frames_per_step: int
    caches: dict[str, KVCache]
    frames_processed: int = 0

    def reset(self) -> None:
        """Start a new stream in every row (keeps the allocations)."""
        for row in range(self.batch_size):
            self.reset_row(row)
        self.frames_processed = 0

    def reset_row(self, row: int) -> None:
        """Start a new stream in row ``row`` only; the other rows keep theirs."""
        for cache in self.caches.values():
            cache.reset_row(row)

    def copy_row(self, row: int, source: "CodecDecodeState", source_row: int = 0) -> None:
        """Continue ``source``'s stream of row ``source_row`` in row ``row`` (e.g. one primed on its own)."""
        for name, cache in self.caches.items():
            cache.copy_row(row, source.cache(name), source_row)

    def cache(self, name: str) -> KVCache:
        """Return the cache of layer ``name``; a missing entry is a wiring bug."""
        try:
            return self.caches[name]
        except KeyError:
            raise KeyError(f"decode state has no cache for layer {name!r}; "
                           "create the state with the codec that decodes it") from None


@dataclass(frozen=True)
class DecodeSchedule:
    """When and how many frames the streaming pipeline decodes (official ``inference_stream`` policy, its CPU
    defaults; ``configs/cuda.yaml`` holds its CUDA ones). The budget is ``budgets[i]`` for the first threshold the
    playback lead (``lead_s``) is below (``budgets[0]`` before anything was emitted), else ``budgets[-1]``."""

    lead_thresholds_s: tuple[float, ...] = (0.20, 0.55, 1.10)
    budgets: tuple[int, ...] = (1, 2, 4, 8)
    head_lead_s: float = 0.45  # decode the head row's pending frames at once while lead is below this

    def __post_init__(self) -> None:
        if len(self.budgets) != len(self.lead_thresholds_s) + 1 or min(self.budgets) < 1:
            raise ConfigError(f"decode schedule: {len(self.lead_thresholds_s)} thresholds need "
                              f"{len(self.lead_thresholds_s) + 1} budgets >= 1, got {self.budgets}")
        if list(self.lead_thresholds_s) != sorted(self.lead_thresholds_s):
            raise ConfigError(f"decode schedule: thresholds must increase, got {self.lead_thresholds_s}")

    @staticmethod
    def lead_s(emitted_s: float, since_first_emit_s: Optional[float]) -> float:
        """Playback lead: emitted audio minus wall time since the first emission (0 before it)."""
        return 0.0 if since_first_emit_s is None else emitted_s - since_first_emit_s

    def budget(self, emitted_s: float, lead_s: float) -> int:
        """Frames per row to decode in one call at this lead."""
        if emitted_s <= 0.0:
            return self.budgets[0]
        for threshold, budget in zip(self.lead_thresholds_s, self.budgets):
            if lead_s < threshold:
                return budget
        return self.budgets[-1]

    def frames_to_decode(self, *, emitted_s: float, lead_s: float, head_pending: int, max_pending: int,
                         final: bool = False) -> int:
        """Return how many frames per row to decode now (0: wait), given the seconds emitted, the playback lead, the
        undecoded frames of the row playing now and of the row with most; ``final``: decode everything pending."""
        if max_pending <= 0:
            return 0
        if final:
            return max_pending
        budget = self.budget(emitted_s, lead_s)
        nothing_emitted = emitted_s <= 0.0
        if ((nothing_emitted and head_pending > 0) or (head_pending > 0 and lead_s < self.head_lead_s)
                or max_pending >= budget or lead_s < 0.0):
            return budget
        return 0


OFFICIAL_SCHEDULE = DecodeSchedule()
