"""The weights folder check: missing files, wrong shapes and a tokenizer without the special tokens."""

import numpy as np
import pytest

from moss_npu.delay.prompt import DelayTokenizer
from moss_npu.delay.weights import DelayWeights
from moss_npu.errors import CheckpointError

from .conftest import make_weights


def test_tiny_folder_opens(tiny_weights):
    weights = DelayWeights.open(tiny_weights)
    assert (weights.hidden_size, weights.vocab_size, len(weights.emb_ext)) == (8, 32, 32)
    assert weights.gguf.name == "TINY.gguf"


def test_missing_gguf(tmp_path):
    root = make_weights(tmp_path / "w", gguf=False)
    with pytest.raises(CheckpointError, match="no .gguf backbone"):
        DelayWeights.open(root)


def test_two_ggufs_need_a_choice(tiny_weights):
    (tiny_weights / "OTHER.gguf").write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match="several .gguf"):
        DelayWeights.open(tiny_weights)
    assert DelayWeights.open(tiny_weights, "OTHER.gguf").gguf.name == "OTHER.gguf"


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        DelayWeights.open(tmp_path / "nope")


def test_missing_audio_head(tiny_weights):
    (tiny_weights / "lm_heads" / "lm_head_audio_31.npy").unlink()
    with pytest.raises(CheckpointError, match="lm_head_audio_31.npy"):
        DelayWeights.open(tiny_weights)


def test_audio_table_without_the_pad_row(tiny_weights):
    np.save(tiny_weights / "embeddings" / "emb_ext_05.npy", np.zeros((1024, 8), dtype=np.float16))
    with pytest.raises(CheckpointError, match=r"emb_ext_05.npy: shape \(1024, 8\), expected \(1025, 8\)"):
        DelayWeights.open(tiny_weights)


def test_text_head_of_another_vocabulary(tiny_weights):
    np.save(tiny_weights / "lm_heads" / "lm_head_text.npy", np.zeros((33, 8), dtype=np.float16))
    with pytest.raises(CheckpointError, match="lm_head_text.npy"):
        DelayWeights.open(tiny_weights)


def test_hidden_size_disagreeing_with_config(tiny_weights):
    np.save(tiny_weights / "embeddings" / "embed_tokens.npy", np.zeros((32, 16), dtype=np.float16))
    with pytest.raises(CheckpointError, match="hidden size 16"):
        DelayWeights.open(tiny_weights)


def test_integer_table_is_refused(tiny_weights):
    np.save(tiny_weights / "embeddings" / "embed_tokens.npy", np.zeros((32, 8), dtype=np.int64))
    with pytest.raises(CheckpointError, match="float table"):
        DelayWeights.open(tiny_weights)


def test_tokenizer_without_special_tokens(tmp_path):
    root = make_weights(tmp_path / "w", with_specials=False)
    weights = DelayWeights.open(root)
    with pytest.raises(CheckpointError, match="not a special token of this tokenizer"):
        DelayTokenizer(weights.tokenizer_json, weights.config)


def test_tokenizer_with_the_special_tokens(tiny_weights):
    weights = DelayWeights.open(tiny_weights)
    tok = DelayTokenizer(weights.tokenizer_json, weights.config)
    assert tok.encode(tok.strings["audio_start_token_id"]) == [weights.config.audio_start_token_id]
