"""Builders for the nano tests: a tiny SentencePiece tokenizer trained on the spot and tiny random checkpoints.

The tokenizer has the official id layout (0-3 <unk> <s> </s> <pad>, 4-14 the chat/audio symbols, byte fallback),
so prompts build exactly as with the real one, only with other text ids. Training it takes ~30 ms.
"""

import io
from pathlib import Path

import pytest
import sentencepiece as spm

from moss_npu_verify import goldens
from moss_npu_verify.random_checkpoints import write_random_checkpoint
from tests.optional import missing

SYMBOLS = ["<|im_start|>", "<|im_end|>", "<|audio_start|>", "<|audio_end|>", "<|vision_pad|>", "<|video_pad|>",
           "<|vision_start|>", "<|vision_end|>", "<|audio_pad|>", "<user_inst>", "</user_inst>"]
CORPUS = ["Hello world, this is a tiny test of the tokenizer.", "The quick brown fox jumps over the lazy dog.",
          "- Reference(s): - Instruction: None - Tokens: - Quality: - Sound Event: - Ambient Sound:",
          "- Language: - Text: user assistant", "你好世界，欢迎使用。数字 123"] * 40

# A small model: 2 global layers of width 32, 4 channels of 64 codes.
TINY = {
    "n_vq": 4,
    "audio_vocab_size": 64,
    "audio_codebook_sizes": [64] * 4,
    "audio_pad_token_id": 64,
    "gpt2_config": {"n_embd": 32, "n_head": 2, "n_layer": 2, "n_inner": 64, "vocab_size": 512},
}


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory) -> Path:
    """Path of a freshly trained tiny tokenizer.model."""
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=out, vocab_size=400, model_type="bpe", byte_fallback=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3, user_defined_symbols=SYMBOLS, normalization_rule_name="nmt_nfkc",
        character_coverage=1.0, minloglevel=2)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.model"
    path.write_bytes(out.getvalue())
    return path


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory, tiny_tokenizer) -> Path:
    """A tiny random checkpoint folder (safetensors, fp32, heads stored once)."""
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny"), TINY, seed=1, tokenizer_model=tiny_tokenizer)


@pytest.fixture(scope="session")
def nano_fixture() -> Path:
    """The nano-tiny golden fixture folder, or skip."""
    root = goldens.fixtures_root() / "nano-tiny"
    if not (root / "tts" / "config.json").is_file():
        missing(f"nano-tiny fixture not found under {goldens.fixtures_root()}; set MOSS_NPU_FIXTURES")
    return root
