"""Random checkpoints in the official on-disk layouts, for tests and benchmarks: a MOSS-TTS-Nano model folder
(``write_random_checkpoint``) and a MOSS-Audio-Tokenizer-Nano codec folder (``write_random_codec``), each from the
real config (``official_config_dict``, ``nano_codec_config``) with overrides. The runtime never writes weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch

from moss_npu.codec.checkpoint import WEIGHT_NORM_G, WEIGHT_NORM_V
from moss_npu.codec.config import codec_config_from_dict
from moss_npu.codec.model import NanoCodec
from moss_npu.nano.checkpoint import tied_keys
from moss_npu.nano.config import NanoConfig
from moss_npu.nano.model import NanoTTSModel


def official_config_dict() -> dict[str, Any]:
    """Return the real MOSS-TTS-Nano config (12 × 768 global, 1 local layer, 16 × 1024 codebooks)."""
    return {
        "architectures": ["MossTTSNanoForCausalLM"],
        "model_type": "moss_tts_nano",
        "n_vq": 16,
        "audio_vocab_size": 1024,
        "audio_codebook_sizes": [1024] * 16,
        "audio_pad_token_id": 1024,
        "pad_token_id": 3,
        "im_start_token_id": 4,
        "im_end_token_id": 5,
        "audio_start_token_id": 6,
        "audio_end_token_id": 7,
        "audio_user_slot_token_id": 8,
        "audio_assistant_slot_token_id": 9,
        "attn_implementation": "flash_attention_2",
        "local_transformer_attn_implementation": "flash_attention_2",
        "local_transformer_layers": 1,
        "model_architecture": "global_local_transformer",
        "audio_tokenizer_type": "moss-audio-tokenizer-nano",
        "audio_tokenizer_pretrained_name_or_path": "OpenMOSS-Team/MOSS-Audio-Tokenizer-Nano",
        "audio_tokenizer_sample_rate": 48000,
        "tokenizer_class": "MossTTSNanoSentencePieceTokenizer",
        "tokenizer_use_fast": False,
        "initializer_range": 0.02,
        "dtype": "float32",
        "gpt2_config": {
            "model_type": "gpt2",
            "n_embd": 768,
            "n_head": 12,
            "n_layer": 12,
            "n_inner": 3072,
            "n_positions": 32768,
            "n_ctx": 32768,
            "vocab_size": 16384,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5,
            "position_embedding_type": "rope",
            "rope_base": 10000.0,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "attn_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "resid_pdrop": 0.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 3,
            "initializer_range": 0.02,
            "tie_word_embeddings": True,
        },
    }


def _merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in overrides.items():
        out[key] = _merge(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), dict) else value
    return out


def random_state_dict(config: NanoConfig, seed: int = 0, std: Optional[float] = None) -> dict[str, torch.Tensor]:
    """Return random fp32 weights with the unique official keys (normal(0, std), norms 1/0)."""
    std = config.gpt2_config.initializer_range if std is None else std
    model = NanoTTSModel(config)
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for key, p in model.state_dict().items():
        if key in tied_keys(config):
            continue
        if ".ln_" in key or key.endswith("ln_f.weight") or key.endswith("ln_f.bias"):
            fill = 1.0 if key.endswith("weight") else 0.0
            state[key] = torch.full(p.shape, fill)
        elif key.endswith(".bias"):
            state[key] = torch.zeros(p.shape)
        else:
            state[key] = torch.randn(p.shape, generator=gen) * std
    return state


def write_random_checkpoint(
    folder: Path | str,
    config_overrides: Optional[Mapping[str, Any]] = None,
    *,
    seed: int = 0,
    fmt: str = "safetensors",
    dtype: torch.dtype = torch.float32,
    tied_copies: bool = False,
    stray_local_wte: bool = False,
    tokenizer_model: Optional[Path | str] = None,
    state: Optional[Mapping[str, torch.Tensor]] = None,
) -> Path:
    """Write an official-format model folder with random (or given) weights; return the folder.

    The config is the real MOSS-TTS-Nano one (12 × 768, 16 × 1024 codebooks) updated with ``config_overrides``
    (nested dicts merge, e.g. ``{"gpt2_config": {"n_layer": 2}}``). ``fmt`` is "safetensors" or "bin";
    ``tied_copies`` also stores the head aliases, ``stray_local_wte`` adds the key upstream ignores, as the
    official release file does. ``tokenizer_model`` is copied in as ``tokenizer.model`` when given.
    """
    if fmt not in ("safetensors", "bin"):
        raise ValueError(f"fmt={fmt!r}; use 'safetensors' or 'bin'")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = _merge(official_config_dict(), config_overrides or {})
    config = NanoConfig.from_dict(data)
    (folder / "config.json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    weights = dict(random_state_dict(config, seed) if state is None else state)
    weights = {k: v.to(dtype).contiguous() for k, v in weights.items()}
    if tied_copies:
        for alias, source in tied_keys(config).items():
            weights[alias] = weights[source].clone()
    if stray_local_wte:
        weights["local_transformer.wte.weight"] = weights["transformer.wte.weight"].clone()
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(weights, str(folder / "model.safetensors"))
    else:
        torch.save(weights, str(folder / "pytorch_model.bin"))
    if tokenizer_model is not None:
        shutil.copyfile(tokenizer_model, folder / "tokenizer.model")
    return folder


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
