"""WeTextProcessing's token strings: parse the tagger's output and put each token's fields in reading order.

A tagged text is a run of tokens ``name { key: "value" key: "value" }`` separated by spaces; values keep
their escapes (``\\"`` for ``"``). Before verbalizing, the fields of some token kinds are put in the order
the grammar reads them (a Chinese fraction says its denominator first), unless the token carries
``preserve_order: "true"``. This mirrors ``tn.token_parser`` of WeTextProcessing 1.2.0, whose quirks the
official outputs hold: fields of a reordered kind that its order does not name are dropped.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field

# Field order per token kind, for the Chinese and the English text normalization grammars.
ORDERS: dict[str, dict[str, tuple[str, ...]]] = {
    "zh": {
        "date": ("year", "month", "day"),
        "fraction": ("denominator", "numerator"),
        "measure": ("denominator", "numerator", "value"),
        "money": ("value", "currency"),
        "time": ("noon", "hour", "minute", "second"),
    },
    "en": {
        "date": ("preserve_order", "text", "day", "month", "year"),
        "money": ("integer_part", "fractional_part", "quantity", "currency_maj"),
    },
}
_KEY_CHARS = frozenset(string.ascii_letters + "_")


@dataclass
class Token:
    """One tagged token: its kind, its keys in reading order and each key's (escaped, last-given) value."""

    name: str
    order: list[str] = field(default_factory=list)
    values: dict[str, str] = field(default_factory=dict)

    def fields(self) -> list[tuple[str, str]]:
        """Return the (key, escaped value) pairs in reading order."""
        return [(key, self.values[key]) for key in self.order if key in self.values]

    def serialize(self) -> str:
        """Return the token as the verbalizer grammar reads it."""
        return self.name + " {" + "".join(f' {key}: "{value}"' for key, value in self.fields()) + " }"


_TOKEN = re.compile(r'([A-Za-z_]*) \{ +((?:[A-Za-z_]+: "(?:[^"\\]|\\.)*" +)*)\}( |$)', re.DOTALL)
_FIELD = re.compile(r'([A-Za-z_]+): "((?:[^"\\]|\\.)*)" +', re.DOTALL)


def parse_tokens(tagged: str) -> list[Token]:
    """Split a tagger output into tokens (a key given twice is read twice, with its last value)."""
    tokens = _parse_well_formed(tagged)
    return tokens if tokens is not None else _parse_any(tagged)


def _parse_well_formed(tagged: str) -> list[Token] | None:
    """Parse the tagger's own layout (``name { key: "value" } `` after one another, fields one or more spaces
    apart) with regular expressions; None for anything else, which the character reader takes."""
    tokens, end = [], 0
    for match in _TOKEN.finditer(tagged):
        if match.start() != end:
            return None
        token = Token(match.group(1))
        for key, value in _FIELD.findall(match.group(2)):
            token.order.append(key)
            token.values[key] = value
        tokens.append(token)
        end = match.end()
    return tokens if end == len(tagged) and tagged else None


def _parse_any(tagged: str) -> list[Token]:
    """Read a tagged text character by character, leniently (the official token parser's behaviour)."""
    reader = _Reader(tagged)
    tokens: list[Token] = []
    while reader.skip_spaces():
        token = Token(reader.key())
        reader.skip_each(" { ")
        while reader.skip_spaces():
            if reader.char == "}":
                reader.advance()
                break
            key = reader.key()
            reader.skip_each(': "')
            token.order.append(key)
            token.values[key] = reader.value()
            reader.skip_each('"')
        tokens.append(token)
    return tokens


def reorder(tokens: list[Token], language: str) -> list[Token]:
    """Put the fields of each token kind that has a reading order in that order (in place); return tokens."""
    orders = ORDERS[language]
    for token in tokens:
        order = orders.get(token.name)
        if order is not None and token.values.get("preserve_order") != "true":
            token.order = list(order)
    return tokens


def serialize(tokens: list[Token]) -> str:
    """Return the tokens as one string, as the verbalizer grammar reads it."""
    return " ".join(token.serialize() for token in tokens)


_END = None  # the reader's char at the end of the text


class _Reader:
    """A cursor over a tagged string (one character of look-ahead; ``None`` past the last character)."""

    def __init__(self, text: str) -> None:
        self.text, self.index = text, 0
        self.char = text[0] if text else _END

    def advance(self) -> None:
        self.index += 1
        self.char = self.text[self.index] if self.index < len(self.text) else _END

    def skip_spaces(self) -> bool:
        """Skip spaces; False at the end of the text."""
        while self.char == " ":
            self.advance()
        return self.char is not _END

    def skip_each(self, chars: str) -> None:
        """Skip each of ``chars`` in turn where it is the current character."""
        for ch in chars:
            if self.char == ch:
                self.advance()

    def key(self) -> str:
        start = self.index
        while self.char is not _END and self.char in _KEY_CHARS:
            self.advance()
        return self.text[start:self.index]

    def value(self) -> str:
        """Read up to the closing quote; a backslash takes the next character with it."""
        out = []
        while self.char is not _END and self.char != '"':
            escaped = self.char == "\\"
            out.append(self.char)
            self.advance()
            if escaped and self.char is not _END:
                out.append(self.char)
                self.advance()
        return "".join(out)
