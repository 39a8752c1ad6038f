"""Progress of a synthesis run on stderr, and the frame counts per chunk the CLI checks afterwards (the frame cap
hit, nothing produced). Displays: ``bar`` (tqdm, on a terminal only), ``lines`` (a line per finished chunk and a
heartbeat on long ones: logs and pipes) and ``off``. A batch's chunk is finished once a step passes without it.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional, TextIO

DISPLAYS = ("bar", "lines", "off")


def pick_display(quiet: bool, stream: Optional[TextIO] = None) -> str:
    """Return ``off`` when quiet or stderr is closed, ``bar`` on a terminal, else ``lines``."""
    stream = sys.stderr if stream is None else stream
    if quiet or stream is None:
        return "off"
    isatty = getattr(stream, "isatty", None)
    return "bar" if isatty is not None and isatty() else "lines"


class Progress:
    """Counts generated frames per text chunk and shows them as the chosen display."""

    def __init__(self, display: str, frame_rate_hz: Optional[float], *, stream: Optional[TextIO] = None,
                 heartbeat_s: float = 10.0, clock: Callable[[], float] = time.monotonic, unit: str = "frame") -> None:
        """``frame_rate_hz`` turns counts into seconds of audio; None when a count is not audio (the Delay
        model's decoding steps, whose first ones hold no audio frame yet): then lines say ``N {unit}s`` only."""
        if display not in DISPLAYS:
            raise ValueError(f"display {display!r}: use one of {DISPLAYS}")
        self.display, self.unit = display, unit
        self.frame_rate_hz = None if frame_rate_hz is None else float(frame_rate_hz)
        self.stream = sys.stderr if stream is None else stream  # looked up now: tests and callers may swap it
        self.heartbeat_s, self.clock = heartbeat_s, clock
        self.frames: dict[int, int] = {}  # chunk index -> frames generated
        self._open: dict[int, tuple[float, int]] = {}  # chunk -> (start time, last step seen)
        self._step = -1
        self._last_line = clock()
        self._bar = None
        if display == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=None, unit=unit, file=self.stream, leave=False, dynamic_ncols=True)

    @property
    def total_frames(self) -> int:
        """Frames generated over all chunks."""
        return sum(self.frames.values())

    def chunks_at_cap(self, max_new_frames: int) -> list[int]:
        """Return the (0-based) chunks whose generation stopped at the frame cap rather than on its own."""
        return sorted(c for c, n in self.frames.items() if n >= max_new_frames)

    def on_frame(self, chunk: int, step: int) -> None:
        """Record one frame of ``chunk`` at decoding ``step`` (the pipeline's ``on_frame`` callback)."""
        if step < self._step:  # a new batch started from step 0
            self._finish(list(self._open))
        elif step > self._step:
            self._finish([c for c, (_, last) in self._open.items() if last < self._step])
        self._step = step
        self._count(chunk, 1, step)

    def add_frames(self, chunk: int, count: int) -> None:
        """Record ``count`` frames of ``chunk`` (streaming: chunks come one after the other)."""
        self._finish([c for c in self._open if c != chunk])
        self._count(chunk, count, self._step)

    def close(self) -> None:
        """Report the chunks still open and remove the bar."""
        self._finish(list(self._open))
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:
            self._open.clear()  # an aborted run: no "finished" lines
        self.close()

    def _count(self, chunk: int, count: int, step: int) -> None:
        self.frames[chunk] = self.frames.get(chunk, 0) + count
        start = self._open.get(chunk, (self.clock(), step))[0]
        self._open[chunk] = (start, step)
        if self._bar is not None:
            self._bar.set_postfix_str(f"chunk {chunk + 1}", refresh=False)
            self._bar.update(count)
        elif self.display == "lines" and self.clock() - self._last_line >= self.heartbeat_s:
            for c in sorted(self._open):
                self._line(f"chunk {c + 1}: {self._describe(c)} so far")

    def _finish(self, chunks: list[int]) -> None:
        for c in sorted(chunks):
            start, _ = self._open.pop(c)
            if self.display == "lines":
                self._line(f"chunk {c + 1}: {self._describe(c)} in {self.clock() - start:.1f} s")

    def _describe(self, chunk: int) -> str:
        count = self.frames.get(chunk, 0)
        if self.frame_rate_hz is None:
            return f"{count} {self.unit}s"
        return f"{count} {self.unit}s ({count / self.frame_rate_hz:.2f} s of audio)"

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)
        self._last_line = self.clock()

