"""Streaming decode: chunked output equals one-shot decode, causality, O(new frames) work, schedule rules."""

import pytest
import torch

from moss_npu.codec import OFFICIAL_SCHEDULE, DecodeSchedule
from moss_npu.errors import ConfigError, InputError

FRAMES = 14  # longer than every attention window of the small codec (conftest), so eviction is exercised


def _codes(batch=1, frames=FRAMES, seed=0):
    return torch.randint(0, 1024, (16, batch, frames), generator=torch.Generator().manual_seed(seed))


def _close(a, b):
    assert a.shape == b.shape
    assert (a - b).abs().max() <= 1e-5 * b.abs().max(), float((a - b).abs().max())


def _stream(codec, codes, chunks, max_frames_per_step=4):
    state = codec.init_decode_state(codes.shape[1], max_frames_per_step=max_frames_per_step)
    out, start = [], 0
    for n in chunks:
        out.append(codec.decode_step(codes[:, :, start:start + n], state))
        start += n
    assert start == codes.shape[2]
    return torch.cat(out, dim=-1), state


@pytest.mark.parametrize("chunks", [
    pytest.param([1] * FRAMES, id="frame-by-frame"),
    pytest.param([1, 2, 4, 7], id="growing-budget"),
    pytest.param([FRAMES], id="one-call-larger-than-ring"),
    pytest.param([3, 5, 6], id="uneven"),
])
def test_streaming_equals_offline(small_codec, chunks):
    codes = _codes(batch=2)
    offline, _ = small_codec.decode(codes)
    streamed, _ = _stream(small_codec, codes, chunks)
    _close(streamed, offline)


def test_offline_decode_is_causal(small_codec):
    """Appending frames leaves the audio of earlier frames unchanged."""
    codes = _codes()
    full, _ = small_codec.decode(codes)
    prefix, _ = small_codec.decode(codes[:, :, :5])
    _close(full[..., : prefix.shape[-1]], prefix)


def test_incremental_decoding_does_linear_work(small_codec):
    """N frames decoded one per call push exactly N frames through the decoder (no re-decoding)."""
    _, state = _stream(small_codec, _codes(), [1] * FRAMES)
    assert state.frames_processed == FRAMES
    _, state = _stream(small_codec, _codes(), [2, 5, 7])
    assert state.frames_processed == FRAMES


def test_reset_starts_a_new_stream(small_codec):
    codes = _codes(seed=1)
    first, state = _stream(small_codec, codes, [4, 4, 6])
    state.reset()
    assert state.frames_processed == 0
    again = torch.cat([small_codec.decode_step(codes[:, :, i:i + 7], state) for i in (0, 7)], dim=-1)
    _close(again, first)


def test_rows_with_different_frame_counts(small_codec):
    """A call may carry fewer frames for some rows; each row still equals its own offline decode."""
    codes = _codes(batch=2, seed=2)
    offline, _ = small_codec.decode(codes)
    state = small_codec.init_decode_state(2, max_frames_per_step=4)
    first = small_codec.decode_step(codes[:, :, :6], state, lengths=torch.tensor([6, 2]))
    assert first[1, :, 2 * 3840:].abs().max() == 0  # nothing past row 1's frames
    rest = torch.stack([codes[:, 0, 6:10], codes[:, 1, 2:6]], dim=1)
    second = small_codec.decode_step(rest, state)
    _close(torch.cat([first[0], second[0]], dim=-1), offline[0, :, : 10 * 3840])
    _close(torch.cat([first[1, :, : 2 * 3840], second[1]], dim=-1), offline[1, :, : 6 * 3840])


def test_state_batch_must_match(small_codec):
    state = small_codec.init_decode_state(1)
    with pytest.raises(InputError, match="batch 2"):
        small_codec.decode_step(_codes(batch=2, frames=1), state)


@pytest.mark.parametrize("emitted_s, lead_s, budget", [
    (0.0, 5.0, 1), (1.0, 0.1, 1), (1.0, 0.3, 2), (1.0, 0.9, 4), (1.0, 1.5, 8), (1.0, 0.2, 2)],
    ids=["nothing-emitted", "lead<0.20", "lead<0.55", "lead<1.10", "lead>=1.10", "threshold-is-exclusive"])
def test_official_budgets(emitted_s, lead_s, budget):
    assert OFFICIAL_SCHEDULE.budget(emitted_s, lead_s) == budget


def test_decide_now_rules():
    s = OFFICIAL_SCHEDULE
    assert s.frames_to_decode(emitted_s=0.0, lead_s=0.0, head_pending=1, max_pending=1) == 1  # first audio asap
    assert s.frames_to_decode(emitted_s=2.0, lead_s=0.3, head_pending=1, max_pending=1) == 2  # head row, lead<0.45
    assert s.frames_to_decode(emitted_s=2.0, lead_s=0.9, head_pending=1, max_pending=3) == 0  # wait for 4
    assert s.frames_to_decode(emitted_s=2.0, lead_s=0.9, head_pending=0, max_pending=4) == 4  # budget reached
    assert s.frames_to_decode(emitted_s=2.0, lead_s=0.9, head_pending=1, max_pending=3, final=True) == 3
    assert s.frames_to_decode(emitted_s=2.0, lead_s=0.9, head_pending=0, max_pending=0, final=True) == 0
    assert s.lead_s(2.0, None) == 0.0 and s.lead_s(2.0, 0.5) == 1.5


def test_presets_are_data():
    assert DecodeSchedule(budgets=(4, 6, 8, 12)).budget(1.0, 2.0) == 12  # the official CUDA service's budgets
    custom = DecodeSchedule(lead_thresholds_s=(0.5,), budgets=(3, 9))
    assert custom.budget(1.0, 0.4) == 3 and custom.budget(1.0, 0.6) == 9
    with pytest.raises(ConfigError, match="budgets"):
        DecodeSchedule(lead_thresholds_s=(0.5,), budgets=(1, 2, 3))
