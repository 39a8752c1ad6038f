import pytest

from moss_npu.errors import InputError
from moss_npu.nano.text import (pause_samples, prepare_text, split_by_punctuation, split_text,
                                voice_clone_chunks)
from moss_npu.nano.tokenizer import TextTokenizer


def test_prepare_text():
    assert prepare_text("  hello there my good old friend ") == "Hello there my good old friend."
    assert prepare_text("hi") == " " * 8 + "Hi."  # fewer than 5 words: upstream's 8-space prefix
    assert prepare_text("你好\n世界") == "你好 世界。"
    with pytest.raises(InputError):
        prepare_text("  \n ")


def test_split_by_punctuation_keeps_closing_marks():
    assert split_by_punctuation('He said "stop." Then left! ok', frozenset(".!")) == ['He said "stop."', "Then left!",
                                                                                      "ok"]
    assert split_by_punctuation("pi is 3.14", frozenset(".")) == ["pi is 3.", "14"]


def test_split_text_budget(tiny_tokenizer):
    tok = TextTokenizer(tiny_tokenizer)
    text = "The quick brown fox jumps over the lazy dog. Hello world, this is a tiny test of the tokenizer."
    assert split_text(tok, text, 0) == [text]
    for budget in (6, 12, 25):
        chunks = split_text(tok, text, budget)
        assert " ".join(chunks).split() == text.split()  # nothing lost or reordered
        assert all(tok.count(c) <= budget for c in chunks)
    assert split_text(tok, text, 1000) == [text]


def test_voice_clone_uses_original_text_for_one_chunk(tiny_tokenizer):
    tok = TextTokenizer(tiny_tokenizer)
    assert voice_clone_chunks(tok, "hello   world", 50) == ["hello   world"]
    assert len(voice_clone_chunks(tok, "One two three. Four five six. Seven eight nine.", 4)) > 1


def test_pause_rule():
    assert pause_samples("one two three four", 1000) == 400
    assert pause_samples("one two three four five", 1000) == 240
    assert pause_samples("床前明月光，疑是地上霜。", 1000) == 400  # no spaces: one "word"
    assert pause_samples("a b c d e", 48000) == 11520
