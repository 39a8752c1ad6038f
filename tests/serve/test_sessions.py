"""WebSocket sessions that last, and messages that cannot stall the server (issue 36).

The server here has a 1 s header-read timeout and a 6 s idle timeout (``--request-timeout``), so a session that
outlives the first several times over, and one that outlives the second, take seconds, not minutes.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from moss_npu.nano.text import pause_samples
from tests.optional import require
from tests.serve.conftest import FRAME, MODEL, ServerProcess, serve_module

serve_module("fastapi")
httpx = serve_module("httpx")
sync_client = require("websockets.sync.client", "pip install -e '.[dev]'")
from websockets.exceptions import ConnectionClosed  # noqa: E402

HEADER_TIMEOUT_S = 1
IDLE_TIMEOUT_S = 6
FRAMES = 4
CONFIG = {"type": "session.config", "model": MODEL, "voice": "default", "response_format": "pcm",
          "max_new_frames": FRAMES, "greedy": True}
# /health while the server takes a huge message: the acceptance's 100 ms, with room for a CI machine whose two
# cores run other tests too. Parsing such a message on the event loop took seconds.
HEALTH_BOUND_S = 0.5


@pytest.fixture(scope="module")
def session_server(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("sessions"), "--device", "auto", "--header-timeout",
                         str(HEADER_TIMEOUT_S), "--request-timeout", str(IDLE_TIMEOUT_S), api_key=None)
    yield proc
    proc.stop()


def test_health_shows_the_device_a_worker_resolved(session_server):
    """Started with --device auto, the worker says where it runs (here: the CPU), not "auto"."""
    assert [w["device"] for w in session_server.health()["workers"]] == ["cpu"]


def connect(server):
    return sync_client.connect(server.url.replace("http://", "ws://") + "/v1/audio/speech/stream",
                               open_timeout=30, close_timeout=5)


class Reader(threading.Thread):
    """Receives a session's messages while the test sends: audio bytes with their arrival times, JSON events."""

    def __init__(self, ws) -> None:
        super().__init__(daemon=True)
        self.ws, self.events, self.audio, self.audio_at, self.closed = ws, [], 0, [], None

    def run(self) -> None:
        try:
            while True:
                message = self.ws.recv(timeout=60)
                if isinstance(message, bytes):
                    self.audio += len(message)
                    self.audio_at.append(time.monotonic())
                    continue
                self.events.append(json.loads(message))
                if self.events[-1]["type"] in ("session.done", "error"):
                    return
        except (ConnectionClosed, TimeoutError) as exc:
            self.closed = exc


def test_a_session_outlives_the_header_timeout_with_text_in_pieces_and_audio_throughout(session_server):
    """Text arrives in pieces over ~9 s (9 header timeouts), audio flows in between, the session ends cleanly."""
    sentences = [f"Sentence number {i} is here." for i in range(6)]
    with connect(session_server) as ws:
        reader = Reader(ws)
        reader.start()
        ws.send(json.dumps(CONFIG))
        started = time.monotonic()
        for sentence in sentences:
            half = len(sentence) // 2
            for piece in (sentence[:half], sentence[half:] + " "):
                ws.send(json.dumps({"type": "input.text", "text": piece}))
                time.sleep(0.75)
        last_text = time.monotonic()
        ws.send(json.dumps({"type": "input.done"}))
        reader.join(120)
    assert reader.closed is None and reader.events[-1]["type"] == "session.done", reader.closed
    assert last_text - started > 8 * HEADER_TIMEOUT_S
    assert reader.events[-1]["total_sentences"] == len(sentences)
    pauses = sum(pause_samples(s, 48000) for s in sentences[:-1])
    assert reader.audio // 4 == len(sentences) * FRAMES * FRAME + pauses
    # audio came while the text was still arriving, not only at the end
    assert reader.audio_at[0] - started < (last_text - started) / 2


def test_a_silent_session_gets_a_timeout_event_and_a_close_frame(session_server):
    with connect(session_server) as ws:
        ws.send(json.dumps(CONFIG))
        started = time.monotonic()
        event = json.loads(ws.recv(timeout=IDLE_TIMEOUT_S + 30))
        waited = time.monotonic() - started
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
    assert event["type"] == "error" and event["error"]["code"] == "timeout"
    assert waited > IDLE_TIMEOUT_S - 1  # the idle timeout, not the header timeout, ended it
    assert ws.close_code == 1008


def test_a_deeply_nested_message_is_an_invalid_json_event(session_server):
    with connect(session_server) as ws:
        ws.send("[" * 100_000)
        event = json.loads(ws.recv(timeout=30))
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
    assert event["type"] == "error" and event["error"]["code"] == "invalid_json"
    assert ws.close_code == 1008
    assert "RecursionError" not in session_server.output()


def _health_latencies(server, stop: threading.Event, out: list) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        while not stop.is_set():
            started = time.monotonic()
            assert http.get("/health").status_code == 200
            out.append(time.monotonic() - started)
            time.sleep(0.01)


@pytest.mark.parametrize("text, code", [
    ("a" * 10_000_000, "message_too_large"),  # over the limit: refused before it is parsed
    ("Short one. " * 90_000, None),  # under it (~1 MB, 90,000 sentences): parsed and split off the event loop
], ids=["10MB", "1MB-of-sentences"])
def test_a_huge_message_does_not_stall_health(session_server, text, code):
    latencies: list[float] = []
    stop = threading.Event()
    poller = threading.Thread(target=_health_latencies, args=(session_server, stop, latencies), daemon=True)
    poller.start()
    time.sleep(0.3)
    try:
        with connect(session_server) as ws:
            ws.send(json.dumps(CONFIG))
            sent = len(latencies)
            ws.send(json.dumps({"type": "input.text", "text": text}))
            event = json.loads(ws.recv(timeout=60))
            time.sleep(0.5)
    finally:
        stop.set()
        poller.join(30)
    if code is None:
        assert event["type"] == "audio.start"
    else:
        assert event["type"] == "error" and event["error"]["code"] == code
    assert len(latencies) > sent and max(latencies[sent:]) < HEALTH_BOUND_S, latencies[sent:]


@pytest.mark.slow
def test_a_two_minute_session_on_the_default_timeouts(tmp_path):
    """The acceptance's session, at full length on the documented defaults (10 s header timeout, 300 s idle): text
    in pieces over the first 60 s with audio throughout, a silent minute, then the last sentence and input.done at
    ~2 min; the session ends with session.done and every sample, never cut at 10 s."""
    server = ServerProcess(tmp_path, "--device", "cpu", api_key=None)
    try:
        sentences = [f"Piece {i} of a long talk." for i in range(12)] + ["And the last one."]
        with connect(server) as ws:
            reader = Reader(ws)
            reader.start()
            ws.send(json.dumps(CONFIG))
            started = time.monotonic()
            for sentence in sentences[:-1]:  # one every 5 s for a minute
                ws.send(json.dumps({"type": "input.text", "text": sentence + " "}))
                time.sleep(5)
            first_minute = [at for at in reader.audio_at if at - started < 60]
            time.sleep(max(0.0, 115 - (time.monotonic() - started)))  # a silent minute, far below 300 s
            ws.send(json.dumps({"type": "input.text", "text": sentences[-1]}))
            ws.send(json.dumps({"type": "input.done"}))
            reader.join(120)
            lasted = time.monotonic() - started
    finally:
        server.stop()
    assert reader.closed is None and reader.events[-1]["type"] == "session.done", reader.closed
    assert lasted > 115 and len({int((at - started) // 10) for at in first_minute}) >= 5  # audio in most 10 s spans
    assert reader.events[-1]["total_sentences"] == len(sentences)
    pauses = sum(pause_samples(s, 48000) for s in sentences[:-1])
    assert reader.audio // 4 == len(sentences) * FRAMES * FRAME + pauses
