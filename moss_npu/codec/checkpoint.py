"""Load an official codec folder (``config.json`` and ``model.safetensors`` or ``pytorch_model.bin``), and write
random official-format ones for tests and benchmarks. Keys pass through one visible table (``RENAMES``), weight-norm
pairs are folded into a plain ``weight`` as torch computes it, then the state dict loads strictly.
See docs/architecture.md#codec-weights.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional, Union

import torch

from moss_npu.codec.config import codec_config_from_dict, load_codec_config
from moss_npu.codec.model import NanoCodec
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
    quantizer stays fp32, as in the official code), ``attention`` ``"sdpa"`` or ``"eager"``.

    Raises:
        CheckpointError: missing/unreadable weights, or keys/shapes that do not match the config.
        ConfigError: an invalid ``config.json``.
    """
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
    if backend(torch.device(device)).packs_linears(dtype):
        pack_linears(model)  # oneDNN-packed products: faster streamed and batched decodes (docs/performance.md)
        for layer in model.decoder.modules():  # packed now: every synthesis decodes (encoding: voice clones only)
            if isinstance(layer, PackedLinear):
                layer.pack()
    return model


def nano_codec_config() -> dict[str, Any]:
    """Return the real MOSS-Audio-Tokenizer-Nano ``config.json`` contents (docs/architecture.md#codec-config)."""
    def transformer(d_in: int, d_out: int, layers: int, context_s: float) -> dict[str, Any]:
        return {"module_type": "Transformer", "input_dimension": d_in, "output_dimension": d_out, "d_model": 256,
                "num_heads": 4, "num_layers": layers, "dim_feedforward": 1024, "causal": True, "conv_layout": True,
                "context_duration": context_s, "gating": "none", "norm": "layer_norm", "layer_scale": 0.01,
                "positional_embedding": "rope", "max_period": 10000}

    def patch(size: int) -> dict[str, Any]:
        return {"module_type": "PatchedPretransform", "patch_size": size}

    return {
        "architectures": ["MossAudioTokenizerModel"], "model_type": "moss-audio-tokenizer",
        "sample_rate": 48000, "sampling_rate": 48000, "downsample_rate": 3840,
        "causal_transformer_context_duration": 10.0, "number_channels": 2, "enable_channel_interleave": True,
        "attention_implementation": "sdpa", "compute_dtype": "fp32", "dtype": "float32", "code_dim": 768,
        "quantizer_type": "rlfq",
        "quantizer_kwargs": {"input_dim": 768, "rvq_dim": 512, "output_dim": 768, "num_quantizers": 16,
                             "codebook_size": 1024, "codebook_dim": 8, "quantizer_type": "rlfq",
                             "quantizer_dropout": 1.0, "codebook_loss_weight": 1.0, "commitment_loss_weight": 0.25},
        "encoder_kwargs": [patch(240), transformer(240, 384, 4, 4.0), patch(2), transformer(768, 384, 2, 6.0),
                           patch(2), transformer(768, 384, 2, 8.0), patch(2), transformer(768, 192, 4, 10.0),
                           patch(4)],
        "decoder_kwargs": [patch(4), transformer(192, 768, 4, 10.0), patch(2), transformer(384, 768, 2, 8.0),
                           patch(2), transformer(384, 768, 2, 6.0), patch(2), transformer(384, 240, 4, 4.0),
                           patch(240)],
    }


def small_codec_overrides(*, d_model: int = 32, context_scale: float = 1.0) -> dict[str, Any]:
    """Config overrides for a tiny codec with the real patch layout (48 kHz stereo, 16 x 1024 codes): widths
    ``d_model``, 2 heads, 1 layer per stage, windows scaled by ``context_scale`` (small: short streams outgrow them)."""
    raw = nano_codec_config()
    small = {"d_model": d_model, "num_heads": 2, "num_layers": 1, "dim_feedforward": 2 * d_model}
    code_dim, rvq_dim = d_model, d_model // 2
    encoder, decoder = [], []
    enc_io = [(240, rvq_dim), (2 * rvq_dim, rvq_dim), (2 * rvq_dim, rvq_dim), (2 * rvq_dim, code_dim // 4)]
    dec_io = [(code_dim // 4, d_model), (d_model // 2, d_model), (d_model // 2, d_model), (d_model // 2, 240)]
    for stages, out, dims in ((raw["encoder_kwargs"], encoder, enc_io), (raw["decoder_kwargs"], decoder, dec_io)):
        it = iter(dims)
        for stage in stages:
            stage = dict(stage)
            if stage["module_type"] == "Transformer":
                stage.update(small)
                stage["input_dimension"], stage["output_dimension"] = next(it)
                stage["context_duration"] = stage["context_duration"] * context_scale
            out.append(stage)
    quantizer = dict(raw["quantizer_kwargs"], input_dim=code_dim, rvq_dim=rvq_dim, output_dim=code_dim)
    return {"encoder_kwargs": encoder, "decoder_kwargs": decoder, "quantizer_kwargs": quantizer, "code_dim": code_dim}


def _weight_norm_split(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write a conv weight as (g, v) such that folding gives it back (up to rounding)."""
    g = torch.linalg.vector_norm(weight.reshape(weight.shape[0], -1), dim=1).reshape(-1, 1, 1)
    return g, weight.clone()


def write_random_codec(folder: Union[str, Path], config_overrides: Optional[dict[str, Any]] = None, *,
                       seed: int = 0, legacy_weight_norm_keys: bool = False) -> Path:
    """Write a random codec in the official on-disk format: the real config updated with ``config_overrides``
    (top-level keys), weight-normed convs stored as ``parametrizations.weight.original0/1`` (or, with
    ``legacy_weight_norm_keys``, ``weight_g``/``weight_v``)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    raw = nano_codec_config()
    raw.update(config_overrides or {})
    generator = torch.Generator().manual_seed(seed)
    model = NanoCodec(codec_config_from_dict(raw))
    state = {}
    for key, tensor in model.state_dict().items():
        if key.endswith("scale"):  # LayerScale: official init value order of magnitude, made random
            value = 0.1 + 0.05 * torch.rand(tensor.shape, generator=generator)
        elif ".norm" in key:
            value = (1.0 if key.endswith("weight") else 0.0) + 0.05 * torch.randn(tensor.shape, generator=generator)
        else:
            fan_in = tensor[0].numel() if tensor.dim() > 1 else 0
            value = torch.randn(tensor.shape, generator=generator) * (fan_in ** -0.5 if fan_in else 0.02)
        if key.startswith("quantizer.") and key.endswith(".weight") and tensor.dim() == 3:
            g, v = _weight_norm_split(value)
            base = key[: -len(".weight")]
            g_key, v_key = ((base + ".weight_g", base + ".weight_v") if legacy_weight_norm_keys
                            else (base + WEIGHT_NORM_G, base + WEIGHT_NORM_V))
            state[g_key], state[v_key] = g.contiguous(), v.contiguous()
        else:
            state[key] = value.contiguous()
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return folder
