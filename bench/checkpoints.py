"""Random-weight checkpoints in the official format for the speed benchmark, made once and cached.

Speed does not depend on the weights' values, only on their shapes, so the bench writes the real configs
(``official_config_dict``: 12 × 768 global, 16 × 1024 codebooks; ``nano_codec_config``) with random weights.
Random weights would pick the stop token at frame 0, so two things are biased as in the nano-tiny fixture:
feature 0 of ``local_transformer.ln_f.bias`` is large and ``wte`` rows 9 (continue) / 7 (stop) point opposite
ways on it, so greedy decoding always continues to ``max_new_frames``. ``steer_to_continue`` applies the same
bias in memory to a checkpoint the user passes (``--force-frames``): bench only, the audio is then noise.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from moss_npu_verify import goldens
from moss_npu.nano.config import NanoConfig
from moss_npu_verify.random_checkpoints import (nano_codec_config, official_config_dict, random_state_dict,
                                                small_codec_overrides, write_random_checkpoint, write_random_codec)
from moss_npu.nano.model import NanoTTSModel

SIZES = ("real", "tiny")
# A small model with the real vocabulary (so the real tokenizer fits) for smoke tests of the bench itself.
TINY_MODEL = {"gpt2_config": {"n_embd": 64, "n_head": 4, "n_layer": 2, "n_inner": 128}}
STEER_BIAS = 20.0


def default_cache_dir() -> Path:
    """Return the folder for generated checkpoints: ``<system temp>/moss-npu-bench`` (outside the repo)."""
    return Path(tempfile.gettempdir()) / "moss-npu-bench"


def model_overrides(size: str) -> dict[str, Any]:
    """Return the config overrides of a bench model size (``real``: none)."""
    if size not in SIZES:
        raise ValueError(f"size {size!r}; use one of {SIZES}")
    return {} if size == "real" else TINY_MODEL


def codec_overrides(size: str) -> dict[str, Any]:
    """Return the codec config overrides of a bench size (``real``: none)."""
    return {} if size == "real" else small_codec_overrides()


def steer_to_continue(model: NanoTTSModel) -> NanoTTSModel:
    """Bias a loaded model in place so that greedy decoding never picks the stop token (bench only)."""
    with torch.no_grad():
        _steer(dict(model.named_parameters()), model.config)
    return model


def _steered_state(config: NanoConfig, seed: int) -> dict[str, torch.Tensor]:
    return _steer(random_state_dict(config, seed), config)


def _steer(state: dict[str, torch.Tensor], config: NanoConfig) -> dict[str, torch.Tensor]:
    """Steer ``state`` (a state dict, or a model's parameters by name) in place: see ``steer_to_continue``."""
    state["local_transformer.ln_f.bias"][0] = STEER_BIAS
    state["transformer.wte.weight"][config.audio_assistant_slot_token_id, 0] = 1.0
    state["transformer.wte.weight"][config.audio_end_token_id, 0] = -1.0
    return state


def steered_copy(folder: Path, work: Path) -> Path:
    """A copy of the official-format checkpoint ``folder`` in ``work``, steered as ``steer_to_continue`` steers a
    loaded model: for comparing implementations that load the folder themselves (the official code)."""
    from safetensors.torch import load_file, save_file

    out = work / f"steered-{folder.name}"
    shutil.copytree(folder, out)
    out.chmod(0o755)  # a read-only source folder (the fixtures) gives a read-only copy
    weights = out / "model.safetensors"
    config = NanoConfig.from_dict(json.loads((out / "config.json").read_text()))
    state = {k: v.clone() for k, v in load_file(str(weights)).items()}
    weights.chmod(0o644)
    save_file(_steer(state, config), str(weights), metadata={"format": "pt"})
    return out


def tokenizer_file(work: Path) -> Path:
    """Return the real ``tokenizer.model`` from the nano-tiny fixture, else a tiny one trained into ``work``."""
    real = goldens.fixtures_root() / "nano-tiny" / "tts" / "tokenizer.model"
    if real.is_file():
        return real
    import sentencepiece as spm

    symbols = ["<|im_start|>", "<|im_end|>", "<|audio_start|>", "<|audio_end|>", "<|vision_pad|>",
               "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|audio_pad|>", "<user_inst>", "</user_inst>"]
    corpus = ["Hello world, this is a small benchmark of a speech model.", "你好世界，欢迎使用。今天天气很好。",
              "- Reference(s): - Instruction: None - Tokens: - Quality: - Sound Event: - Ambient Sound:",
              "- Language: - Text: user assistant"] * 40
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=out, vocab_size=400, model_type="bpe", byte_fallback=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3, user_defined_symbols=symbols, normalization_rule_name="nmt_nfkc",
        character_coverage=1.0, minloglevel=2)
    path = work / "tokenizer.model"
    path.write_bytes(out.getvalue())
    return path


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


def _publish(build, final: Path) -> Path:
    """Build a folder next to ``final`` and rename it into place, so a killed run leaves no half-written cache."""
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=final.name + ".", dir=final.parent))
    try:
        build(work)
        os.replace(work, final)
    except OSError:
        if not (final / "config.json").is_file():  # not a lost race with another bench process
            raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def ensure_checkpoints(size: str = "real", cache_dir: Optional[Path] = None, seed: int = 0) -> tuple[Path, Path]:
    """Return (model folder, codec folder) of the bench checkpoints, writing them on first use."""
    cache_dir = default_cache_dir() if cache_dir is None else Path(cache_dir)
    overrides = model_overrides(size)
    model_dir = cache_dir / f"nano-{size}-{_key(official_config_dict(), overrides, seed, STEER_BIAS)}"
    codec_dir = cache_dir / f"codec-{size}-{_key(nano_codec_config(), codec_overrides(size), seed)}"

    def build_model(work: Path) -> None:
        data = official_config_dict()
        for key, value in overrides.items():  # one level deep is all the bench sizes use
            data[key] = {**data[key], **value} if isinstance(value, dict) else value
        spm_dir = work / "spm"
        spm_dir.mkdir()
        write_random_checkpoint(work, overrides, seed=seed, state=_steered_state(NanoConfig.from_dict(data), seed),
                                tokenizer_model=tokenizer_file(spm_dir))
        shutil.rmtree(spm_dir)

    _publish(build_model, model_dir)
    _publish(lambda work: write_random_codec(work, codec_overrides(size), seed=seed), codec_dir)
    return model_dir, codec_dir
