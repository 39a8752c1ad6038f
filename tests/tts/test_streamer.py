"""One stream's codec schedule (``tts.streamer``): frames that wait are decoded together, within the codec state."""

import torch

from moss_npu.tts.prepare import Plan
from moss_npu.tts.settings import RunConfig
from moss_npu.tts.streamer import AudioStreamer


class FakeRows:
    """A codec of 10 samples per frame that records the frames of each call."""

    max_frames_per_step = 8

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


def test_frames_waiting_behind_playback_go_in_one_codec_call():
    """The first frame is decoded alone (the time to first audio); five frames that arrived while playback ran
    dry (lead < 0: the budget is one frame) are then decoded in one call, not five."""
    now = [0.0]
    audio, rows = streamer(lambda: now[0])
    audio.add(torch.zeros(16, dtype=torch.long))
    assert len(list(audio.decode_due())) == 1 and rows.calls == [{0: 1}]
    now[0] = 1.0  # 10 ms of audio out, a second gone
    for _ in range(5):
        audio.add(torch.zeros(16, dtype=torch.long))
    chunks = list(audio.decode_due())
    assert rows.calls[1:] == [{0: 5}] and [c.waveform.shape[-1] for c in chunks] == [50]


def test_no_codec_call_takes_more_frames_than_its_state_holds():
    now = [0.0]
    audio, rows = streamer(lambda: now[0])
    for _ in range(19):
        audio.add(torch.zeros(16, dtype=torch.long))
    list(audio.end_chunk("text"))
    assert [call[0] for call in rows.calls] == [8, 8, 3]
