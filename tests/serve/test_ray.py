"""The server as a Ray Serve application: a local cluster (2 cores) with 2 CPU replicas on the tiny checkpoint.

Through Ray's HTTP proxy and the gateway: the openai client gets wav and streamed pcm; a WebSocket session is
relayed both ways; a voice uploaded through one replica is used and deleted through the other
(``X-Moss-Replica`` names the replica that answered); a replica's worker killed mid-request fails that request
with 503 in the OpenAI shape. A whole replica killed mid-request: a whole file still being made is sent to the
other replica and arrives whole; a stream under way is cut (never completed); a request whose second replica is
killed too gets 503 in the OpenAI shape; Ray restarts the replicas, ``/health`` shows the new ones, and every
request after that succeeds.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import signal
import threading
import time

import numpy as np
import pytest
import soundfile

from tests.optional import require
from tests.serve.conftest import API_KEY, FRAME, LONG, MODEL, ServerProcess, assert_error, serve_module
from tests.serve.test_live import CONFIG, SENTENCES, collect, connect, expected_samples
from tests.serve.test_voices import recording, upload

serve_module("fastapi")
require("ray", "pip install -e '.[ray]'")
openai = serve_module("openai")
from websockets.exceptions import InvalidStatus  # noqa: E402 - after test_live's check that websockets is there
httpx = serve_module("httpx")
psutil = require("psutil", "pip install psutil")

FRAMES = 4
GREEDY = {"max_new_frames": FRAMES, "greedy": True}
TRIES = 40  # requests until one lands on a given replica of two (chance of missing: 2**-40)
RESTART_S = 300.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("ray"), "--num-cpus", "2", "--min-replicas", "2",
                         "--max-replicas", "2", "--cpus-per-replica", "1", "--max-batch", "2", "--max-queue", "4",
                         module="moss_npu.serve.ray", wait=False)
    try:
        wait_replicas(proc, 2)
        yield proc
    finally:
        proc.stop()


def wait_replicas(proc: ServerProcess, count: int, deadline_s: float = RESTART_S) -> dict:
    """Wait until /health (through the proxy) reports ``count`` running replicas and a ready worker."""
    end = time.monotonic() + deadline_s
    state: dict = {}
    while time.monotonic() < end:
        if proc.process.poll() is not None:
            raise AssertionError(f"server exited with {proc.process.returncode}:\n{proc.output()}")
        try:
            state = proc.health()
            replicas = state.get("deployment", {}).get("replicas", {})
            if state["status"] == "ready" and replicas == {"RUNNING": count}:
                return state
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"not {count} running replicas after {deadline_s} s (last health {state}):\n{proc.output()}")


def replica_processes(proc: ServerProcess) -> list:
    """The replica actors' processes of this cluster (descendants of the server process)."""
    return [p for p in psutil.Process(proc.process.pid).children(recursive=True)
            if _title(p).startswith("ray::ServeReplica:moss-npu:speech")]


def _title(p) -> str:
    return (_cmdline(p) or [""])[0]


def busy_replica(proc: ServerProcess, deadline_s: float = 30.0, besides: frozenset = frozenset()):
    """The replica process handling a request now (Ray titles it after the request's method while it runs),
    other than the processes ``besides``."""
    # A request of the tiny model runs ~0.4 s, and walking the process tree takes longer than that under load:
    # the tree is walked twice a second, the replicas' titles polled in between.
    end = time.monotonic() + deadline_s
    listed, replicas = 0.0, []
    while time.monotonic() < end:
        if time.monotonic() - listed > 0.5:
            listed, replicas = time.monotonic(), replica_processes(proc)
        busy = [p for p in replicas if ".handle_request" in _title(p) and p.pid not in besides]
        if busy:
            return busy[0]
        time.sleep(0.01)
    raise AssertionError("no replica took the request")


def in_background(call) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run():
        result["r"] = call()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def speak(http, **fields):
    return http.post("/v1/audio/speech", json={"model": MODEL, "input": "Hi.", **GREEDY, **fields})


def test_openai_client_gets_wav_and_streamed_pcm_through_the_proxy(cluster):
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    wav = client.audio.speech.create(model=MODEL, voice="default", input="Hello there.", response_format="wav",
                                     extra_body=GREEDY).read()
    samples, rate = soundfile.read(io.BytesIO(wav), dtype="float32", always_2d=True)
    assert rate == 48000 and samples.shape == (FRAMES * FRAME, 2) and np.abs(samples).max() > 0
    with client.audio.speech.with_streaming_response.create(model=MODEL, voice="default", input="Good morning.",
                                                            response_format="pcm", extra_body=GREEDY) as response:
        assert response.headers["x-sample-rate"] == "48000" and response.headers["x-moss-replica"]
        pieces = list(response.iter_bytes())
    assert len(b"".join(pieces)) == FRAMES * FRAME * 2 * 2


def test_a_websocket_session_is_relayed_to_a_replica_and_back(cluster):
    with connect(cluster) as ws:
        ws.send(json.dumps(CONFIG))
        for sentence in SENTENCES:
            ws.send(json.dumps({"type": "input.text", "text": sentence + " "}))
        ws.send(json.dumps({"type": "input.done"}))
        events, audio = collect(ws)
    assert events[-1]["type"] == "session.done" and events[-1]["total_sentences"] == len(SENTENCES)
    assert len(audio) == expected_samples() * 2 * 2  # pcm16 stereo
    with pytest.raises(InvalidStatus) as refused, connect(cluster, key="wrong"):
        pass
    assert refused.value.response.status_code == 403  # the edge's key check, at the gateway


def test_a_voice_uploaded_through_one_replica_is_used_and_deleted_through_the_other(cluster):
    with cluster.client(timeout=120) as http:
        made = upload(http, "shared", recording())
        assert made.status_code == 200, made.text
        first, voice = made.headers["x-moss-replica"], made.json()
        for _ in range(TRIES):
            used = speak(http, voice="shared")
            assert used.status_code == 200, used.text
            if used.headers["x-moss-replica"] != first:
                break
        else:
            raise AssertionError(f"no request reached the other replica in {TRIES} tries")
        plain = speak(http)
        assert used.headers["x-codes-sha256"] != plain.headers["x-codes-sha256"]  # the voice was spoken with
        gone = http.delete(f"/v1/audio/voices/{voice['id']}")
        assert gone.status_code == 200, gone.text
        deleter, seen = gone.headers["x-moss-replica"], set()
        for _ in range(TRIES):
            after = speak(http, voice="shared")
            assert_error(after, 404, "voice")
            seen.add(after.headers["x-moss-replica"])
            if seen - {deleter}:
                break
        else:
            raise AssertionError(f"no request reached the other replica in {TRIES} tries")


def replica_ids(proc: ServerProcess, deadline_s: float = 30.0) -> set[str]:
    """Both replicas' ids, from /health answers (each names the replica that gave it). A replica Ray has just
    started may take a moment to get requests routed to it, so this asks until a deadline, not a fixed count."""
    seen: set[str] = set()
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        seen.add(proc.health()["replica"])
        if len(seen) == 2:
            return seen
        time.sleep(0.05)
    raise AssertionError(f"/health reached one replica in {deadline_s:g} s: {seen}")


def wait_new_replica(proc: ServerProcess, old: set[str], deadline_s: float = RESTART_S) -> None:
    """Wait until /health reports a replica that is not one of ``old`` (Ray's restart) and 2 running."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            state = proc.health()
            if state["replica"] not in old and state["deployment"]["replicas"] == {"RUNNING": 2}:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"no restarted replica reported after {deadline_s} s:\n{proc.output()}")


def until_served(http, deadline_s: float = RESTART_S) -> None:
    """Wait until speech succeeds 6 times in a row (a restarting worker answers 503 with Retry-After)."""
    end, in_a_row = time.monotonic() + deadline_s, 0
    while in_a_row < 6:
        assert time.monotonic() < end, "requests did not succeed again"
        answer = speak(http)
        if answer.status_code == 200:
            in_a_row += 1
        else:
            assert_error(answer, 503)
            in_a_row = 0
            time.sleep(0.5)


def test_a_killed_worker_fails_its_request_with_503_and_the_replica_serves_again(cluster):
    wait_replicas(cluster, 2)
    body = _long_clone()
    with cluster.client(timeout=120) as http:
        thread, result = in_background(lambda: http.post("/v1/audio/speech", json=body))
        replica = busy_replica(cluster)
        workers = [c for c in replica.children() if "spawn_main" in " ".join(_cmdline(c))]
        assert len(workers) == 1
        workers[0].send_signal(signal.SIGKILL)
        thread.join(timeout=60)
        assert not thread.is_alive()
        error = assert_error(result["r"], 503)
        assert error["code"] == "worker_unavailable"
        until_served(http)


def _cmdline(p) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def test_a_replica_killed_mid_file_has_the_request_answered_by_the_other_and_is_restarted(cluster):
    wait_replicas(cluster, 2)
    before = replica_ids(cluster)
    with cluster.client(timeout=120) as http:
        thread, result = in_background(lambda: http.post("/v1/audio/speech", json={**LONG, "response_format": "wav"}))
        busy_replica(cluster).send_signal(signal.SIGKILL)
        thread.join(timeout=120)
        assert not thread.is_alive()
        answer = result["r"]
        # Nothing was answered yet (a whole file is sent once made): the gateway sent the request again.
        assert answer.status_code == 200, answer.text[:500]
        samples, rate = soundfile.read(io.BytesIO(answer.content), dtype="float32", always_2d=True)
        assert rate == 48000 and samples.shape == (LONG["max_new_frames"] * FRAME, 2)
        wait_new_replica(cluster, before)
        after = replica_ids(cluster)
        answered = [speak(http) for _ in range(TRIES // 4)]
    assert answer.headers["x-moss-replica"] in after & before  # the replica that answered is the one not killed
    assert [r.status_code for r in answered] == [200] * len(answered)


def test_a_replica_killed_mid_stream_cuts_the_stream(cluster):
    wait_replicas(cluster, 2)
    before = replica_ids(cluster)
    whole = LONG["max_new_frames"] * FRAME * 2 * 2
    received = 0
    with cluster.client(timeout=120) as http:
        with http.stream("POST", "/v1/audio/speech", json=LONG) as response:
            assert response.status_code == 200
            pieces = response.iter_raw()
            received += len(next(pieces))
            busy_replica(cluster).send_signal(signal.SIGKILL)
            with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
                for piece in pieces:
                    received += len(piece)
        assert 0 < received < whole  # the status line was out: the stream ends short, never looks whole
        wait_new_replica(cluster, before)
        assert response.headers["x-moss-replica"] not in replica_ids(cluster)  # the one that streamed was killed
        until_served(http)


def _long_clone() -> dict:
    """A whole file that keeps a replica busy for seconds on any machine: a cloned voice (inline ref_audio) speaks a
    long text in many chunks of up to 375 frames (one chunk takes a fraction of a second on a fast CPU)."""
    from tests.serve.test_voices import recording

    return {**LONG, "input": "A long one. " * 300, "ref_audio": base64.b64encode(recording()).decode(),
            "response_format": "wav"}


def test_a_request_whose_second_replica_is_killed_too_gets_503_in_the_openai_shape(cluster):
    wait_replicas(cluster, 2)
    before = replica_ids(cluster)
    body = _long_clone()
    with cluster.client(timeout=120) as http:
        thread, result = in_background(lambda: http.post("/v1/audio/speech", json=body))
        first = busy_replica(cluster)
        first.send_signal(signal.SIGKILL)
        # The request sent again dies too: every other replica seen busy is killed until the answer comes (a
        # replica's title can lag behind its request on a loaded machine, so the first one seen may not be it).
        killed, end = {first.pid}, time.monotonic() + 120
        while thread.is_alive() and time.monotonic() < end:
            for victim in replica_processes(cluster):
                if ".handle_request" in _title(victim) and victim.pid not in killed:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        victim.send_signal(signal.SIGKILL)
                    killed.add(victim.pid)
            time.sleep(0.05)
        thread.join(timeout=120)
        assert not thread.is_alive()
        error = assert_error(result["r"], 503)
        assert error["code"] == "replica_unavailable" and error["type"] == "server_error"
        assert result["r"].headers["retry-after"] == "1"
        wait_replicas(cluster, 2)
        until_served(http)
        assert not replica_ids(cluster) & before  # both were restarted


def test_a_load_burst_scales_one_replica_to_two_and_back(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")  # decisions in seconds
    monkeypatch.setenv("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")
    proc = ServerProcess(tmp_path, "--num-cpus", "2", "--min-replicas", "1", "--max-replicas", "2",
                         "--target-ongoing-requests", "1", "--upscale-delay", "0", "--downscale-delay", "2",
                         "--look-back", "2", "--max-batch", "2", "--max-queue", "4", module="moss_npu.serve.ray",
                         wait=False)
    try:
        wait_replicas(proc, 1)
        stop = threading.Event()

        def client():
            with proc.client(timeout=120) as http:
                while not stop.is_set():
                    http.post("/v1/audio/speech", json={**LONG, "max_new_frames": 120})

        burst = [threading.Thread(target=client) for _ in range(4)]
        for thread in burst:
            thread.start()
        try:
            wait_replicas(proc, 2)
        finally:
            stop.set()
            for thread in burst:
                thread.join(timeout=120)
        wait_replicas(proc, 1)
    finally:
        proc.stop()
