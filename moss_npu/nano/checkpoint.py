"""Load official-format MOSS-TTS-Nano checkpoints (docs/architecture.md#checkpoints).

A model folder holds ``config.json``, ``model.safetensors`` or ``pytorch_model.bin`` and ``tokenizer.model``.
Files differ in their dtype and in which tied copies and stray keys they store; the tables below say what
happens to those, and everything else must match the model exactly (strict load).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Mapping

import torch

from moss_npu.errors import CheckpointError
from moss_npu.nano.config import NanoConfig, load_config
from moss_npu.nano.model import NanoTTSModel
from moss_npu.origin import stamp_origin

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")

# Keys a file may hold that the model does not use (upstream `_keys_to_ignore_on_load_unexpected`).
IGNORED_KEYS = ("local_transformer.wte.weight",)
SAMPLED_BYTES = 1 << 20  # checkpoint_identity hashes this much of the weights file's start and of its end


def tied_keys(config: NanoConfig) -> dict[str, str]:
    """Return alias → source of the tied heads; a file may store the alias, the source or both (same tensor)."""
    table = {"text_lm_head.weight": "transformer.wte.weight"}
    table.update({f"audio_lm_heads.{k}.weight": f"audio_embeddings.{k}.weight" for k in range(config.n_vq)})
    return table


def weights_file(model_dir: Path) -> Path:
    """Return the weights file of a folder (safetensors preferred)."""
    for name in WEIGHT_FILES:
        if (model_dir / name).is_file():
            return model_dir / name
    raise CheckpointError(f"{model_dir}: no {' or '.join(WEIGHT_FILES)} found; pass an official MOSS-TTS-Nano "
                          "model folder")


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Read every tensor of a ``.safetensors`` or ``.bin`` file onto the CPU, as stored."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return dict(load_file(str(path), device="cpu"))
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupt or truncated file: the user must re-download it
        raise CheckpointError(f"{path}: cannot read weights ({type(exc).__name__}: {exc}); re-download it") from exc
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: not a flat state dict of tensors; save the model's state_dict()")
    return dict(state)


def resolve_state_dict(state: Mapping[str, torch.Tensor], config: NanoConfig) -> dict[str, torch.Tensor]:
    """Drop ignored keys and resolve tied copies so the result has exactly one tensor per unique parameter."""
    out = {k: v for k, v in state.items() if k not in IGNORED_KEYS}
    for alias, source in tied_keys(config).items():
        stored = out.pop(alias, None)
        if source not in out and stored is not None:
            out[source] = stored  # only the alias was stored: it is the shared weight
    return out


def load_model(
    model_dir: Path | str,
    *,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    attn_impl: str = "sdpa",
) -> NanoTTSModel:
    """Build the model from a folder's ``config.json`` and weights, cast to ``dtype``; return it in eval mode on
    ``device``. ``attn_impl`` ("sdpa" or "eager") applies to both decoders (the config's is ignored).
    CheckpointError for missing, unreadable or mismatched weights, ConfigError for an invalid config.json."""
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    identity = checkpoint_identity(model_dir)
    state = resolve_state_dict(read_state_dict(weights_file(model_dir)), config)
    model = NanoTTSModel(config, attn_impl=attn_impl)
    expected = {k for k in model.state_dict() if k not in tied_keys(config)}
    missing, unknown = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unknown:
        raise CheckpointError(f"{weights_file(model_dir)}: weights do not match config.json (missing: "
                              f"{_names(missing)}; unknown: {_names(unknown)}); use the config.json that came with "
                              "these weights")
    params = model.state_dict()
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(params[key].shape):
            raise CheckpointError(f"{key}: stored shape {tuple(tensor.shape)} but config.json implies "
                                  f"{tuple(params[key].shape)}; use the config.json that came with these weights")
        if not tensor.dtype.is_floating_point:
            raise CheckpointError(f"{key}: stored dtype {tensor.dtype} is not floating point; re-export the weights")
    for alias, source in tied_keys(config).items():
        state[alias] = state[source]
    model.load_state_dict(state, strict=True)
    # Cast after loading: the RoPE buffer follows the dtype, as upstream's model.to(dtype) does.
    model = model.to(device=torch.device(device), dtype=dtype).eval().requires_grad_(False)
    if checkpoint_identity(model_dir) == identity:  # else the folder changed while it was read: no origin
        stamp_origin(model, f"{identity}:{dtype}")
    return model


def checkpoint_identity(model_dir: Path) -> str:
    """Return a name for the content of a model folder's weights and config without reading the weights whole:
    the weights file's size, inode, device, modification and change times in nanoseconds, and a SHA-256 of its
    first and last MiB and of ``config.json``. Why that is safe: docs/performance.md#start-up.
    """
    path = weights_file(model_dir).resolve()
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as weights:
            info = os.fstat(weights.fileno())
            digest.update(weights.read(SAMPLED_BYTES))
            weights.seek(max(info.st_size - SAMPLED_BYTES, 0))
            digest.update(weights.read(SAMPLED_BYTES))
        digest.update((model_dir / "config.json").read_bytes())
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read weights ({type(exc).__name__}: {exc}); re-download it") from exc
    stamp = (info.st_size, info.st_ino, info.st_dev, info.st_mtime_ns, info.st_ctime_ns)
    return f"{':'.join(map(str, stamp))}:{digest.hexdigest()}"


def _names(keys: list[str], limit: int = 8) -> str:
    if not keys:
        return "none"
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more
