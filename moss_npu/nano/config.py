"""Model config of MOSS-TTS-Nano, read from the official ``config.json`` (docs/architecture.md#config).

Field names are the official ones, including the nested ``gpt2_config``. Keys the model does not use are kept in
``extra`` and never consulted. ``attn_implementation`` in the file (often ``flash_attention_2``) is recorded but
ignored: the attention function is chosen by the caller of ``load_model``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Optional

from moss_npu.errors import ConfigError

# Activation names of GPT2Config that this decoder implements (the official model uses "gelu_new").
ACTIVATIONS = ("gelu_new", "gelu", "relu", "silu")


@dataclass(frozen=True)
class GPT2Config:
    """The nested ``gpt2_config`` (a transformers GPT2Config plus ``position_embedding_type``/``rope_base``).

    Defaults are GPT2Config's own, used only when a key is absent from the file.
    """

    n_embd: int = 768
    n_head: int = 12
    n_layer: int = 12
    n_inner: Optional[int] = None
    n_positions: int = 1024
    n_ctx: Optional[int] = None
    vocab_size: int = 50257
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    position_embedding_type: str = "absolute"
    rope_base: float = 10000.0
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    initializer_range: float = 0.02
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ConfigError(f"gpt2_config: n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                              "fix config.json")
        if self.head_dim % 2 != 0:
            raise ConfigError(f"gpt2_config: head dim {self.head_dim} must be even for RoPE; fix config.json")
        if self.position_embedding_type != "rope":
            raise ConfigError(f"gpt2_config.position_embedding_type={self.position_embedding_type!r}: only 'rope' "
                              "(MOSS-TTS-Nano) is supported; use an official MOSS-TTS-Nano config.json")
        if self.activation_function not in ACTIVATIONS:
            raise ConfigError(f"gpt2_config.activation_function={self.activation_function!r} is not supported; "
                              f"use one of {list(ACTIVATIONS)}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def inner_size(self) -> int:
        return self.n_inner or 4 * self.n_embd


@dataclass(frozen=True)
class NanoConfig:
    """Top-level ``MossTTSNanoConfig``; defaults are the official constructor's, used only if absent."""

    gpt2_config: GPT2Config = field(default_factory=GPT2Config)
    n_vq: int = 8
    audio_vocab_size: Optional[int] = 1024
    audio_codebook_sizes: Optional[tuple[int, ...]] = None
    audio_pad_token_id: int = 1024
    pad_token_id: int = 151643
    im_start_token_id: int = 151644
    im_end_token_id: int = 151645
    audio_start_token_id: int = 151652
    audio_end_token_id: int = 151653
    audio_user_slot_token_id: int = 151654
    audio_assistant_slot_token_id: int = 151656
    tokenizer_use_fast: bool = False
    audio_tokenizer_type: str = "moss-audio-tokenizer-nano"
    audio_tokenizer_pretrained_name_or_path: Optional[str] = "OpenMOSS-Team/MOSS-Audio-Tokenizer-Nano"
    audio_tokenizer_sample_rate: int = 48000
    attn_implementation: str = "flash_attention_2"  # recorded, never consulted
    initializer_range: float = 0.02
    model_architecture: str = "global_local_transformer"
    local_transformer_layers: int = 4
    local_transformer_attn_implementation: Optional[str] = None  # recorded, never consulted
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        # The same checks, in the same order, as the official constructor.
        if self.audio_codebook_sizes is None:
            if self.audio_vocab_size is None:
                raise ConfigError("config.json: audio_vocab_size must be set when audio_codebook_sizes is absent")
            sizes = (int(self.audio_vocab_size),) * int(self.n_vq)
        else:
            sizes = tuple(int(s) for s in self.audio_codebook_sizes)
        object.__setattr__(self, "audio_codebook_sizes", sizes)
        if len(sizes) != self.n_vq:
            raise ConfigError(f"config.json: audio_codebook_sizes has {len(sizes)} entries but n_vq={self.n_vq}; "
                              "they must match")
        if any(s <= 0 for s in sizes):
            raise ConfigError(f"config.json: audio_codebook_sizes={list(sizes)} must all be positive")
        if self.audio_vocab_size is not None and int(self.audio_vocab_size) < max(sizes):
            raise ConfigError(f"config.json: audio_vocab_size={self.audio_vocab_size} is below the largest "
                              f"codebook {max(sizes)}; it must be >= max(audio_codebook_sizes)")
        if self.audio_vocab_size is None:
            object.__setattr__(self, "audio_vocab_size", max(sizes))
        if self.audio_pad_token_id < max(sizes):
            raise ConfigError(f"config.json: audio_pad_token_id={self.audio_pad_token_id} lies inside a codebook "
                              f"(max size {max(sizes)}); it must be >= max(audio_codebook_sizes)")
        if self.local_transformer_layers < 1:
            raise ConfigError(f"config.json: local_transformer_layers={self.local_transformer_layers} must be >= 1")
        if self.audio_tokenizer_type != "moss-audio-tokenizer-nano":
            raise ConfigError(f"config.json: audio_tokenizer_type={self.audio_tokenizer_type!r}; the only "
                              "accepted value is 'moss-audio-tokenizer-nano'")

    @property
    def hidden_size(self) -> int:
        return self.gpt2_config.n_embd

    @property
    def vocab_size(self) -> int:
        return self.gpt2_config.vocab_size

    @property
    def row_width(self) -> int:
        """Integers per global row: one text id plus one code per channel (docs/architecture.md#rows)."""
        return self.n_vq + 1

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "NanoConfig":
        """Build from a parsed official ``config.json``; unknown keys go to ``extra``."""
        data = dict(data)
        gpt2 = data.pop("gpt2_config", None) or {}
        if not isinstance(gpt2, Mapping):
            raise ConfigError(f"config.json: gpt2_config must be an object, got {type(gpt2).__name__}")
        return _build(cls, data, gpt2_config=_build(GPT2Config, gpt2))


def _split(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """Split a dict into dataclass fields and ``extra``."""
    names = {f.name for f in fields(cls)} - {"extra", "gpt2_config"}
    known = {k: v for k, v in data.items() if k in names}
    known["extra"] = {k: v for k, v in data.items() if k not in names}
    return known


def _build(cls: type, data: Mapping[str, Any], **parts: Any):
    try:
        return cls(**_split(cls, data), **parts)
    except (TypeError, ValueError) as exc:  # a value of the wrong type in the file
        raise ConfigError(f"config.json: {exc}; fix the file") from exc


def load_config(path: Path | str) -> NanoConfig:
    """Read ``config.json`` from a model folder (or the file itself)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: config.json not found; pass an official MOSS-TTS-Nano model folder")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc}); re-download the checkpoint") from exc
    return NanoConfig.from_dict(data)
