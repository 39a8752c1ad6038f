"""Layers whose parameters always come from a checkpoint, so they skip torch's random initialisation: the
real model's ~100 M linear weights took ~0.5 s of every start to fill with numbers that the load then overwrote
(``torch.nn.utils.skip_init`` avoids it too, but its first use costs ~0.25 s of importing meta-tensor support)."""

from __future__ import annotations

from torch import nn


class CheckpointLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters, names and product) left uninitialised: its weights are loaded."""

    def reset_parameters(self) -> None:
        """Nothing: the parameters keep ``torch.empty``'s contents until a state dict is loaded into them."""
