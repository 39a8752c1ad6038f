"""Builders for the Delay tests: a tiny weights folder in the MOSS-TTS-GGUF layout, the fixture, llama_cpp."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moss_npu.extras import LLAMA_INSTALL
from tests.optional import missing, require

SPECIAL_TOKENS = {
    "pad_token_id": "<|endoftext|>",
    "im_start_token_id": "<|im_start|>",
    "im_end_token_id": "<|im_end|>",
    "audio_start_token_id": "<|audio_start|>",
    "audio_end_token_id": "<|audio_end|>",
    "audio_user_slot_token_id": "<|audio_user_slot|>",
    "audio_assistant_gen_slot_token_id": "<|audio_assistant_gen_slot|>",
    "audio_assistant_delay_slot_token_id": "<|audio_assistant_delay_slot|>",
}
N_VQ, AUDIO_VOCAB, HIDDEN = 32, 1024, 8


def write_tokenizer(path: Path, with_specials: bool = True) -> dict[str, int]:
    """Write a word-level tokenizer.json; return the special ids it assigned (empty without specials)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "hello", "world", "user", "assistant", "None", "-", ":", "Text", "<", ">", "/"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if with_specials:
        tok.add_special_tokens(list(SPECIAL_TOKENS.values()))
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return {k: tok.token_to_id(v) for k, v in SPECIAL_TOKENS.items()} if with_specials else {}


def make_weights(root: Path, with_specials: bool = True, gguf: bool = True) -> Path:
    """Write a tiny weights folder (tables, heads, tokenizer, config.json, a placeholder .gguf)."""
    ids = write_tokenizer(root / "tokenizer" / "tokenizer.json", with_specials)
    if not ids:  # the config still needs ids; take ones the tokenizer does not hold as special tokens
        ids = {k: 1 + i for i, k in enumerate(SPECIAL_TOKENS)}
    vocab = 32
    rng = np.random.RandomState(0)
    (root / "embeddings").mkdir(parents=True, exist_ok=True)
    (root / "lm_heads").mkdir(parents=True, exist_ok=True)
    np.save(root / "embeddings" / "embed_tokens.npy", rng.randn(vocab, HIDDEN).astype(np.float16))
    np.save(root / "lm_heads" / "lm_head_text.npy", rng.randn(vocab, HIDDEN).astype(np.float16))
    for i in range(N_VQ):
        np.save(root / "embeddings" / f"emb_ext_{i:02d}.npy", rng.randn(AUDIO_VOCAB + 1, HIDDEN).astype(np.float16))
        np.save(root / "lm_heads" / f"lm_head_audio_{i:02d}.npy", rng.randn(AUDIO_VOCAB + 1, HIDDEN).astype(np.float16))
    config = {"n_vq": N_VQ, "audio_vocab_size": AUDIO_VOCAB, "audio_pad_code": AUDIO_VOCAB, "sampling_rate": 24000,
              "hidden_size": HIDDEN, "vocab_size": vocab, **ids,
              "language_config": {"hidden_size": HIDDEN, "vocab_size": vocab, "model_type": "qwen3"}}
    (root / "config.json").write_text(json.dumps(config), encoding="utf-8")
    if gguf:
        (root / "TINY.gguf").write_bytes(b"GGUF")
    return root


@pytest.fixture
def tiny_weights(tmp_path: Path) -> Path:
    return make_weights(tmp_path / "weights")


@pytest.fixture(scope="session")
def delay_fixture() -> Path:
    """The delay-tiny fixture folder; skip (fail in CI) when absent."""
    from moss_npu_verify.goldens import fixtures_root

    root = fixtures_root() / "delay-tiny"
    if not (root / "cases.json").is_file():
        missing(f"fixture {root} not found (set MOSS_NPU_FIXTURES)")
    return root


@pytest.fixture(scope="session")
def llama_cpp():
    """llama-cpp-python: required in CI (it installs it), skipped elsewhere when missing."""
    return require("llama_cpp", LLAMA_INSTALL)
