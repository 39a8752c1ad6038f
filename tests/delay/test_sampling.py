"""The Delay sampler: RNG use (one draw per row, none when greedy), penalty rule, top-p edge, clamp."""

import numpy as np

from moss_npu.delay.sampling import apply_repetition_penalty, apply_top_p, draw, sample_token


def _state(rng):
    return rng.get_state()[1].copy(), rng.get_state()[2]


def test_greedy_draws_nothing():
    rng = np.random.RandomState(3)
    before = _state(rng)
    logits = np.array([[0.1, 2.0, -1.0]], dtype=np.float32)
    assert sample_token(logits, rng, do_sample=False).tolist() == [1]
    after = _state(rng)
    assert np.array_equal(before[0], after[0]) and before[1] == after[1]


def test_top_k_1_still_draws_one_uniform_per_row():
    logits = np.random.RandomState(0).randn(3, 50).astype(np.float32)
    rng = np.random.RandomState(9)
    tokens = sample_token(logits, rng, top_k=1)
    assert tokens.tolist() == logits.argmax(axis=1).tolist()
    reference = np.random.RandomState(9)
    reference.random_sample(3)
    assert rng.random_sample() == reference.random_sample()


def test_penalty_divides_positive_and_multiplies_negative_logits():
    logits = np.array([[2.0, -2.0, 1.0, -np.inf]], dtype=np.float32)
    out = apply_repetition_penalty(logits, np.array([[0, 1, 3, 1024]]), 2.0)
    assert out.tolist() == [[1.0, -4.0, 1.0, -np.inf]]
    assert logits[0, 0] == 2.0  # input untouched


def test_penalty_one_or_no_history_is_identity():
    logits = np.ones((1, 4), dtype=np.float32)
    assert apply_repetition_penalty(logits, None, 2.0) is logits
    assert apply_repetition_penalty(logits, np.array([1]), 1.0) is logits


def test_top_p_keeps_the_token_that_crosses_the_threshold():
    probs = np.array([[0.5, 0.3, 0.15, 0.05]])
    out = apply_top_p(np.log(probs).astype(np.float32), 0.7)
    assert np.isfinite(out[0, :2]).all() and np.isinf(out[0, 2:]).all()


def test_top_p_always_keeps_the_most_likely_token():
    out = apply_top_p(np.log(np.array([[0.9, 0.1]])).astype(np.float32), 0.01)
    assert np.isfinite(out[0, 0]) and np.isinf(out[0, 1])


def test_draw_clamps_when_the_cumsum_ends_below_the_uniform():
    class One:
        def random_sample(self, n):
            return np.full(n, 0.99999999)

    probs = np.array([[0.5, 0.49999]], dtype=np.float32)
    assert draw(probs, One()).tolist() == [1]


def test_per_head_penalty_for_3d_logits_uses_each_heads_history():
    logits = np.ones((1, 2, 4), dtype=np.float32)
    out = apply_repetition_penalty(logits, np.array([[0, 3]]), 2.0)
    assert out[0, 0].tolist() == [0.5, 1, 1, 1] and out[0, 1].tolist() == [1, 1, 1, 0.5]


def test_any_leading_shape_is_sampled_row_by_row():
    logits = np.random.RandomState(1).randn(2, 3, 40).astype(np.float32)
    tokens = sample_token(logits, np.random.RandomState(0), top_k=5, top_p=0.9)
    flat = sample_token(logits.reshape(6, 40), np.random.RandomState(0), top_k=5, top_p=0.9)
    assert tokens.shape == (2, 3) and tokens.ravel().tolist() == flat.tolist()
