"""The three tiers of an accuracy comparison, computed from two host-side captures (``sides.Capture``).

A — module parity under teacher forcing: both sides see identical inputs, so every difference is numerical.
B — fixed-token waveform: the reference's generated codes decoded on both sides.
C — free-running generation with shared random numbers: token agreement first; waveforms only when tokens agree,
because one flipped token makes two autoregressive outputs unrelated. Metrics come from ``moss_npu.accuracy``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from moss_npu import accuracy
from moss_npu.errors import InputError
from moss_npu.evaluation.sides import Capture, InputCapture

TIER_TITLES = {
    "A": "module parity under teacher forcing",
    "B": "fixed-token waveform (the reference's greedy codes decoded on both sides)",
    "C": "free-running generation with shared random numbers",
}
# Tier A tensors in the order the data flows; None on a side means that side cannot produce it.
TEACHER_FORCED = ("global_hidden", "text_logits", "local_hidden", "audio_logits", "decode_step_hidden")


@dataclass(frozen=True)
class Thresholds:
    """Pass limits. Tensors (hidden states, logits) need mse <= max_mse and rel <= max_rel; waveforms need
    mse <= max_mse, snr >= min_snr_db and equal length; token streams need agreement >= min_token_agreement
    (1.0: every token identical). Prompt rows must always be identical."""

    max_mse: float = 1e-6
    max_rel: float = 1e-3
    min_snr_db: float = 40.0
    min_token_agreement: float = 1.0

    def __post_init__(self) -> None:
        for flag, value in (("--max-mse", self.max_mse), ("--max-rel", self.max_rel)):
            if not (math.isfinite(value) and value >= 0):
                raise InputError(f"{flag} {value}: must be a finite number >= 0, e.g. 1e-6")
        if math.isnan(self.min_snr_db):
            raise InputError("--min-snr nan: must be a number of dB, e.g. 40")
        if not 0.0 <= self.min_token_agreement <= 1.0:
            raise InputError(f"--min-token-agreement {self.min_token_agreement}: must lie in [0, 1] "
                             "(1 = every token identical)")


@dataclass(frozen=True)
class Item:
    """One compared quantity. ``passed`` None means not compared (not available, or not comparable)."""

    name: str
    input: str
    kind: str  # tensor | waveform | tokens
    passed: Optional[bool]
    metrics: dict[str, Any] = field(default_factory=dict)
    note: str = ""


@dataclass(frozen=True)
class TierResult:
    """The items of one tier; the tier passes when no compared item fails."""

    tier: str
    items: list[Item]

    @property
    def title(self) -> str:
        return TIER_TITLES[self.tier]

    @property
    def passed(self) -> bool:
        return all(item.passed is not False for item in self.items)


def _float_metrics(a: Any, b: Any) -> dict[str, Any]:
    return {"shape": list(np.shape(accuracy.as_array(a))), "max_abs": accuracy.max_abs(a, b), "mse": accuracy.mse(a, b),
            "rel": accuracy.relative_error(a, b), "cosine": accuracy.cosine(a, b), "snr_db": accuracy.snr_db(a, b)}


def tensor_item(name: str, label: str, a: Optional[torch.Tensor], b: Optional[torch.Tensor], th: Thresholds) -> Item:
    """Compare a hidden-state or logits tensor ``a`` against reference ``b`` (mse and relative error)."""
    if a is None or b is None:
        return Item(name, label, "tensor", None, note=f"not available from the {'target' if a is None else 'reference'}")
    if a.shape != b.shape:
        return Item(name, label, "tensor", False, {"shape": list(a.shape), "reference_shape": list(b.shape)},
                    "shapes differ")
    m = _float_metrics(a, b)
    failed = [f"mse > {th.max_mse:g}"] * (m["mse"] > th.max_mse) + [f"rel > {th.max_rel:g}"] * (m["rel"] > th.max_rel)
    return Item(name, label, "tensor", not failed, m, "; ".join(failed))


def waveform_item(name: str, label: str, a: Optional[torch.Tensor], b: Optional[torch.Tensor], th: Thresholds,
                  missing: str = "no audio frames to decode") -> Item:
    """Compare waveform ``a`` (C, S) against reference ``b``: equal length, mse and SNR."""
    if a is None or b is None:
        return Item(name, label, "waveform", None, note=missing)
    if not accuracy.same_length(a, b):
        return Item(name, label, "waveform", False, {"shape": list(a.shape), "reference_shape": list(b.shape),
                                                     "same_length": False}, "lengths differ")
    m = _float_metrics(a, b) | {"same_length": True}
    failed = ([f"mse > {th.max_mse:g}"] * (m["mse"] > th.max_mse)
              + [f"snr_db < {th.min_snr_db:g}"] * (m["snr_db"] < th.min_snr_db))
    return Item(name, label, "waveform", not failed, m, "; ".join(failed))


def token_item(name: str, label: str, a: Optional[torch.Tensor], b: Optional[torch.Tensor],
               min_agreement: float) -> Item:
    """Compare integer streams (frames or prompt rows, ...) by agreement and the first divergent row."""
    if a is None or b is None:
        return Item(name, label, "tokens", None, note="not available")
    m = {"frames": int(a.shape[0]), "reference_frames": int(b.shape[0]),
         "agreement": accuracy.token_agreement(a.numpy(), b.numpy()),
         "first_divergent_frame": accuracy.first_divergent_frame(a.numpy(), b.numpy())}
    passed = m["agreement"] >= min_agreement
    return Item(name, label, "tokens", passed, m, "" if passed else f"agreement < {min_agreement:g}")


def comparable_decisions(codes: torch.Tensor, ref_codes: torch.Tensor, nq: int) -> tuple[int, int, str]:
    """Return how many (text, audio) decisions both runs made from identical histories (per frame the continue/stop
    choice, then channels 0..nq-1; up to and including the first divergent one, whose logits are still comparable)
    and that one's kind (``text``, ``audio`` or ``none``)."""
    k = accuracy.first_divergent_frame(codes.numpy(), ref_codes.numpy())
    if k is None:
        return len(codes) + 1, len(codes) * nq, "none"  # + 1: a stop decision may follow the last frame
    if k < len(codes) and k < len(ref_codes):
        channel = int((codes[k, :nq] != ref_codes[k, :nq]).nonzero()[0, 0])
        return k + 1, k * nq + channel + 1, "audio"
    return k + 1, k * nq, "text"  # one run stopped at frame k: the continue/stop choice differed


def generation_item(label: str, cap: InputCapture, ref: InputCapture, nq: int, th: Thresholds) -> Item:
    """Tier C tokens: agreement, first divergent frame, and the logits error of the decisions up to it."""
    if cap.error or ref.error:
        side = "target" if cap.error else "reference"
        return Item("codes", label, "tokens", False, note=f"{side} generation failed: {cap.error or ref.error}")
    item = token_item("codes", label, cap.codes, ref.codes, th.min_token_agreement)
    n_text, n_audio, kind = comparable_decisions(cap.codes, ref.codes, nq)
    pairs = {"text": _aligned(cap.text_logits[:n_text], ref.text_logits[:n_text]),
             "audio": _aligned(cap.audio_logits[:n_audio], ref.audio_logits[:n_audio])}
    errors = [accuracy.max_abs(a, b) for a, b in pairs.values() if len(a)]
    m = dict(item.metrics, decisions_compared=sum(len(a) for a, _ in pairs.values()),
             decision_logits_max_abs=max(errors) if errors else 0.0)
    note = item.note
    if kind != "none":
        a, b = pairs[kind]
        m["divergent_decision"] = kind if kind == "text" else f"audio channel {(n_audio - 1) % nq}"
        m["divergent_decision_logits_max_abs"] = accuracy.max_abs(a[-1:], b[-1:]) if len(a) else None
    elif len(ref.codes) == 0:
        note = "both sides stopped before the first frame: only the stop decision was compared"
    return Item(item.name, label, item.kind, item.passed, m, note)


def _aligned(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = min(len(a), len(b))
    return a[:n], b[:n]


def tier_a(target: Capture, reference: Capture, th: Thresholds) -> TierResult:
    """Module parity: prompt rows, codec encode, global/local outputs, one decode step, codec decode."""
    items = []
    for label, ref in reference.inputs.items():
        cap = target.inputs[label]
        rows = token_item("prompt_rows", label, cap.own_rows, ref.own_rows, 1.0)
        if rows.passed is False:
            rows = Item(rows.name, label, rows.kind, False, rows.metrics, "prompt rows differ: the inputs are not the same")
        items.append(rows)
        if ref.prompt_codes is not None:
            items.append(token_item("codec_encode", label, cap.prompt_codes, ref.prompt_codes, th.min_token_agreement))
        items.extend(tensor_item(name, label, cap.tensors.get(name), ref.tensors.get(name), th) for name in TEACHER_FORCED)
    items.append(waveform_item("codec_decode", "fixed", target.tensors.get("codec_decode"),
                               reference.tensors.get("codec_decode"), th))
    return TierResult("A", items)


def tier_b(target: Capture, reference: Capture, th: Thresholds) -> TierResult:
    """The reference's greedy codes decoded on both sides."""
    return TierResult("B", [waveform_item("waveform", label, target.inputs[label].tensors.get("decoded_codes"),
                                          ref.tensors.get("decoded_codes"), th)
                            for label, ref in reference.inputs.items()])


def tier_c(target: Capture, reference: Capture, nq: int, th: Thresholds) -> TierResult:
    """Token agreement of free-running generation; the streamed waveform only where every token agrees."""
    items = []
    for label, ref in reference.inputs.items():
        cap = target.inputs[label]
        codes = generation_item(label, cap, ref, nq, th)
        items.append(codes)
        if codes.metrics.get("first_divergent_frame", 0) is None:
            items.append(waveform_item("waveform", label, cap.stream_wave, ref.tensors.get("generated_wave"), th))
        else:
            k = codes.metrics.get("first_divergent_frame")
            why = "generation failed" if k is None else f"tokens differ from frame {k}"
            items.append(Item("waveform", label, "waveform", None, note=f"not comparable: {why}"))
    return TierResult("C", items)


def compare(target: Capture, reference: Capture, nq: int, th: Thresholds) -> list[TierResult]:
    """Return tiers A, B and C for a target capture against the reference capture."""
    return [tier_a(target, reference, th), tier_b(target, reference, th), tier_c(target, reference, nq, th)]
