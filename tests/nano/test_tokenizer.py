import pytest

from moss_npu.errors import CheckpointError
from moss_npu.nano.tokenizer import TextTokenizer


def test_literal_specials_split_out(tiny_tokenizer):
    """Like the HF slow tokenizer: <s>, </s>, <pad>, <unk> become single ids; fragments are encoded alone."""
    tok = TextTokenizer(tiny_tokenizer)
    sp = tok.sp
    assert tok.encode("Hello <s> world") == list(sp.encode("Hello ")) + [1] + list(sp.encode(" world"))
    assert tok.encode("<pad></s>x<unk>") == [3, 2] + list(sp.encode("x")) + [0]
    # Plain SentencePiece would spell the literal out piece by piece instead.
    assert 1 not in sp.encode("Hello <s> world")


def test_plain_text_is_sentencepiece(tiny_tokenizer):
    tok = TextTokenizer(tiny_tokenizer)
    for text in ["Hello world", "  spaced  out ", "你好，世界", "<user_inst>\n- Text:\n"]:
        assert tok.encode(text) == list(tok.sp.encode(text))
    assert tok.encode("\n") == [] and tok.count("") == 0


def test_official_tokenizer_examples(nano_fixture):
    """The official wrapper splits out a literal `<s>`; plain SentencePiece does not (as transformers 4.57.1)."""
    tok = TextTokenizer.from_dir(nano_fixture / "tts")
    assert tok.encode("Hello <s> world") == [7026, 1, 1177]
    assert tok.encode("None") == [505, 587]


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.model not found"):
        TextTokenizer(tmp_path / "tokenizer.model")
