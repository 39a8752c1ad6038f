"""A stop signal drains the server (issue 36): what is in flight finishes, what arrives is told to go elsewhere.

A rolling update in Kubernetes sends SIGTERM to a pod with requests in flight; the old server gave them 5 s and
then cut streams and answered whole-file requests with a bare 500.
"""

from __future__ import annotations

import json
import signal
import threading
import time

from tests.optional import require
from tests.serve.conftest import FRAME, MODEL, ServerProcess, assert_error, metric, serve_module

serve_module("fastapi")
httpx = serve_module("httpx")
sync_client = require("websockets.sync.client", "pip install -e '.[dev]'")
from websockets.exceptions import ConnectionClosed  # noqa: E402

FRAMES = 200
IN_FLIGHT = 8


def _speak(server: ServerProcess, body: dict, results: list, index: int) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        if body.get("response_format") == "pcm":
            with http.stream("POST", "/v1/audio/speech", json=body) as r:
                results[index] = (r.status_code, len(b"".join(r.iter_bytes())))
        else:
            r = http.post("/v1/audio/speech", json=body)
            results[index] = (r.status_code, len(r.content))


def _wait_in_flight(server: ServerProcess, count: int, within_s: float) -> None:
    end = time.monotonic() + within_s
    with httpx.Client(base_url=server.url, timeout=10) as http:
        while metric(http.get("/metrics").text, "moss_npu_in_flight_requests") < count:
            assert time.monotonic() < end, f"never {count} requests in flight"
            time.sleep(0.02)


def test_sigterm_with_requests_in_flight_loses_none(tmp_path):
    server = ServerProcess(tmp_path, "--device", "cpu", "--max-batch", str(IN_FLIGHT), "--shutdown-grace", "120",
                           api_key=None)
    try:
        bodies = [{"model": MODEL, "input": f"Request {i}.", "max_new_frames": FRAMES, "greedy": True,
                   "response_format": "pcm" if i % 2 else "wav"} for i in range(IN_FLIGHT)]
        results: list = [None] * IN_FLIGHT
        threads = [threading.Thread(target=_speak, args=(server, body, results, i)) for i, body in enumerate(bodies)]
        for thread in threads:
            thread.start()
        _wait_in_flight(server, IN_FLIGHT, 120)
        with sync_client.connect(server.url.replace("http://", "ws://") + "/v1/audio/speech/stream",
                                 open_timeout=30) as ws:
            ws.send(json.dumps({"type": "session.config", "model": MODEL, "voice": "default", "max_new_frames": 4,
                                "greedy": True}))
            ws.send(json.dumps({"type": "input.text", "text": "Spoken before the stop. Never finished"}))
            _wait_in_flight(server, IN_FLIGHT + 1, 60)  # the session's complete sentence too

            server.process.send_signal(signal.SIGTERM)
            with httpx.Client(base_url=server.url, timeout=10) as http:
                end = time.monotonic() + 10
                while http.get("/health").json()["status"] != "draining":
                    assert time.monotonic() < end, "/health never said draining"
                    time.sleep(0.02)
                assert http.get("/health").status_code == 503
                late = http.post("/v1/audio/speech", json={**bodies[0], "max_new_frames": 2})
            assert assert_error(late, 503)["code"] == "shutting_down" and int(late.headers["Retry-After"]) > 0

            events, audio = [], 0
            try:
                while True:
                    message = ws.recv(timeout=60)
                    if isinstance(message, bytes):
                        audio += len(message)
                    else:
                        events.append(json.loads(message))
            except ConnectionClosed:
                pass
            assert [e["type"] for e in events] == ["audio.start", "audio.done", "error"], events
            assert events[-1]["error"]["code"] == "shutting_down" and ws.close_code == 1001
            assert audio == 4 * FRAME * 4  # the complete sentence was spoken; the unfinished one was not

        for thread in threads:
            thread.join(120)
        header = 44  # the whole WAV's header
        expected = [FRAMES * FRAME * 4 + (0 if body["response_format"] == "pcm" else header) for body in bodies]
        assert results == [(200, size) for size in expected]
        assert server.process.wait(60) == 130
    finally:
        server.stop()


def test_a_request_that_outlasts_the_grace_gets_503_in_the_openai_shape(tmp_path):
    """Past --shutdown-grace a whole-file request is answered 503 shutting_down, not uvicorn's bare 500."""
    server = ServerProcess(tmp_path, "--device", "cpu", "--shutdown-grace", "0.5", "--max-new-frames", "7500",
                           api_key=None)
    try:
        results: list = [None]
        body = {"model": MODEL, "input": "A very long one.", "max_new_frames": 7500, "greedy": True,
                "response_format": "wav"}
        thread = threading.Thread(target=lambda: results.__setitem__(0, httpx.post(
            f"{server.url}/v1/audio/speech", json=body, timeout=120)))
        thread.start()
        _wait_in_flight(server, 1, 60)
        server.process.send_signal(signal.SIGTERM)
        thread.join(60)
        assert assert_error(results[0], 503)["code"] == "shutting_down"
        assert server.process.wait(60) == 130
    finally:
        server.stop()
