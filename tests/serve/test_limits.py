"""Limits on a one-slot server: voices survive a restart, a full server answers 429, a client that goes away
frees its slot. The tiny model takes seconds for 375 greedy frames, so a long request is really in flight."""

from __future__ import annotations


import pytest

from tests.serve.conftest import LONG, MODEL, ServerProcess, assert_error, metric, serve_module, wait_idle
from tests.serve.test_voices import recording, upload

serve_module("fastapi")
httpx = serve_module("httpx")


@pytest.fixture(scope="module")
def restarted(tmp_path_factory):
    """A voice uploaded to one server, which is then stopped with Ctrl-C; a new one-slot server on its folder."""
    tmp = tmp_path_factory.mktemp("limits")
    first = ServerProcess(tmp, "--device", "cpu")
    try:
        with first.client() as http:
            voice = upload(http, "kept", recording()).json()
    finally:
        code = first.stop()
    assert code == 130, first.output()
    second = ServerProcess(tmp, "--device", "cpu", "--max-batch", "1", "--max-queue", "0",
                           voices_dir=first.voices_dir)
    yield second, voice
    second.stop()


def test_voices_survive_a_restart(restarted):
    server, voice = restarted
    with server.client() as http:
        listed = http.get("/v1/audio/voices").json()["data"]
        assert [v["id"] for v in listed] == [voice["id"]]
        spoken = http.post("/v1/audio/speech", json={"model": MODEL, "input": "Hi.", "voice": "kept",
                                                     "max_new_frames": 3, "greedy": True})
    assert spoken.status_code == 200 and spoken.headers["x-audio-frames"] == "3"


def test_full_server_answers_429_with_retry_after(restarted):
    server, _ = restarted
    with server.client() as http, http.stream("POST", "/v1/audio/speech", json=LONG) as held:
        assert held.status_code == 200
        chunks = held.iter_bytes()  # kept alive: dropping the iterator would close the connection
        next(chunks)  # the slot is taken now
        refused = httpx.post(f"{server.url}/v1/audio/speech", headers=server.headers,
                             json={"model": MODEL, "input": "Me too.", "max_new_frames": 2})
        assert_error(refused, 429)
        assert int(refused.headers["retry-after"]) >= 1
    wait_idle(server, 3.0)


def test_disconnect_mid_stream_frees_the_slot(restarted):
    server, _ = restarted
    with server.client() as http:
        with http.stream("POST", "/v1/audio/speech", json=LONG) as r:
            received = 0
            for chunk in r.iter_bytes():
                received += len(chunk)
                if received > 3840 * 4 * 4:  # a few frames in, far from the 375
                    break
        # Leaving the block closes the connection mid-stream.
    freed = wait_idle(server, 3.0)
    assert freed < 3.0
    with server.client() as http:  # the single slot is free again: no 429
        again = http.post("/v1/audio/speech", json={"model": MODEL, "input": "Next.", "max_new_frames": 2,
                                                    "greedy": True})
        assert again.status_code == 200
        frames = metric(http.get("/metrics").text, "moss_npu_frames_total")
    assert frames < 375  # the abandoned request never ran to its end


def test_disconnect_while_waiting_for_a_whole_file_frees_the_slot(restarted):
    """A cloned voice speaks a long text in many chunks of up to 375 frames (seconds of work even where one chunk
    takes a fraction of one), so the slot is free within 3 s only because the client left."""
    server, voice = restarted
    body = {**LONG, "input": "A long one. " * 300, "voice": voice["id"], "response_format": "wav"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/audio/speech", headers=server.headers, json=body,
                   timeout=httpx.Timeout(5.0, read=0.5))
    assert wait_idle(server, 3.0) < 3.0
