"""One request's audio as its codes come: the streaming codec on the official playback-lead schedule."""

from __future__ import annotations

import time
from typing import Callable, Iterator, Optional

import torch

from moss_npu.codec.rows import CodecRows
from moss_npu.tts.prepare import Plan
from moss_npu.tts.settings import RunConfig
from moss_npu.tts.timeline import AudioChunk, pause


class AudioStreamer:
    """One request's audio as its codes come: the streaming codec on the official playback-lead schedule.

    The codec keeps its transformer state between calls, so each call decodes only the new frames. The first
    call decodes as soon as one frame exists (budget 1), which sets the time to first audio. Pauses between
    text chunks are zeros. Alone (``push`` / ``end_chunk``) it decodes in its row of ``rows``; the engine instead
    collects ``due`` frames of many streamers, decodes them in one ``CodecRows`` call and hands each its audio
    through ``emit``.

    Alone, once audio is out, a decode takes every frame waiting (cheaper in one call than one by one), and behind
    playback (lead < 0) it waits for the largest budget instead of decoding each frame on its own, which never
    catches up (docs/performance.md#the-streamed-cli). The engine, whose calls pad every row to the longest,
    keeps the official counts.
    """

    def __init__(self, plan: Plan, settings: RunConfig, rows: CodecRows,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.plan, self.clock = plan, clock
        self.sample_rate, self.channels = rows.codec.sample_rate, rows.codec.channels
        self.schedule = settings.schedule()
        self.rows = rows
        self.row = 0
        self.emitted_s, self.first_emit = 0.0, None
        self.pending: list[torch.Tensor] = []
        self.index = 0

    def start_chunk(self, index: int, row: int = 0) -> None:
        """Begin text chunk ``index`` in codec row ``row`` (a continuation first primes it with the prompt codes)."""
        self.index, self.pending, self.row = index, [], row
        codes = self.plan.prompt_codes
        prime = codes[:, :self.plan.nq] if self.plan.mode == "continuation" and codes is not None else None
        self.rows.start(row, prime)

    def push(self, codes: torch.Tensor) -> Iterator[AudioChunk]:
        """Add one frame's codes (Q,); yield the audio the schedule says to decode now."""
        self.add(codes)
        return self.decode_due()

    def end_chunk(self, chunk: str) -> Iterator[AudioChunk]:
        """Decode what is left of the chunk, then its pause when more chunks follow."""
        yield from self.decode_due(final=True)
        pause = self.pause(chunk)
        if pause is not None:
            yield pause

    def add(self, codes: torch.Tensor) -> None:
        """Add one frame's codes (Q,) without decoding."""
        self.pending.append(codes)

    def due(self, final: bool = False, alone: bool = False) -> Optional[torch.Tensor]:
        """Take the frames (n, nq) the schedule says to decode now (all at the end of a chunk), or None; ``alone``:
        for a stream decoded on its own (see the class docstring)."""
        since = None if self.first_emit is None else self.clock() - self.first_emit
        lead, waiting = self.schedule.lead_s(self.emitted_s, since), len(self.pending)
        count = self.schedule.frames_to_decode(emitted_s=self.emitted_s, lead_s=lead, head_pending=waiting,
                                               max_pending=waiting, final=final)
        if alone and since is not None and not final:
            largest = self.schedule.budgets[-1]
            count = (waiting if waiting >= largest else 0) if lead < 0 else (waiting if count else 0)
        if not count or not self.pending:
            return None
        take, self.pending = self.pending[:count], self.pending[count:]
        return torch.stack(take)[:, :self.plan.nq]

    def emit(self, wave: torch.Tensor) -> AudioChunk:
        """Wrap decoded audio (C, n) of this stream as the next chunk (and start the playback clock)."""
        self.first_emit = self.clock() if self.first_emit is None else self.first_emit
        self.emitted_s += wave.shape[-1] / self.sample_rate
        return AudioChunk(wave, self.sample_rate, self.index, False, self.plan.chunks[self.index])

    def pause(self, chunk: str) -> Optional[AudioChunk]:
        """The silence after text chunk ``chunk`` when more chunks follow, else None."""
        if self.index >= len(self.plan.chunks) - 1:
            return None
        silence = torch.zeros(self.channels, pause(chunk, self.sample_rate))
        self.emitted_s += silence.shape[-1] / self.sample_rate
        return AudioChunk(silence, self.sample_rate, self.index, True, self.plan.chunks[self.index])

    def decode_due(self, final: bool = False) -> Iterator[AudioChunk]:
        """Decode, in this streamer's row, what the schedule says to decode now (everything at a chunk's end)."""
        codes = self.due(final, alone=True)
        if codes is not None:
            yield self.emit(self.rows.decode({self.row: codes})[self.row])
