"""WeTextProcessing's compiled grammars, run without pynini: numbers, dates, units, money… to words.

The official pipeline runs WeTextProcessing 1.2.0 (pynini): English with its default grammar, Chinese with a
custom build (``remove_interjections=False, remove_erhua=False, full_to_half=False``). Those options change
only the Chinese *verbalizer*: the custom build's tagger is byte-identical to the ``zh_tn_tagger.fst`` that
the WeTextProcessing wheel ships, and the custom verbalizer only concatenates the tagged values (keeping
儿, interjections and full-width marks), which ``verbalize_chinese`` does directly. So this module needs
no grammar compiler: kaldifst (wheels for x86-64 and aarch64) runs the wheel's tagger FSTs and its English
verbalizer, and pynini (no aarch64 wheel) is never imported. Each FST's lightest path is found piece by
piece (``cuts``), with the very same answer as kaldifst's search of the whole text, each piece composed with
the FST prepared for lookahead search (``lookahead``: the same lattice, found sooner), which is built once
per grammar file (under a second) and kept in the user cache (``grammar_cache``). (The
official runtime loads the files with pynini's ``optimize()``, which renumbers their states; in rare ties
that breaks them otherwise: ``foo@example.org, CO2`` is tagged ``example.o`` + ``rg, Colorado`` there,
``example.or`` + ``g, Colorado`` here, by the whole search and the pieces alike; ``¥192.168.1.1``, two
readings of weight 2.11, is ``十九元`` + ``二点一六八点一点一`` there, ``一元`` + ``九二点一六八点一点一`` here.)
"""

from __future__ import annotations

import importlib.metadata
import logging
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from moss_npu.text.cuts import SEARCH_BUDGET, PieceCache, GrammarCuts, make_room, add_weights
from moss_npu.text.grammar_cache import GrammarCache
from moss_npu.text.lookahead import Lookahead, PreparationError
from moss_npu.text.tokens import Token, parse_tokens, reorder

log = logging.getLogger(__name__)

DISTRIBUTION = "WeTextProcessing"
OFFICIAL_VERSION = "1.2.0"  # the version the official outputs were produced with
INSTALL_HINT = f"pip install kaldifst && pip install --no-deps {DISTRIBUTION}=={OFFICIAL_VERSION}"
# The grammar files each language reads from the WeTextProcessing wheel (tagger, verbalizer or None).
GRAMMAR_FILES: dict[str, tuple[str, Optional[str]]] = {
    "zh": ("tn/zh_tn_tagger.fst", None),
    "en": ("tn/en_tn_tagger.fst", "tn/en_tn_verbalizer.fst"),
}


RESTRICTION_STATES_KEPT = 600_000  # states of restricted FSTs kept per grammar (~45 MB): ~15 English ones of up
# to ~60,000 states, or the ~30 label sets of a Chinese text (1,000-5,000 states each) and hundreds more
LABEL_SETS_KEPT = 4096  # label sets met once, remembered so that a second meeting builds their restriction
ILABEL_SORTED = 0x10000000  # OpenFst's kILabelSorted property bit
_DIGITS = frozenset(b"0123456789")
_LETTERS = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
VERBALIZER_BUDGET = 5000  # a verbalizer piece is a whole token: its single path takes longer to find


class WeTextUnavailable(RuntimeError):
    """kaldifst or WeTextProcessing's grammar files are missing or unreadable; the message says how to fix it."""


class NoReading(ValueError):
    """The grammar has no reading of a text (the official runtime raises on such a text too)."""


@dataclass(frozen=True)
class Grammars:
    """Where the installed WeTextProcessing grammar files are, and which version they belong to."""

    root: Path
    version: str

    @classmethod
    def locate(cls) -> "Grammars":
        """Find the installed WeTextProcessing wheel; raise ``WeTextUnavailable`` if it or a file is missing."""
        try:
            dist = importlib.metadata.distribution(DISTRIBUTION)
        except importlib.metadata.PackageNotFoundError:
            raise WeTextUnavailable(f"{DISTRIBUTION} is not installed ({INSTALL_HINT})") from None
        root = Path(str(dist.locate_file("")))
        for tagger, verbalizer in GRAMMAR_FILES.values():
            for rel in filter(None, (tagger, verbalizer)):
                if not (root / rel).is_file():
                    raise WeTextUnavailable(f"{DISTRIBUTION} {dist.version} lacks {rel} ({INSTALL_HINT})")
        return cls(root, dist.version)


class Grammar:
    """One language's text normalization: tag with the FST, order the fields, verbalize."""

    def __init__(self, language: str, tagger: "_PiecewiseSearch", verbalizer: Optional["_PiecewiseSearch"]) -> None:
        self.language = language
        self._tagger = tagger
        self._verbalizer = verbalizer
        self._lock = threading.Lock()  # OpenFst caches properties on the FSTs while composing

    @classmethod
    def load(cls, language: str, grammars: Grammars, cache: Optional[GrammarCache] = None) -> "Grammar":
        """Read ``language``'s FSTs with kaldifst, prepared for lookahead search through ``cache`` (the user
        cache unless given); raise ``WeTextUnavailable`` when they cannot be read."""
        try:
            import kaldifst
        except ImportError:
            raise WeTextUnavailable(f"kaldifst is not installed ({INSTALL_HINT})") from None
        cache = GrammarCache() if cache is None else cache
        tagger_rel, verbalizer_rel = GRAMMAR_FILES[language]
        tagger = _PiecewiseSearch.load(kaldifst, grammars.root / tagger_rel, cache)
        verbalizer = None
        if verbalizer_rel is not None:
            verbalizer = _PiecewiseSearch.load(kaldifst, grammars.root / verbalizer_rel, cache, VERBALIZER_BUDGET)
        return cls(language, tagger, verbalizer)

    def normalize(self, text: str) -> str:
        """Return ``text`` read out in words (the official ``Normalizer.normalize``); ``""`` stays ``""``."""
        if not text:
            return ""
        with self._lock:
            tokens = reorder(parse_tokens(self._tagger.best(text)), self.language)
            if self._verbalizer is None:
                return verbalize_chinese(tokens)
            units = [token.serialize() + " " for token in tokens]  # ``serialize(tokens)``, cut by token
            if units:
                units[-1] = units[-1][:-1]
            return self._verbalizer.best(units)


class _PiecewiseSearch:
    """An FST's lightest path over a text, found piece by piece between cut units (``cuts``: characters for a
    tagger, serialized tokens for a verbalizer), with the very answer of the whole-text search.

    Each piece's lattice is searched alone, seeded with the exact weight reached before it, under the
    queue discipline that the whole text's search uses. OpenFst's ``ShortestPath`` picks its queue from
    the whole lattice: processing in topological order when some arc is weighted, last-in-first-out when
    none is, and equal weights are broken by that order. A piece whose seed is not 0 has a weighted (seed)
    arc, so its search and the whole search both run in topological order. A piece searched from weight 0
    whose own lattice has no weighted arc is read both ways: as found (last-in-first-out) and with a seed of
    1 (every sum stays a tie, in topological order); which one holds is known once every piece is read
    (some piece weighted: the whole lattice is). Forced pieces (one path) cost no search; searched pieces
    are reused from ``PieceCache`` where that is provably the same. Pieces are composed with the lookahead
    variants when the grammar could be prepared (``lookahead``): the lattice searched, the weights, the
    queue and so every answer stay the same; forced paths and cuts read the plain FST."""

    def __init__(self, fst: Any, budget: int = SEARCH_BUDGET, lookahead: Optional[Lookahead] = None) -> None:
        """``lookahead``: ``fst`` prepared for lookahead search (``lookahead``), with its boundary and final
        states; the pieces' lattices are composed with it (the same lattices, found sooner), else with ``fst``."""
        import kaldifst

        if lookahead is None:
            self.cuts = GrammarCuts(fst, budget)
        else:
            self.cuts = GrammarCuts(fst, budget, lookahead.boundary, lookahead.to_boundary)
        self.lookahead = lookahead
        self.pieces = PieceCache()
        self._fst = fst
        self._from_zero: dict[tuple[str, bool, bool], tuple[bool, bytes, bytes, float]] = {}
        self._variants: dict[tuple[bool, bool], Any] = {}
        self._sorted = bool(fst.properties(ILABEL_SORTED, True))
        self._restrictions = _Restrictions(RESTRICTION_STATES_KEPT)
        self._label_sets: OrderedDict[tuple[frozenset[int], bool, bool], None] = OrderedDict()  # met once
        z = self.cuts.boundary
        if z is None:
            return
        if lookahead is not None:
            finals = lookahead.finals
        else:
            finals = [s for s in range(fst.num_states) if fst.final(s).value != float("inf")]
        composed = fst if lookahead is None else lookahead.fst
        self._variants[True, True] = composed
        for from_start, to_end in ((True, False), (False, True), (False, False)):
            variant = kaldifst.StdVectorFst(composed)
            variant.start = fst.start if from_start else z
            if not to_end:  # the piece ends before a cut: its lattice ends at the boundary state
                for s in finals:
                    variant.set_final(s, float("inf"))
                variant.set_final(z, 0.0)
            self._variants[from_start, to_end] = variant

    @classmethod
    def load(cls, kaldifst: Any, path: Path, cache: GrammarCache, budget: int = SEARCH_BUDGET) -> "_PiecewiseSearch":
        """Read the FST at ``path`` and its lookahead preparation from ``cache`` (built there on first use); a
        preparation that fails gives one warning and the plain search (the same answers, slower)."""
        fst = _read_fst(kaldifst, path)
        try:
            lookahead = cache.lookahead(path, lambda: GrammarCuts(fst, budget).boundary)
        except (OSError, PreparationError) as exc:
            log.warning("text normalization: %s cannot be prepared for lookahead search (%s); searching it "
                        "without (the same readings, slower)", path.name, exc)
            lookahead = None
        return cls(fst, budget, lookahead)

    def best(self, units: Sequence[str]) -> str:
        """Return the output of the lightest path over the text ``"".join(units)`` (pynini's shortestpath, as
        the official ``Processor.tag`` and ``verbalize`` take it)."""
        text = "".join(units)
        if self.cuts.boundary is None or not text:
            return _best_output(text, self._fst)[0]
        bounds = [0] + self.cuts.cut_positions(units) + [len(units)]
        chunks: list[bytes] = []
        unweighted: list[tuple[int, bytes]] = []  # chunk index, reading in topological order
        weight, weighted = 0.0, False
        try:
            for a, b in zip(bounds, bounds[1:]):
                piece, first, last = "".join(units[a:b]), a == 0, b == len(units)
                forced = None
                if b == a + 1 and not last:  # a longer piece (a number) has many paths: not worth enumerating
                    forced = self.cuts.forced(self.cuts.start if first else self.cuts.boundary, piece)
                if forced is not None:
                    chunks.append(forced[0])
                    weight = add_weights(weight, forced[1])
                    weighted = weighted or any(w != math.inf for w in forced[1])
                elif weight != 0.0:
                    output, weight = self._search(piece, first, last, weight)
                    chunks.append(output)
                    weighted = True
                else:
                    holds, lifo, top_order, weight = self._search_from_zero(piece, first, last)
                    weighted = weighted or holds
                    if not holds:
                        unweighted.append((len(chunks), top_order))
                    chunks.append(lifo)
        except NoReading:
            raise NoReading(f"the grammar has no reading of {text[:40]!r}") from None
        if weighted:
            for index, top_order in unweighted:
                chunks[index] = top_order
        return b"".join(chunks).decode("utf-8")

    def _search(self, piece: str, first: bool, last: bool, weight: float) -> tuple[bytes, float]:
        """The lightest output of ``piece`` and the path weight at its end, its lattice starting from path weight
        ``weight`` (not 0) at the boundary state, or at the start for the first piece."""
        key = (piece, first, last)
        found = self.pieces.get(key, weight)
        if found is None:
            output, total, lattice = _lightest(piece, self._restricted(piece, first, last), weight,
                                               self.lookahead, last)
            self.pieces.put(key, weight, output, total, lattice)
            return output, total
        return found

    def _restricted(self, piece: str, first: bool, last: bool) -> Any:
        """The piece's FST variant with only the arcs that can read ``piece``'s bytes (epsilons, and the bytes
        of its characters; all ASCII digits or letters when it holds one), trimmed to the states that still
        lead to its end.

        The piece's lattice is the same, arc for arc in the same order: an arc with another input label is
        never part of it, a trimmed state is never on one of its paths, and restricting an ilabel-sorted FST
        by composition keeps each state's arcs in their order. With lookahead the variant is the relabelled
        one and the labels kept are the relabelled epsilons that such a piece can take
        (``Lookahead.labels_meeting``; the argument is in ``lookahead``). The composition explores far fewer
        dead states on it (a number: 5× faster). Built on a label set's second use, kept within a state budget."""
        variant = self._variants[first, last]
        if not self._sorted:
            return variant
        data = piece.encode("utf-8")
        labels = set(data)
        for group in (_DIGITS, _LETTERS):
            if not labels.isdisjoint(group):
                labels |= group
        key = (frozenset(labels), first, last)
        found = self._restrictions.get(key)
        if found is None:
            if key not in self._label_sets:
                _remember(self._label_sets, key, None, LABEL_SETS_KEPT)
                return variant
            import kaldifst

            sigma = kaldifst.StdVectorFst()
            sigma.add_state()
            sigma.start = 0
            sigma.set_final(0, 0.0)
            kept = sorted(labels)
            if self.lookahead is not None:  # and the relabelled epsilons that a piece of these bytes can take
                kept += self.lookahead.labels_meeting(labels, last)
            for label in kept:
                sigma.add_arc(0, kaldifst.StdArc(label, label, 0.0, 0))
            found = kaldifst.compose(sigma, variant)
        self._restrictions.put(key, found)
        return found

    def _search_from_zero(self, piece: str, first: bool, last: bool) -> tuple[bool, bytes, bytes, float]:
        """For a piece reached with path weight 0: whether its reading as searched holds whatever the other pieces
        are (its lattice has a weighted arc, or it is the whole text), that reading (last-in-first-out when the
        lattice is unweighted), its reading in topological order, and the path weight at its end."""
        key = (piece, first, last)
        found = self._from_zero.get(key)
        if found is None:
            variant = self._restricted(piece, first, last)
            output, total, lattice = _lightest(piece, variant, None if first else 0.0, self.lookahead, last)
            if (first and last) or _has_weight(lattice):  # a whole text is read as OpenFst reads it
                found = (True, output, output, total)
            else:
                found = (False, output, _lightest(piece, variant, 1.0, self.lookahead, last)[0], 0.0)
            make_room(self._from_zero)
            self._from_zero[key] = found
        return found


class _Restrictions:
    """Restricted FSTs by label set, least recently used dropped once they hold more than ``states`` states (a
    count, not a number of FSTs: an English restriction is ten times a Chinese one)."""

    def __init__(self, states: int) -> None:
        self.states = states
        self._held = 0
        self._fsts: OrderedDict[tuple[frozenset[int], bool, bool], Any] = OrderedDict()

    def get(self, key: tuple[frozenset[int], bool, bool]) -> Optional[Any]:
        """The restriction of ``key``, if kept (it becomes the most recently used)."""
        found = self._fsts.get(key)
        if found is not None:
            self._fsts.move_to_end(key)
        return found

    def put(self, key: tuple[frozenset[int], bool, bool], fst: Any) -> None:
        """Keep ``fst`` as ``key``'s restriction, dropping the least recently used beyond the state budget."""
        if key not in self._fsts:
            self._fsts[key] = fst
            self._held += fst.num_states
        while self._held > self.states and len(self._fsts) > 1:
            self._held -= self._fsts.popitem(last=False)[1].num_states

    def __len__(self) -> int:
        return len(self._fsts)


def _remember(table: OrderedDict, key: Any, value: Any, size: int) -> None:
    """Put ``key`` in the least-recently-used ``table`` (as its newest entry), dropping the oldest beyond ``size``."""
    table[key] = value
    table.move_to_end(key)
    while len(table) > size:
        table.popitem(last=False)


def _has_weight(lattice: Any) -> bool:
    """Whether some arc of ``lattice`` weighs other than 0 or infinity (the test by which OpenFst's ``AutoQueue``
    takes last-in-first-out for a lattice with no such arc)."""
    import kaldifst

    return any(arc.weight.value not in (0.0, math.inf)
               for s in range(lattice.num_states) for arc in kaldifst.ArcIterator(lattice, s))


def _read_fst(kaldifst: Any, path: Path) -> Any:
    """Read one FST file; a missing or damaged file (kaldifst returns None) is ``WeTextUnavailable``."""
    try:
        fst = kaldifst.StdVectorFst.read(str(path))
    except Exception as exc:
        fst, why = None, str(exc)
    else:
        why = "not a readable FST"
    if fst is None:
        raise WeTextUnavailable(f"cannot read {path} ({why}); reinstall it: {INSTALL_HINT}")
    return fst


def verbalize_chinese(tokens: list[Token]) -> str:
    """Say Chinese tokens as the official custom verbalizer does: each token's values in field order, with
    分之 between a fraction's denominator and numerator and 每 before a measure's denominator."""
    out = []
    for token in tokens:
        fields = dict(token.fields())
        if token.name == "measure" and "denominator" in fields:
            out.append("每")
        for key, value in token.fields():
            out.append(_unescape(value))
            if token.name == "fraction" and key == "denominator":
                out.append("分之")
    return "".join(out)


def _unescape(value: str) -> str:
    """Undo the tagger's escapes: a backslash before a backslash or a double quote stands for that character."""
    if "\\" not in value:
        return value
    out, i = [], 0
    while i < len(value):
        if value[i] == "\\" and value[i + 1:i + 2] in ("\\", '"'):
            i += 1
        out.append(value[i])
        i += 1
    return "".join(out)


def _best_output(text: str, fst: Any) -> tuple[str, float]:
    """Return the output and the weight of the lightest path of ``fst`` over ``text``'s UTF-8 bytes (pynini's
    shortestpath)."""
    output, weight, _ = _lightest(text, fst, None)
    return output.decode("utf-8"), weight


def _lightest(text: str, fst: Any, seed: Optional[float], lookahead: Optional[Lookahead] = None,
              to_end: bool = True) -> tuple[bytes, float, Any]:
    """The output bytes and weight of the lightest path of ``fst`` over ``text``'s UTF-8 bytes, and the lattice
    searched; a ``seed`` weight goes on a first epsilon arc, so that sums start from it as in a longer text.
    With ``lookahead``, ``fst`` is one of its variants (ending at a final state if ``to_end``, else at the
    boundary) and the chain has its lookahead loops: the same lattice, but for relabelled epsilon ilabels."""
    import kaldifst

    data = text.encode("utf-8")
    if lookahead is not None:
        chain = lookahead.chain(data, seed, to_end)
    else:
        chain = kaldifst.make_linear_acceptor(list(data))
        if seed is not None:
            first = chain.add_state()
            chain.add_arc(first, kaldifst.StdArc(0, 0, seed, chain.start))
            chain.start = first
    lattice = kaldifst.compose(chain, fst)
    best = kaldifst.shortest_path(lattice, n=1)
    found, _, output, weight = kaldifst.get_linear_symbol_sequence(best)
    if not found or best.num_states == 0:
        raise NoReading(f"the grammar has no reading of {text[:40]!r}")
    return bytes(output), weight.value, lattice
