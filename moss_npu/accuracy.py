"""Accuracy metrics: how far one device's tensors, waveforms and token streams are from a reference.

Pure functions over anything ``numpy.asarray`` accepts (torch tensors are moved to the host first).
Sums are accumulated in float64 so the metric itself adds no error. ``a`` is the output under test and
``b`` the reference throughout. Used by ``eval_accuracy.py`` and by the conformance handlers.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np


def as_array(x: Any) -> np.ndarray:
    """Return ``x`` as a float64 NumPy array (torch tensors are detached and moved to the host)."""
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def _pair(a: Any, b: Any) -> tuple[np.ndarray, np.ndarray]:
    a, b = as_array(a), as_array(b)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs reference {b.shape}")
    return a, b


def max_abs(a: Any, b: Any) -> float:
    """Return the largest absolute elementwise difference (0 for empty inputs)."""
    a, b = _pair(a, b)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def mse(a: Any, b: Any) -> float:
    """Return the mean squared difference."""
    a, b = _pair(a, b)
    return float(np.mean((a - b) ** 2)) if a.size else 0.0


def relative_error(a: Any, b: Any) -> float:
    """Return ‖a − b‖ / ‖b‖ (inf when the reference is all zeros and ``a`` is not)."""
    a, b = _pair(a, b)
    diff, ref = float(np.linalg.norm((a - b).ravel())), float(np.linalg.norm(b.ravel()))
    if ref == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / ref


def cosine(a: Any, b: Any) -> float:
    """Return the cosine similarity of the flattened inputs (1.0 when both are all zeros)."""
    a, b = _pair(a, b)
    na, nb = float(np.linalg.norm(a.ravel())), float(np.linalg.norm(b.ravel()))
    if na == 0.0 or nb == 0.0:
        return 1.0 if na == nb else 0.0
    return float(np.dot(a.ravel(), b.ravel()) / (na * nb))


def snr_db(a: Any, b: Any) -> float:
    """Return the signal-to-noise ratio of ``a`` against reference ``b`` in dB (inf when identical)."""
    a, b = _pair(a, b)
    noise, signal = float(np.sum((a - b) ** 2)), float(np.sum(b ** 2))
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def same_length(a: Any, b: Any) -> bool:
    """Return whether two waveforms or sequences have the same shape."""
    return np.shape(as_array(a)) == np.shape(as_array(b))


def token_agreement(a: Any, b: Any) -> float:
    """Return the fraction of equal tokens over the common frames; frames missing in one stream count as unequal.

    ``a`` and ``b`` are ``(frames, channels)`` integer codes.
    """
    a, b = np.asarray(a), np.asarray(b)
    total = max(len(a), len(b))
    if total == 0:
        return 1.0
    n = min(len(a), len(b))
    width = a.shape[1] if a.ndim > 1 else 1
    equal = int(np.sum(a[:n] == b[:n]))
    return equal / (total * width)


def first_divergent_frame(a: Any, b: Any) -> Optional[int]:
    """Return the index of the first frame where two code streams differ (None when identical)."""
    a, b = np.asarray(a), np.asarray(b)
    n = min(len(a), len(b))
    for i in range(n):
        if not np.array_equal(a[i], b[i]):
            return i
    return None if len(a) == len(b) else n
