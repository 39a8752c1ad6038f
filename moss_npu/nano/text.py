"""Long-text chunking for voice clone and the pause between chunks (docs/architecture.md#long-text).

The splitter is upstream's ``_split_text_into_best_sentences``: sentence split, clause split for long sentences,
a token-budget cut for long clauses, then greedy packing of the pieces up to ``max_tokens`` tokens per chunk.
Token counts use the model's own tokenizer.
"""

from __future__ import annotations

import re

from moss_npu.errors import InputError
from moss_npu.nano.tokenizer import TextTokenizer

SENTENCE_END = frozenset(".!?。！？；;")
CLAUSE_SPLIT = frozenset(",，、；;：:")
CLOSING = frozenset("\"'”’)]}）】》」』")
BOUNDARY_LOOKBACK = 24  # characters scanned back for a clause/space boundary in the token-budget cut


def contains_cjk(text: str) -> bool:
    """True if any character is CJK ideograph, kana or hangul (upstream's ranges)."""
    return any("\u4e00" <= ch <= "\u9fff" or "\u3400" <= ch <= "\u4dbf" or "\u3040" <= ch <= "\u30ff"
               or "\uac00" <= ch <= "\ud7af" for ch in str(text))


def prepare_text(text: str) -> str:
    """Normalise whitespace and end punctuation before splitting (upstream's preparation)."""
    prepared = str(text).strip()
    if not prepared:
        raise InputError("text is empty; pass the text to speak")
    prepared = re.sub(" {2,}", " ", prepared.replace("\n", " ").replace("\r", " "))
    if contains_cjk(prepared):
        return prepared if prepared[-1] in SENTENCE_END else prepared + "。"
    if not prepared[0].isupper():
        prepared = prepared[0].upper() + prepared[1:]
    if prepared[-1].isalnum():
        prepared += "."
    if len(prepared.split()) < 5:
        prepared = " " * 8 + prepared  # upstream quirk; later stripping removes it
    return prepared


def split_by_punctuation(text: str, marks: frozenset[str]) -> list[str]:
    """Split after each mark (plus closing quotes/brackets right after it); return stripped non-empty parts."""
    mark, closing = (re.escape("".join(sorted(chars))) for chars in (marks, CLOSING))
    parts = re.findall(f"[^{mark}]*[{mark}][{closing}]*|[^{mark}]+", text)
    return [part.strip() for part in parts if part.strip()]


def split_by_token_budget(tok: TextTokenizer, text: str, max_tokens: int) -> list[str]:
    """Cut text into pieces of at most ``max_tokens`` tokens, preferring cuts after punctuation or spaces."""
    remaining = text.strip()
    boundaries = CLAUSE_SPLIT | SENTENCE_END | {" "}
    pieces: list[str] = []
    while remaining:
        if tok.count(remaining) <= max_tokens:
            pieces.append(remaining)
            break
        # Longest character prefix (stripped) that fits the budget; at least one character.
        low, high, best = 1, len(remaining), 1
        while low <= high:
            middle = (low + high) // 2
            candidate = remaining[:middle].strip()
            if candidate and tok.count(candidate) <= max_tokens:
                best, low = middle, middle + 1
            elif candidate:
                high = middle - 1
            else:
                low = middle + 1
        cut = best
        prefix = remaining[:best]
        for k in range(len(prefix) - 1, max(-1, len(prefix) - BOUNDARY_LOOKBACK - 1), -1):
            if prefix[k] in boundaries:
                cut = k + 1
                break
        piece = remaining[:cut].strip()
        if not piece:
            piece, cut = remaining[:best].strip(), best
        pieces.append(piece)
        remaining = remaining[cut:].strip()
    return pieces


def join_parts(left: str, right: str) -> str:
    """Join two pieces: no separator when either side has CJK, else one space."""
    if not left or not right:
        return left or right
    return left + right if contains_cjk(left) or contains_cjk(right) else left + " " + right


def split_text(tok: TextTokenizer, text: str, max_tokens: int) -> list[str]:
    """Split ``text`` into chunks of at most ``max_tokens`` tokens where possible (``max_tokens <= 0``: no split)."""
    if max_tokens <= 0:
        return [str(text)]
    prepared = prepare_text(text)
    sentences = split_by_punctuation(prepared, SENTENCE_END) or [prepared.strip()]
    pieces: list[tuple[int, str]] = []
    for sentence in (s.strip() for s in sentences):
        if not sentence:
            continue
        count = tok.count(sentence)
        if count <= max_tokens:
            pieces.append((count, sentence))
            continue
        clauses = split_by_punctuation(sentence, CLAUSE_SPLIT)
        for clause in (c.strip() for c in (clauses if len(clauses) > 1 else [sentence])):
            if not clause:
                continue
            count = tok.count(clause)
            if count <= max_tokens:
                pieces.append((count, clause))
                continue
            for piece in split_by_token_budget(tok, clause, max_tokens):
                if piece.strip():
                    pieces.append((tok.count(piece.strip()), piece.strip()))
    chunks: list[str] = []
    current, current_count = "", 0
    for count, piece in pieces:
        if not current:
            current, current_count = piece, count
        elif current_count + count > max_tokens:
            chunks.append(current.strip())
            current, current_count = piece, count
        else:
            current = join_parts(current, piece)
            current_count = tok.count(current)  # recount: joining can change the token count
    if current:
        chunks.append(current.strip())
    return chunks or [prepared.strip()]


def voice_clone_chunks(tok: TextTokenizer, text: str, max_tokens: int) -> list[str]:
    """Chunks as upstream's voice clone uses them: the split if it has several chunks, else the original text."""
    chunks = split_text(tok, text, max_tokens)
    return chunks if len(chunks) > 1 else [text]


def pause_samples(chunk: str, sample_rate_hz: int) -> int:
    """Samples of the silence inserted after a chunk (except the last): 0.40 s after at most 4 words, else 0.24 s."""
    return round(sample_rate_hz * (0.40 if len(str(chunk).split()) <= 4 else 0.24))
