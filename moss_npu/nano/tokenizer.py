"""Text tokenizer of MOSS-TTS-Nano: SentencePiece with the HF slow-tokenizer wrapping (docs/architecture.md#tokenizer).

Upstream's ``encode(text, add_special_tokens=False)`` equals plain SentencePiece except for literal special-token
strings (``<unk>``, ``<s>``, ``</s>``, ``<pad>``): they become single ids and the fragments between them are
encoded separately; whitespace next to a token is stripped only where ``tokenizer_config.json`` sets
``lstrip``/``rstrip`` (the official files set neither). ``TextTokenizer.encode`` reproduces exactly that.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional, Sequence

import sentencepiece as spm

from moss_npu.errors import CheckpointError

# The wrapper's special tokens (constructor defaults of the official tokenizer class).
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")


class TextTokenizer:
    """SentencePiece model plus the special-token splitting of the HF slow tokenizer."""

    def __init__(self, model_file: Path | str, added_tokens: Sequence[str] = (),
                 strip: Optional[dict[str, tuple[bool, bool]]] = None) -> None:
        """Load ``tokenizer.model``; ``added_tokens`` encode to single ids besides the special tokens, ``strip``
        maps a token to its (lstrip, rstrip) flags of ``tokenizer_config.json`` (absent: no stripping)."""
        self.model_file = Path(model_file)
        if not self.model_file.is_file():
            raise CheckpointError(f"{self.model_file}: tokenizer.model not found; the model folder must hold the "
                                  "official SentencePiece file")
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(str(self.model_file))
        except (OSError, RuntimeError) as exc:
            raise CheckpointError(f"{self.model_file}: not a SentencePiece model ({exc}); re-download it") from exc
        tokens = list(dict.fromkeys([*SPECIAL_TOKENS, *added_tokens]))
        self.added_ids = {t: int(self.sp.piece_to_id(t)) for t in tokens}
        self.strip = dict(strip or {})
        # Longest match first, like transformers' trie.
        self._split_re = re.compile("(" + "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True))
                                    + ")")

    @classmethod
    def from_dir(cls, model_dir: Path | str) -> "TextTokenizer":
        """Load ``tokenizer.model`` (and any added tokens of ``tokenizer_config.json``) from a model folder."""
        model_dir = Path(model_dir)
        strip: dict[str, tuple[bool, bool]] = {}
        config = model_dir / "tokenizer_config.json"
        if config.is_file():
            decoder = json.loads(config.read_text(encoding="utf-8")).get("added_tokens_decoder", {}) or {}
            for entry in decoder.values():
                if isinstance(entry, dict) and "content" in entry:
                    strip[str(entry["content"])] = (bool(entry.get("lstrip")), bool(entry.get("rstrip")))
        return cls(model_dir / "tokenizer.model", list(strip), strip)

    def encode(self, text: str) -> list[int]:
        """Return the ids upstream gets from ``encode(text, add_special_tokens=False)``."""
        parts = self._split_re.split(str(text))
        # parts alternates fragment, token, fragment, ...
        for i in range(1, len(parts), 2):
            lstrip, rstrip = self.strip.get(parts[i], (False, False))
            if lstrip:
                parts[i - 1] = parts[i - 1].rstrip()
            if rstrip:
                parts[i + 1] = parts[i + 1].lstrip()
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                ids.append(self.added_ids[part])
            elif part:
                ids.extend(int(x) for x in self.sp.encode(part))
        return ids

    def count(self, text: str) -> int:
        """Return the number of tokens of ``text`` (the unit of the long-text splitter's budget)."""
        return len(self.encode(text))
