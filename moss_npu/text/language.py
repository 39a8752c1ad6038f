"""Which WeTextProcessing grammar reads a text, and the hyphen rewrite the Chinese grammar needs first."""

from __future__ import annotations

import re

# The official preset voices that speak English: a text without letters is read in English for them.
ENGLISH_PRESET_VOICES = frozenset({"Trump", "Ava", "Bella", "Adam", "Nathan"})
LANGUAGES = ("zh", "en")

_IDEOGRAPH = re.compile("[\u3400-\u9fff]")
_LATIN_LETTER = re.compile("[A-Za-z]")
_HAN = "[\u3400-\u9fff]"
# Stands for a hyphen that must stay while the later rules run; a private-use character no text holds.
_KEPT = "\ue000"
# Hyphens kept as minus signs, in this order: before a digit at the start, after an operator or an opening
# mark, after a Chinese character, and between two digits (ranges, dates).
_KEPT_MINUS = tuple(re.compile(p) for p in (
    r"(^\s*)-\s*(?=\d)",
    r"([=:+*/,(，:：；;（【\[{])\s*-\s*(?=\d)",
    rf"({_HAN})\s*-\s*(?=\d)",
    r"(\d)\s*-\s*(?=\d)",
))
_HAN_HYPHEN_HAN = re.compile(rf"({_HAN})\s*-\s*(?={_HAN})")
_INNER_HYPHEN = re.compile(r"([^\s-])\s*-\s*(?=[^\s-])")


def choose_language(text: str, voice: str = "") -> str:
    """Return ``zh`` for a text with a CJK ideograph, else ``en`` with a Latin letter or an English preset
    voice, else ``zh`` (the official ``resolve_text_normalization_language``)."""
    if _IDEOGRAPH.search(text):
        return "zh"
    if _LATIN_LETTER.search(text) or voice in ENGLISH_PRESET_VOICES:
        return "en"
    return "zh"


def guard_chinese_hyphens(text: str) -> str:
    """Rewrite hyphens the Chinese grammar would read as 减 (minus): a hyphen between two Chinese characters
    becomes ``，``, any other hyphen inside a token a space; minus signs and digit ranges stay."""
    if "-" not in text:
        return text
    for rule in _KEPT_MINUS:
        text = rule.sub(rf"\1{_KEPT}", text)
    text = _HAN_HYPHEN_HAN.sub(r"\1，", text)
    text = _INNER_HYPHEN.sub(r"\1 ", text)
    return re.sub(r" {2,}", " ", text).strip().replace(_KEPT, "-")
