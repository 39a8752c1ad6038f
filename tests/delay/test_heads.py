"""Audio heads (NumPy and torch) and the embedding sum on a tiny weights folder."""

import numpy as np
import pytest

from moss_npu.delay.embeddings import DelayEmbeddings
from moss_npu.delay.heads import NumpyAudioHeads, TorchAudioHeads, build_audio_heads
from moss_npu.delay.weights import DelayWeights
from moss_npu.errors import InputError


@pytest.fixture
def weights(tiny_weights):
    return DelayWeights.open(tiny_weights)


def test_numpy_heads_match_a_per_head_product_and_mask_the_pad(weights):
    heads = NumpyAudioHeads(weights)
    hidden = np.random.RandomState(0).randn(weights.hidden_size).astype(np.float32)
    logits = heads(hidden)
    assert logits.shape == (32, 1025) and logits.dtype == np.float32
    assert np.isneginf(logits[:, 1024]).all()
    head7 = np.load(weights.lm_head_audio[7]).astype(np.float32)
    np.testing.assert_allclose(logits[7, :1024], head7[:1024] @ hidden, rtol=1e-5, atol=1e-5)


def test_torch_heads_agree_with_numpy(weights):
    import torch

    hidden = np.random.RandomState(1).randn(weights.hidden_size).astype(np.float32)
    got = TorchAudioHeads(weights, torch.device("cpu"))(hidden)
    want = NumpyAudioHeads(weights)(hidden)
    assert np.isneginf(got[:, -1]).all()
    np.testing.assert_allclose(got[:, :-1], want[:, :-1], atol=1e-5)


def test_auto_heads_on_a_cpu_only_machine_are_numpy(weights):
    assert isinstance(build_audio_heads(weights, "auto", "cpu"), NumpyAudioHeads)
    assert isinstance(build_audio_heads(weights, "torch", "cpu"), TorchAudioHeads)


def test_without_torch_auto_heads_are_numpy_and_torch_heads_an_error(weights, monkeypatch):
    import sys

    from moss_npu.errors import ConfigError

    monkeypatch.setitem(sys.modules, "torch", None)
    assert isinstance(build_audio_heads(weights, "auto", "auto"), NumpyAudioHeads)
    with pytest.raises(ConfigError, match="heads_backend: numpy"):
        build_audio_heads(weights, "torch", "auto")


def test_embeddings_sum_text_and_every_channel_including_the_pad_row(weights):
    embed = DelayEmbeddings(weights)
    row = np.array([3] + [1024] * 31 + [5])
    want = np.load(weights.embed_tokens)[3].astype(np.float32)
    for q in range(32):
        want = want + np.load(weights.emb_ext[q])[row[q + 1]].astype(np.float32)
    got = embed(row)
    assert got.dtype == np.float32 and np.array_equal(got, want)
    assert np.array_equal(embed(np.stack([row, row]))[1], want)


@pytest.mark.parametrize("rows", [np.zeros((2, 32), dtype=np.int64), np.full((1, 33), 1025),
                                  np.zeros((1, 33), dtype=np.float32)], ids=["width", "range", "float"])
def test_embeddings_reject_bad_rows(weights, rows):
    with pytest.raises(InputError):
        DelayEmbeddings(weights)(rows)
