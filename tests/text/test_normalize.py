"""The stages of the official text preparation, and the missing-library path (one warning, robust only)."""

import logging

import pytest

from moss_npu.text import normalize
from moss_npu.text.normalize import TextNormalizer
from moss_npu.text.wetext import WeTextUnavailable


@pytest.fixture
def without_wetext(monkeypatch):
    def unavailable(cls):
        raise WeTextUnavailable("WeTextProcessing is not installed (pip install ...)")

    monkeypatch.setattr(normalize.Grammars, "locate", classmethod(unavailable))


def test_missing_library_warns_once_and_runs_the_robust_stage(without_wetext, caplog):
    normalizer = TextNormalizer()
    with caplog.at_level(logging.WARNING):
        first = normalizer.prepare("价格是12元！！！", "提示3个")
        second = normalizer.prepare("Version 2!!!")
    assert (first.text, first.prompt_text, first.language) == ("价格是12元！", "提示3个。", "")
    assert first.method == "robust"
    assert (second.text, second.method) == ("Version 2！", "robust")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not installed" in warnings[0].getMessage()


def test_missing_library_with_robust_off_changes_nothing(without_wetext):
    out = TextNormalizer().prepare("12元！！！", robust=False)
    assert (out.text, out.method) == ("12元！！！", "none")


def test_all_stages_off_pass_the_text_through():
    out = TextNormalizer().prepare("  12元！！！ ", "x", robust=False, wetext=False)
    assert out == normalize.NormalizedText("  12元！！！ ", "x", "", "none")


def test_robust_only():
    out = TextNormalizer().prepare("Wow!!! 3 cats...", wetext=False)
    assert (out.text, out.language, out.method) == ("Wow！3 cats...", "", "robust")


def test_full_pipeline_on_text_and_prompt(needs_wetext):
    out = TextNormalizer().prepare("明天下午2点开会。", "昨天是11月30日。")
    assert out == normalize.NormalizedText("明天下午二点开会。", "昨天是十一月三十日。", "zh",
                                           "robust_pre+wetext:zh+robust_post")


def test_wetext_only_and_the_hyphen_guard(needs_wetext):
    out = TextNormalizer().prepare("这是一款AI-驱动的产品", robust=False)
    assert (out.text, out.method) == ("这是一款AI 驱动的产品", "wetext:zh")


def test_prompt_text_is_read_in_the_texts_language(needs_wetext):
    out = TextNormalizer().prepare("今天", "I have 2 apples")
    assert out.language == "zh" and out.prompt_text == "I have 二 apples。"  # the official output
