"""When each text chunk is spoken: timestamps, the pause after a chunk, and the speaking rate applied to a
stream of chunks (the one place a request's speed and pauses are applied).

A chunk's span ends after its pause, so the spans tile the audio with no gap or overlap
(docs/serving-features.md#timestamps); at a speed other than 1.0 the times are the stretched audio's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Iterator, Optional, Union

import torch

from moss_npu.nano.text import pause_samples
from moss_npu.tempo import Stretcher

@dataclass(frozen=True)
class AudioChunk:
    """One piece of a stream: ``waveform`` (C, n) float32 on the CPU (pauses are zeros) speaking ``text``;
    ``source_samples``: the samples it stands for before a speed other than 1.0 stretched it (None: its own)."""

    waveform: torch.Tensor
    sample_rate: int
    chunk_index: int
    is_pause: bool
    text: str = ""
    source_samples: Optional[int] = None

    @property
    def source_length(self) -> int:
        """Samples this piece stands for at the model's own pace."""
        return self.waveform.shape[-1] if self.source_samples is None else self.source_samples


@dataclass(frozen=True)
class Timestamp:
    """One text chunk's place in the output audio, in seconds."""

    index: int
    text: str
    start_s: float
    end_s: float
    no_audio: bool = False  # the model spoke nothing of it (``tts.loop``): its span is its pause

    def public(self) -> dict:
        """The JSON form used by the server's events and ``--timestamps``."""
        out = {"index": self.index, "text": self.text, "start": round(self.start_s, 6), "end": round(self.end_s, 6)}
        return {**out, "no_audio": True} if self.no_audio else out


class Timeline:
    """Turns a stream's chunks into timestamps as each text chunk ends (``add``), then the last (``finish``)."""

    def __init__(self, sample_rate: int, speed: float = 1.0, offset_s: float = 0.0) -> None:
        self.rate, self.speed, self.offset_s = sample_rate, speed, offset_s
        self.source = 0  # samples before stretching, so far
        self._open: Optional[tuple[int, str, int]] = None  # (index, text, first source sample)

    def add(self, index: int, text: str, source_samples: int) -> list[Timestamp]:
        """Count audio of text chunk ``index``; return the timestamp of the text chunk it closes, if any."""
        closed = []
        if self._open is not None and index != self._open[0]:
            closed.append(self._close(self._time(self.source)))
        if self._open is None:
            self._open = (index, text, self.source)
        self.source += source_samples
        return closed

    def finish(self, output_samples: Optional[int] = None) -> list[Timestamp]:
        """Close the last text chunk at the end of the audio (``output_samples``: its stretched length)."""
        if self._open is None:
            return []
        end = self._time(self.source) if output_samples is None else self.offset_s + output_samples / self.rate
        return [self._close(end)]

    def _time(self, source_samples: int) -> float:
        return self.offset_s + round(source_samples / self.speed) / self.rate

    def _close(self, end_s: float) -> Timestamp:
        index, text, first = self._open
        self._open = None
        return Timestamp(index, text, self._time(first), end_s)


def at_speed(chunks: Iterable["AudioChunk"], speed: float, sample_rate: int,
             channels: int) -> Iterator["AudioChunk"]:
    """The chunks of one stream spoken at ``speed`` through one stretcher, each keeping its index, text and source
    length, then a last chunk with the stretcher's tail (the chunks themselves at 1.0)."""
    if speed == 1.0:
        yield from chunks
        return
    stretcher, last = Stretcher(speed, sample_rate, channels), None
    for chunk in chunks:
        wave = stretcher.push(chunk.waveform.detach().to("cpu", torch.float32).numpy())
        last = chunk
        yield replace(chunk, waveform=torch.from_numpy(wave), source_samples=chunk.source_length)
    if last is not None:
        yield replace(last, waveform=torch.from_numpy(stretcher.flush()), source_samples=0)


def pause(chunk: str, sample_rate: int, speed: float = 1.0) -> int:
    """Samples of silence after text chunk ``chunk`` (upstream's rule, ``nano.text.pause_samples``) at ``speed``."""
    samples = pause_samples(chunk, sample_rate)
    return samples if speed == 1.0 else round(samples / speed)


def timestamped(chunks: Iterable["AudioChunk"], speed: float, sample_rate: int,
                offset_s: float = 0.0) -> Iterator[Union[AudioChunk, Timestamp]]:
    """Chunks already at ``speed`` (``at_speed``: the engine's streams), with each text chunk's ``Timestamp`` once
    its audio is complete."""
    timeline, samples = Timeline(sample_rate, speed, offset_s), 0
    for chunk in chunks:
        yield from timeline.add(chunk.chunk_index, chunk.text, chunk.source_length)
        samples += chunk.waveform.shape[-1]
        yield chunk
    yield from timeline.finish(samples)


def whole_timestamps(chunks: list[str], lengths: list[int], sample_rate: int, speed: float,
                     output_samples: int) -> tuple[Timestamp, ...]:
    """Timestamps of a whole utterance: ``lengths`` are each text chunk's samples (its pause included)."""
    timeline = Timeline(sample_rate, speed)
    out: list[Timestamp] = []
    for index, (text, length) in enumerate(zip(chunks, lengths)):
        out += timeline.add(index, text, length)
    return tuple(out + timeline.finish(output_samples))
