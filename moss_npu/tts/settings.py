"""Run settings of the TTS pipeline: one frozen dataclass, YAML presets, and the merge of the two with CLI flags.

Precedence: dataclass default < preset (``configs/*.yaml``, run values only) < explicit CLI flag. Defaults are
the official runtime's (infer.py: sampled, 375 frames, 75-token voice-clone chunks), spec §9.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml

from moss_npu.codec.streaming import OFFICIAL_SCHEDULE, DecodeSchedule
from moss_npu.errors import ConfigError, InputError
from moss_npu.nano.graphs import GRAPH_MODES
from moss_npu.sampling import SamplingParams

MODES = ("auto", "continuation", "voice_clone")
# "optimized": the frame decoder; "reference": the official algorithm (nano.reference, the oracle), same codes.
SPEEDS = ("optimized", "reference")


@dataclass(frozen=True)
class RunConfig:
    """Everything a synthesis run can set besides the text and the model folders."""

    device: str = "auto"
    dtype: str = "auto"
    attn_implementation: str = "sdpa"
    mode: str = "auto"  # auto: voice_clone with a reference and no prompt text, else continuation
    max_new_frames: int = 375
    do_sample: bool = True
    text_temperature: float = 1.0
    text_top_p: float = 1.0
    text_top_k: int = 50
    audio_temperature: float = 0.8
    audio_top_p: float = 0.95
    audio_top_k: int = 25
    audio_repetition_penalty: float = 1.2
    nq: Optional[int] = None
    seed: Optional[int] = None
    host_rng: bool = False
    voice_clone_max_text_tokens: int = 75
    voice_clone_max_memory_per_sample_gb: float = 1.0
    tts_max_batch_size: int = 0
    speed: str = "optimized"  # "optimized" (the frame decoder) or "reference" (the official algorithm, the oracle)
    graph: str = "auto"  # device graphs of the frame step: auto (on for CUDA/NPU with host_rng), on, off
    stability_fallback: bool = True  # non-finite bf16/fp16 logits: cast to float32 and retry (official behaviour)
    num_threads: int = 0  # intra-op CPU threads (0: torch's default); a process setting, applied by the CLIs
    stream_lead_thresholds_s: tuple[float, ...] = OFFICIAL_SCHEDULE.lead_thresholds_s
    stream_budgets: tuple[int, ...] = OFFICIAL_SCHEDULE.budgets
    stream_head_lead_s: float = OFFICIAL_SCHEDULE.head_lead_s

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InputError(f"--mode {self.mode}: unknown; use {', '.join(MODES)}")
        if self.max_new_frames < 1:
            raise InputError(f"--max-new-frames {self.max_new_frames}: use at least 1 (12.5 frames per second)")
        if self.voice_clone_max_text_tokens < 0 or self.tts_max_batch_size < 0:
            raise InputError("voice_clone_max_text_tokens and tts_max_batch_size must be >= 0 (0 = no limit)")
        if self.num_threads < 0:
            raise InputError(f"--num-threads {self.num_threads}: use 0 (torch's default) or a thread count")
        if self.speed not in SPEEDS:
            raise InputError(f"--speed {self.speed}: unknown; use one of {', '.join(SPEEDS)}")
        if self.graph not in GRAPH_MODES:
            raise InputError(f"--graph {self.graph}: unknown; use one of {', '.join(GRAPH_MODES)}")
        self.sampling()  # validates the sampling values
        self.schedule()

    def sampling(self) -> SamplingParams:
        """Return the sampling parameters of this run."""
        return SamplingParams(
            do_sample=self.do_sample,
            text_temperature=self.text_temperature, text_top_p=self.text_top_p, text_top_k=self.text_top_k,
            audio_temperature=self.audio_temperature, audio_top_p=self.audio_top_p, audio_top_k=self.audio_top_k,
            audio_repetition_penalty=self.audio_repetition_penalty,
        )

    def schedule(self) -> DecodeSchedule:
        """Return the streaming decode schedule (how many frames to decode per codec call)."""
        return DecodeSchedule(tuple(float(x) for x in self.stream_lead_thresholds_s),
                              tuple(int(x) for x in self.stream_budgets), float(self.stream_head_lead_s))


FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}


def load_preset(path: Path | str) -> dict[str, Any]:
    """Read a YAML preset of run values; unknown keys raise ConfigError listing them."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: file not found; use one of configs/cpu.yaml, configs/cuda.yaml, configs/npu.yaml")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not valid YAML ({exc.__class__.__name__}); fix the syntax") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of run settings, got {type(data).__name__}")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ConfigError(f"--config {path}: unknown keys {', '.join(unknown)}; known keys: {', '.join(FIELDS)}")
    return data


def merge(preset: Optional[Mapping[str, Any]] = None, overrides: Optional[Mapping[str, Any]] = None) -> RunConfig:
    """Build a RunConfig from defaults, then the preset, then explicit overrides (None values are ignored)."""
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
        return RunConfig(**values)
    except TypeError as exc:  # a preset value of the wrong type
        raise ConfigError(f"invalid run settings: {exc}") from exc
