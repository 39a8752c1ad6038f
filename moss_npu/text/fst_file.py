"""OpenFst's binary file of a vector FST of standard (tropical float32) arcs, read into numpy arrays and written back.

The grammar files of WeTextProcessing are such files; kaldifst reads and writes them too, so arrays pass to and
from kaldifst's operations through them, where adding arcs one by one from Python would take seconds.
Layout: a header (magic number, "vector", "standard", version, flags, properties, start, state and arc counts),
then per state its final weight (float32), its arc count (int64) and its arcs (int32 ilabel, int32 olabel,
float32 weight, int32 next state).
"""

from __future__ import annotations

import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = 2125659606
_HEADER_END = struct.Struct("<iiQqqq")  # version, flags, properties, start, states, arcs
_ARC = np.dtype([("ilabel", "<i4"), ("olabel", "<i4"), ("weight", "<f4"), ("next", "<i4")])
UNKNOWN_PROPERTIES = 0x3  # kExpanded | kMutable: nothing else known, as in WeTextProcessing's files


class FstFileError(ValueError):
    """Bytes that are not an OpenFst vector FST of standard arcs (or one with symbol tables), or a damaged one."""


@dataclass
class FstArrays:
    """A vector FST as arrays: state s's arcs are ``arc_start[s]:arc_start[s + 1]``, in their order; a final weight
    of inf is a state that is not final; ``properties``: the bits its file says are known."""

    start: int
    arc_start: np.ndarray  # int64 (states + 1)
    ilabel: np.ndarray  # int32 per arc
    olabel: np.ndarray
    weight: np.ndarray  # float32
    next: np.ndarray  # int32
    final_weight: np.ndarray  # float32 per state
    properties: int = UNKNOWN_PROPERTIES

    @property
    def states(self) -> int:
        return len(self.final_weight)

    @classmethod
    def read(cls, data: bytes) -> "FstArrays":
        """Parse a file's bytes; raise ``FstFileError`` saying what is wrong with them."""
        at = 0

        def string() -> bytes:
            nonlocal at
            if at + 4 > len(data):
                raise FstFileError("the file ends inside its header")
            (length,) = struct.unpack_from("<i", data, at)
            if not 0 <= length <= 64 or at + 4 + length > len(data):
                raise FstFileError("not an OpenFst file")
            at += 4 + length
            return data[at - length:at]

        if len(data) < 4 or struct.unpack_from("<i", data)[0] != MAGIC:
            raise FstFileError("not an OpenFst file")
        at = 4
        kind, arc_type = string(), string()
        if (kind, arc_type) != (b"vector", b"standard"):
            raise FstFileError(f"a {kind.decode(errors='replace')} FST of {arc_type.decode(errors='replace')} "
                               "arcs, not a vector FST of standard arcs")
        if at + _HEADER_END.size > len(data):
            raise FstFileError("the file ends inside its header")
        _version, flags, properties, start, states, _arcs = _HEADER_END.unpack_from(data, at)
        at += _HEADER_END.size
        if flags & 0b11:
            raise FstFileError("an FST with symbol tables")
        if not (0 <= start < states < 2 ** 31 or start == -1 and states == 0):  # -1: an empty FST, no start
            raise FstFileError(f"start state {start} of {states} states")
        counts = np.empty(states, np.int64)
        offsets = np.empty(states, np.int64)
        for state in range(states):  # arc counts chain the records: one read each
            if at + 12 > len(data):
                raise FstFileError("the file is truncated")
            count = int.from_bytes(data[at + 4:at + 12], "little", signed=True)
            if count < 0 or at + 12 + 16 * count > len(data):
                raise FstFileError("the file is truncated or damaged")
            offsets[state], counts[state] = at, count
            at += 12 + 16 * count
        body = np.frombuffer(data, np.uint8)
        final_weight = np.empty(states, np.float32)
        if states:
            final_weight[:] = body[(offsets[:, None] + np.arange(4)).ravel()].view("<f4")
        arc_start = np.zeros(states + 1, np.int64)
        np.cumsum(counts, out=arc_start[1:])
        owner = np.repeat(np.arange(states), counts)
        first_arc = offsets[owner] + 12 + 16 * (np.arange(len(owner)) - arc_start[owner])
        arcs = body[(first_arc[:, None] + np.arange(16)).ravel()].view(_ARC) if len(owner) else np.empty(0, _ARC)
        fst = cls(int(start), arc_start, arcs["ilabel"].copy(), arcs["olabel"].copy(), arcs["weight"].copy(),
                  arcs["next"].copy(), final_weight, int(properties))
        if len(fst.next) and (fst.next.min() < 0 or fst.next.max() >= states):
            raise FstFileError("an arc leads to a state that does not exist")
        return fst

    def write(self) -> bytes:
        """The file's bytes (with ``properties``: what OpenFst may take as known)."""
        states, arcs = self.states, len(self.ilabel)
        head = b"".join([struct.pack("<i", MAGIC), struct.pack("<i", 6), b"vector", struct.pack("<i", 8),
                         b"standard", _HEADER_END.pack(2, 0, self.properties, self.start, states, arcs)])
        words = np.empty(3 * states + 4 * arcs, np.uint32)  # every field is 4 bytes wide, or two of them
        counts = np.diff(self.arc_start)
        at = 3 * np.arange(states) + 4 * self.arc_start[:-1]
        words[at] = self.final_weight.astype("<f4").view(np.uint32)
        words[at + 1] = (counts & 0xFFFFFFFF).astype(np.uint32)
        words[at + 2] = (counts >> 32).astype(np.uint32)
        owner = np.repeat(np.arange(states), counts)
        arc_at = at[owner] + 3 + 4 * (np.arange(arcs) - self.arc_start[owner])
        words[arc_at] = self.ilabel.astype("<i4").view(np.uint32)
        words[arc_at + 1] = self.olabel.astype("<i4").view(np.uint32)
        words[arc_at + 2] = self.weight.astype("<f4").view(np.uint32)
        words[arc_at + 3] = self.next.astype("<i4").view(np.uint32)
        return head + words.astype("<u4").tobytes()

    def to_kaldifst(self) -> Any:
        """This FST as a ``kaldifst.StdVectorFst`` (through a file: kaldifst reads paths only)."""
        import kaldifst

        with tempfile.TemporaryDirectory(prefix="moss_npu_fst_") as folder:
            path = Path(folder) / "grammar.fst"
            path.write_bytes(self.write())
            fst = kaldifst.StdVectorFst.read(str(path))
        if fst is None:
            raise FstFileError("kaldifst cannot read it")
        return fst

    @classmethod
    def from_kaldifst(cls, fst: Any) -> "FstArrays":
        """A ``kaldifst.StdVectorFst`` as arrays, with the properties kaldifst knows of it."""
        with tempfile.TemporaryDirectory(prefix="moss_npu_fst_") as folder:
            path = Path(folder) / "grammar.fst"
            if not fst.write(str(path)):
                raise OSError(f"kaldifst could not write {path}")
            return cls.read(path.read_bytes())
