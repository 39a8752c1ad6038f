"""What a worker process loads and how it runs (light to import: a spawned worker unpickles it first)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker loads and how it runs: model folders, its device, dtype, batch slots, CPU threads, and the
    longest request it must admit (``max_new_frames``: the server's frame cap)."""

    model: str
    codec: str
    device: str
    dtype: Optional[str] = None
    max_batch: int = 8
    num_threads: int = 0
    warmup_frames: int = 4
    max_new_frames: int = 375

    @property
    def max_len(self) -> int:
        """Rows per decoder slot: room for a prompt of ``PROMPT_ROWS`` rows plus the frame cap (a multiple of 256)."""
        return -(-(PROMPT_ROWS + self.max_new_frames) // 256) * 256


PROMPT_ROWS = 1024  # text tokens, template and reference frames of one prompt (a 30 s reference is 375 frames)
