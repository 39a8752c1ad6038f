"""Where a model's weights came from: a stamp that holds while the parameters are unchanged, so that what is
derived from a checkpoint's weights (the prepared CPU arrays) is cached only for weights that are still its."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class WeightsOrigin:
    """Where a model's weights came from (``identity``) and the parameters' ``weights_state`` then: the weights
    still are that checkpoint's while the state is unchanged."""

    identity: str
    state: tuple


def weights_state(model: torch.nn.Module) -> tuple:
    """Return each parameter's address and version counter: every in-place edit or replacement changes it."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


def stamp_origin(model: torch.nn.Module, identity: str) -> None:
    """Record that ``model``'s weights, as they are now, are what ``identity`` names (a checkpoint as loaded, or
    such weights rounded by a named step: ``cpu.quantize``)."""
    model.weights_origin = WeightsOrigin(identity, weights_state(model))


def origin_identity(model: torch.nn.Module) -> Optional[str]:
    """Return the identity stamped on ``model`` if its weights were not changed since, else None."""
    origin = getattr(model, "weights_origin", None)
    return origin.identity if origin is not None and origin.state == weights_state(model) else None
