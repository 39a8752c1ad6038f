"""Device accuracy comparison behind ``eval_accuracy.py`` (docs/accuracy.md#tiers).

``sides`` runs one model (native or official code) on one device over fixed inputs and keeps every result on
the host; ``run`` loads the reference side, captures, frees it, then does the same for the target side (never
both at once); ``tiers`` compares the two captures in three tiers; ``report`` prints and writes the outcome.
"""

from moss_npu.evaluation.run import EvalRequest, SideSpec, evaluate, generation_settings
from moss_npu.evaluation.sides import DEFAULT_INPUTS, EvalInput, load_side
from moss_npu.evaluation.tiers import Thresholds
