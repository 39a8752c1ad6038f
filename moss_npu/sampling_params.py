"""Sampling parameters of a generation, one set for the Nano and the Delay models: their names, defaults and
ranges. Torch-free, so the Delay backend, the command line and the server schema read them without torch.

The Nano model reads ``do_sample`` (False: greedy); the Delay sampler's greedy choice is a temperature of 0. The
defaults are the official model API's; ``RUNTIME`` holds the official Nano runtime's (infer.py, the CLI, the server).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, make_dataclass

from moss_npu.errors import SettingError


# Above these a distribution is already flat (temperature) or crushed (penalty); far above, float32 overflows.
MAX_TEMPERATURE = 100.0
MAX_PENALTY = 100.0
MAX_TOP_K = 2**31 - 1


@dataclass(frozen=True)
class TokenParams:
    """Sampling parameters of one decision (the 2-way text decision or one audio channel)."""

    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        # The official API takes None for "no top-k / top-p filter"; 0 and 1.0 say the same here.
        if self.top_k is None:
            object.__setattr__(self, "top_k", 0)
        if self.top_p is None:
            object.__setattr__(self, "top_p", 1.0)
        if self.do_sample and not 0 < self.temperature <= MAX_TEMPERATURE:
            raise SettingError("temperature", self.temperature, f"outside (0, {MAX_TEMPERATURE:g}]; use e.g. 1.0 "
                               "(for greedy decoding ask for greedy, not a temperature of 0)")
        if not math.isfinite(self.temperature):
            raise SettingError("temperature", self.temperature, "not a finite number; use e.g. 1.0")
        if not 0.0 < self.top_p <= 1.0:
            raise SettingError("top_p", self.top_p, "outside (0, 1]; use e.g. 0.95, or 1.0 to disable it")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise SettingError("top_k", self.top_k, f"outside 0..{MAX_TOP_K}; use 0 to disable it or a positive count")
        if not 0 < self.repetition_penalty <= MAX_PENALTY:
            raise SettingError("repetition_penalty", self.repetition_penalty,
                               f"outside (0, {MAX_PENALTY:g}]; use 1.0 to disable it")


@dataclass(frozen=True)
class SamplingParams:
    """All sampling parameters of a generation; defaults are the official model-API ones (greedy), and
    ``runtime_defaults()`` the official runtime's."""

    do_sample: bool = False
    text_temperature: float = 1.5
    text_top_p: float = 1.0
    text_top_k: int = 50
    audio_temperature: float = 1.7
    audio_top_p: float = 0.8
    audio_top_k: int = 25
    audio_repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        for kind, build in (("text", self.text), ("audio", self.audio)):
            try:
                build()  # validates
            except SettingError as exc:  # name the key: top_p -> audio_top_p
                raise SettingError(f"{kind}_{exc.setting}", exc.value, exc.reason) from None

    @classmethod
    def runtime_defaults(cls, **overrides) -> "SamplingParams":
        """Return the official runtime defaults (sampled, 1.0/1.0/50 text, 0.8/0.95/25/1.2 audio), then overrides."""
        values = dict(do_sample=True, text_temperature=1.0, text_top_p=1.0, text_top_k=50,
                      audio_temperature=0.8, audio_top_p=0.95, audio_top_k=25, audio_repetition_penalty=1.2)
        values.update(overrides)
        return cls(**values)

    def text(self) -> TokenParams:
        """Parameters of the 2-way continue/stop decision (no repetition penalty, as upstream)."""
        return TokenParams(self.do_sample, self.text_temperature, self.text_top_k, self.text_top_p)

    def audio(self) -> TokenParams:
        """Parameters shared by every audio channel."""
        return TokenParams(self.do_sample, self.audio_temperature, self.audio_top_k, self.audio_top_p,
                           self.audio_repetition_penalty)


RUNTIME = SamplingParams.runtime_defaults()
# The value keys (every field but the Nano switch): CLI flags, preset keys, server fields, Delay flags.
VALUES = tuple(f.name for f in fields(SamplingParams) if f.name != "do_sample")


def sampling_fields(defaults: SamplingParams, switch: bool = False) -> type:
    """A frozen dataclass of the sampling values (and ``do_sample`` with ``switch``) defaulting to ``defaults``:
    the base of a runner's settings, so every runner has the same keys."""
    names = ("do_sample",) * switch + VALUES
    return make_dataclass("SamplingValues", [(n, type(getattr(defaults, n)), getattr(defaults, n)) for n in names],
                          frozen=True)
