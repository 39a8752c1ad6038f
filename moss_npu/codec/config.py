"""Codec model config: the official MOSS-Audio-Tokenizer-Nano ``config.json`` as frozen dataclasses, under the
official keys. The per-stage attention windows are derived from it (stream rate x ``context_duration``), never
hard-coded, so a shrunk fixture gets what its config implies. See docs/architecture.md#codec-config.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from moss_npu.errors import ConfigError

PATCH = "PatchedPretransform"
TRANSFORMER = "Transformer"
SUPPORTED_QUANTIZERS = ("rlfq", "random_prefix_rlfq")


@dataclass(frozen=True)
class PatchStage:
    """A parameter-free reshape between time and channels (patch on encode, unpatch on decode)."""

    patch_size: int
    module_type: str = PATCH

    @property
    def ratio(self) -> int:
        """How much this stage divides (encoder) or multiplies (decoder) the stream rate."""
        return self.patch_size


@dataclass(frozen=True)
class TransformerStage:
    """A projected causal transformer stage (``MossAudioTokenizerProjectedTransformer``)."""

    input_dimension: int
    output_dimension: int
    d_model: int
    num_heads: int
    num_layers: int
    dim_feedforward: int
    context_duration: float
    causal: bool = True
    layer_scale: Optional[float] = None
    max_period: float = 10000.0
    norm: str = "layer_norm"
    positional_embedding: str = "rope"
    gating: str = "none"
    conv_layout: bool = True
    module_type: str = TRANSFORMER

    @property
    def ratio(self) -> int:
        """Transformers keep the stream rate."""
        return 1

    def __post_init__(self) -> None:
        where = f"codec transformer stage (d_model={self.d_model})"
        if self.d_model % self.num_heads or (self.d_model // self.num_heads) % 2:
            raise ConfigError(f"{where}: d_model {self.d_model} / num_heads {self.num_heads} must be an even "
                              "integer head size; fix config.json")
        unsupported = {"norm": (self.norm, "layer_norm"), "gating": (self.gating, "none"),
                       "positional_embedding": (self.positional_embedding, "rope"), "causal": (self.causal, True)}
        for key, (value, wanted) in unsupported.items():
            if value != wanted:
                raise ConfigError(f"{where}: {key}={value!r} is not supported (the Nano codec uses {wanted!r}); "
                                  "use an official MOSS-Audio-Tokenizer-Nano config.json")


Stage = Union[PatchStage, TransformerStage]


@dataclass(frozen=True)
class QuantizerConfig:
    """Residual LFQ settings (``quantizer_kwargs``)."""

    input_dim: int
    rvq_dim: int
    output_dim: int
    num_quantizers: int
    codebook_size: int
    codebook_dim: int
    quantizer_type: str = "rlfq"


@dataclass(frozen=True)
class CodecConfig:
    """The codec's ``config.json``; unknown keys are kept in ``extra`` and never consulted."""

    sampling_rate: int
    downsample_rate: int
    number_channels: int
    enable_channel_interleave: bool
    causal_transformer_context_duration: float
    encoder_kwargs: tuple[Stage, ...]
    decoder_kwargs: tuple[Stage, ...]
    quantizer_kwargs: QuantizerConfig
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def interleave_factor(self) -> int:
        """Channels folded into the time axis (L0 R0 L1 R1 ...) before the encoder."""
        return self.number_channels if self.enable_channel_interleave and self.number_channels > 1 else 1

    @property
    def stream_rate_hz(self) -> int:
        """Sample rate of the single interleaved stream the encoder sees (96 000 for 48 kHz stereo)."""
        return self.sampling_rate * self.interleave_factor

    def encoder_contexts(self) -> tuple[Optional[int], ...]:
        """Attention window in steps per encoder stage (None for patch stages)."""
        return _contexts(self.encoder_kwargs, float(self.stream_rate_hz), divide=True)

    def decoder_contexts(self) -> tuple[Optional[int], ...]:
        """Attention window in steps per decoder stage (None for patch stages)."""
        rate = float(self.stream_rate_hz)
        for stage in self.encoder_kwargs:
            rate /= stage.ratio
        return _contexts(self.decoder_kwargs, rate, divide=False)

    def decoder_steps_per_frame(self) -> tuple[int, ...]:
        """Sequence positions one code frame occupies at the input of each decoder stage."""
        steps, out = 1, []
        for stage in self.decoder_kwargs:
            out.append(steps)
            steps *= stage.ratio
        return tuple(out)

    def __post_init__(self) -> None:
        total = math.prod(stage.ratio for stage in self.encoder_kwargs)
        if total != self.downsample_rate * self.interleave_factor:
            raise ConfigError(f"codec config: encoder patch sizes multiply to {total}, expected downsample_rate "
                              f"{self.downsample_rate} x {self.interleave_factor} interleaved channels; fix config.json")
        back = math.prod(stage.ratio for stage in self.decoder_kwargs)
        if back != total:
            raise ConfigError(f"codec config: decoder patch sizes multiply to {back}, but the encoder divides by "
                              f"{total}; the decoder must return to {self.stream_rate_hz} Hz; fix config.json")
        q = self.quantizer_kwargs
        if q.quantizer_type not in SUPPORTED_QUANTIZERS:
            raise ConfigError(f"codec config: quantizer_type {q.quantizer_type!r} is not supported; "
                              f"use one of {', '.join(SUPPORTED_QUANTIZERS)}")


def _contexts(stages: tuple[Stage, ...], rate: float, *, divide: bool) -> tuple[Optional[int], ...]:
    out: list[Optional[int]] = []
    for stage in stages:
        # Python round() like the official constructor (banker's rounding on exact halves).
        out.append(int(round(rate * stage.context_duration)) if isinstance(stage, TransformerStage) else None)
        rate = rate / stage.ratio if divide else rate * stage.ratio
    return tuple(out)


def _stage(raw: dict, default_context: float, where: str) -> Stage:
    kind = raw.get("module_type")
    if kind == PATCH:
        if "patch_size" not in raw:
            raise ConfigError(f"codec config {where}: patch stage lacks 'patch_size'; fix config.json")
        return PatchStage(patch_size=int(raw["patch_size"]))
    if kind != TRANSFORMER:
        raise ConfigError(f"codec config {where}: module_type {kind!r} is unknown; expected {PATCH} or {TRANSFORMER}")
    try:
        return TransformerStage(
            input_dimension=int(raw["input_dimension"]), output_dimension=int(raw["output_dimension"]),
            d_model=int(raw["d_model"]), num_heads=int(raw["num_heads"]), num_layers=int(raw["num_layers"]),
            dim_feedforward=int(raw.get("dim_feedforward", 2048)),
            context_duration=float(raw.get("context_duration", default_context)),
            causal=bool(raw.get("causal", False)),
            layer_scale=None if raw.get("layer_scale") is None else float(raw["layer_scale"]),
            max_period=float(raw.get("max_period", 10000)), norm=str(raw.get("norm", "layer_norm")),
            positional_embedding=str(raw.get("positional_embedding", "sin")),
            gating=str(raw.get("gating", "none")), conv_layout=bool(raw.get("conv_layout", False)))
    except KeyError as exc:
        raise ConfigError(f"codec config {where}: transformer stage lacks {exc.args[0]!r}; fix config.json") from None


def _reverse_decoder(reversed_kwargs: list[dict]) -> list[dict]:
    """Turn the legacy ``reversed_decoder_kwargs`` (encoder order) into execution order."""
    out = []
    for raw in reversed(reversed_kwargs):
        raw = dict(raw)
        if raw.get("module_type") == TRANSFORMER:
            raw["input_dimension"], raw["output_dimension"] = raw["output_dimension"], raw["input_dimension"]
        out.append(raw)
    return out


def codec_config_from_dict(raw: dict[str, Any]) -> CodecConfig:
    """Validate an official codec ``config.json`` dict into a ``CodecConfig``."""
    raw = dict(raw)
    if "encoder_kwargs" not in raw or not ("decoder_kwargs" in raw or "reversed_decoder_kwargs" in raw):
        raise ConfigError("codec config.json: encoder_kwargs/decoder_kwargs missing; this is not a "
                          "MOSS-Audio-Tokenizer-Nano config (use the official codec folder)")
    default_context = float(raw.get("causal_transformer_context_duration", 10.0))
    decoder_raw = raw.get("decoder_kwargs") or _reverse_decoder(raw["reversed_decoder_kwargs"])
    qraw = dict(raw.get("quantizer_kwargs") or {})
    try:
        input_dim = int(qraw["input_dim"])
        quantizer = QuantizerConfig(
            input_dim=input_dim, rvq_dim=int(qraw.get("rvq_dim") or input_dim),
            output_dim=int(qraw.get("output_dim") or input_dim),
            num_quantizers=int(qraw.get("num_quantizers", 32)), codebook_size=int(qraw.get("codebook_size", 1024)),
            codebook_dim=int(qraw.get("codebook_dim", 8)),
            quantizer_type=str(qraw.get("quantizer_type", raw.get("quantizer_type", "rlfq"))))
    except KeyError as exc:
        raise ConfigError(f"codec config.json: quantizer_kwargs lacks {exc.args[0]!r}; fix config.json") from None
    # Legacy aliases accepted by the official config class.
    rate = raw.get("sampling_rate", raw.get("sample_rate", 48000))
    channels = raw.get("number_channels", raw.get("channels_numbers", 2))
    known = {"sampling_rate", "sample_rate", "downsample_rate", "number_channels", "channels_numbers",
             "enable_channel_interleave", "causal_transformer_context_duration", "encoder_kwargs",
             "decoder_kwargs", "reversed_decoder_kwargs", "quantizer_kwargs"}
    return CodecConfig(
        sampling_rate=int(rate), downsample_rate=int(raw.get("downsample_rate", 3840)),
        number_channels=int(channels), enable_channel_interleave=bool(raw.get("enable_channel_interleave", True)),
        causal_transformer_context_duration=default_context,
        encoder_kwargs=tuple(_stage(s, default_context, f"encoder_kwargs[{i}]")
                             for i, s in enumerate(raw["encoder_kwargs"])),
        decoder_kwargs=tuple(_stage(s, default_context, f"decoder_kwargs[{i}]") for i, s in enumerate(decoder_raw)),
        quantizer_kwargs=quantizer, extra={k: v for k, v in raw.items() if k not in known})


def load_codec_config(path: Union[str, Path]) -> CodecConfig:
    """Read and validate a codec ``config.json``."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"codec config {path}: file not found; pass the official codec folder") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"codec config {path}: cannot parse JSON ({exc}); re-download the codec folder") from None
    return codec_config_from_dict(raw)
