"""WeTextProcessing's compiled grammars, run without pynini: numbers, dates, units, money… to words.

The official pipeline runs WeTextProcessing 1.2.0 on pynini: English with its default grammar, Chinese with a
custom build whose tagger is byte-identical to the wheel's ``zh_tn_tagger.fst`` and whose verbalizer only joins the
tagged values, which ``verbalize_chinese`` does (docs/text-normalization.md#what-happens). So nothing is compiled:
the wheel's tagger FSTs and English verbalizer are searched by ``lattice`` (compiled, arrays kept by
``grammar_cache``) or else by kaldifst, read as pynini's ``optimize()`` numbers them (``optimize_order``, so that
ties break as officially: docs/text-normalization.md#tie-order).
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol

from moss_npu.text.grammar_cache import GrammarCache
from moss_npu.text.fst_file import FstArrays, FstFileError
from moss_npu.text.lattice import CompiledGrammar, LatticeKernels, NoReading, PreparationError, prepare, utf8
from moss_npu.text.optimize_order import optimize_order
from moss_npu.text.tokens import Token, parse_tokens, reorder, serialize

log = logging.getLogger(__name__)
_ESCAPED = re.compile(r'\\([\\"])')

DISTRIBUTION = "WeTextProcessing"
OFFICIAL_VERSION = "1.2.0"  # the version the official outputs were produced with
INSTALL_HINT = f"pip install kaldifst && pip install --no-deps {DISTRIBUTION}=={OFFICIAL_VERSION}"
# The grammar files each language reads from the WeTextProcessing wheel (tagger, verbalizer or None).
GRAMMAR_FILES: dict[str, tuple[str, Optional[str]]] = {
    "zh": ("tn/zh_tn_tagger.fst", None),
    "en": ("tn/en_tn_tagger.fst", "tn/en_tn_verbalizer.fst"),
}


class WeTextUnavailable(RuntimeError):
    """kaldifst or WeTextProcessing's grammar files are missing or unreadable; the message says how to fix it."""


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


class Search(Protocol):
    """An FST's lightest path over a text: ``best(text)`` is its output (pynini's ``shortestpath(...).string()``)."""

    def best(self, text: str) -> str: ...


class Grammar:
    """One language's text normalization: tag with the FST, order the fields, verbalize."""

    def __init__(self, language: str, tagger: Search, verbalizer: Optional[Search]) -> None:
        self.language = language
        self._tagger = tagger
        self._verbalizer = verbalizer
        self._lock = threading.Lock()  # a search keeps its working memory from one text to the next

    @classmethod
    def load(cls, language: str, grammars: Grammars, cache: Optional[GrammarCache] = None,
             kernels: Optional[LatticeKernels] = None) -> "Grammar":
        """Read ``language``'s FSTs: for the compiled search (``kernels``) through ``cache`` (the user cache unless
        given), else with kaldifst; raise ``WeTextUnavailable`` when they cannot be read."""
        cache = GrammarCache() if cache is None else cache
        return cls(language, *(_load_search(grammars.root / rel, cache, kernels) if rel else None
                               for rel in GRAMMAR_FILES[language]))  # the tagger, then the verbalizer

    def normalize(self, text: str) -> str:
        """Return ``text`` read out in words (the official ``Normalizer.normalize``); ``""`` stays ``""``."""
        if not text:
            return ""
        with self._lock:
            tokens = reorder(parse_tokens(self._tagger.best(text)), self.language)
            if self._verbalizer is None:
                return verbalize_chinese(tokens)
            return self._verbalizer.best(serialize(tokens))


def _load_search(path: Path, cache: GrammarCache, kernels: Optional[LatticeKernels]) -> Search:
    """The grammar file at ``path`` as the official runtime loads it (``optimized``), ready to search: compiled,
    through ``cache``, where ``kernels`` are given, else kaldifst's."""
    if kernels is None:
        return WholeTextSearch(optimized(path))
    fst: Optional[FstArrays] = None  # the optimized grammar, once the cache has to prepare it

    def prepare_optimized() -> dict:
        nonlocal fst
        fst = optimized(path)
        return prepare(kernels, fst)

    try:
        arrays = cache.prepared(path, prepare_optimized)
    except OSError as exc:
        raise WeTextUnavailable(f"cannot read {path} ({exc}); reinstall it: {INSTALL_HINT}") from None
    except PreparationError as exc:  # a readable grammar the compiled search cannot take (raised by prepare)
        log.warning("text normalization: %s is searched with kaldifst (%s): the same readings, slower", path.name,
                    exc)
        return WholeTextSearch(fst)
    return CompiledGrammar(kernels, arrays)


def optimized(path: Path) -> FstArrays:
    """The FST file at ``path`` put through pynini's ``optimize()`` as the official runtime does (``optimize_order``:
    the same states and arc order, so that ties break the same way); an FST that rule does not cover is kept as
    read, after one warning. Raises ``WeTextUnavailable`` for a file that cannot be read."""
    try:
        fst = FstArrays.read(path.read_bytes())
    except (OSError, FstFileError) as exc:
        raise WeTextUnavailable(f"cannot read {path} ({exc}); reinstall it: {INSTALL_HINT}") from None
    try:
        return optimize_order(fst)
    except ImportError:
        raise WeTextUnavailable(f"kaldifst is not installed ({INSTALL_HINT})") from None
    except ValueError as exc:
        log.warning("text normalization: %s is searched as read, not as pynini's optimize() gives it (%s); "
                    "equally light readings may be broken otherwise than officially", path.name, exc)
        return fst


class WholeTextSearch:
    """The lightest path of an FST over a whole text with kaldifst (OpenFst's ``Compose`` and ``ShortestPath``, as
    pynini takes it): where the compiled search cannot be built; the same answers, a hundred times slower."""

    def __init__(self, fst: FstArrays) -> None:
        try:
            import kaldifst
        except ImportError:
            raise WeTextUnavailable(f"kaldifst is not installed ({INSTALL_HINT})") from None
        self._kaldifst = kaldifst
        try:
            self._fst = fst.to_kaldifst()
        except FstFileError as exc:
            raise WeTextUnavailable(f"{exc} ({INSTALL_HINT})") from None

    def best(self, text: str) -> str:
        """Return the output of the lightest path over ``text``'s UTF-8 bytes; raise ``NoReading`` if none."""
        kaldifst = self._kaldifst
        lattice = kaldifst.compose(kaldifst.make_linear_acceptor(list(utf8(text))), self._fst)
        best = kaldifst.shortest_path(lattice, n=1)
        found, _, output, _ = kaldifst.get_linear_symbol_sequence(best)
        if not found or best.num_states == 0:
            raise NoReading(f"the grammar has no reading of {text[:40]!r}")
        return bytes(output).decode("utf-8")


def verbalize_chinese(tokens: list[Token]) -> str:
    """Say Chinese tokens as the official custom verbalizer does: each token's values in field order, with
    分之 between a fraction's denominator and numerator and 每 before a measure's denominator."""
    out = []
    for token in tokens:
        if token.name == "measure" and "denominator" in token.values:  # every parsed key is in its order too
            out.append("每")
        for key, value in token.fields():
            out.append(_ESCAPED.sub(r"\1", value))  # the tagger escapes a backslash and a double quote
            if token.name == "fraction" and key == "denominator":
                out.append("分之")
    return "".join(out)
