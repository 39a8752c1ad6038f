"""A sentence whose text chunk gave no audio (the engine retried it once, ``tts.loop``) is not dropped silently
over the WebSocket either: the session sends an ``audio.warning`` event naming it before the sentence's
``audio.done``, as the SSE stream sends ``speech.audio.warning``."""

import asyncio
from types import SimpleNamespace

import numpy as np

from moss_npu.serve.drain import Drain
from moss_npu.serve.live import Session
from moss_npu.serve.schema import speech_body

WARNING = "text chunk 1 ('Quiet.') gave no audio after one retry with the next seed"


class ScriptedTicket:
    """A worker's answer to one sentence, as the pool hands it on: audio, then the request's summary."""

    def __init__(self, events):
        self.events = list(events)

    async def next(self, timeout):
        return self.events.pop(0)


class Socket:
    def __init__(self):
        self.sent = []

    async def send_json(self, message):
        self.sent.append(message)

    async def send_bytes(self, data):
        self.sent.append(len(data))


def _speak(summary):
    ws = Socket()
    pool = SimpleNamespace(audio_format=lambda: (48000, 2))
    session = Session(ws, pool, make_job=None, config=SimpleNamespace(request_timeout_s=5.0), drain=Drain())
    ticket = ScriptedTicket([("chunk", np.zeros((2, 480), np.float32)), ("done", summary)])
    body = speech_body({"model": "moss-tts-nano", "input": "Loud. Quiet.", "response_format": "pcm"})
    asyncio.run(session._sentence(0, "Loud. Quiet.", ticket, body, None))
    return [m for m in ws.sent if isinstance(m, dict)]


def test_a_chunk_without_audio_is_a_warning_event_before_the_sentence_ends():
    events = _speak({"input_tokens": 3, "frames": 1, "warnings": [WARNING]})
    assert [e["type"] for e in events] == ["audio.start", "audio.warning", "audio.done"]
    assert events[1] == {"type": "audio.warning", "sentence_index": 0, "message": WARNING}


def test_a_sentence_spoken_whole_has_no_warning():
    events = _speak({"input_tokens": 3, "frames": 1, "warnings": []})
    assert [e["type"] for e in events] == ["audio.start", "audio.done"]
