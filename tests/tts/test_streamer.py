"""One stream's codec schedule (``tts.streamer``): frames that wait are decoded together."""

import torch

from moss_npu.tts.prepare import Plan
from moss_npu.tts.settings import RunConfig
from moss_npu.tts.streamer import AudioStreamer


class FakeRows:
    """A codec of 10 samples per frame that records the frames of each call."""

    def __init__(self):
        self.codec = type("Codec", (), {"sample_rate": 1000, "channels": 1})()
        self.calls = []

    def start(self, row, prime=None):
        pass

    def decode(self, due):
        self.calls.append({row: codes.shape[0] for row, codes in due.items()})
        return {row: torch.zeros(1, codes.shape[0] * 10) for row, codes in due.items()}


def streamer(clock):
    rows = FakeRows()
    audio = AudioStreamer(Plan("continuation", ["text"], None, None, 16), RunConfig(), rows, clock=clock)
    audio.start_chunk(0)
    return audio, rows


def frames(audio, count):
    for _ in range(count):
        audio.add(torch.zeros(16, dtype=torch.long))


def test_frames_that_wait_go_in_one_codec_call():
    """The first frame is decoded alone (the time to first audio); five frames that waited while the lead is
    short (the official budget: one frame) are then decoded in one call, not five."""
    now = [0.0]
    audio, rows = streamer(lambda: now[0])
    frames(audio, 1)
    assert len(list(audio.decode_due())) == 1 and rows.calls == [{0: 1}]
    now[0] = 0.005  # 10 ms of audio out, 5 ms gone: a lead of 5 ms
    frames(audio, 5)
    chunks = list(audio.decode_due())
    assert rows.calls[1:] == [{0: 5}] and [c.waveform.shape[-1] for c in chunks] == [50]


def test_behind_playback_a_stream_waits_for_the_largest_budget():
    """Behind playback (lead < 0) the official schedule decodes every frame on its own, the dearest way; a stream
    decoded alone waits for the largest budget (8 frames) and decodes them in one call."""
    now = [0.0]
    audio, rows = streamer(lambda: now[0])
    frames(audio, 1)
    list(audio.decode_due())
    now[0] = 1.0  # 10 ms of audio out, a second gone
    for _ in range(7):
        frames(audio, 1)
        assert not list(audio.decode_due())
    frames(audio, 1)
    assert [c.waveform.shape[-1] for c in audio.decode_due()] == [80] and rows.calls[1:] == [{0: 8}]
    assert audio.due() is None and rows.calls[1:] == [{0: 8}]


def test_the_engine_keeps_the_official_counts():
    """``due`` without ``alone`` (the engine, whose calls pad every row to the longest) takes the budget."""
    now = [0.0]
    audio, rows = streamer(lambda: now[0])
    frames(audio, 1)
    list(audio.decode_due())
    now[0] = 1.0
    frames(audio, 5)
    assert audio.due().shape[0] == 1

