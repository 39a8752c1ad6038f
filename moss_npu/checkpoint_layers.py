"""Layers whose parameters always come from a checkpoint, so they skip torch's random initialisation: filling
weights the load then overwrites slows every start (docs/performance.md#start-up)."""

from __future__ import annotations

from torch import nn


class CheckpointLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters, names and product) left uninitialised: its weights are loaded."""

    def reset_parameters(self) -> None:
        """Nothing: the parameters keep ``torch.empty``'s contents until a state dict is loaded into them."""
