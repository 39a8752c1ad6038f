"""Load an official codec folder (``config.json`` and ``model.safetensors`` or ``pytorch_model.bin``). Keys pass through one visible table (``RENAMES``), weight-norm
pairs are folded into a plain ``weight`` as torch computes it, then the state dict loads strictly.
See docs/architecture.md#codec-weights.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Union

import torch

from moss_npu.codec.config import load_codec_config
from moss_npu.codec.model import NanoCodec
from moss_npu.codec.modules import MultiheadAttention
from moss_npu.errors import CheckpointError
from moss_npu.cpu.packed import PackedLinear, pack_linears
from moss_npu.device import backend

# (pattern, replacement) applied in order to every checkpoint key (official load-time pre-hooks).
RENAMES: tuple[tuple[str, str], ...] = (
    (r"\.weight_g$", ".parametrizations.weight.original0"),
    (r"\.weight_v$", ".parametrizations.weight.original1"),
    (r"\.self_attn\.in_proj_weight$", ".self_attn.in_proj.weight"),
    (r"\.self_attn\.in_projs\.0\.weight$", ".self_attn.in_proj.weight"),
    (r"\.self_attn\.out_projs\.0\.weight$", ".self_attn.out_proj.weight"),
    (r"\.linear1\.(weight|bias)$", r".ffn.0.\1"),
    (r"\.linear2\.(weight|bias)$", r".ffn.2.\1"),
)
WEIGHT_NORM_G = ".parametrizations.weight.original0"
WEIGHT_NORM_V = ".parametrizations.weight.original1"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def rename_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Apply ``RENAMES`` to every key."""
    out = {}
    for key, value in state.items():
        for pattern, replacement in RENAMES:
            key = re.sub(pattern, replacement, key)
        out[key] = value
    return out


def fold_weight_norm(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace each ``(g, v)`` weight-norm pair by ``weight = g * v / ||v||`` (norm over all but dim 0)."""
    out = {k: v for k, v in state.items() if not k.endswith((WEIGHT_NORM_G, WEIGHT_NORM_V))}
    for key in state:
        if key.endswith(WEIGHT_NORM_G):
            base = key[: -len(WEIGHT_NORM_G)]
            if base + WEIGHT_NORM_V not in state:
                raise CheckpointError(f"codec checkpoint: {key} has no matching {base + WEIGHT_NORM_V}; "
                                      "the weights file is incomplete, re-download it")
            g, v = state[key].float(), state[base + WEIGHT_NORM_V].float()
            # torch._weight_norm is what the official parametrization calls, so folded weights are bit-identical.
            out[base + ".weight"] = torch._weight_norm(v, g, 0)
        elif key.endswith(WEIGHT_NORM_V) and key[: -len(WEIGHT_NORM_V)] + WEIGHT_NORM_G not in state:
            raise CheckpointError(f"codec checkpoint: {key} has no matching weight-norm gain; re-download it")
    return out


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Read the folder's weights file into a CPU state dict."""
    for name in WEIGHT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file
                return load_file(str(path))
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # a corrupt or truncated file: name it and the fix
            raise CheckpointError(f"codec weights {path}: cannot read ({type(exc).__name__}: {exc}); "
                                  "re-download the codec folder") from exc
    raise CheckpointError(f"codec folder {folder}: no {' or '.join(WEIGHT_FILES)}; "
                          "pass the MOSS-Audio-Tokenizer-Nano folder")


def load_codec(codec_dir: Union[str, Path], *, device: Union[str, torch.device] = "cpu",
               dtype: torch.dtype = torch.float32, attention: str = "sdpa") -> NanoCodec:
    """Build a ``NanoCodec`` from an official codec folder on ``device``; ``dtype`` is the transformer stages' (the
    quantizer stays fp32, as in the official code), ``attention`` ``"sdpa"`` or ``"eager"``. CheckpointError for
    missing or unreadable weights and keys or shapes the config does not hold, ConfigError for a bad config.json."""
    folder = Path(codec_dir)
    if not folder.is_dir():
        raise CheckpointError(f"codec folder {folder}: not found; pass the MOSS-Audio-Tokenizer-Nano folder")
    config = load_codec_config(folder / "config.json")
    state = fold_weight_norm(rename_keys(read_weights(folder)))
    model = NanoCodec(config, attention=attention)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"codec weights in {folder} do not match config.json: missing {missing[:3]}"
                              f"{'...' if len(missing) > 3 else ''}, unexpected {unexpected[:3]}"
                              f"{'...' if len(unexpected) > 3 else ''}; use the matching codec folder")
    for key, tensor in expected.items():
        if tuple(state[key].shape) != tuple(tensor.shape):
            raise CheckpointError(f"codec weight {key}: shape {tuple(state[key].shape)} in {folder}, config.json "
                                  f"implies {tuple(tensor.shape)}; use the matching codec folder")
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    model.eval().to(device=torch.device(device))
    model.encoder.to(dtype=dtype)
    model.decoder.to(dtype=dtype)
    place = backend(torch.device(device))
    window = place.window_attention(dtype)
    for layer in model.decoder.modules():  # the streamed decode's attention (the encoder runs offline)
        if isinstance(layer, MultiheadAttention):
            layer.window = window
    if place.packs_linears(dtype):
        pack_linears(model)  # oneDNN-packed products: faster streamed and batched decodes (docs/performance.md)
        for layer in model.decoder.modules():  # packed now: every synthesis decodes (encoding: voice clones only)
            if isinstance(layer, PackedLinear):
                layer.pack()
    return model
