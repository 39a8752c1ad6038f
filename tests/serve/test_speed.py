"""``speed`` and timestamps over real HTTP: the openai client whole and streamed, SSE timestamp events.

Greedy runs of the tiny model yield exactly N frames (conftest), so the audio at ``speed`` s is
round(N × 3840 / s) samples per channel, whole or streamed.
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import soundfile

from tests.optional import require
from tests.serve.conftest import API_KEY, FRAME, MODEL, serve_module

serve_module("fastapi")
openai = serve_module("openai")
require("pylibrb", 'pip install -e ".[tempo]"')

FRAMES = 8
GREEDY = {"max_new_frames": FRAMES, "greedy": True}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def pcm_frames(data: bytes) -> int:
    return len(data) // 4  # stereo int16


@pytest.mark.parametrize("speed", [0.5, 1.5, 3.0])
def test_openai_client_speed_whole_and_streamed(client, speed):
    expected = round(FRAMES * FRAME / speed)
    whole = client.audio.speech.create(model=MODEL, voice="default", input="Hello there.", response_format="wav",
                                       speed=speed, extra_body=GREEDY).read()
    samples, rate = soundfile.read(io.BytesIO(whole), dtype="int16", always_2d=True)
    assert rate == 48000 and samples.shape == (expected, 2)
    with client.audio.speech.with_streaming_response.create(model=MODEL, voice="default", input="Hello there.",
                                                            response_format="pcm", speed=speed,
                                                            extra_body=GREEDY) as response:
        streamed = b"".join(response.iter_bytes())
    assert abs(pcm_frames(streamed) - expected) <= FRAME  # ±1 codec frame (issue 25); in fact equal
    # The same audio: the WAV encoder and the PCM path round to int16 apart by at most one step.
    assert np.abs(np.frombuffer(streamed, "<i2").reshape(-1, 2).astype(int) - samples).max() <= 1


def test_speed_one_is_todays_audio(client):
    body = dict(model=MODEL, voice="default", input="Same words.", response_format="pcm", extra_body=GREEDY)
    assert client.audio.speech.create(**body).read() == client.audio.speech.create(speed=1.0, **body).read()


def test_sse_carries_timestamps_that_cover_the_audio(server):
    body = {"model": MODEL, "input": "One sentence here.", "stream_format": "sse", "response_format": "pcm",
            "speed": 1.5, **GREEDY}
    with server.client(timeout=120) as http, http.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    stamps = [e for e in events if e["type"] == "speech.audio.timestamp"]
    assert events[-1]["type"] == "speech.audio.done"
    assert len(stamps) == 1 and stamps[0]["index"] == 0 and stamps[0]["text"]
    assert stamps[0]["start"] == 0
    assert stamps[0]["end"] == pytest.approx(pcm_frames(audio) / 48000, abs=1e-6)
    assert pcm_frames(audio) == round(FRAMES * FRAME / 1.5)
