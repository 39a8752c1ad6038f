"""Settings of the TTS pipeline: load-time and per-call frozen dataclasses, YAML presets, and their merge with flags.

``LoadConfig`` is fixed when a pipeline loads (``MossTTSNano.from_pretrained``), ``RunConfig`` is what each call
may change; a load-time name given to ``RunConfig`` is refused. Precedence: dataclass default < preset
(``configs/*.yaml``) < explicit flag. Run defaults are the official runtime's (docs/architecture.md#defaults).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Optional

from moss_npu.codec.streaming import OFFICIAL_SCHEDULE, DecodeSchedule
from moss_npu.errors import ConfigError, InputError, MossNpuError, SettingError
from moss_npu.limits import MAX_NEW_FRAMES, MAX_SEED
from moss_npu.cpu.step import COMPILE_MODES
from moss_npu.nano.graphs import GRAPH_MODES
from moss_npu.cpu.quantize import QUANTIZE_MODES
from moss_npu.presets import check_types, read_yaml_mapping
from moss_npu.sampling_params import RUNTIME, VALUES, SamplingParams, sampling_fields
from moss_npu.tempo import check_speed

MODES = ("auto", "continuation", "voice_clone")
# "optimized": the frame decoder; "reference": the official algorithm (nano.reference, the oracle), same codes.
DECODERS = ("optimized", "reference")


@dataclass(frozen=True)
class LoadConfig:
    """How a pipeline is loaded; fixed for its lifetime (the keywords of ``MossTTSNano.from_pretrained``)."""

    device: str = "auto"  # auto, cpu, cuda[:N], npu[:N], mps
    dtype: str = "auto"  # auto (float32), float32, bfloat16, float16: the LM's compute dtype
    attn_implementation: str = "sdpa"  # sdpa or eager
    num_threads: int = 0  # intra-op CPU threads (0: moss_npu.cpu.threads' default); process-wide, as torch has one pool
    quantize: str = "none"  # none, or int8: the LM's block weights rounded to int8 (CPU, float32; cpu.quantize)
    # How the pipeline's decoder computes (the same codes every way):
    decoder: str = "optimized"  # "optimized" (the frame decoder) or "reference" (the official algorithm, the oracle)
    graph: str = "auto"  # device graphs of the frame step: auto (on for CUDA/NPU with host_rng), on, off
    compile: str = "auto"  # torch.compile of the float32 CPU frame step: auto (eager: measured faster), on, off

    def __post_init__(self) -> None:
        if self.num_threads < 0:
            raise SettingError("num_threads", self.num_threads, "use 0 (the default policy) or a thread count")
        for name, allowed in (("quantize", QUANTIZE_MODES), ("decoder", DECODERS), ("graph", GRAPH_MODES),
                              ("compile", COMPILE_MODES)):
            if getattr(self, name) not in allowed:
                raise SettingError(name, getattr(self, name), f"unknown; use one of {', '.join(allowed)}")


@dataclass(frozen=True)
class RunConfig(sampling_fields(RUNTIME, switch=True)):
    """Everything one synthesis call can set besides the text and the voice prompt (per call, never the device);
    the sampling values (``do_sample``, ``text_temperature``, ...) at the official runtime's defaults come from
    ``moss_npu.sampling_params``."""

    mode: str = "auto"  # auto: voice_clone with a reference and no prompt text, else continuation
    max_new_frames: int = 375
    nq: Optional[int] = None
    seed: Optional[int] = None
    host_rng: Optional[bool] = None  # sampling noise from a host generator; None: the runner's own way (official
    # device draws in MossTTSNano, host draws per request in the Engine, which refuses False)
    voice_clone_max_text_tokens: int = 75
    voice_clone_max_memory_per_sample_gb: float = 1.0
    tts_max_batch_size: int = 0
    speed: float = 1.0  # speaking rate, pitch kept (moss_npu.tempo); 1.0 leaves the audio untouched
    stability_fallback: bool = True  # non-finite bf16/fp16 logits: retry with a float32 copy (official behaviour)
    # Official infer.py text preparation (moss_npu.text): the robust cleanup, and WeTextProcessing's reading of
    # numbers and symbols; the model API (model.inference) runs neither.
    text_normalization: bool = True
    wetext: bool = True
    stream_lead_thresholds_s: tuple[float, ...] = OFFICIAL_SCHEDULE.lead_thresholds_s
    stream_budgets: tuple[int, ...] = OFFICIAL_SCHEDULE.budgets
    stream_head_lead_s: float = OFFICIAL_SCHEDULE.head_lead_s

    def __new__(cls, *args: Any, **kwargs: Any) -> "RunConfig":
        # A load-time name gets the fix instead of a bare "unexpected keyword" TypeError.
        misplaced = sorted(set(kwargs) & {f.name for f in dataclasses.fields(LoadConfig)})
        if misplaced:
            raise ConfigError(f"{', '.join(misplaced)}: set when the pipeline loads, not per call; pass "
                              f"MossTTSNano.from_pretrained(..., {misplaced[0]}=...) or load another pipeline")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise SettingError("mode", self.mode, f"unknown; use {', '.join(MODES)}")
        if not 1 <= self.max_new_frames <= MAX_NEW_FRAMES:
            raise SettingError("max_new_frames", self.max_new_frames,
                               f"use 1 .. {MAX_NEW_FRAMES} (12.5 frames per second)")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise SettingError("seed", self.seed, "use 0 .. 2**63-1")
        if self.voice_clone_max_text_tokens < 0 or self.tts_max_batch_size < 0:
            raise InputError("voice_clone_max_text_tokens and tts_max_batch_size must be >= 0 (0 = no limit)")
        if not isinstance(self.text_normalization, bool) or not isinstance(self.wetext, bool):
            raise InputError("text_normalization and wetext must be true or false")
        check_speed(self.speed)
        self.sampling()  # validates the sampling values
        self.schedule()

    def sampling(self) -> SamplingParams:
        """Return the sampling parameters of this run."""
        return SamplingParams(self.do_sample, **{name: getattr(self, name) for name in VALUES})

    def schedule(self) -> DecodeSchedule:
        """Return the streaming decode schedule (how many frames to decode per codec call)."""
        return DecodeSchedule(tuple(float(x) for x in self.stream_lead_thresholds_s),
                              tuple(int(x) for x in self.stream_budgets), float(self.stream_head_lead_s))


LOAD_FIELDS = {f.name: f for f in dataclasses.fields(LoadConfig)}
RUN_FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}
FIELDS = {**LOAD_FIELDS, **RUN_FIELDS}


class Settings(NamedTuple):
    """A preset merged with flags: how to load the pipeline and how to run each call."""

    load: LoadConfig
    run: RunConfig


def load_preset(path: Path | str) -> dict[str, Any]:
    """Read a YAML preset of run values; unknown keys, values of the wrong type or out of range raise ConfigError."""
    if not Path(path).exists():
        raise ConfigError(f"--config {path}: file not found; use one of configs/cpu.yaml, configs/cuda.yaml, configs/npu.yaml")
    data = read_yaml_mapping(path)
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ConfigError(f"--config {path}: unknown keys {', '.join(unknown)}; known keys: {', '.join(FIELDS)}")
    if "speed" in data:
        try:
            check_speed(data["speed"])
        except SettingError as exc:
            raise ConfigError(f"--config {path}: {exc.named(exc.setting)}") from None
    check_types(data, RunConfig, f"--config {path}")
    try:
        merge(data)  # the preset alone must be valid, even where a command-line flag replaces a value
    except MossNpuError as exc:
        raise ConfigError(f"--config {path}: {exc}") from None
    return data


def merge(preset: Optional[Mapping[str, Any]] = None, overrides: Optional[Mapping[str, Any]] = None) -> Settings:
    """Build the load and run settings from defaults, then the preset, then explicit overrides (None = unset)."""
    values: dict[str, Any] = {}
    for source in (preset or {}, overrides or {}):
        values.update({k: v for k, v in source.items() if v is not None})
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise ConfigError(f"unknown run settings {', '.join(unknown)}; known: {', '.join(FIELDS)}")
    for name in ("stream_lead_thresholds_s", "stream_budgets"):
        if name in values:
            values[name] = tuple(values[name])
    try:
        return Settings(LoadConfig(**{k: v for k, v in values.items() if k in LOAD_FIELDS}),
                        RunConfig(**{k: v for k, v in values.items() if k in RUN_FIELDS}))
    except TypeError as exc:  # a preset value of the wrong type
        raise ConfigError(f"invalid run settings: {exc}") from exc
