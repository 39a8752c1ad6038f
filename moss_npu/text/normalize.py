"""The official text preparation of ``infer.py`` (docs/text-normalization.md#what-happens): robust cleanup →
WeTextProcessing → robust cleanup again, on the text and the prompt text, in the language chosen from the text.
Without WeTextProcessing, one warning line says how to install it and the robust cleanup alone runs.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from moss_npu.native.library import KernelUnavailable, report_build
from moss_npu.text.grammar_cache import GrammarCache
from moss_npu.text.language import LANGUAGES, choose_language, guard_chinese_hyphens
from moss_npu.text.lattice import LatticeKernels, NoReading
from moss_npu.text.robust import clean_for_speech
from moss_npu.text.wetext import OFFICIAL_VERSION, Grammar, Grammars, WeTextUnavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NormalizedText:
    """What the model will read: the text, the prompt text, the WeTextProcessing language (``""`` when that
    stage did not run) and the stages run (``robust_pre+wetext:zh+robust_post``, ``robust``, ``none``…)."""

    text: str
    prompt_text: str
    language: str
    method: str


class TextNormalizer:
    """Prepares texts as the official command line does; owns the loaded grammars (read once, on first use)."""

    def __init__(self, cache_dir: Optional[Path] = None) -> None:
        """``cache_dir``: where the grammars prepared for the compiled search and the search itself are kept
        (``grammar_cache``, ``native``; by default ``$MOSS_NPU_CACHE_DIR`` or ``~/.cache/moss-npu``)."""
        self._cache_dir = cache_dir
        self._cache = GrammarCache(cache_dir)
        self._lock = threading.Lock()
        self._grammars: dict[str, Grammar] = {}
        self._unavailable: Optional[str] = None

    def prepare(self, text: str, prompt_text: str = "", *, voice: str = "", robust: bool = True,
                wetext: bool = True) -> NormalizedText:
        """Run the enabled stages on ``text`` and ``prompt_text`` (an empty prompt text stays empty)."""
        stages: list[str] = []
        language = ""
        if robust and wetext:
            text, prompt_text = self._clean(text, prompt_text)
            stages.append("robust_pre")
        grammar = self.grammar(choose_language(text, voice)) if wetext else None
        if grammar is not None:
            language = grammar.language
            text, prompt_text = self._read_out(grammar, text), self._read_out(grammar, prompt_text)
            stages.append(f"wetext:{language}")
        if stages == ["robust_pre"]:
            stages = ["robust"]  # WeTextProcessing is missing: that one pass was the robust stage alone
        elif robust:
            text, prompt_text = self._clean(text, prompt_text)
            stages.append("robust_post" if grammar is not None else "robust")
        return NormalizedText(text, prompt_text, language, "+".join(stages) or "none")

    def grammar(self, language: str) -> Optional[Grammar]:
        """Return ``language``'s grammar (all are read on first use); None, after one warning, if unavailable."""
        with self._lock:
            if not self._grammars and self._unavailable is None:
                try:
                    found = Grammars.locate()
                    kernels = self._kernels()
                    self._grammars = {lang: Grammar.load(lang, found, self._cache, kernels) for lang in LANGUAGES}
                except WeTextUnavailable as exc:
                    self._unavailable = str(exc)
                    log.warning("text normalization: %s; numbers and symbols are read as written "
                                "(robust cleanup only)", exc)
                else:
                    if found.version != OFFICIAL_VERSION:
                        log.warning("text normalization: WeTextProcessing %s is installed; the official outputs "
                                    "come from %s, so some readings may differ", found.version, OFFICIAL_VERSION)
            return self._grammars.get(language)

    def _kernels(self) -> Optional[LatticeKernels]:
        """The compiled search; None, after one warning, where it cannot be built (kaldifst searches instead)."""
        start = time.perf_counter()
        try:
            kernels = LatticeKernels.load(self._cache_dir)
        except KernelUnavailable as exc:
            log.warning("text normalization: the compiled search cannot be built or loaded (%s); searching with kaldifst "
                        "instead (the same readings, about 100x slower, and a few seconds to load)", exc)
            return None
        report_build(log, "the text normalization search", kernels.built, time.perf_counter() - start)
        return kernels

    @staticmethod
    def _clean(text: str, prompt_text: str) -> tuple[str, str]:
        return clean_for_speech(text), clean_for_speech(prompt_text) if prompt_text else ""

    @staticmethod
    def _read_out(grammar: Grammar, text: str) -> str:
        if grammar.language == "zh":
            text = guard_chinese_hyphens(text)
        try:
            return grammar.normalize(text)
        except NoReading as exc:
            log.warning("text normalization: %s; that text is read as written", exc)
            return text
