"""The language choice and the Chinese hyphen guard (docs/text-normalization.md#what-happens)."""

import pytest

from moss_npu.text.language import choose_language, guard_chinese_hyphens


@pytest.mark.parametrize("text,voice,language", [
    ("Hello 世界", "", "zh"),  # an ideograph wins
    ("Hello", "", "en"),
    ("12345", "Ava", "en"),  # no letters: an English preset voice reads English
    ("12345", "Someone", "zh"),
    ("", "", "zh"),
])
def test_language_choice(text, voice, language):
    assert choose_language(text, voice) == language


@pytest.mark.parametrize("text,expected", [
    ("-2是负数", "-2是负数"),  # minus at the start
    ("x=-2", "x=-2"),  # after an operator
    ("(-3)", "(-3)"),
    ("为 -2", "为-2"),  # after a Chinese character (spaces around it go)
    ("2024-05-01", "2024-05-01"),  # between digits
    ("请求接入-身份判定", "请求接入，身份判定"),  # between Chinese characters: a pause
    ("GPU-A100", "GPU A100"),  # anything else inside a token: a space
    ("AI-驱动", "AI 驱动"),
    ("没有连字符", "没有连字符"),
])
def test_hyphen_guard(text, expected):
    assert guard_chinese_hyphens(text) == expected
