"""Configs of the Delay backend: ``DelayModelConfig``, the model's special ids and sizes from the weights folder's
``config.json`` (docs/delay.md#special-ids), and ``DelayRunConfig``, the run values a ``configs/llama_cpp/*.yaml``
preset may set (docs/delay.md#presets), merged defaults < preset < overrides by ``load_run_config``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Optional

from moss_npu.errors import CheckpointError, ConfigError, InputError, MossNpuError
from moss_npu.hub import download_command
from moss_npu.presets import check_types, read_yaml_mapping
from moss_npu.sampling_params import VALUES, SamplingParams, sampling_fields

# The KV cache types and flash attention modes, with llama.cpp's numbers for them (ggml_type, llama_flash_attn_type).
KV_CACHE_TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q5_1": 7, "q5_0": 6, "q4_1": 3, "q4_0": 2}
FLASH_ATTN_MODES = {"auto": -1, "enabled": 1, "disabled": 0}
HEADS_BACKENDS = ("auto", "numpy", "torch")
AUDIO_BACKENDS = ("onnx",)


@dataclass(frozen=True)
class DelayModelConfig:
    """Sizes and special ids (the ``*_token_id`` fields) of a MOSS-TTS Delay checkpoint (names as in its
    ``config.json``)."""

    pad_token_id: int
    im_start_token_id: int
    im_end_token_id: int
    audio_start_token_id: int
    audio_end_token_id: int
    audio_user_slot_token_id: int
    audio_assistant_gen_slot_token_id: int
    audio_assistant_delay_slot_token_id: int
    n_vq: int = 32
    audio_vocab_size: int = 1024
    audio_pad_code: int = 1024
    sampling_rate: int = 24000
    hidden_size: Optional[int] = None

    def __post_init__(self) -> None:
        if self.n_vq < 1 or self.audio_vocab_size < 1:
            raise CheckpointError(f"config.json: n_vq={self.n_vq}, audio_vocab_size={self.audio_vocab_size}; both "
                                  "must be >= 1")
        if self.audio_pad_code != self.audio_vocab_size:  # the tables' last row (audio_vocab_size + 1 rows) is the pad
            raise CheckpointError(f"config.json: audio_pad_code={self.audio_pad_code} but audio_vocab_size="
                                  f"{self.audio_vocab_size}; the pad code must be the row after the last real code")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str) -> "DelayModelConfig":
        """Build from a MOSS config dict; ``source`` names the file in errors."""
        missing = [key for key in SPECIAL_ID_KEYS if not isinstance(data.get(key), int)]
        if missing:
            raise CheckpointError(f"{source}: special ids missing or not integers: {', '.join(missing)}; use the "
                                  "config.json of the MOSS-TTS checkpoint the weights were converted from")
        lang = data.get("language_config") or {}
        known = {f.name for f in fields(cls)}
        values = {k: data[k] for k in known if k in data and data[k] is not None}
        values.setdefault("audio_pad_code", values.get("audio_vocab_size", cls.audio_vocab_size))
        values.setdefault("hidden_size", lang.get("hidden_size"))
        return cls(**values)

    @classmethod
    def from_weights_dir(cls, weights_dir: Path) -> "DelayModelConfig":
        """Read ``config.json`` (else ``extraction_meta.json`` -> ``moss_config``) from a weights folder."""
        config_path = weights_dir / "config.json"
        meta_path = weights_dir / "extraction_meta.json"
        if config_path.is_file():
            return cls.from_dict(_read_json(config_path), str(config_path))
        if meta_path.is_file():
            meta = _read_json(meta_path)
            if isinstance(meta.get("moss_config"), dict):
                return cls.from_dict(meta["moss_config"], f"{meta_path} (moss_config)")
        fetch = download_command("OpenMOSS-Team/MOSS-TTS", str(weights_dir), ["config.json"])
        raise CheckpointError(f"{weights_dir}: no config.json with the special token ids; copy config.json of the "
                              f"MOSS-TTS checkpoint into it (e.g. `{fetch}`)")


SPECIAL_ID_KEYS = tuple(f.name for f in fields(DelayModelConfig) if f.name.endswith("_token_id"))


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read JSON ({exc}); restore the file from the download") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


@dataclass(frozen=True)
class DelayRunConfig(sampling_fields(SamplingParams())):
    """Run values of the llama.cpp backend; a YAML preset may set any of these keys. The sampling values
    (``moss_npu.sampling_params``, at upstream's defaults; a temperature of 0 is greedy) come first."""

    backbone_gguf: Optional[str] = None  # file name inside the weights folder; None = its only .gguf
    n_gpu_layers: int = -1
    device_index: Optional[int] = None  # accelerator number for llama.cpp (main_gpu) and ONNX (device_id); None = theirs
    n_ctx: int = 4096
    n_batch: int = 512
    n_threads: int = 4
    kv_cache_type_k: str = "f16"
    kv_cache_type_v: str = "f16"
    flash_attn: str = "auto"
    heads_backend: str = "auto"
    heads_device: str = "auto"
    audio_backend: str = "onnx"
    audio_provider: str = "auto"  # auto or a device kind; checked against onnxruntime by the codec
    max_new_tokens: int = 3072
    verbose: bool = False

    def __post_init__(self) -> None:
        choices = {
            "kv_cache_type_k": KV_CACHE_TYPES,
            "kv_cache_type_v": KV_CACHE_TYPES,
            "flash_attn": FLASH_ATTN_MODES,
            "heads_backend": HEADS_BACKENDS,
            "audio_backend": AUDIO_BACKENDS,
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in tuple(allowed):  # a tuple: an unhashable value is refused too
                raise ConfigError(f"{key}={getattr(self, key)!r}: not one of {', '.join(allowed)}")
        for key in ("n_ctx", "n_batch", "n_threads", "max_new_tokens"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ConfigError(f"{key}={getattr(self, key)!r}: must be an integer >= 1")
        if self.device_index is not None and (not isinstance(self.device_index, int) or self.device_index < 0):
            raise ConfigError(f"device_index={self.device_index!r}: use null (the runtimes' default) or a number >= 0")
        if not isinstance(self.n_gpu_layers, int) or self.n_gpu_layers < -1:
            raise ConfigError(f"n_gpu_layers={self.n_gpu_layers!r}: use -1 (all), 0 (CPU) or a layer count")
        try:
            self.sampling  # the ranges of moss_npu.sampling_params
        except InputError as exc:
            raise ConfigError(str(exc)) from None

    @property
    def sampling(self) -> SamplingParams:
        """Return the sampling parameters as their own value object."""
        return SamplingParams(**{name: getattr(self, name) for name in VALUES})


def load_run_config(path: Optional[Path | str] = None, overrides: Optional[Mapping[str, Any]] = None) -> DelayRunConfig:
    """Merge defaults < YAML preset at ``path`` < ``overrides`` (keys whose value is None are not set). ``ConfigError``
    for a file unreadable or not a mapping, a value out of range (even one ``overrides`` replaces), unknown keys."""
    values: dict[str, Any] = {}
    if path is not None:
        data = read_yaml_mapping(path)
        _reject_unknown(data, str(path))
        check_types(data, DelayRunConfig, f"--config {path}")
        try:
            DelayRunConfig(**data)  # the preset alone must be valid, even where an override replaces a value
        except MossNpuError as exc:
            raise ConfigError(f"--config {path}: {exc}") from None
        values.update(data)
    if overrides:
        given = {k: v for k, v in overrides.items() if v is not None}
        _reject_unknown(given, "overrides")
        values.update(given)
    return DelayRunConfig(**values)


def _reject_unknown(data: Mapping[str, Any], source: str) -> None:
    known = {f.name for f in fields(DelayRunConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{source}: unknown keys {', '.join(unknown)}; known keys are {', '.join(sorted(known))}")
