"""The serial comparison: the reference side (normally native fp32 on the CPU) captured on the host and freed,
then the target side on the reference's fixed inputs; never both loaded at once. Loading goes through an
injectable ``load`` and every step is announced to ``on_event``, so callers show progress and tests check the order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

from moss_npu.errors import InputError
from moss_npu.evaluation.report import Report
from moss_npu.evaluation.sides import Capture, EvalInput, GenerationSettings, SideSpec, load_side
from moss_npu.evaluation.tiers import Thresholds, compare
from moss_npu.sampling import SamplingParams

# (what happens: "load", "capture", "release", "released"; the side it happens to)
EventHook = Callable[[str, SideSpec], None]
Loader = Callable[[SideSpec], Any]


@dataclass(frozen=True)
class EvalRequest:
    """Everything a comparison needs: the two sides, the inputs, tier C's generation, the pass limits."""

    reference: SideSpec
    target: SideSpec
    inputs: tuple[EvalInput, ...]
    settings: GenerationSettings
    thresholds: Thresholds = Thresholds()

    def __post_init__(self) -> None:
        if not self.inputs:
            raise InputError("no inputs to compare; pass --text or --text-file")
        labels = [i.label for i in self.inputs]
        if len(set(labels)) != len(labels):
            raise InputError(f"input labels repeat ({labels}); give every input its own label")
        if self.reference.impl != "native":
            raise InputError("the reference side runs the native code; choose the target with --impl/--against")


def generation_settings(reference: SideSpec, target: SideSpec, *, max_new_frames: int, seed: int,
                        greedy: bool) -> GenerationSettings:
    """Choose tier C's sampling (greedy, or the official runtime defaults) and random source so that both sides draw
    the same tokens: two native sides share a seeded host generator; the official code draws on the device only, so
    against it both seed their device generator, which matches on one device only (elsewhere: refused)."""
    if max_new_frames < 1:
        raise InputError(f"--max-new-frames {max_new_frames}: use at least 1 (12.5 frames per second)")
    if seed < 0:
        raise InputError(f"--seed {seed}: use a number >= 0")
    if greedy:
        return GenerationSettings(max_new_frames, SamplingParams(do_sample=False), seed, "none")
    sampling = SamplingParams.runtime_defaults()
    if reference.impl == target.impl == "native":
        return GenerationSettings(max_new_frames, sampling, seed, "host")
    if reference.device == target.device:
        return GenerationSettings(max_new_frames, sampling, seed, "device")
    raise InputError(f"the official code draws random numbers on the device, so {reference.device} and "
                     f"{target.device} cannot draw the same tokens; add --greedy, or use --against upstream "
                     "to compare on one device")


def evaluate(request: EvalRequest, *, load: Loader = load_side, on_event: Optional[EventHook] = None) -> Report:
    """Run the reference side, free it, run the target side, and compare the two in tiers A-C."""
    emit = on_event or (lambda what, spec: None)
    order: list[str] = []

    def note(what: str, spec: SideSpec) -> None:
        order.append(f"{what} {spec.role} ({spec.impl}, {spec.device}, {str(spec.dtype).replace('torch.', '')})")
        emit(what, spec)

    reference = _run_side(request.reference, request, None, load, note)
    target = _run_side(request.target, request, reference, load, note)
    nq = len(reference.frame_row) - 1
    tiers = compare(target, reference, nq, request.thresholds)
    settings = request.settings
    generation = {"max_new_frames": settings.max_new_frames, "seed": settings.seed, "rng": settings.rng,
                  "sampling_mode": _sampling_mode(settings), "sampling": dataclasses.asdict(settings.sampling)}
    inputs = [{"label": i.label, "text": i.text, "mode": i.mode,
               "prompt_audio": None if i.prompt_audio is None else str(i.prompt_audio)} for i in request.inputs]
    return Report(reference.side, target.side, inputs, generation, request.thresholds, tiers, order)


def _run_side(spec: SideSpec, request: EvalRequest, reference: Optional[Capture], load: Loader,
              note: EventHook) -> Capture:
    note("load", spec)
    side = load(spec)
    try:
        note("capture", spec)
        return side.capture(request.inputs, request.settings, reference)
    finally:
        note("release", spec)
        side.close()
        del side
        note("released", spec)


def _sampling_mode(settings: GenerationSettings) -> str:
    if settings.rng == "none":
        return "greedy"
    where = "a seeded host generator shared by both sides" if settings.rng == "host" else "each side's device generator"
    return f"sampled (official runtime defaults), seed {settings.seed}, random numbers from {where}"
