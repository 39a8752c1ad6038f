"""An FST's lightest path over a text, compiled (``lattice.c``): the answer of OpenFst's ``ShortestPath`` over the
text composed with the grammar, which is what the official runtime (pynini) takes, found in milliseconds. Why it is
the very same answer, arc for arc: docs/text-normalization.md#why-the-search-gives-openfsts-answer.

The grammar's arrays (``prepare``: read from the FST file as pynini's ``optimize()`` gives it, epsilons and arcs
by label, first sets) are kept in the user cache (``grammar_cache``). The search is part of the package's C library
(``moss_npu.native``); where it is missing ``LatticeKernels.load`` raises ``KernelUnavailable`` and the grammar is
searched with kaldifst (OpenFst itself) instead: the same answers, slower.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import numpy as np

from moss_npu.native.library import load_library, require
from moss_npu.text.fst_file import FstArrays

FORMAT_VERSION = 4  # of the prepared arrays (grammar_cache names its files by it)
WORDS = 13  # uint64 words of a state's lookahead sets (lattice.c's SET_WORDS: first set, pair set)
_NO_READING, _NO_MEMORY, _EPSILON_CYCLE = -1, -2, -4
_ACYCLIC = 0x800000000  # OpenFst's kAcyclic property bit
_P, _L = ctypes.c_void_p, ctypes.c_long
ARRAYS = {"header": np.int64, "arc_start": np.int32, "olabel": np.int32, "weight": np.float32,
          "final_weight": np.float32, "epsilons": np.int32, "sorted": np.int32, "first": np.int32,
          "sets": np.uint64}  # a prepared grammar: header = (start, states, known to be acyclic)


class PreparationError(ValueError):
    """A grammar this search cannot take (labels beyond bytes, an epsilon cycle, no states), or cached arrays that
    do not describe one."""


class NoReading(ValueError):
    """The grammar has no reading of a text (the official runtime raises on such a text too)."""


class LatticeKernels:
    """The compiled functions of ``lattice.c`` (``load``)."""

    def __init__(self, library: ctypes.CDLL, built: Optional[str] = None) -> None:
        self.built = built  # where this load compiled them (library.PRIVATE: a temporary folder), None if cached
        self.lookahead_sets = library.fst_lookahead_sets
        self.lookahead_sets.argtypes, self.lookahead_sets.restype = [_L] + [_P] * 5, ctypes.c_int
        self.best_path = library.fst_best_path
        self.best_path.argtypes = [_P, _L, ctypes.c_int32, ctypes.c_int] + [_P] * 9 + [_L, _P]
        self.best_path.restype = ctypes.c_int
        self.output = library.fst_workspace_output
        self.output.argtypes, self.output.restype = [_P], ctypes.POINTER(ctypes.c_int32)
        self.workspace_new = library.fst_workspace_new
        self.workspace_new.argtypes, self.workspace_new.restype = [_L], _P
        self.workspace_free = library.fst_workspace_free
        self.workspace_free.argtypes, self.workspace_free.restype = [_P], None

    @classmethod
    def load(cls, cache: Optional[Path] = None) -> "LatticeKernels":
        """Return the search (``native.library.load_library``: the installed library, or the one built for this CPU into
        ``cache/kernels`` where asked); raises ``KernelUnavailable`` where there is none."""
        library, built = load_library(cache)
        return cls(library, built)


def _ptr(array: np.ndarray) -> int:
    return array.ctypes.data


def prepare(kernels: LatticeKernels, fst: FstArrays) -> dict[str, np.ndarray]:
    """What the search reads of a grammar: each state's epsilon count and its arcs
    by (ilabel, position) as (ilabel, next state, arc) triples, and its lookahead sets (first set, pair set) as a
    number into a table of the distinct ones (a few thousand: the table stays in the CPU cache)."""
    ilabel, olabel, arc_start = fst.ilabel, fst.olabel, fst.arc_start.astype(np.int32)
    states = fst.states
    if states == 0:
        raise PreparationError("an empty FST (it reads nothing)")
    for name, labels in (("input", ilabel), ("output", olabel)):
        if len(labels) and (labels.min() < 0 or labels.max() > 255):
            raise PreparationError(f"{name} labels beyond bytes (0-255)")
    if np.isnan(fst.weight).any() or np.isnan(fst.final_weight).any():
        raise PreparationError("NaN weights (OpenFst stops with an error on them)")
    owner = np.repeat(np.arange(states, dtype=np.int32), np.diff(arc_start))
    by_label = np.lexsort((np.arange(len(ilabel)), ilabel, owner)).astype(np.int32)
    lookahead = np.empty((states, WORDS), np.uint64)
    arcs = len(ilabel)
    for name, array, dtype, shape in (("arc_start", arc_start, np.int32, (states + 1,)),
                                      ("ilabel", ilabel, np.int32, (arcs,)), ("next", fst.next, np.int32, (arcs,)),
                                      ("final_weight", fst.final_weight, np.float32, (states,))):
        require(array, dtype, shape, name)
    status = kernels.lookahead_sets(states, _ptr(arc_start), _ptr(ilabel), _ptr(fst.next), _ptr(fst.final_weight),
                                    _ptr(lookahead))
    if status == _EPSILON_CYCLE:
        raise PreparationError("an epsilon cycle (a text's lattice would be cyclic)")
    if status < 0:
        raise MemoryError("no memory for the grammar's lookahead sets")
    sets, numbers = np.unique(lookahead.view(np.dtype((np.void, 8 * WORDS))).ravel(), return_inverse=True)
    return {"header": np.array([fst.start, states, bool(fst.properties & _ACYCLIC)], np.int64),
            "arc_start": arc_start, "olabel": olabel, "weight": fst.weight, "final_weight": fst.final_weight,
            "epsilons": np.bincount(owner[ilabel == 0], minlength=states).astype(np.int32),
            "sorted": np.stack([ilabel[by_label], fst.next[by_label], by_label], axis=1).astype(np.int32),
            "first": numbers.astype(np.int32).ravel(),
            "sets": np.frombuffer(sets.tobytes(), np.uint64).reshape(-1, WORDS)}


def check(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Return ``arrays`` (a prepared grammar, e.g. read back from the cache) made contiguous, after checking every
    index the C search follows; raise ``PreparationError`` on the first that does not hold."""
    try:
        arrays = {key: np.ascontiguousarray(arrays[key], dtype) for key, dtype in ARRAYS.items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise PreparationError(f"arrays missing or of another kind ({exc})") from None
    start, states = (int(v) for v in arrays["header"][:2]) if arrays["header"].shape == (3,) else (-1, -1)
    arc_start, sorted_arcs, sets = arrays["arc_start"], arrays["sorted"], arrays["sets"]
    arcs = len(arrays["olabel"])
    holds = (0 <= start < states and arc_start.shape == (states + 1,) and arc_start[0] == 0
             and arc_start[-1] == arcs and bool(np.all(np.diff(arc_start) >= 0))
             and arrays["weight"].shape == (arcs,) and sorted_arcs.shape == (arcs, 3)
             and arrays["final_weight"].shape == (states,) and arrays["epsilons"].shape == (states,)
             and arrays["first"].shape == (states,) and sets.ndim == 2 and sets.shape[1] == WORDS)
    if holds and arcs:
        holds = (bool(np.all((sorted_arcs[:, 1] >= 0) & (sorted_arcs[:, 1] < states)))
                 and bool(np.all((sorted_arcs[:, 2] >= 0) & (sorted_arcs[:, 2] < arcs))))
    if holds and states:
        holds = (bool(np.all((arrays["first"] >= 0) & (arrays["first"] < len(sets))))
                 and bool(np.all((arrays["epsilons"] >= 0) & (arrays["epsilons"] <= np.diff(arc_start)))))
    if not holds:
        raise PreparationError("the arrays do not describe a grammar")
    return arrays


def utf8(text: str) -> bytes:
    """``text``'s UTF-8 bytes, which the grammars read; ``NoReading`` for a text that has none (a lone surrogate)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise NoReading(f"the grammar has no reading of {text[:40]!r}: it is not valid Unicode") from None


class CompiledGrammar:
    """One grammar searched by ``lattice.c``; owns the arrays and the C search's workspace (memory kept from one
    text to the next: not thread-safe, callers hold a lock)."""

    def __init__(self, kernels: LatticeKernels, arrays: dict[str, np.ndarray]) -> None:
        self._kernels = kernels
        self._arrays = check(arrays)
        self.start, self.states, self._acyclic = (int(v) for v in self._arrays["header"])
        self._workspace = kernels.workspace_new(self.states)
        if not self._workspace:
            raise MemoryError("no memory for a search workspace")
        self._pointers = tuple(_ptr(self._arrays[key]) for key in (
            "arc_start", "olabel", "weight", "final_weight", "epsilons", "sorted", "first", "sets"))

    def best(self, text: str) -> str:
        """Return the output of the lightest path over ``text``'s UTF-8 bytes; raise ``NoReading`` if none."""
        raw = utf8(text)
        data, size = np.frombuffer(raw or b"\0", np.uint8), len(raw)
        if size >= 2 ** 31 - 1:
            raise MemoryError(f"a text of {size} bytes is too long to search")
        length = _L()
        status = self._kernels.best_path(self._workspace, self.states, self.start, self._acyclic, *self._pointers,
                                         _ptr(data), size, ctypes.byref(length))
        if status == _NO_READING:
            raise NoReading(f"the grammar has no reading of {text[:40]!r}")
        if status == _NO_MEMORY:
            raise MemoryError(f"no memory to search a text of {size} bytes")
        if length.value == 0:
            return ""
        labels = np.ctypeslib.as_array(self._kernels.output(self._workspace), (length.value,))
        return labels.astype(np.uint8).tobytes().decode("utf-8")

    def __del__(self) -> None:
        workspace, self._workspace = getattr(self, "_workspace", None), None
        if workspace:
            self._kernels.workspace_free(workspace)
