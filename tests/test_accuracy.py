"""Accuracy metrics on inputs whose answers can be worked out by hand."""

import math

import numpy as np
import pytest
import torch

from moss_npu import accuracy


def test_max_abs_and_mse():
    a, b = [1.0, 2.0, 4.0], [1.0, 2.5, 3.0]
    assert accuracy.max_abs(a, b) == 1.0
    assert accuracy.mse(a, b) == pytest.approx((0 + 0.25 + 1.0) / 3)


def test_relative_error_uses_reference_norm():
    # ‖(3,4) − (0,0)‖ / ‖(0,0)‖ is undefined; ‖(3,4)−(0,4)‖/‖(0,4)‖ = 3/4
    assert accuracy.relative_error([3.0, 4.0], [0.0, 4.0]) == pytest.approx(0.75)
    assert accuracy.relative_error([0.0], [0.0]) == 0.0
    assert accuracy.relative_error([1.0], [0.0]) == math.inf


def test_cosine():
    assert accuracy.cosine([1.0, 0.0], [0.0, 1.0]) == pytest.approx(0.0)
    assert accuracy.cosine([2.0, 2.0], [1.0, 1.0]) == pytest.approx(1.0)
    assert accuracy.cosine([-1.0], [1.0]) == pytest.approx(-1.0)


def test_snr_db():
    # signal power 4 (values ±2), noise power 0.04 (error 0.2 everywhere) -> 10·log10(100) = 20 dB
    ref = np.array([2.0, -2.0, 2.0, -2.0])
    assert accuracy.snr_db(ref + 0.2, ref) == pytest.approx(20.0)
    assert accuracy.snr_db(ref, ref) == math.inf


def test_torch_inputs_and_shape_mismatch():
    assert accuracy.max_abs(torch.ones(3, dtype=torch.bfloat16), np.ones(3)) == 0.0
    with pytest.raises(ValueError, match="shapes differ"):
        accuracy.mse(np.zeros(3), np.zeros(4))
    assert not accuracy.same_length(np.zeros((2, 5)), np.zeros((2, 6)))


def test_token_agreement_and_first_divergence():
    a = np.array([[1, 2], [3, 4], [5, 6]])
    b = np.array([[1, 2], [3, 0], [5, 6]])
    assert accuracy.token_agreement(a, b) == pytest.approx(5 / 6)
    assert accuracy.first_divergent_frame(a, b) == 1
    assert accuracy.first_divergent_frame(a, a) is None
    # a shorter stream diverges where it ends, and its missing frames count as disagreement
    assert accuracy.first_divergent_frame(a[:2], a) == 2
    assert accuracy.token_agreement(a[:2], a) == pytest.approx(4 / 6)
