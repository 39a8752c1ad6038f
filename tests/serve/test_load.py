"""A bounded load test on loopback: 24 concurrent requests of every kind, then an idle engine."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from tests.serve.conftest import FRAME, MODEL, metric, serve_module
from tests.serve.test_voices import recording, upload

serve_module("fastapi")

FRAMES = 5
REQUESTS = 24
DEADLINE_S = 240.0  # the whole burst; each request also has its own client timeout


def _speak(server, kind: str, index: int, voice: str) -> tuple[str, int, object]:
    """Run one request; return (kind, status, what to check)."""
    body = {"model": MODEL, "input": f"Sentence number {index % 3}.", "max_new_frames": FRAMES, "greedy": True}
    with server.client(timeout=120) as http:
        if kind == "stream":
            with http.stream("POST", "/v1/audio/speech", json={**body, "response_format": "pcm"}) as r:
                return kind, r.status_code, len(r.read())
        if kind == "sse":
            with http.stream("POST", "/v1/audio/speech", json={**body, "stream_format": "sse",
                                                               "response_format": "pcm"}) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
                return kind, r.status_code, lines[-1]
        if kind == "voice":
            body["voice"] = voice
        if kind == "bad":
            return kind, http.post("/v1/audio/speech", json={**body, "speed": 9.0}).status_code, None
        r = http.post("/v1/audio/speech", json=body)
        return kind, r.status_code, (body["input"], kind, r.headers.get("x-codes-sha256"))


def test_concurrent_mixed_burst_then_idle(server):
    with server.client() as http:
        voice = upload(http, "load-voice", recording()).json()["id"]
        solo = {}
        for i in range(3):  # solo runs of the greedy requests the burst repeats
            for kind, extra in (("plain", {}), ("voice", {"voice": voice})):
                text = f"Sentence number {i}."
                r = http.post("/v1/audio/speech", json={"model": MODEL, "input": text, "max_new_frames": FRAMES,
                                                        "greedy": True, **extra})
                solo[(text, kind)] = r.headers["x-codes-sha256"]
    kinds = ["stream", "plain", "sse", "voice", "plain", "bad"] * (REQUESTS // 6)
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=REQUESTS) as pool:
        futures = [pool.submit(_speak, server, kind, i, voice) for i, kind in enumerate(kinds)]
        results = [f.result(timeout=max(1.0, DEADLINE_S - (time.monotonic() - start))) for f in futures]
    for kind, status, value in results:
        if kind == "bad":
            assert status == 400
            continue
        assert status == 200, (kind, value)
        if kind == "stream":
            assert value == FRAMES * FRAME * 2 * 2
        elif kind == "sse":
            assert '"speech.audio.done"' in value
        else:
            text, k, digest = value
            assert digest == solo[(text, k)]  # same codes as the request served alone
    with server.client() as http:
        end = time.monotonic() + 10
        while time.monotonic() < end:  # the workers report their load a few times a second
            text = http.get("/metrics").text
            if metric(text, "moss_npu_in_flight_requests") == 0 and metric(text, "moss_npu_active_slots") == 0:
                break
            time.sleep(0.1)
        assert metric(text, "moss_npu_in_flight_requests") == 0
        assert metric(text, "moss_npu_active_slots") == 0 and metric(text, "moss_npu_queue_depth") == 0
        assert http.get("/health").json()["workers"][0]["in_flight"] == 0
        http.delete(f"/v1/audio/voices/{voice}")

