"""Where an FST's search over a text can be cut into independent pieces without changing its answer.

The official runtime composes the whole text with the grammar FST (tagger, then verbalizer) and takes
OpenFst's single shortest path over the lattice of (byte position, FST state) pairs. Its answer hangs on
the exact float32 path weights, summed arc by arc from the start of the text, and on how equal weights
are broken. Why a piecewise search gives the very same answer:

- The lattice searched is trimmed: composition keeps only states on a path from the start to a final
  state (``connect``), and only such *complete* paths matter below.
- The *boundary state* Z is where the grammar is between two tokens. Scanning the text, the states a
  path can be in at the current position are followed; before a character that none of them can read
  other than from Z's epsilon closure while Z is reachable, every path of the lattice passes the single
  lattice state (position, Z), once (no epsilon path leads from Z back to Z). Where some can, the paths
  that read it so (Z avoided) are followed further: if they all end before Z is reachable from any of
  them again, and before the text ends, none of them is complete, so again every complete path passes
  (position, Z) (``pm after``: ``pm a`` could begin ``a.m.``, ``pm af`` cannot; most English tokens end so).
  The trimmed lattice falls apart there into a part before and a part after that state, each the same
  sub-lattice as that of the piece searched alone and trimmed (the lattice's arcs at (position, state)
  depend on that state and that byte only, in the FST's order).
- Distances: OpenFst adds weights in float32 one arc at a time from the start, so a piece searched with
  an epsilon arc carrying the exact weight reached at its cut (the *seed*) forms the very sums of the
  whole search, and the same minimum at each state.
- Ties: the lattice of a composed text has no known properties, so ``ShortestPath``'s ``AutoQueue``
  decomposes it: for an acyclic lattice (the grammars have no input-epsilon cycle) with some arc weighing
  neither 0 nor infinity it visits states in topological order (reverse depth-first finishing order), and
  last-in-first-out when no arc does; a state keeps the first of equally light ways in. A depth-first search enters
  the part after a cut only through the cut state and leaves no state of it unfinished, and a
  last-in-first-out queue empties that part before it returns to the part before, so either order,
  restricted to one piece, is the order of the piece searched alone, and the same way in is kept
  everywhere. The one thing that is not local is which of the two orders runs: a piece whose own lattice
  is unweighted would be searched last-in-first-out even when the whole text's lattice is weighted
  (cut by token, the English verbalizer read ``-5℃`` as "negative" where the whole search reads "minus").
  So each piece is searched under the whole text's discipline (``wetext._PiecewiseSearch``).
- A piece is *forced* from a state when exactly one FST path reads it from there and arrives at Z (a
  plain Chinese character): it needs no search, only its output and the float32 sum of its weights.
- ``PieceCache`` reuses a searched piece's reading where that is provably the same (the same seed, or a
  seed of the same float32 binade whose sums round the same way).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import numpy as np

EPSILON = 0
SEARCH_BUDGET = 500  # partial paths looked at before a piece is left to the full search (a hanzi needs ~300)
LATTICE_ARCS_KEPT = 200_000  # arcs of searched lattices kept for later binade proofs (~20 MB)
CANDIDATES_FOLLOWED = 16  # candidate cuts followed at once (a token rarely leaves more open)
MEMO_LIMIT = 200_000  # memoized answers kept per table before it is emptied (a server meets endless texts)
Path = tuple[bytes, tuple[float, ...]]  # the output bytes and the non-zero arc weights of a forced path


Arc = tuple[int, int, float, int]  # input label, output label, weight, next state
States = tuple[int, ...]  # a set of FST states, sorted: a tuple of ints, which the garbage collector stops
# following after one pass (a frozenset it walks on every full collection, and the memo tables hold ~100,000)
_ScanState = tuple[States, bool]  # open states, boundary reachable


class GrammarCuts:
    """The cuts of a text (between characters for a tagger, between tokens for a verbalizer) and the forced
    paths of one grammar FST (arcs read on demand; every answer is memoized, so a normalizer gets faster as
    it meets more contexts)."""

    def __init__(self, fst: Any, budget: int = SEARCH_BUDGET, boundary: Optional[int] = None,
                 to_boundary: Optional[bytes] = None) -> None:
        """``boundary``: the boundary state when known already (``_find_boundary``'s answer, kept with a prepared
        grammar), else it is looked for; ``to_boundary``: per state 1 if epsilon arcs lead from it to the
        boundary (``lookahead.first_sets``), else worked out when asked."""
        self._fst, self._budget = fst, budget
        self._to_boundary = to_boundary
        self._arcs: dict[int, tuple[Arc, ...]] = {}
        self._labelled: dict[int, dict[int, tuple[Arc, ...]]] = {}
        self._next: dict[int, dict[int, States]] = {}  # per state, per input label: the next states of its arcs
        self._reached: dict[tuple[int, Optional[int]], States] = {}
        self.start = fst.start
        self.boundary = self._find_boundary() if boundary is None else boundary
        # The scan's states by number (``_scan_states[n]``, ``_numbered[state] == n``), so that the step
        # memo's keys are (number, character) pairs, cheap to hash.
        self._scan_states: list[_ScanState] = []
        self._numbered: dict[_ScanState, int] = {}
        self._step: dict[tuple[int, str], tuple[bool, int, Optional[States]]] = {}
        self._bypassed: dict[tuple[States, str], tuple[States, bool]] = {}
        self._from_boundary: dict[str, tuple[States, bool]] = {}
        self._boundary_prefix: dict[bytes, States] = {}
        # Per unit read, per open state: the open states after it and whether the boundary is reachable then
        # (dicts by state, so that an open set is looked up in one ``map``, not state by state in Python).
        self._advanced: dict[str, tuple[dict[int, States], dict[int, bool]]] = {}
        self._advanced_entries = 0
        self._forced: dict[tuple[int, str], Optional[Path]] = {}

    def cut_positions(self, text: Sequence[str]) -> list[int]:
        """The indices ``i > 0`` of ``text`` where every path of its lattice passes the boundary state.

        Follows the states a path can be in after each character (``open``). A cut lies before a character
        that no open state can read, other than through the boundary, while the boundary is reachable there.
        Where some can (a *candidate*), the paths that read it so are followed on: when they all come to a
        dead end before the boundary is reachable from any of them again (or the text ends), none of them
        is a path of the lattice, and the candidate is a cut after all (``1 pm after``: ``pm a`` could begin
        ``a.m.``, ``af`` cannot)."""
        cuts: list[int] = []
        if self.boundary is None:
            return cuts
        state = self._number(((self.start,), False))
        pending: list[tuple[int, States]] = []  # candidates and their paths, not yet through the boundary
        for i, unit in enumerate(text):
            step = self._step.get((state, unit))
            if step is None:
                if len(self._step) >= MEMO_LIMIT or len(self._numbered) >= MEMO_LIMIT:
                    state = self._renumber(state)
                step = self._step[state, unit] = self._scan_step(self._scan_states[state], unit)
            cut, state, bypass = step
            pending = self._follow(pending, unit, cuts)
            if i and cut:
                cuts.append(i)
            elif i and bypass:
                pending.append((i, bypass))
                del pending[:-CANDIDATES_FOLLOWED]  # an older one given up is just not a cut
        return sorted(cuts)

    def _number(self, state: _ScanState) -> int:
        """The number of a scan state (given one when first met)."""
        found = self._numbered.get(state)
        if found is None:
            found = self._numbered[state] = len(self._scan_states)
            self._scan_states.append(state)
        return found

    def _renumber(self, current: int) -> int:
        """Empty the step memo and the state numbers (grown to ``MEMO_LIMIT``); the new number of ``current``."""
        state = self._scan_states[current]
        self._step.clear()
        self._numbered.clear()
        self._scan_states.clear()
        return self._number(state)

    def _follow(self, pending: list[tuple[int, States]], unit: str,
                cuts: list[int]) -> list[tuple[int, States]]:
        """Read ``unit`` on each candidate's paths: a candidate whose paths all end is a cut (added to ``cuts``),
        one from whose paths the boundary is reachable is not; the others stay pending."""
        still = []
        for at, paths in pending:
            key = (paths, unit)
            found = self._bypassed.get(key)
            if found is None:
                make_room(self._bypassed)
                found = self._bypassed[key] = self._advance(paths, unit)
            after, reached = found
            if reached:
                continue
            if after:
                still.append((at, after))
            else:
                cuts.append(at)
        return still

    def _scan_step(self, state: _ScanState, unit: str) -> tuple[bool, int, Optional[States]]:
        """Whether a cut lies before ``unit`` in ``state`` (the open states and whether the boundary is
        reachable), the number of the state after it, and, where the boundary is reachable but some open
        state reads ``unit`` around it, the states those paths reach."""
        open_states, at_boundary = state
        after_open, boundary_after_open = self._advance(open_states, unit)
        from_z, boundary_again = self._from_boundary_read(unit) if at_boundary else ((), False)
        after = (_sorted_union(after_open, from_z), boundary_after_open or boundary_again)
        bypass = after_open if at_boundary and after_open and not boundary_after_open else None
        return at_boundary and not after_open, self._number(after), bypass

    def forced(self, state: int, piece: str) -> Optional[Path]:
        """The single tagger path that reads ``piece`` from ``state`` and arrives at the boundary, or None when
        there is none, more than one, or too many to look at."""
        key = (state, piece)
        if key not in self._forced:
            make_room(self._forced)
            self._forced[key] = self._single_path(state, piece.encode("utf-8"))
        return self._forced[key]

    def arcs(self, state: int) -> tuple[Arc, ...]:
        found = self._arcs.get(state)
        if found is None:
            import kaldifst

            found = self._arcs[state] = tuple((a.ilabel, a.olabel, a.weight.value, a.nextstate)
                                              for a in kaldifst.ArcIterator(self._fst, state))
        return found

    def by_label(self, state: int, label: int) -> tuple[Arc, ...]:
        """The arcs of ``state`` whose input label is ``label``, in the FST's order."""
        table = self._labelled.get(state)
        if table is None:
            table = {}
            for arc in self.arcs(state):
                table.setdefault(arc[0], []).append(arc)
            table = self._labelled[state] = {label: tuple(arcs) for label, arcs in table.items()}
        return table.get(label, ())

    def _successors(self, state: int) -> dict[int, States]:
        """The next states of ``state``'s arcs by input label (what the scan reads: no weights, no outputs)."""
        found = self._next.get(state)
        if found is None:
            arcs: dict[int, list[int]] = {}
            for label, _, _, nxt in self.arcs(state):
                arcs.setdefault(label, []).append(nxt)
            found = self._next[state] = {label: tuple(nexts) for label, nexts in arcs.items()}
        return found

    def _find_boundary(self) -> Optional[int]:
        """A state, other than the start, whose token-name insertions equal the start's (or, for a grammar that
        inserts nothing there, that has every arc of the start); the first of them: any such state is sound,
        the first is where the grammar returns after a token. None if there is none or an epsilon path leads
        from it back to it."""
        eps = [a for a in self.arcs(self.start) if a[0] == EPSILON]
        if eps:
            def fits(arcs: tuple[Arc, ...]) -> bool:
                return [a for a in arcs if a[0] == EPSILON] == eps
            least = len(eps)
        else:
            wanted = set(self.arcs(self.start))

            def fits(arcs: tuple[Arc, ...]) -> bool:
                return wanted <= set(arcs)
            least = len(wanted)
        if not least:
            return None
        fst = self._fst
        found = [s for s in range(fst.num_states)
                 if s != self.start and fst.num_arcs(s) >= least
                 and (not eps or fst.num_input_epsilons(s) == len(eps)) and fits(self.arcs(s))]
        self._arcs = {self.start: self._arcs[self.start], **{s: self._arcs[s] for s in found}}
        if not found or found[0] in self._closure({found[0]}, avoid=None, strict=True):
            return None
        return found[0]

    def _closure(self, states: Iterable[int], avoid: Optional[int], strict: bool = False) -> set[int]:
        """States reachable by epsilon arcs (never entering ``avoid``); ``strict`` leaves the sources out."""
        if strict:
            return {t for s in states for t in self._reach(s, avoid) if t != s}
        return set(states).union(*(self._reach(s, avoid) for s in states))

    def _reach(self, state: int, avoid: Optional[int]) -> States:
        """``state`` and the states its epsilon arcs lead to (never entering ``avoid``), memoized."""
        key = (state, avoid)
        found = self._reached.get(key)
        if found is None:
            out, stack = {state}, [state]
            table, successors = self._next, self._successors
            while stack:
                s = stack.pop()
                for nxt in (table.get(s) or successors(s)).get(EPSILON, ()):
                    if nxt != avoid and nxt not in out:
                        out.add(nxt)
                        stack.append(nxt)
            found = self._reached[key] = tuple(sorted(out))
        return found

    def _read(self, states: Iterable[int], data: bytes) -> set[int]:
        """States after reading ``data`` from ``states`` (epsilon moves allowed between bytes, none after)."""
        table, successors = self._next, self._successors
        for k, byte in enumerate(data):
            if k:
                states = self._closure(states, avoid=None)
            after: set[int] = set()
            for s in states:
                found = (table.get(s) or successors(s)).get(byte)
                if found:
                    after.update(found)
            states = after
        return states

    def _advance(self, open_states: States, char: str) -> tuple[States, bool]:
        """Read ``char`` from the open states (no boundary on the way before it): the open states after it and
        whether the boundary is reachable after it (state by state: reading distributes over a union)."""
        if self._advanced_entries >= MEMO_LIMIT:
            self._advanced.clear()
            self._advanced_entries = 0
        memo = self._advanced.get(char)
        if memo is None:
            memo = self._advanced[char] = ({}, {})
            self._advanced_entries += 1  # a verbalizer meets endless tokens: their tables count too
        nexts, reaches = memo
        found = list(map(nexts.get, open_states))
        if None in found:
            data = char.encode("utf-8")
            for i, state in enumerate(open_states):
                if found[i] is None:
                    after, reaches[state] = self._split(self._read(self._reach(state, self.boundary), data))
                    found[i] = nexts[state] = after
                    self._advanced_entries += 1
        return tuple(sorted(set().union(*found))), any(map(reaches.__getitem__, open_states))

    def _split(self, states: set[int]) -> tuple[States, bool]:
        z = self.boundary
        if self._to_boundary is not None:
            flags = self._to_boundary
            reached = any(map(flags.__getitem__, states))
        else:
            reached = z in states or z in self._closure(states - {z}, avoid=None)
        return tuple(sorted(states - {z})), reached

    def _from_boundary_read(self, char: str) -> tuple[States, bool]:
        """Read ``char`` from the boundary: the states after it (the boundary left out) and whether the boundary
        is reachable after it. Reads byte by byte, each prefix memoized: characters share their first bytes."""
        found = self._from_boundary.get(char)
        if found is None:
            data = char.encode("utf-8")
            states = self._closure({self.boundary}, avoid=None)
            for k in range(1, len(data) + 1):
                prefix = data[:k]
                known = self._boundary_prefix.get(prefix)
                if known is None:
                    known = tuple(sorted(self._read(states if k == 1 else self._closure(states, avoid=None),
                                                    prefix[-1:])))
                    make_room(self._boundary_prefix)
                    self._boundary_prefix[prefix] = known
                states = known
            make_room(self._from_boundary)
            found = self._from_boundary[char] = self._split(set(states))
        return found

    def _single_path(self, state: int, data: bytes) -> Optional[Path]:
        """Enumerate the paths from ``state`` reading ``data`` that end at the boundary; keep one if unique."""
        found: list[tuple[list[int], list[float]]] = []
        stack: list[tuple[int, int, list[int], list[float]]] = [(state, 0, [], [])]
        budget = self._budget
        while stack:
            budget -= 1
            if budget < 0:
                return None
            s, read, labels, weights = stack.pop()
            if read == len(data) and s == self.boundary:
                found.append((labels, weights))
                if len(found) > 1:
                    return None
                continue
            moves = self.by_label(s, EPSILON) + (self.by_label(s, data[read]) if read < len(data) else ())
            for ilabel, olabel, weight, nxt in moves:
                stack.append((nxt, read + (ilabel != EPSILON), labels + [olabel] if olabel else labels,
                              weights + [weight] if weight else weights))
        if len(found) != 1:
            return None
        labels, weights = found[0]
        return bytes(labels), tuple(weights)


def _sorted_union(a: States, b: States) -> States:
    """The union of two sorted state tuples, sorted (one of them itself when the other is empty)."""
    if not b:
        return a
    if not a:
        return b
    return tuple(sorted({*a, *b}))


def make_room(memo: dict) -> None:
    """Empty a memo table that has grown to ``MEMO_LIMIT`` entries."""
    if len(memo) >= MEMO_LIMIT:
        memo.clear()


def add_weights(total: float, weights: tuple[float, ...]) -> float:
    """Add arc weights to a path weight one at a time in float32, as OpenFst's tropical semiring does."""
    acc = np.float32(total)
    for weight in weights:
        acc = np.float32(acc + np.float32(weight))
    return float(acc)


@dataclass(frozen=True)
class _Reading:
    """A searched piece's answer: for one exact seed, or for every seed of one float32 binade whose sums
    stay inside it."""

    seed: Optional[float]  # the one seed it holds for, or None: any seed of the binade
    exponent: int  # the binade: [2 ** (exponent - 1), 2 ** exponent)
    low: float  # the lowest and highest sum the search formed, less the seed
    high: float
    output: bytes
    delta: float  # the path weight at the piece's end, less the seed (for one exact seed: that weight)

    def end(self, seed: float) -> float:
        """The path weight at the piece's end, searched from ``seed`` (for which the reading holds)."""
        if self.seed is not None:
            return self.delta
        return float(np.float32(seed) + np.float32(self.delta))

    def holds_for(self, seed: float) -> bool:
        if self.seed is not None:
            return seed == self.seed
        exponent = math.frexp(seed)[1]
        return exponent == self.exponent and _inside(seed + self.low, exponent) and _inside(seed + self.high, exponent)


class PieceCache:
    """The readings of pieces searched more than once, reused across seeds where that provably gives the same
    answer.

    With every sum of a search inside the seed's binade (one float32 grid step u), adding an arc weight w to
    a sum x gives x + round(w / u) * u whatever x is, unless w / u ends in exactly one half (then rounding to
    even depends on x). So when no weight of the lattice is such a half step and all the search's sums stay
    in the binade, a seed D' of the same binade whose sums D' + low .. D' + high stay in it too meets the
    same comparisons, ties included, and reads the piece the same, ending at D' + delta. Otherwise (and for
    a first piece, whose seed is 0) the reading is kept for its exact seed only. Least recently used pieces
    are dropped beyond ``size``."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._readings: OrderedDict[tuple[str, bool, bool], list[_Reading]] = OrderedDict()
        self._searched: OrderedDict[tuple[str, bool, bool], int] = OrderedDict()  # searches per piece
        self._lattices: OrderedDict[tuple[str, bool, bool], Optional[_LatticeSums]] = OrderedDict()
        self._lattice_arcs = 0

    def get(self, key: tuple[str, bool, bool], seed: float) -> Optional[tuple[bytes, float]]:
        """The output and end weight of ``key`` searched from ``seed``, if known."""
        readings = self._readings.get(key)
        if readings is None:
            return None
        self._readings.move_to_end(key)
        for r in readings:
            if r.holds_for(seed):
                return r.output, r.end(seed)
        return None

    def put(self, key: tuple[str, bool, bool], seed: float, output: bytes, total: float, lattice: Any) -> None:
        """Keep the answer of a search from ``seed``: nothing on a piece's first search (most pieces with numbers
        in them come once), the exact seed's reading on its second, and from its third on the reading for the
        seed's binade where that is proven (the proof costs about as much as a search, less once its lattice
        is read)."""
        searches = self._searched.get(key, 0) + 1
        self._searched[key] = searches
        self._searched.move_to_end(key)
        while len(self._searched) > self.size:
            self._searched.popitem(last=False)
        if searches == 1:
            return
        sums = None if key[1] or searches == 2 else self._sums(key, lattice)
        reading = None if sums is None else sums.reading(seed, output, total)
        if reading is None:
            reading = _Reading(seed, 0, 0.0, 0.0, output, total)
        readings = self._readings.setdefault(key, [])
        readings.append(reading)
        del readings[:-8]  # a piece met from many seeds keeps its latest readings
        self._readings.move_to_end(key)
        while len(self._readings) > self.size:
            self._readings.popitem(last=False)

    def _sums(self, key: tuple[str, bool, bool], lattice: Any) -> Optional[_LatticeSums]:
        """``key``'s lattice as the proof reads it, read from ``lattice`` on its first proof and kept (least
        recently used dropped beyond ``LATTICE_ARCS_KEPT`` arcs): a piece is proven once per binade it meets."""
        if key in self._lattices:
            self._lattices.move_to_end(key)
            return self._lattices[key]
        sums = self._lattices[key] = _LatticeSums.of(lattice)
        self._lattice_arcs += 0 if sums is None else sums.arcs
        while self._lattice_arcs > LATTICE_ARCS_KEPT and len(self._lattices) > 1:
            dropped = self._lattices.popitem(last=False)[1]
            self._lattice_arcs -= 0 if dropped is None else dropped.arcs
        return sums


def _inside(value: float, exponent: int) -> bool:
    return 2.0 ** (exponent - 1) <= value < 2.0 ** exponent


class _LatticeSums:
    """A searched piece's lattice as the binade proof reads it: each state's arcs (weight, next state), the
    states in topological order from the seed arc's end, and its distinct arc weights. The same whatever the
    seed (only the seed arc's weight changes), so it is read out of OpenFst once per piece."""

    def __init__(self, order: tuple[tuple[int, tuple[tuple[np.float32, int], ...]], ...], first: int,
                 weights: frozenset[float]) -> None:
        """``order``: tuples, not lists, which the garbage collector stops following after one pass."""
        self.order, self.first, self.weights = order, first, weights
        self.arcs = sum(len(arcs) for _, arcs in order)

    @classmethod
    def of(cls, lattice: Any) -> Optional["_LatticeSums"]:
        """Read ``lattice``; None unless its start has the seed arc alone and no cycle leads back to it."""
        import kaldifst

        arcs = {s: [(a.weight.value, a.nextstate) for a in kaldifst.ArcIterator(lattice, s)]
                for s in range(lattice.num_states)}
        start = lattice.start
        if len(arcs[start]) != 1:
            return None
        first = arcs[start][0][1]
        order = _topological(arcs, first)
        if order is None or start in order:
            return None
        weights = frozenset(weight for s in order for weight, _ in arcs[s])
        flat = [arc for s in order for arc in arcs[s]]
        # (float32 weight, next state) pairs, the weights made in one numpy call
        pairs = list(zip(np.array([w for w, _ in flat], np.float32), [nxt for _, nxt in flat]))
        rows, at = [], 0
        for s in order:
            count = len(arcs[s])
            rows.append((s, tuple(pairs[at:at + count])))
            at += count
        return cls(tuple(rows), first, weights)

    def reading(self, seed: float, output: bytes, total: float) -> Optional[_Reading]:
        """Redo the search's sums from ``seed`` (float32, OpenFst's order: the seed arc, then each arc from a
        state's lightest weight) and return the reading when they all stay in the seed's binade with no
        half-step weight."""
        exponent = math.frexp(seed)[1]
        if seed <= 0.0 or not _inside(seed, exponent):
            return None
        step = 2.0 ** (exponent - 1 - 23)
        if any((weight / step) % 1.0 == 0.5 for weight in self.weights):
            return None
        low = high = np.float32(seed)
        best = {self.first: low}
        for s, arcs in self.order:
            here = best[s]
            for weight, nxt in arcs:
                value = here + weight
                if value < low:
                    low = value
                if value > high:
                    high = value
                known = best.get(nxt)
                if known is None or value < known:
                    best[nxt] = value
        if not (_inside(float(low), exponent) and _inside(float(high), exponent)):
            return None
        return _Reading(None, exponent, float(low) - seed, float(high) - seed, output, total - seed)


def _topological(arcs: dict[int, list[tuple[float, int]]], source: int) -> Optional[list[int]]:
    """States reachable from ``source`` in an order where each comes after all its predecessors."""
    order: list[int] = []
    state = {source: 0}
    stack = [(source, iter(arcs[source]))]
    while stack:
        s, it = stack[-1]
        for _, nxt in it:
            mark = state.get(nxt)
            if mark is None:
                state[nxt] = 0
                stack.append((nxt, iter(arcs[nxt])))
                break
            if mark == 0:
                return None  # a cycle
        else:
            stack.pop()
            state[s] = 1
            order.append(s)
    order.reverse()
    return order
