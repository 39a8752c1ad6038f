"""Conformance handlers for the text-norm fixture: ``normalize_text``, ``normalize_robust``,
``normalize_language`` (tolerance: identical strings)."""

from __future__ import annotations

from moss_npu.errors import MissingDependency
from moss_npu_verify.goldens import CaseResult, Fixture
from moss_npu.text.language import choose_language
from moss_npu.text.normalize import TextNormalizer
from moss_npu.text.robust import clean_for_speech
from moss_npu.text.wetext import Grammars, WeTextUnavailable


def _same(got: dict, expected: dict) -> CaseResult:
    wrong = {key: got.get(key) for key in expected if got.get(key) != expected[key]}
    if not wrong:
        return CaseResult(True, "identical")
    return CaseResult(False, "; ".join(f"{key}: got {value!r}, expected {expected[key]!r}"
                                       for key, value in wrong.items()))


def check_normalize_text(case: dict, fx: Fixture) -> CaseResult:
    """The full official preparation of text and prompt text, with the case's stage switches."""
    given = case["input"]
    if given["enable_wetext"]:
        fx.memo("text.wetext_installed", _require_wetext)
    normalizer = fx.memo("text.normalizer", TextNormalizer)
    out = normalizer.prepare(given["text"], given.get("prompt_text", ""), voice=given.get("voice", ""),
                             robust=given["enable_normalize_tts_text"], wetext=given["enable_wetext"])
    got = {"text": out.text, "prompt_text": out.prompt_text, "language": out.language, "method": out.method}
    return _same(got, case["expected"])


def _require_wetext() -> bool:
    """Raise MissingDependency when WeTextProcessing's grammars or kaldifst are not installed: without them the
    normalizer falls back to the robust stage, so such a case would fail for a missing optional part."""
    try:
        Grammars.locate()
        import kaldifst  # noqa: F401
    except (WeTextUnavailable, ImportError) as exc:
        raise MissingDependency(f"WeTextProcessing stage: {exc}") from None
    return True


def check_normalize_robust(case: dict, fx: Fixture) -> CaseResult:
    """The robust cleanup alone."""
    return _same({"text": clean_for_speech(case["input"]["text"])}, case["expected"])


def check_normalize_language(case: dict, fx: Fixture) -> CaseResult:
    """The WeTextProcessing language chosen for a text and a voice."""
    given = case["input"]
    return _same({"language": choose_language(given["text"], given.get("voice", ""))}, case["expected"])
