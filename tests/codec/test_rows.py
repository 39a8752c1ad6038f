"""Many streams in one state (``CodecRows``): each row decodes as its own stream alone, however the rows mix."""

import pytest
import torch

from moss_npu.codec import load_codec
from moss_npu.codec.rows import CodecRows
from moss_npu.errors import InputError

FRAMES = 14  # longer than every attention window of the small codec (conftest), so eviction is exercised


def _codes(frames, seed):
    """Codes (F, Q) of one stream."""
    return torch.randint(0, 1024, (frames, 16), generator=torch.Generator().manual_seed(seed))


def _alone(codec, codes, skip=0):
    """The offline decode of one stream (F, Q), without the audio of its first ``skip`` frames."""
    audio, _ = codec.decode(codes.T[:, None, :])
    return audio[0, :, skip * codec.frame_size:]


def _close(got, want):
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), float((got - want).abs().max())


def test_rows_equal_streams_alone(small_codec):
    """Rows start primed, restart over an old stream, join late with fewer codebooks, and get uneven calls."""
    rows = CodecRows(small_codec, 4, max_frames_per_step=4)
    rows.start(1)
    rows.decode({1: _codes(5, seed=9)})  # an earlier stream in row 1, left half-way
    a, b, c, prime = _codes(FRAMES, 1), _codes(FRAMES, 2), _codes(FRAMES, 3)[:, :8], _codes(6, 4)
    rows.start(0, prime=b[:0])  # an empty prime is no prime
    rows.start(0, prime=prime)  # only the prime's state is kept, its audio is dropped
    rows.start(1)  # restarts row 1 (row 2 stays idle: a padded row inside the span)
    got, done, streams = {0: [], 1: [], 3: []}, {0: 0, 1: 0, 3: 0}, {0: a, 1: b, 3: c}
    # frames per row, per call; row 3 joins at the third call with 8 of the 16 codebooks
    calls = [{0: 1}, {0: 2, 1: 3}, {1: 1, 3: 2}, {0: 4, 1: 0, 3: 5}, {0: 7, 1: 10, 3: 7}]
    for k, call in enumerate(calls):
        if k == 2:
            rows.start(3)
        due = {r: streams[r][done[r]:done[r] + n] for r, n in call.items()}
        for r, wave in rows.decode(due).items():
            assert wave.shape == (small_codec.channels, call[r] * small_codec.frame_size)
            got[r].append(wave)
            done[r] += call[r]
    assert done == {0: FRAMES, 1: FRAMES, 3: FRAMES}
    _close(torch.cat(got[0], dim=1), _alone(small_codec, torch.cat([prime, a]), skip=prime.shape[0]))
    _close(torch.cat(got[1], dim=1), _alone(small_codec, b))
    _close(torch.cat(got[3], dim=1), _alone(small_codec, c))


def test_rows_are_checked(small_codec):
    rows = CodecRows(small_codec, 2)
    with pytest.raises(InputError, match="row 2"):
        rows.start(2)
    with pytest.raises(InputError, match="row -1"):
        rows.decode({-1: _codes(1, 0)})


def test_a_fresh_row_padded_in_a_call_stays_clean(small_codec_dir):
    """A just-started row inside another call's span sees no keys; with eager attention that is NaN, which
    must not stay in its ring (the audio it decodes next would be NaN)."""
    codec = load_codec(small_codec_dir, device="cpu", attention="eager")
    rows = CodecRows(codec, 2, max_frames_per_step=4)
    rows.start(0)
    rows.start(1)
    narrow, a = _codes(4, seed=5)[:, :8], _codes(4, seed=6)
    rows.decode({1: narrow[:3]})  # 8 codebooks: row 0 (16) is padded in this call, over 3 frames of steps
    first = rows.decode({0: a[:1], 1: narrow[3:]})  # row 0 overwrites only 1 frame of those steps
    rest = rows.decode({0: a[1:]})
    _close(torch.cat([first[0], rest[0]], dim=1), _alone(codec, a))
    _close(first[1], _alone(codec, narrow)[:, 3 * codec.frame_size:])


@pytest.mark.skipif(not hasattr(__import__("resource"), "getrusage"), reason="needs getrusage (POSIX)")
def test_a_row_starts_without_touching_the_pages_its_streams_never_wrote():
    """A server's codec state holds every slot's ring (28 MB a row for the real codec) in pages first touched on
    use. Starting a stream in a row writes none of the pages its earlier streams left unwritten (they are zero
    already), so a burst of new requests does not page in every row before its first audio; the slots a stream
    wrote are cleared, all of them once it wrapped around the ring."""
    import resource

    from moss_npu.codec.streaming import KVCache

    cache = KVCache.empty(2, 8, 64, context=16000, chunk_capacity=384, device=torch.device("cpu"),
                          dtype=torch.float32)  # 67 MB a row: ~16,000 pages
    faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt  # noqa: E731
    before = faults()
    cache.reset_row(1)
    assert faults() - before < 1000
    steps = torch.arange(5).view(1, 5)
    cache.write(torch.ones(1, 8, 5, 64), torch.ones(1, 8, 5, 64), torch.ones(1, 5, dtype=torch.bool), steps)
    before = faults()
    cache.reset_row(0)
    assert faults() - before < 1000  # the 5 slots written, not the row's ~16,000 pages
    assert not cache.keys[0].any() and not cache.values[0].any() and (cache.positions[0] == -1).all()
    assert cache.written[0] == 0 and cache.offsets[0] == 0
    cache.keys[1] = 1.0  # a stream that went round the ring: every slot may hold a key
    cache.positions[1] = 7
    cache.written[1] = cache.keys.shape[2] + 3
    cache.reset_row(1)
    assert not cache.keys[1].any() and (cache.positions[1] == -1).all()
