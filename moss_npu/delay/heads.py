"""The 32 audio heads of the Delay model (docs/delay.md#heads): post-norm hidden state ``(H,)`` -> logits ``(Q, A)``,
in NumPy or in torch on the device layer's device. Q codebooks, A = audio vocabulary + 1, H hidden size.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from moss_npu.delay.weights import DelayWeights, load_table
from moss_npu.errors import ConfigError

AudioHeads = Callable[[np.ndarray], np.ndarray]  # hidden state (H,) float32 -> audio logits (Q, A) float32


def _stacked(weights: DelayWeights) -> tuple[np.ndarray, int, int]:
    """The audio heads as one ``(Q * A, H)`` float32 matrix, with Q and A."""
    tables = [load_table(path) for path in weights.lm_head_audio]
    return np.concatenate([np.asarray(t, dtype=np.float32) for t in tables], axis=0), len(tables), tables[0].shape[0]


class NumpyAudioHeads:
    """Audio heads as one stacked ``(Q * A, H)`` float32 matrix."""

    def __init__(self, weights: DelayWeights) -> None:
        self.stacked, self.n_vq, self.audio_size = _stacked(weights)

    def __call__(self, hidden: np.ndarray) -> np.ndarray:
        """Return ``(Q, A)`` float32 logits for one hidden state ``(H,)``."""
        # (1, H) @ (H, Q*A) exactly as upstream: the BLAS call shape decides the float32 rounding.
        logits = (np.asarray(hidden, dtype=np.float32)[None, :] @ self.stacked.T).reshape(self.n_vq, self.audio_size)
        logits[:, -1] = -np.inf
        return logits


class TorchAudioHeads:
    """Audio heads as a float32 torch matrix on a device of the device layer."""

    def __init__(self, weights: DelayWeights, device) -> None:
        import torch

        stacked, self.n_vq, self.audio_size = _stacked(weights)
        self.device = device
        self.weight = torch.from_numpy(stacked).to(device)

    def __call__(self, hidden: np.ndarray) -> np.ndarray:
        """Return ``(Q, A)`` float32 logits (computed on the device, returned as NumPy)."""
        import torch

        with torch.no_grad():
            h = torch.from_numpy(np.ascontiguousarray(hidden, dtype=np.float32)).to(self.device)
            logits = (self.weight @ h).reshape(self.n_vq, self.audio_size).cpu().numpy()
        logits[:, -1] = -np.inf
        return logits


def build_audio_heads(weights: DelayWeights, backend: str, device_spec: str = "auto") -> AudioHeads:
    """Build the heads for ``backend``: ``numpy``, ``torch`` (without torch an error, never a quiet NumPy run), or
    ``auto``: torch when it imports and the device layer resolves ``device_spec`` to an accelerator, else NumPy."""
    if backend == "numpy":
        return NumpyAudioHeads(weights)
    try:
        import torch  # noqa: F401  (importable at all: a torch build for another CUDA fails here)
    except Exception as exc:  # absent, or a build for another CUDA that fails with OSError at import
        if backend == "torch":
            raise ConfigError("heads_backend=torch but torch is not importable; install torch or use "
                              "heads_backend: numpy") from exc
        return NumpyAudioHeads(weights)
    from moss_npu.device import backend as device_backend, resolve_device

    device = resolve_device(device_spec)
    if backend == "auto" and device_backend(device).host:
        return NumpyAudioHeads(weights)  # on the CPU the NumPy heads are as fast and match upstream's rounding
    return TorchAudioHeads(weights, device)
