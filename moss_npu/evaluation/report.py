"""The outcome of an accuracy comparison: a readable table for stdout and a JSON-ready report.

The JSON holds, per tier, every item's metrics and pass/fail, the thresholds used, both sides (implementation,
dtype, device name from ``moss_npu.device.describe``) and the library versions. JSON has no infinity, so
non-finite numbers (the SNR of identical outputs) are written as the strings ``"inf"``, ``"-inf"``, ``"nan"``.
"""

from __future__ import annotations

import dataclasses
import math
import platform
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from moss_npu import __version__
from moss_npu.evaluation.tiers import Item, Thresholds, TierResult

VERSIONED = ("torch", "torch_npu", "numpy", "transformers")


@dataclass(frozen=True)
class Report:
    """Both sides, the inputs and settings, the tiers, and what ran in which order."""

    reference: dict[str, Any]
    target: dict[str, Any]
    inputs: list[dict[str, Any]]
    generation: dict[str, Any]
    thresholds: Thresholds
    tiers: list[TierResult]
    order: list[str]

    @property
    def passed(self) -> bool:
        """Whether every tier passed."""
        return all(t.passed for t in self.tiers)

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON-ready report (non-finite floats as strings)."""
        thresholds = dataclasses.asdict(self.thresholds)
        data = {
            "passed": self.passed,
            "reference": self.reference,
            "target": self.target,
            "versions": versions(),
            "inputs": self.inputs,
            "generation": self.generation,
            "thresholds": thresholds,
            "order": self.order,
            "tiers": {t.tier: {"title": t.title, "passed": t.passed, "thresholds": thresholds,
                               "items": [dataclasses.asdict(i) for i in t.items]} for t in self.tiers},
        }
        return _finite(data)

    def format_table(self) -> str:
        """Return the human-readable summary: both sides, one block per tier, one line per item."""
        lines = [f"reference: {_side(self.reference)}", f"target:    {_side(self.target)}",
                 f"generation: {self.generation['max_new_frames']} frames max, {self.generation['sampling_mode']}"]
        for tier in self.tiers:
            lines.append("")
            lines.append(f"tier {tier.tier}  {tier.title}: {'PASS' if tier.passed else 'FAIL'}")
            for item in tier.items:
                result = "n/a" if item.passed is None else ("PASS" if item.passed else "FAIL")
                text = _summary(item)
                if item.note:
                    text = f"{text}  ({item.note})" if text else item.note
                lines.append(f"  {item.name:<19} {item.input:<6} {result:<5} {text}")
        lines.append("")
        lines.append("PASS: every tier passed" if self.passed
                     else "FAIL: tiers " + ", ".join(t.tier for t in self.tiers if not t.passed) + " failed")
        return "\n".join(lines)


def versions() -> dict[str, str]:
    """Versions of Python and of the installed packages that decide the numbers (absent ones left out), from their
    metadata: torch_npu is never imported just to report its version."""
    out = {"python": platform.python_version(), "moss_npu": __version__}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def _side(info: dict[str, Any]) -> str:
    quantized = info.get("quantize") not in (None, "none")
    weights = f" with {info['quantize']} weights" if quantized else ""
    kernels = f", kernels {info['cpu_kernels']}" if info.get("cpu_kernels") else ""
    settings = "".join(f", {name}={value}" for name, value in (info.get("process_settings") or {}).items())
    return (f"{info.get('impl')} {info.get('dtype')}{weights} on {info.get('device')} "
            f"({info.get('name')}{kernels}{settings})")


def _num(x: Any) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if isinstance(x, float) else str(x)  # "inf", "-inf" and "nan" format as themselves


def _summary(item: Item) -> str:
    m = item.metrics
    if not m:
        return ""
    if item.kind == "tokens":
        text = f"agreement={m['agreement']:.4f} first_divergent_frame={_num(m['first_divergent_frame'])}"
        text += f" frames={m['frames']}/{m['reference_frames']}"
        if "decision_logits_max_abs" in m:
            text += f" logits_max_abs={_num(m['decision_logits_max_abs'])}"
        if m.get("divergent_decision_logits_max_abs") is not None:
            text += f" at_divergence={_num(m['divergent_decision_logits_max_abs'])} ({m['divergent_decision']})"
        return text
    if "mse" not in m:
        return f"shape={m.get('shape')} reference_shape={m.get('reference_shape')}"
    return (f"max_abs={_num(m['max_abs'])} mse={_num(m['mse'])} rel={_num(m['rel'])} "
            f"cos={m['cosine']:.6f} snr={_num(m['snr_db'])} dB")


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
