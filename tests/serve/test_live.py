"""The WebSocket ``/v1/audio/speech/stream`` with a real client (``websockets``): text sent in pieces.

Greedy runs of the tiny model yield exactly N frames per sentence (conftest), so a session's audio length
is known: sentences × N × 3840 samples plus the pipeline's pause before every sentence but the first.
"""

from __future__ import annotations

import json
import time

import pytest

from moss_npu.nano.text import pause_samples
from moss_npu.tts.prepare import split_sentences
from tests.optional import require
from tests.serve.conftest import API_KEY, FRAME, MODEL, serve_module

serve_module("fastapi")
sync_client = require("websockets.sync.client", "pip install -e '.[dev]'")
from websockets.exceptions import InvalidStatus  # noqa: E402

FRAMES = 6
SENTENCES = ["First sentence here.", "Second one comes next.", "Third and last."]
CONFIG = {"type": "session.config", "model": MODEL, "voice": "default", "response_format": "pcm",
          "max_new_frames": FRAMES, "greedy": True}


def url(server) -> str:
    return server.url.replace("http://", "ws://") + "/v1/audio/speech/stream"


def connect(server, key=API_KEY):
    return sync_client.connect(url(server), additional_headers={"Authorization": f"Bearer {key}"},
                               open_timeout=30, close_timeout=5)


def expected_samples(speed: float = 1.0) -> int:
    pauses = sum(round(pause_samples(s, 48000) / speed) for s in SENTENCES[:-1])
    return len(SENTENCES) * round(FRAMES * FRAME / speed) + pauses


def collect(ws, timeout: float = 120.0) -> tuple[list[dict], bytes]:
    """Read until session.done or error; return (JSON events, the binary audio joined)."""
    events, audio = [], b""
    while True:
        message = ws.recv(timeout=timeout)
        if isinstance(message, bytes):
            audio += message
            continue
        events.append(json.loads(message))
        if events[-1]["type"] in ("session.done", "error"):
            return events, audio


def test_sentences_split_only_where_the_text_is_complete():
    assert split_sentences("Pi is 3.") == ([], "Pi is 3.")  # "3." may go on as "3.14"
    assert split_sentences("Pi is 3.14. Next") == (["Pi is 3.14."], " Next")
    assert split_sentences('He said "Hi!" then') == (['He said "Hi!"'], " then")
    assert split_sentences("你好。世界") == (["你好。"], "世界")
    assert split_sentences("the rest", final=True) == (["the rest"], "")


def test_first_audio_comes_before_the_text_ends_and_matches_the_whole_text(server):
    with connect(server) as ws:
        ws.send(json.dumps(CONFIG))
        ws.send(json.dumps({"type": "input.text", "text": "First sen"}))
        time.sleep(0.3)
        ws.send(json.dumps({"type": "input.text", "text": "tence here. Sec"}))
        # Nothing else is sent until the first sentence's audio arrives: it cannot wait for the end marker.
        start = json.loads(ws.recv(timeout=120))
        assert start == {"type": "audio.start", "sentence_index": 0, "sentence_text": SENTENCES[0],
                         "format": "pcm", "sample_rate": 48000, "channels": 2}
        first = ws.recv(timeout=120)
        assert isinstance(first, bytes) and len(first) > 0
        time.sleep(0.3)
        ws.send(json.dumps({"type": "input.text", "text": "ond one comes next. Third "}))
        time.sleep(0.3)
        ws.send(json.dumps({"type": "input.text", "text": "and last."}))
        ws.send(json.dumps({"type": "input.done"}))
        events, audio = collect(ws)
    pieces = first + audio
    with connect(server) as ws:
        ws.send(json.dumps(CONFIG))
        ws.send(json.dumps({"type": "input.text", "text": " ".join(SENTENCES)}))
        ws.send(json.dumps({"type": "input.done"}))
        whole_events, whole = collect(ws)
    # ±1 frame per sentence (issue 25); greedy decoding makes them equal.
    assert abs(len(pieces) - len(whole)) <= len(SENTENCES) * FRAME * 4
    assert len(pieces) // 4 == len(whole) // 4 == expected_samples()
    starts = [e for e in [start, *events] if e["type"] == "audio.start"]
    assert [e["sentence_text"] for e in starts] == SENTENCES
    done = [e for e in events if e["type"] == "audio.done"]
    assert [e["sentence_index"] for e in done] == [0, 1, 2]
    assert sum(e["total_bytes"] for e in done) == len(pieces)
    # Sentence spans tile the session's audio; each sentence's text chunks lie inside its span.
    assert done[0]["start"] == 0 and done[-1]["end"] == pytest.approx(expected_samples() / 48000, abs=1e-6)
    assert all(a["end"] == b["start"] for a, b in zip(done, done[1:]))
    for sentence in done:
        stamps = sentence["timestamps"]
        assert stamps and sentence["start"] <= stamps[0]["start"] and stamps[-1]["end"] == sentence["end"]
    final = events[-1]
    assert final["type"] == "session.done" and final["total_sentences"] == 3
    assert final["usage"]["output_tokens"] == 3 * FRAMES and final["usage"]["input_tokens"] > 0
    assert [e["type"] for e in whole_events].count("audio.done") == 3


def test_speed_applies_to_every_sentence_and_pause(server):
    require("pylibrb", 'pip install -e ".[tempo]"')
    with connect(server) as ws:
        ws.send(json.dumps({**CONFIG, "speed": 1.5}))
        ws.send(json.dumps({"type": "input.text", "text": " ".join(SENTENCES)}))
        ws.send(json.dumps({"type": "input.done"}))
        events, audio = collect(ws)
    assert events[-1]["type"] == "session.done"
    assert len(audio) // 4 == expected_samples(1.5)


@pytest.mark.parametrize("config, param", [
    ({**CONFIG, "model": "tts-1"}, "model"),
    ({**CONFIG, "speed": 9.0}, "speed"),
    ({**CONFIG, "response_format": "mp3"}, "response_format"),
    ({**CONFIG, "volume": 3}, "volume"),
    ({"type": "input.text", "text": "no config first"}, "type"),
])
def test_a_bad_session_config_gets_an_error_event_in_the_openai_shape(server, config, param):
    with connect(server) as ws:
        ws.send(json.dumps(config))
        events, audio = collect(ws)
    error = events[-1]
    assert error["type"] == "error" and not audio
    assert set(error["error"]) == {"message", "type", "param", "code"} and error["error"]["param"] == param


def test_a_wrong_key_is_refused_at_the_handshake(server):
    with pytest.raises(InvalidStatus) as refused:
        connect(server, key="wrong")
    assert refused.value.response.status_code == 403


def test_a_keyless_server_takes_sessions_only_from_its_own_pages(keyless_server):
    with pytest.raises(InvalidStatus):
        sync_client.connect(url(keyless_server), origin="http://evil.example", open_timeout=30)
    own = f"http://127.0.0.1:{keyless_server.port}"
    with sync_client.connect(url(keyless_server), origin=own, open_timeout=30) as ws:
        ws.send(json.dumps({**CONFIG, "model": "nope"}))
        events, _ = collect(ws)
    assert events[-1]["error"]["code"] == "model_not_found"


def test_whole_files_per_sentence_without_stream_audio(server):
    import io

    import soundfile

    with connect(server) as ws:
        ws.send(json.dumps({**CONFIG, "response_format": "flac", "stream_audio": False}))
        ws.send(json.dumps({"type": "input.text", "text": SENTENCES[0]}))
        ws.send(json.dumps({"type": "input.done"}))
        frames = []
        while True:
            message = ws.recv(timeout=120)
            if isinstance(message, bytes):
                frames.append(message)
            elif json.loads(message)["type"] == "session.done":
                break
    assert len(frames) == 1
    samples, rate = soundfile.read(io.BytesIO(frames[0]), dtype="float32", always_2d=True)
    assert rate == 48000 and samples.shape == (FRAMES * FRAME, 2)
