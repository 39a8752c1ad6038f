"""Device accuracy comparison behind ``eval_accuracy.py`` (docs/accuracy.md#tiers): ``sides`` runs one model on
one device, ``run`` the reference side then the target side (never both at once), ``tiers`` compares the two
captures, ``report`` holds the outcome."""

from moss_npu.evaluation.run import EvalRequest, SideSpec, evaluate, generation_settings
from moss_npu.evaluation.sides import DEFAULT_INPUTS, EvalInput, load_side
from moss_npu.evaluation.tiers import Thresholds
