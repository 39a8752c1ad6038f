"""Many audio streams decoded together, one row of a shared ``CodecDecodeState`` each: one codec call for the
frames due in every row instead of one per stream (rows with nothing due are padded and do not move). Each row
equals its stream decoded alone, up to float rounding. Shapes: Q codebooks, n frames, C channels.
See docs/architecture.md#streaming-decode.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from moss_npu.codec.model import NanoCodec
from moss_npu.errors import InputError


class CodecRows:
    """``rows`` streaming decoders sharing one state: ``start`` a stream in a row, ``decode`` the frames due.

    ``timer`` (a ``PhaseTimer``-like object with ``phase(name)``) collects the codec's wall time as "codec".
    """

    def __init__(self, codec: NanoCodec, rows: int, max_frames_per_step: int = 8, timer=None) -> None:
        self.codec, self.timer = codec, timer
        self.max_frames_per_step = max_frames_per_step
        self.state = codec.init_decode_state(rows, max_frames_per_step)

    @property
    def rows(self) -> int:
        return self.state.batch_size

    def _phase(self):
        return self.timer.phase("codec") if self.timer is not None else contextlib.nullcontext()

    def start(self, row: int, prime: Optional[torch.Tensor] = None) -> None:
        """Begin a new stream in ``row``; ``prime`` (F, Q) codes run through it first and their audio is dropped.

        The prime decodes in a one-row state copied into ``row``, so the other rows are not touched.
        """
        self._check_row(row)
        self.state.reset_row(row)
        if prime is not None and prime.shape[0]:
            with self._phase():
                alone = self.codec.init_decode_state(1, self.max_frames_per_step)
                self.codec.decode_step(prime.T[:, None, :], alone)
                self.state.copy_row(row, alone)

    def decode(self, due: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Decode each row's new frames ``due[row]`` (n_row, Q) together; return row -> (C, n_row·frame) on the CPU.

        Rows with different Q (codebooks) go in separate calls, since a call sums the same codebooks for all.
        """
        for row in due:
            self._check_row(row)
        out: dict[int, torch.Tensor] = {}
        by_width: dict[int, list[int]] = {}
        for row, codes in due.items():
            if codes.shape[0]:
                by_width.setdefault(codes.shape[1], []).append(row)
        for width, rows in by_width.items():
            span, frames = max(rows) + 1, max(due[r].shape[0] for r in rows)
            codes = torch.zeros(width, span, frames, dtype=torch.long)
            lengths = torch.zeros(span, dtype=torch.long)
            for r in rows:
                n = due[r].shape[0]
                codes[:, r, :n] = due[r].T
                lengths[r] = n
            with self._phase():
                audio = self.codec.decode_step(codes, self.state, lengths).cpu()
            for r in rows:
                out[r] = audio[r, :, :int(lengths[r]) * self.codec.frame_size]
        for row, codes in due.items():
            if not codes.shape[0]:
                out[row] = torch.zeros(self.codec.channels, 0)
        return out

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.rows:
            raise InputError(f"codec row {row} is out of range; this decoder has rows 0..{self.rows - 1}")
