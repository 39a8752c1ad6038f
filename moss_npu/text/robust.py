"""The official robust cleanup of TTS input (``normalize_tts_text``; docs/text-normalization.md#what-happens):
layout and noise, never meaning. It rewrites what a reader would not say, shields what it cannot judge (URLs,
addresses, names, tags, file-like tokens: ``_SHIELDED_KINDS``) and leaves numbers, dates and units as written for
WeTextProcessing (``moss_npu.text.wetext``).
"""

from __future__ import annotations

import re
import unicodedata

# Scripts written without spaces between words: CJK ideographs and Japanese kana.
CJK_CLASS = "\u3400-\u4dbf\u4e00-\u9fff\u3040-\u30ff"
_CJK = f"[{CJK_CLASS}]"

# A shielded span while the rules run: ``___PROT<n>___``. The official placeholder text matters, because
# the rules see it (it counts as a Latin token next to Chinese, and as a title end after 《…》).
_SHIELD = r"___PROT\d+___"
_SHIELD_RE = re.compile(f"({_SHIELD})")

# What is shielded, in this order (an earlier kind wins over a later one).
_SHIELDED_KINDS = tuple(re.compile(p) for p in (
    r"https?://[^\s\u3000，。！？；、）】》〉」』]+",  # URL up to a space or closing Chinese punctuation
    r"(?<![\w.+-])[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}(?![\w.-])",  # e-mail address
    r"(?<![A-Za-z0-9_])@[A-Za-z0-9_]{1,32}",  # @mention
    r"(?<![A-Za-z0-9_])(?:u|r)/[A-Za-z0-9_]+",  # reddit user or subreddit
    r"(?<![A-Za-z0-9_])#(?!\s)[^\s#]+",  # hashtag
    r"(?<![A-Za-z0-9_])\.(?=[A-Za-z0-9._-]*[A-Za-z0-9])[A-Za-z0-9._-]+",  # .env, .gitignore
    # a token with a letter and one of . / + : - inside (file names, versions, paths); plain snake_case is not
    r"(?<![A-Za-z0-9_])(?=[A-Za-z0-9._/+:-]*[A-Za-z])(?=[A-Za-z0-9._/+:-]*[./+:-])[A-Za-z0-9][A-Za-z0-9._/+:-]*"
    r"(?![A-Za-z0-9_])",
))

# A token that takes one space next to Chinese: a shielded span, or a run holding at least one Latin letter.
_LATIN_TOKEN = rf"(?:{_SHIELD}|(?=[A-Za-z0-9._/+:-]*[A-Za-z])[A-Za-z0-9][A-Za-z0-9._/+:-]*)"

_ARROW = r"\s*(?:<[-=]+>|[-=]+>|<[-=]+|[→←↔⇒⇐⇔⟶⟵⟷⟹⟸⟺↦↤↪↩])\s*"
_ZERO_WIDTH = re.compile("[\u200b-\u200d\ufeff]")
_LINE_PREFIXES = tuple(re.compile(p) for p in (
    r"^#{1,6}\s+",  # heading
    r"^>\s+",  # quote
    r"^[-*+]\s+",  # bullet
    r"^\d+[.)]\s+",  # numbered item
))
_CLOSERS = frozenset('"\')]}）】》〉」』”’')

# (pattern, replacement) steps, applied in order.
_SPACING = tuple((re.compile(p), r) for p, r in (
    (r"[ \t\r\f\v]+", " "),
    (rf"({_CJK})\s+(?={_CJK})", r"\1"),
    (rf"({_CJK})\s+(?=\d)", r"\1"),
    (rf"(\d)\s+(?={_CJK})", r"\1"),
    (rf"({_CJK})(?=({_LATIN_TOKEN}))", r"\1 "),
    (rf"(({_LATIN_TOKEN}))(?={_CJK})", r"\1 "),
    (r" {2,}", " "),
    (r"\s+([，。！？；：、”’」』】）》])", r"\1"),  # no space before Chinese closing punctuation
    (r"([（【「『《“‘])\s+", r"\1"),  # nor after Chinese opening punctuation
    (r"([，。！？；：、])\s*", r"\1"),
    (r"\s+([,.;!?])", r"\1"),  # none before ASCII punctuation either
    (r" {2,}", " "),
))
_BRACKETS = tuple((re.compile(p), r'"\1"') for p in (
    r"\[\s*([^\[\]]+?)\s*\]",
    r"\{\s*([^{}]+?)\s*\}",
    r"[【〖『「]\s*([^】〗』」]+?)\s*[】〗』」]",
))
# 《Title》 standing alone (at the start or after a sentence end, before an end, a dash run or a shield)
# loses its marks; an embedded title keeps them.
_LONE_TITLE = re.compile(r"(^|[。！？!?；;]\s*)《([^》]+)》"
                         r"(?=\s*(?:" + _SHIELD + r"|[—–―-]{2,}|$|[。！？!?；;，,]))")
_DASH_RUN = re.compile(r"\s*(?:—|–|―|-){2,}\s*")
_REPEATS = tuple((re.compile(p), r) for p, r in (
    (r"(?:\.{3,}|…{2,}|……+)", "。"),  # ellipses
    (r"[。．]{2,}", "。"),
    (r"[，,]{2,}", "，"),
    (r"[!！]{2,}", "！"),
    (r"[?？]{2,}", "？"),
))
_MIXED_MARKS = re.compile(r"[!?！？]{2,}")


def clean_for_speech(text: str) -> str:
    """Return ``text`` after the official robust cleanup (``normalize_tts_text``), character for character."""
    text = _drop_invisible(text)
    text = _flatten_lines(text)
    text = re.sub(_ARROW, "，", text)
    text, shielded = _shield(text)
    text = "".join(part if _SHIELD_RE.fullmatch(part) else part.replace("_", " ")
                   for part in _SHIELD_RE.split(text))
    text = _fix_spacing(text)
    text = _replace_structure(text)
    text = _collapse_repeats(text)
    text = _fix_spacing(text)
    for index, original in enumerate(shielded):
        text = text.replace(f"___PROT{index}___", original)
    lines = text.strip().split("\n")
    return "\n".join(end_with_punctuation(line.strip()) if line.strip() else "" for line in lines).strip()


def end_with_punctuation(line: str) -> str:
    """Append ``。`` unless the line ends (before closing quotes or brackets) with a punctuation mark."""
    if not line:
        return line
    end = len(line.rstrip())
    while end > 0 and line[end - 1] in _CLOSERS:
        end -= 1
    if end > 0 and unicodedata.category(line[end - 1]).startswith("P"):
        return line
    return line + "。"


def _drop_invisible(text: str) -> str:
    """Unify line ends, turn ideographic spaces into spaces, drop zero-width and other control characters."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\u3000", " ")
    text = _ZERO_WIDTH.sub("", text)
    return "".join(ch for ch in text if ch in "\n\t " or not unicodedata.category(ch).startswith("C"))


def _flatten_lines(text: str) -> str:
    """Markdown links to ``text url``; strip line prefixes; join the non-empty lines as sentences."""
    text = re.sub(r"\[([^\[\]]+?)\]\((https?://[^)\s]+)\)", r"\1 \2", text)
    lines = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        for prefix in _LINE_PREFIXES:
            line = prefix.sub("", line)
        lines.append(line)
    return "".join(end_with_punctuation(line) for line in lines[:-1]) + (lines[-1] if lines else "")


def _shield(text: str) -> tuple[str, list[str]]:
    """Replace every shielded span by its placeholder; return the text and the spans in placeholder order."""
    spans: list[str] = []

    def hide(match: re.Match) -> str:
        spans.append(match.group(0))
        return f"___PROT{len(spans) - 1}___"

    for kind in _SHIELDED_KINDS:
        text = kind.sub(hide, text)
    return text, spans


def _fix_spacing(text: str) -> str:
    for pattern, replacement in _SPACING:
        text = pattern.sub(replacement, text)
    return text.strip()


def _replace_structure(text: str) -> str:
    """Brackets to double quotes, lone titles unmarked, arrows to ``，``, dash runs to ``。``."""
    for pattern, replacement in _BRACKETS:
        text = pattern.sub(replacement, text)
    text = _LONE_TITLE.sub(r"\1\2", text)
    text = re.sub(_ARROW, "，", text)
    return _DASH_RUN.sub("。", text)


def _collapse_repeats(text: str) -> str:
    """Ellipses to ``。``; a run of one mark to one; a run mixing ? and ! to ``？！``."""
    for pattern, replacement in _REPEATS:
        text = pattern.sub(replacement, text)

    def merge(match: re.Match) -> str:
        run = match.group(0)
        question, exclamation = any(c in run for c in "?？"), any(c in run for c in "!！")
        return "？！" if question and exclamation else ("？" if question else "！")

    return _MIXED_MARKS.sub(merge, text)
