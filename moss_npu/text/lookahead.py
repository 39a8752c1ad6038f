"""A grammar FST prepared for lookahead composition: each input-epsilon arc is relabelled by the bytes that can be
read first after it, so that composing a piece with the grammar follows only the epsilon paths that its next byte
can take.

Composing a piece's byte chain with a grammar explores every (position, state) pair that epsilon arcs reach,
although most of them can never read the next byte (English: ~15,000 pairs explored for a few hundred kept).
Here each input-epsilon arc ``q -> r`` carries the label of a superset of its destination's *first set* F(r):
the bytes on the non-epsilon arcs of the states that epsilon arcs lead to from r (r included), plus
``FINAL_BIT`` when a final state is among them and ``BOUNDARY_BIT`` when the boundary state is. The sets are
merged into at most ``SETS_KEPT`` supersets (``merge_sets``): each label costs a self-loop at every chain
position whose byte its set holds, and with the English tagger's 199 exact sets a chain took as long to build
as the composition it saved. The piece's chain gets, at each position p, a self-loop for every label whose set
holds the byte read there, and at the end for every label whose set holds the end bit of the piece's variant
(``FINAL_BIT`` for a piece that ends the text, whose lattice ends at a final state; ``BOUNDARY_BIT`` for one
cut before its end, whose only final state is the boundary). Why the lattice
searched is the very same, arc for arc, state for state, in the same order:

- The chain is olabel-sorted (its byte arc, then its loops by label) and OpenFst knows it, the relabelled
  grammar has no known ilabel sort, so composition matches on the chain's side: at each pair (p, q) it walks
  q's arcs in q's order and keeps those the chain at p can match. The plain composition walks q's arcs too
  (matching on the chain or, with the grammar known ilabel-sorted, looking q's epsilons and then the byte up
  in it: in q's order as well), an epsilon arc matched by the chain's implicit self-loop. Either way the
  arcs out of (p, q) are q's arcs in q's order, those the chain admits. Both lead to (p, r) under the
  composition filter's state 0 (after a grammar epsilon with no chain epsilon left, as after a matched byte),
  with weight 0 + w, i.e. w; the lattice arc's input label is the relabelled label instead of 0, which nothing
  reads (``Lookahead.epsilon`` maps it back; outputs, weights and states are untouched). The seed arc, the
  chain's only epsilon, meets the grammar's start under the same filter rules: no grammar epsilon is taken
  before it in either composition.
- The relabelled composition has a subset of the plain one's arcs, and it keeps every arc of a complete path
  (start to final). An epsilon arc (p, q) -> (p, r) on such a path is followed by reading byte p first
  (then byte p is in F(r), hence in its label's superset, so the chain at p has the loop) or, at the end, by
  arriving at a final state on epsilon arcs (then the end bit is). So both compositions, trimmed
  (``connect``), keep the same states (accessible and coaccessible) and the same arcs (those between kept
  states). (Restricting the relabelled variant to a piece's labels, ``wetext._PiecewiseSearch._restricted``,
  keeps the relabelled epsilons whose set meets those bytes or the end bit: by the same argument the only
  ones a complete path of such a piece can take.)
- Numbering: composition numbers states in the order it first meets them, expanding them in that order, and
  trimming keeps the survivors' order. A kept state is first met from a kept state (whatever reaches it from
  the start and leads on to it is kept), by the first kept arc into it, so the order of the kept states and
  arcs is decided by the kept part alone, the same in both.
- What reads the lattice sees the same: ``ShortestPath``'s queue (chosen from weights, the DFS order and the
  lattice's known properties, which compose from the grammar's: the relabelled grammar knows none that
  ``AutoQueue`` asks for, nor does the plain one), ``_has_weight``, the binade proof (``cuts._LatticeSums``:
  weights and next states) and the output labels of the lightest path.

The relabelled grammar is a byte-for-byte copy of the grammar file, ilabels of epsilon arcs patched, so it keeps
the file's stored properties too, but for those about input labels that the patch changes (sorted, epsilons,
determinism, acceptor: stored as unknown, since OpenFst trusts a stored one); it is built once per grammar file
and kept in the user cache (``grammar_cache``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import numpy as np

FORMAT_VERSION = 4  # of the prepared grammar files and their records (bump it when relabel, first_sets or
# cuts.GrammarCuts' choice of the boundary state changes: the record keeps the boundary and is trusted)
SETS_KEPT = 16  # first sets kept per grammar (merged into supersets beyond): the loops per chain position
CHAIN_LINES_KEPT = 8_000  # chain arcs written, by position and byte, kept for the next chains (English: ~3,000)
LABEL_BASE = 1 << 16  # a relabelled epsilon arc's label: LABEL_BASE + its first set's index
FINAL_BIT = 256  # a final state of the grammar is reachable on epsilon arcs
BOUNDARY_BIT = 257  # the boundary state is reachable on epsilon arcs
_MAGIC = 2125659606  # OpenFst's FST file magic number
# The property bits stored in an FST file whose truth relabelling the input epsilons changes (kAcceptor,
# kNotAcceptor, kIDeterministic, kNonIDeterministic, kEpsilons, kNoEpsilons, kIEpsilons, kNoIEpsilons,
# kILabelSorted, kNotILabelSorted): OpenFst trusts stored ones, so the relabelled copy stores them as unknown.
_INPUT_LABEL_PROPERTIES = 0x30000000 | 0x3000000 | 0xC00000 | 0xC0000 | 0x30000
_ARC_BYTES = 16  # ilabel int32, olabel int32, weight float32, next state int32


class PreparationError(ValueError):
    """The grammar file is not a plain OpenFst vector FST of standard arcs with byte input labels."""


@dataclass(frozen=True)
class _Layout:
    """Where an OpenFst vector FST file keeps its arcs: byte offset, source state, ilabel and next state of each."""

    offsets: np.ndarray
    sources: np.ndarray
    ilabels: np.ndarray
    nextstates: np.ndarray
    finals: np.ndarray  # the states whose final weight is not infinity
    num_states: int
    properties_at: int  # byte offset of the header's stored properties (uint64)


def _read_string(data: bytes, at: int) -> tuple[str, int]:
    (size,) = struct.unpack_from("<i", data, at)
    return data[at + 4:at + 4 + size].decode("ascii", "replace"), at + 4 + size


def read_layout(data: bytes) -> _Layout:
    """Parse an FST file written by OpenFst's ``VectorFst::Write`` (header, then per state its final weight, its
    arc count and its arcs); raise ``PreparationError`` for any other layout."""
    try:
        (magic,) = struct.unpack_from("<i", data, 0)
        fst_type, at = _read_string(data, 4)
        arc_type, at = _read_string(data, at)
        version, flags, _, _, num_states, _ = struct.unpack_from("<iiQqqq", data, at)
    except struct.error:
        raise PreparationError("truncated FST header") from None
    properties_at = at + 8
    if magic != _MAGIC or fst_type != "vector" or arc_type != "standard" or version != 2 or flags != 0:
        raise PreparationError(f"not a plain vector FST of standard arcs ({fst_type!r}, {arc_type!r}, "
                               f"version {version}, flags {flags})")
    at += struct.calcsize("<iiQqqq")
    starts, counts, finals = np.empty(num_states, np.int64), np.empty(num_states, np.int64), []
    unpack = struct.Struct("<fq").unpack_from
    try:
        for s in range(num_states):
            final, narcs = unpack(data, at)
            if final != float("inf"):
                finals.append(s)
            starts[s], counts[s] = at + 12, narcs
            at += 12 + _ARC_BYTES * narcs
    except struct.error:
        raise PreparationError("truncated FST file") from None
    if at != len(data):
        raise PreparationError(f"FST file of {len(data)} bytes, {at} expected")
    sources = np.repeat(np.arange(num_states, dtype=np.int64), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    offsets = np.repeat(starts, counts) + _ARC_BYTES * (np.arange(len(sources), dtype=np.int64) - first)
    raw = np.frombuffer(data, np.uint8)

    def field(shift: int) -> np.ndarray:
        return raw[(offsets + shift)[:, None] + np.arange(4)].copy().view("<i4").ravel()

    return _Layout(offsets, sources, field(0), field(12), np.array(finals, np.int64), num_states, properties_at)


def first_sets(layout: _Layout, boundary: int) -> list[int]:
    """Each state's first set as a bit mask: the input labels of the non-epsilon arcs of the states reachable from it
    on epsilon arcs (itself included), ``FINAL_BIT`` if one of them is final, ``BOUNDARY_BIT`` if one is the
    boundary. Raise ``PreparationError`` on an epsilon cycle (the grammars have none)."""
    num_states = layout.num_states
    own = [0] * num_states
    for s, label in zip(layout.sources[layout.ilabels != 0].tolist(), layout.ilabels[layout.ilabels != 0].tolist()):
        own[s] |= 1 << label
    for s in layout.finals.tolist():
        own[s] |= 1 << FINAL_BIT
    own[boundary] |= 1 << BOUNDARY_BIT
    eps = layout.ilabels == 0
    eps_out: dict[int, list[int]] = {}
    for s, nxt in zip(layout.sources[eps].tolist(), layout.nextstates[eps].tolist()):
        eps_out.setdefault(s, []).append(nxt)
    state = bytearray(num_states)  # 0 unseen, 1 open, 2 done
    for root in eps_out:
        if state[root]:
            continue
        state[root] = 1
        stack = [(root, iter(eps_out[root]))]
        while stack:
            s, it = stack[-1]
            for nxt in it:
                if state[nxt] == 1:
                    raise PreparationError(f"epsilon cycle through state {nxt}")
                if state[nxt] == 0:
                    state[nxt] = 1
                    stack.append((nxt, iter(eps_out.get(nxt, ()))))
                    break
            else:
                stack.pop()
                state[s] = 2
                mask = own[s]
                for nxt in eps_out.get(s, ()):
                    mask |= own[nxt]
                own[s] = mask
    return own


def merge_sets(counts: dict[int, int], limit: int) -> dict[int, int]:
    """Map each first set (a mask, used by ``counts[mask]`` epsilon arcs) to a superset among at most ``limit``
    sets, merging, one pair at a time, the two whose union admits the fewest extra (arc, byte) pairs."""
    sets = list(counts)
    bits = np.array([[mask >> b & 1 for b in range(BOUNDARY_BIT + 1)] for mask in sets], dtype=np.int64)
    weight = np.array([counts[mask] for mask in sets], dtype=np.int64)
    members = {i: [i] for i in range(len(sets))}
    shared = bits @ bits.T
    while len(members) > limit:
        size = np.diag(shared)
        cost = weight[:, None] * (size[None, :] - shared) + weight[None, :] * (size[:, None] - shared)
        alive = np.zeros(len(sets), bool)
        alive[list(members)] = True
        cost = np.where(alive[:, None] & alive[None, :], cost, np.iinfo(np.int64).max).astype(np.float64)
        np.fill_diagonal(cost, np.inf)
        i, j = np.unravel_index(int(np.argmin(cost)), cost.shape)
        bits[i] |= bits[j]
        weight[i] += weight[j]
        members[i] += members.pop(j)
        shared[i, :] = shared[:, i] = bits @ bits[i]
    merged = {}
    for i, group in members.items():
        union = int("".join(map(str, bits[i][::-1].tolist())), 2)
        for k in group:
            merged[sets[k]] = union
    return merged


def relabel(data: bytes, boundary: int,
            limit: Optional[int] = SETS_KEPT) -> tuple[bytes, list[int], list[int], bytes]:
    """The grammar file ``data`` with each input-epsilon arc's ilabel set to ``LABEL_BASE`` + the index of its
    destination's first set (merged into at most ``limit`` sets), those first sets (bit masks) by index, the
    grammar's final states, and per state 1 if the boundary is reachable from it on epsilon arcs, else 0."""
    layout = read_layout(data)
    if layout.ilabels.min(initial=0) < 0 or layout.ilabels.max(initial=0) >= FINAL_BIT:
        raise PreparationError("input labels outside 0-255: not a byte grammar")
    masks = first_sets(layout, boundary)
    eps = np.flatnonzero(layout.ilabels == 0)
    targets = [masks[nxt] for nxt in layout.nextstates[eps].tolist()]
    if limit is not None:
        counts: dict[int, int] = {}
        for mask in targets:
            counts[mask] = counts.get(mask, 0) + 1
        if len(counts) > limit:
            merged = merge_sets(counts, limit)
            targets = [merged[mask] for mask in targets]
    index: dict[int, int] = {}
    labels = np.array([LABEL_BASE + index.setdefault(mask, len(index)) for mask in targets], dtype="<i4")
    out = np.frombuffer(data, np.uint8).copy()
    out[layout.offsets[eps][:, None] + np.arange(4)] = labels.view(np.uint8).reshape(-1, 4)
    properties = out[layout.properties_at:layout.properties_at + 8].view("<u8")
    properties &= ~np.uint64(_INPUT_LABEL_PROPERTIES)
    to_boundary = bytes(mask >> BOUNDARY_BIT & 1 for mask in masks)
    return out.tobytes(), list(index), layout.finals.tolist(), to_boundary


class Lookahead:
    """A relabelled grammar FST, what the search needs to know of the grammar it was made from (its boundary
    state, final states and the states from which epsilon arcs lead to the boundary: ``to_boundary[s]`` is 1),
    and the chains that compose with it (``chain``)."""

    def __init__(self, fst: Any, signatures: list[int], boundary: int, finals: list[int], to_boundary: bytes) -> None:
        self.fst = fst
        self.signatures = signatures
        self.boundary, self.finals, self.to_boundary = boundary, finals, to_boundary
        self._loops = [tuple(LABEL_BASE + i for i, mask in enumerate(signatures) if mask >> bit & 1)
                       for bit in range(BOUNDARY_BIT + 1)]
        self._lines: dict[tuple[int, int], str] = {}  # (position, byte or end bit) -> its arcs as text lines

    @staticmethod
    def epsilon(label: int) -> int:
        """The grammar's input label of an arc of a lookahead lattice (a relabelled epsilon is 0)."""
        return 0 if label >= LABEL_BASE else label

    def labels_meeting(self, labels: Iterable[int], to_end: bool) -> list[int]:
        """The relabelled labels whose first set holds one of ``labels`` or the end bit of the variant: the only
        epsilon arcs that a piece of those bytes can take."""
        wanted = 1 << (FINAL_BIT if to_end else BOUNDARY_BIT)
        for label in labels:
            wanted |= 1 << label
        return [LABEL_BASE + i for i, mask in enumerate(self.signatures) if mask & wanted]

    def chain(self, data: bytes, seed: Optional[float], to_end: bool) -> Any:
        """The chain of ``data`` (``kaldifst.make_linear_acceptor``'s states and arcs, with the seed arc first
        when ``seed`` is given) with each position's lookahead self-loops.

        Written in OpenFst's text format and compiled with its state numbers kept (one call, where adding the
        arcs one by one took a call per arc: an English verbalizer chain has ~500): the same states, arcs in
        the same order and the same known properties. The seed arc, the one weighted arc, is added after."""
        import kaldifst

        end = len(data)
        lines = [self._lines_at(p, byte, p + 1) for p, byte in enumerate(data)]
        lines.append(self._lines_at(end, FINAL_BIT if to_end else BOUNDARY_BIT, None))
        lines.append(f"{end}\n")
        chain = kaldifst.compile("".join(lines), keep_state_numbering=True)
        if seed is not None:
            first = chain.add_state()
            chain.add_arc(first, kaldifst.StdArc(0, 0, seed, 0))
            chain.start = first
        return chain

    def _lines_at(self, p: int, bit: int, nextstate: Optional[int]) -> str:
        """Position ``p``'s arcs as text lines: the byte ``bit`` to ``nextstate`` (none at the end), then the
        self-loops of the labels whose first set holds ``bit``, by label (so that the chain is olabel-sorted).
        Written once."""
        key = (p, bit)
        found = self._lines.get(key)
        if found is None:
            if len(self._lines) >= CHAIN_LINES_KEPT:
                self._lines.clear()
            labels = ([] if nextstate is None else [(bit, nextstate)]) + [(label, p) for label in self._loops[bit]]
            found = self._lines[key] = "".join(f"{p} {nxt} {label} {label}\n" for label, nxt in labels)
        return found
