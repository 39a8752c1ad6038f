"""WeTextProcessing's grammars without pynini: the Chinese verbalizer, and what a missing grammar does."""

import importlib.metadata
from pathlib import Path

import pytest

from moss_npu.text import wetext
from moss_npu.text.tokens import parse_tokens, reorder
from moss_npu.text.wetext import Grammar, Grammars, WeTextUnavailable, verbalize_chinese


def say(tagged: str) -> str:
    return verbalize_chinese(reorder(parse_tokens(tagged), "zh"))


def test_chinese_verbalizer_joins_values_in_reading_order():
    assert say('fraction { numerator: "一" denominator: "三" }') == "三分之一"
    assert say('measure { numerator: "五公里" denominator: "小时" }') == "每小时五公里"
    assert say('date { year: "二零二六年" month: "十二月" day: "一日" }') == "二零二六年十二月一日"


def test_official_chinese_settings_keep_erhua_and_punctuation():
    assert say('char { value: "这" } whitelist { erhua: "儿" } char { value: "！" }') == "这儿！"


def test_escaped_quote_and_backslash_are_unescaped():
    assert say('char { value: "\\"" } char { value: "\\\\" }') == '"\\'


def test_missing_distribution_says_how_to_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(WeTextUnavailable, match="pip install --no-deps WeTextProcessing==1.2.0"):
        Grammars.locate()


def test_damaged_grammar_file_is_unavailable_not_a_crash(tmp_path, needs_wetext):
    (tmp_path / "tn").mkdir()
    (tmp_path / "tn" / "zh_tn_tagger.fst").write_bytes(b"not an fst")
    with pytest.raises(WeTextUnavailable, match="cannot read"):
        Grammar.load("zh", Grammars(Path(tmp_path), wetext.OFFICIAL_VERSION))


def test_grammars_read_numbers_out(needs_wetext):
    grammars = Grammars.locate()
    assert Grammar.load("zh", grammars).normalize("打8折") == "打八折"
    assert Grammar.load("en", grammars).normalize("I have 2 apples.") == "I have two apples."
    assert Grammar.load("en", grammars).normalize("") == ""


def test_missing_kaldifst_with_an_empty_cache_is_unavailable_not_a_crash(monkeypatch, needs_wetext):
    """kaldifst prepares a grammar the cache does not hold yet; without it the grammar is unavailable (the
    normalizer then warns once and cleans up only), not an ImportError out of ``prepare``."""
    import builtins

    real_import = builtins.__import__

    def no_kaldifst(name, *args, **kwargs):
        if name == "kaldifst":
            raise ImportError("No module named 'kaldifst'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_kaldifst)
    path = Grammars.locate().root / "tn" / "zh_tn_tagger.fst"
    with pytest.raises(WeTextUnavailable, match="kaldifst is not installed"):
        wetext.optimized(path)
