
import pytest
import torch

from moss_npu.errors import InputError
from moss_npu.sampling import (SamplingParams, SlotSampling, TokenParams, apply_repetition_penalty, draw_host,
                               filter_scores, sample_token, sample_with_noise)

NEG = float("-inf")


def test_repetition_penalty_once_per_unique_id():
    scores = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    history = torch.tensor([[0, 1, 0, 0, 9]])  # 9 is outside the vocab (like the pad id): ignored
    out = apply_repetition_penalty(scores, history, 2.0)
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]
    assert apply_repetition_penalty(scores, None, 2.0) is scores
    assert apply_repetition_penalty(scores, history, 1.0) is scores


def test_presence_mask_equals_history_scan():
    """A presence mask kept by the caller penalises exactly the ids a history scan would."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 16, generator=g)
    history = torch.randint(0, 20, (3, 7), generator=g)  # ids >= 16 stand for the pad id
    seen = torch.zeros(3, 21, dtype=torch.bool).scatter_(1, history, True)[:, :16]
    assert torch.equal(apply_repetition_penalty(scores, None, 1.3, seen),
                       apply_repetition_penalty(scores, history, 1.3))


def test_top_k_keeps_ties():
    scores = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    assert filter_scores(scores, 1.0, 2, 1.0).tolist() == [[NEG, 2.0, 2.0, NEG]]
    assert filter_scores(scores, 1.0, 1, 1.0).tolist() == [[NEG, 2.0, 2.0, NEG]]
    assert filter_scores(scores, 1.0, 10, 1.0).tolist() == scores.tolist()  # k > V: everything stays


def test_top_p_keeps_the_crossing_token():
    scores = torch.log(torch.tensor([[0.2, 0.5, 0.3]]))
    kept = filter_scores(scores, 1.0, 0, 0.6)  # 0.5 < 0.6, 0.5 + 0.3 crosses: keep both, drop 0.2
    assert torch.isinf(kept[0, 0]) and torch.isfinite(kept[0, 1:]).all()
    kept = filter_scores(scores, 1.0, 0, 0.4)  # the top token alone already crosses 0.4
    assert torch.isfinite(kept).tolist() == [[False, True, False]]


def test_temperature_divides():
    assert filter_scores(torch.tensor([[1.0, -3.0]]), 0.5, 0, 1.0).tolist() == [[2.0, -6.0]]


def test_greedy_takes_first_max_after_penalty():
    greedy = TokenParams(False, 1.0, 0, 1.0, repetition_penalty=4.0)
    logits = torch.tensor([[3.0, 3.0, 1.0], [0.0, 2.0, 1.0]])
    assert sample_token(logits, greedy).tolist() == [0, 1]
    assert sample_token(logits, greedy, torch.tensor([[0], [1]])).tolist() == [1, 2]


def test_multinomial_matches_the_official_call():
    """Same call, same shapes: a seeded run equals torch.multinomial on softmax of the filtered scores."""
    params = TokenParams(True, 0.8, 25, 0.95, 1.2)
    logits = torch.randn(3, 1024, generator=torch.Generator().manual_seed(0))
    history = torch.randint(0, 1024, (3, 5), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(11)
    got = sample_token(logits, params, history)
    torch.manual_seed(11)
    scores = filter_scores(apply_repetition_penalty(logits, history, 1.2), 0.8, 25, 0.95)
    want = torch.multinomial(torch.softmax(scores, dim=-1), 1).squeeze(-1)
    assert torch.equal(got, want)


def test_host_rng_inverse_cdf():
    probs = torch.tensor([[0.7, 0.3, 0.0]]).expand(4000, 3)
    ids = draw_host(probs, torch.Generator().manual_seed(0))
    assert not bool((ids == 2).any())
    assert abs(float((ids == 0).float().mean()) - 0.7) < 0.03
    # Near-equal distributions (as on two devices) pick the same tokens from the same seed.
    p = torch.softmax(torch.randn(64, 1024, generator=torch.Generator().manual_seed(2)), dim=-1)
    q = p * (1 + 1e-7 * torch.randn(64, 1024, generator=torch.Generator().manual_seed(3)))
    assert torch.equal(draw_host(p, torch.Generator().manual_seed(9)), draw_host(q, torch.Generator().manual_seed(9)))


@pytest.mark.parametrize("kwargs,needle", [
    ({"do_sample": True, "temperature": 0.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
])
def test_validation(kwargs, needle):
    values = dict(do_sample=False, temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0)
    values.update(kwargs)
    with pytest.raises(InputError, match=needle):
        TokenParams(**values)


def test_greedy_allows_zero_temperature():
    TokenParams(False, 0.0, 0, 1.0)


def test_defaults():
    api = SamplingParams()
    assert not api.do_sample and (api.text_temperature, api.audio_temperature, api.audio_top_p) == (1.5, 1.7, 0.8)
    rt = SamplingParams.runtime_defaults()
    assert rt.do_sample and rt.audio() == TokenParams(True, 0.8, 25, 0.95, 1.2)
    assert rt.text() == TokenParams(True, 1.0, 50, 1.0, 1.0)
    assert SamplingParams.runtime_defaults(audio_top_k=10).audio_top_k == 10
    with pytest.raises(InputError):
        SamplingParams(audio_repetition_penalty=-1.0)


def test_none_filters_mean_disabled_as_in_the_official_api():
    from moss_npu.sampling import TokenParams

    params = TokenParams(do_sample=True, temperature=1.0, top_k=None, top_p=None)
    assert params.top_k == 0 and params.top_p == 1.0
    assert SamplingParams(audio_top_k=None, text_top_p=None).audio().top_k == 0


def official_pick(logits, seen, penalty, temperature, top_k, top_p, u):
    """The official filter chain on one row in float64, then the inverse-CDF pick of ``u`` (as ``draw_host``)."""
    scores = apply_repetition_penalty(logits[None], None, penalty, seen[None])
    probs = torch.softmax(filter_scores(scores, temperature, top_k, top_p), dim=-1)[0]
    cdf = probs.cumsum(dim=-1)
    return int(torch.searchsorted(cdf, u * cdf[-1:], right=True).clamp(max=logits.shape[-1] - 1))


@pytest.mark.parametrize("seed", range(6))
def test_noise_fed_sampler_equals_the_official_chain(seed):
    """Same uniforms, same tokens as the official chain in float64: per-row parameters, ties, k >= V, greedy rows."""
    g = torch.Generator().manual_seed(seed)
    rows, vocab = 64, [2, 7, 50][seed % 3]
    logits = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 2
    logits[::2] = torch.round(logits[::2])  # many exact ties, also at the top-k and top-p boundaries
    seen = torch.rand(rows, vocab, generator=g) < 0.3
    params = SlotSampling.allocate(rows, torch.device("cpu"), torch.float64)
    choices = dict(temperature=[0.5, 0.8, 1.0, 1.7], top_k=[0, 1, 3, vocab, vocab + 4], top_p=[1.0, 0.95, 0.8, 0.3],
                   repetition_penalty=[1.0, 1.2, 0.7])
    picked = {}
    for name, values in choices.items():
        picked[name] = [values[int(i)] for i in torch.randint(0, len(values), (rows,), generator=g)]
    sample = [bool(x) for x in torch.rand(rows, generator=g) < 0.8]
    for r in range(rows):
        params.set(r, TokenParams(sample[r], picked["temperature"][r], picked["top_k"][r], picked["top_p"][r],
                                  picked["repetition_penalty"][r]))
    u = torch.rand(rows, generator=g, dtype=torch.float64)
    got = sample_with_noise(logits, params, u, seen)
    for r in range(rows):
        pen = picked["repetition_penalty"][r]
        if sample[r]:
            want = official_pick(logits[r], seen[r], pen, picked["temperature"][r], picked["top_k"][r],
                                 picked["top_p"][r], u[r])
        else:
            want = int(apply_repetition_penalty(logits[r:r + 1], None, pen, seen[r:r + 1]).argmax())
        assert int(got[r]) == want, f"row {r}"


@pytest.mark.parametrize("seed", range(4))
def test_an_eager_frames_rows_pick_what_the_general_chain_picks(seed):
    """``SlotSampling.rows`` given the held rows' parameters leaves out the filters none of them asks for (an eager
    frame's fewer device ops) and still picks, for those rows, the ids the general chain (a captured frame) picks."""
    g = torch.Generator().manual_seed(seed)
    rows, vocab = 8, [2, 7, 50, 1024][seed]
    kinds = [TokenParams(True, 1.0, 0, 1.0), TokenParams(True, 0.8, 25, 0.95, 1.2), TokenParams(False, 1.0, 50, 1.0),
             TokenParams(True, 1.0, vocab + 3, 1.0, 0.7)]
    for tokens in ([kinds[0]] * rows, [kinds[1]] * rows, [kinds[2]] * rows, [kinds[i % 4] for i in range(rows)]):
        params = SlotSampling.allocate(rows, torch.device("cpu"))
        for r, token in enumerate(tokens):
            params.set(r, token)
        logits = torch.round(torch.randn(rows, vocab, generator=g) * 4) / 2  # ties
        seen = torch.rand(rows, 3, vocab, generator=g) < 0.3
        u = torch.rand(rows, generator=g)
        eager = params.rows(rows, vocab, logits.dtype, seen, tokens)
        for c in range(3):
            assert torch.equal(eager.sample(logits, u, c), sample_with_noise(logits, params, u, seen[:, c])), c
    left_out = params.rows(rows, vocab, torch.float32, seen, [kinds[0]] * rows)
    assert left_out.sampled and (left_out.do_sample, left_out.temperature, left_out.kth, left_out.top_p,
                                 left_out.penalty) == (None,) * 5
    assert not params.rows(rows, vocab, torch.float32, None, [kinds[2]]).sampled


def test_noise_fed_sampler_never_picks_a_filtered_id():
    """A uniform just below 1 (float32 rounding puts the target on the total mass) stays inside the kept set."""
    logits = torch.tensor([[3.0, 2.0, -50.0, -60.0]])
    params = SlotSampling.allocate(1, torch.device("cpu"))
    params.set(0, TokenParams(True, 1.0, 2, 1.0))
    assert int(sample_with_noise(logits, params, torch.tensor([1.0 - 2 ** -24]))) == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_rows_draw_instead_of_raising(bad):
    """torch.multinomial raises on NaN probabilities (and may fault a device): such a row draws a valid id;
    reporting non-finite logits is the frame loop's job."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, bad, 0.0, 0.0]])
    params = TokenParams(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    ids = sample_token(logits, params, generator=torch.Generator().manual_seed(0))
    assert ids.shape == (2,) and bool(((ids >= 0) & (ids < 4)).all())
