"""The server against hostile and unlucky clients: one test per class of request that once killed, stalled,
filled or fooled it. Each needs a real server process (and raw sockets where a client misbehaves below HTTP).
"""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
import time

import numpy as np
import pytest
import soundfile

from tests.serve.conftest import FRAME, MODEL, ServerProcess, assert_error, metric, serve_module, wait_idle

serve_module("fastapi")
httpx = serve_module("httpx")

GREEDY = {"model": MODEL, "greedy": True, "response_format": "pcm"}


@pytest.fixture(scope="module")
def open_server(tmp_path_factory):
    """A keyless loopback server with short connection timeouts and a high frame cap (for long requests)."""
    proc = ServerProcess(tmp_path_factory.mktemp("hardening"), "--device", "cpu", "--max-upload-mb", "1",
                         "--header-timeout", "1", "--body-timeout", "2", "--max-new-frames", "7500",
                         "--max-batch", "2", api_key=None)
    yield proc
    proc.stop()


def raw(server: ServerProcess, data: bytes, *, read_s: float = 5.0) -> bytes:
    """Send ``data`` on a fresh connection and return what comes back within ``read_s`` (until close)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=read_s) as sock:
        sock.sendall(data)
        return _read_all(sock, read_s)


def _read_all(sock: socket.socket, read_s: float, *, one_answer: bool = False) -> bytes:
    """What arrives within ``read_s`` until the peer closes or resets (``one_answer``: until one whole answer with
    a Content-Length has come)."""
    chunks, end = [], time.monotonic() + read_s
    while time.monotonic() < end:
        try:
            piece = sock.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            break
        if not piece:
            break
        chunks.append(piece)
        if one_answer and _complete(b"".join(chunks)):
            break
    return b"".join(chunks)


def _complete(data: bytes) -> bool:
    head, sep, body = data.partition(b"\r\n\r\n")
    length = [line.split(b":", 1)[1] for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
    return bool(sep) and bool(length) and len(body) >= int(length[0])


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def tone(rate: int, seconds: float) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    out = io.BytesIO()
    soundfile.write(out, 0.3 * np.sin(2 * np.pi * 220 * t), rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def wait_active(server: ServerProcess, within_s: float) -> None:
    """Wait until a slot is generating (preparation done)."""
    end = time.monotonic() + within_s
    with server.client() as http:
        while metric(http.get("/metrics").text, "moss_npu_active_slots") < 1:
            assert time.monotonic() < end, "the request never started"
            time.sleep(0.02)


def frames_generated(server: ServerProcess) -> float:
    with server.client() as http:
        return metric(http.get("/metrics").text, "moss_npu_frames_total")


# --- resampling: any rate, in time and memory linear in the audio ---------------------------------------------


def test_an_output_rate_sharing_no_factor_with_48k_is_served(open_server):
    """44099 Hz once built a 48000 × 44099 resampling kernel in the HTTP process (killed by the OOM killer)."""
    with open_server.client() as http:
        r = http.post("/v1/audio/speech", json={**GREEDY, "input": "Odd rate.", "max_new_frames": 3,
                                                 "sample_rate": 44099})
    assert r.status_code == 200, r.text
    samples = len(r.content) // 4  # s16 stereo
    assert abs(samples - 3 * FRAME * 44099 / 48000) <= 2


def test_a_reference_at_an_odd_rate_clones_without_stalling(open_server):
    """The same rate as a reference recording: resampled with soxr, prepared beside the running frames."""
    audio = base64.b64encode(tone(44099, 8.0)).decode()
    with open_server.client() as http:
        r = http.post("/v1/audio/speech", json={**GREEDY, "input": "Odd reference.", "max_new_frames": 3,
                                                 "ref_audio": audio})
    assert r.status_code == 200, r.text
    assert len(r.content) == 3 * FRAME * 2 * 2


# --- limits and the key before the body -------------------------------------------------------------------------


def test_the_key_is_checked_before_the_body_is_read(server):
    """An unauthenticated upload is answered 401 while its body has not even started."""
    head = (f"POST /v1/audio/voices HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nTransfer-Encoding: chunked\r\n"
            "Content-Type: multipart/form-data; boundary=x\r\n\r\n").encode()
    answer = raw(server, head, read_s=5.0)
    assert status_of(answer) == 401 and b"invalid_api_key" in answer


def test_a_chunked_body_is_cut_off_at_the_limit(open_server):
    """No Content-Length: bytes are counted as they come and reading stops at the limit, with 413 (the old server
    read all three limits' worth, then answered about the JSON). The answer is read while the body is still
    being sent, and it arrives whole: the server's close lingers instead of resetting the connection."""
    limit = 2**20 * 4 // 3 + 2**16
    received: list[bytes] = []
    with socket.create_connection(("127.0.0.1", open_server.port), timeout=10) as sock:
        reader = threading.Thread(target=lambda: received.append(_read_all(sock, 30.0, one_answer=True)))
        reader.start()
        sock.sendall((f"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1:{open_server.port}\r\n"
                      "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode())
        piece, sent = b"x" * 65536, 0
        try:
            while sent < 3 * limit:
                sock.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
                sent += len(piece)
        except OSError:
            pass  # the server closed the connection once it had answered
        reader.join(40)
    assert status_of(received[0]) == 413 and b"request_too_large" in received[0]


def test_a_body_that_trickles_is_answered_408(open_server):
    head = (f"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1:{open_server.port}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"mod").encode()
    answer = raw(open_server, head, read_s=6.0)
    assert status_of(answer) == 408 and b"body_timeout" in answer


# --- a gone client frees its slot --------------------------------------------------------------------------------


@pytest.mark.parametrize("streamed", [False, True])
def test_a_client_that_leaves_frees_its_slot(open_server, streamed):
    """A 7500-frame greedy request cannot finish in the test's window; the client leaves 0.5 s in. Its slot is
    free within a bounded time and the worker stops generating for it (frames counted worker-side)."""
    wait_idle(open_server, 30.0)
    before = frames_generated(open_server)
    body = json.dumps({**GREEDY, "input": "Never finished.", "max_new_frames": 7500, "stream": streamed}).encode()
    with socket.create_connection(("127.0.0.1", open_server.port), timeout=10) as sock:
        sock.sendall((f"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1:{open_server.port}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)
        wait_active(open_server, 30.0)
        time.sleep(0.5)
    assert wait_idle(open_server, 3.0) < 3.0
    time.sleep(0.5)
    spent = frames_generated(open_server) - before
    assert 0 < spent < 7500
    time.sleep(0.5)
    assert frames_generated(open_server) - before == spent  # nothing more was generated for it


# --- no input gives a 5xx ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value,param", [
    ("input", "a lone surrogate \ud800 here", "input"),
    ("text_temperature", 1e300, "text_temperature"),
    ("audio_temperature", float("nan"), "audio_temperature"),
    ("audio_repetition_penalty", float("inf"), "audio_repetition_penalty"),
    ("audio_top_k", 10**30, "audio_top_k"),
    ("seed", 2**64, "seed"),
    ("speed", float("nan"), "speed"),
    ("voice", "\udfff", "voice"),
])
def test_odd_values_are_4xx_naming_the_field(open_server, field, value, param):
    body = json.dumps({**GREEDY, "input": "Hello.", "max_new_frames": 2, field: value}, allow_nan=True)
    with open_server.client() as http:
        r = http.post("/v1/audio/speech", content=body.encode(), headers={"Content-Type": "application/json"})
    assert_error(r, 400, param)


def test_never_an_empty_success(open_server):
    """A hot stop decision makes some seeds stop before the first frame: those are 422 no_audio (whole, streamed
    and SSE, decided before the status line), every 200 carries audio."""
    refused = 0
    with open_server.client() as http:
        for seed in range(12):
            for extra in ({}, {"stream": True}, {"stream_format": "sse"}):
                r = http.post("/v1/audio/speech", json={"model": MODEL, "input": "Hi.", "seed": seed,
                                                         "text_temperature": 50.0, "max_new_frames": 2,
                                                         "response_format": "pcm", **extra})
                if r.status_code == 422:
                    assert assert_error(r, 422)["code"] == "no_audio"
                    refused += 1
                else:
                    assert r.status_code == 200 and len(r.content) > 0 and b"error" not in r.content[:200]
    assert refused >= 3  # about half the seeds stop at once at this temperature


# --- hosts and origins on a keyless server ----------------------------------------------------------------------


def test_a_foreign_host_is_refused(open_server):
    answer = raw(open_server, b"GET /v1/models HTTP/1.1\r\nHost: attacker.example\r\n\r\n")
    assert status_of(answer) == 403 and b"host_not_allowed" in answer
    ok = raw(open_server, f"GET /v1/models HTTP/1.1\r\nHost: localhost:{open_server.port}\r\n"
                          "Connection: close\r\n\r\n".encode())
    assert status_of(ok) == 200


def test_a_cross_origin_form_write_is_refused(open_server):
    with open_server.client() as http:
        r = http.post("/v1/audio/voices", headers={"Origin": "http://attacker.example"},
                      data={"name": "planted"}, files={"audio": ("a.wav", tone(16000, 1.0), "audio/wav")})
        assert assert_error(r, 403)["code"] == "cross_origin"
        assert all(v["name"] != "planted" for v in http.get("/v1/audio/voices").json()["data"])
        same = http.post("/v1/audio/speech", headers={"Origin": open_server.url},
                         json={**GREEDY, "input": "Same origin.", "max_new_frames": 2})
        assert same.status_code == 200


def test_a_keyless_server_refuses_a_public_address(tmp_path):
    proc = ServerProcess(tmp_path, "--device", "cpu", "--host", "0.0.0.0", api_key=None, wait=False)
    assert proc.process.wait(timeout=60) == 2
    lines = [line for line in proc.output().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "API key" in lines[0]


# --- connection hygiene ------------------------------------------------------------------------------------------


def test_headers_that_never_end_are_cut_off(open_server):
    """Slowloris: a byte of header now and then. The connection is closed after --header-timeout (1 s)."""
    with socket.create_connection(("127.0.0.1", open_server.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        started = time.monotonic()
        closed = False
        while time.monotonic() - started < 6:
            try:
                sock.sendall(b"X-a: b\r\n")
                sock.settimeout(0.3)
                if sock.recv(1024) == b"":
                    closed = True
                    break
            except socket.timeout:
                continue
            except OSError:
                closed = True
                break
    assert closed and time.monotonic() - started < 4


# --- the voice store shared by two servers -----------------------------------------------------------------------


def test_two_servers_on_one_folder_race_for_a_name(open_server, tmp_path):
    second = ServerProcess(tmp_path, "--device", "cpu", voices_dir=open_server.voices_dir, api_key=None)
    try:
        results: list[int] = []

        def add(target: ServerProcess) -> None:
            with target.client() as http:
                results.append(http.post("/v1/audio/voices", data={"name": "raced"},
                                         files={"audio": ("a.wav", tone(16000, 1.0), "audio/wav")}).status_code)

        threads = [threading.Thread(target=add, args=(s,)) for s in (open_server, second, open_server, second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(results) == [200, 409, 409, 409]
        with second.client() as http:
            voice = next(v for v in http.get("/v1/audio/voices").json()["data"] if v["name"] == "raced")
        with open_server.client() as http:  # seen by the other server at once, and deleted for both
            assert http.get(f"/v1/audio/voices/{voice['id']}").status_code == 200
            assert http.delete(f"/v1/audio/voices/{voice['id']}").status_code == 200
        with second.client() as http:
            assert http.get(f"/v1/audio/voices/{voice['id']}").status_code == 404
    finally:
        second.stop()


# --- health --------------------------------------------------------------------------------------------------------


def test_health_shows_states_not_pids(open_server):
    workers = open_server.health()["workers"]
    assert workers and all("pid" not in w and w["state"] == "ready" for w in workers)


# --- framing, JSON and echoes (issue 36) ---------------------------------------------------------------------------

SMUGGLED = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


@pytest.mark.parametrize("head", [
    b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
    b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
    b"Content-Length: 5\r\nContent-Length: 45\r\n",
    b"X-Note: one\r\n folded: in\r\nContent-Length: 5\r\n",
], ids=["cl-then-te", "te-then-cl", "two-lengths", "obs-fold"])
def test_ambiguous_framing_is_refused_and_the_connection_closed(open_server, head):
    """A request whose end two readers could see differently is 400 and closes; the request smuggled after it is
    never answered ."""
    request = (b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + head
               + b"\r\n0\r\n\r\n" + SMUGGLED)
    answer = raw(open_server, request)
    assert status_of(answer) == 400 and answer.count(b"HTTP/1.1 ") == 1, answer
    error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "invalid_http" and b"connection: close" in answer.lower()


@pytest.mark.parametrize("body", [
    b'{"model": "moss-tts-nano", "input": "caf\xe9"}',  # latin-1, not UTF-8
    b"[" * 100_000,
    b'{"model": "moss-tts-nano", "input": "x", "seed": ' + b"9" * 5000 + b"}",
    b'{"model": "moss-tts-nano", "input": ',
], ids=["latin-1", "deep", "5000-digits", "cut-off"])
def test_unparsable_json_is_400_invalid_json(open_server, body):
    with open_server.client() as http:
        r = http.post("/v1/audio/speech", content=body, headers={"Content-Type": "application/json"})
    assert assert_error(r, 400)["code"] == "invalid_json"
    assert "RecursionError" not in open_server.output()


@pytest.mark.parametrize("field", ["model", "voice"])
def test_a_huge_name_is_refused_without_being_echoed(open_server, field):
    body = {**GREEDY, "input": "Hello.", field: "x" * 1_000_000}  # the body limit here is 1.4 MB
    with open_server.client() as http:
        r = http.post("/v1/audio/speech", json=body)
    error = assert_error(r, 400, param=field)
    assert len(r.content) < 1000 and "xxxxxxxx" not in error["message"]


def test_an_unknown_name_is_echoed_cut_short(open_server):
    with open_server.client() as http:
        r = http.post("/v1/audio/speech", json={**GREEDY, "input": "Hello.", "voice": "v" * 200})
    error = assert_error(r, 404, param="voice")
    assert "v" * 60 in error["message"] and "v" * 70 not in error["message"] and "…" in error["message"]


def test_the_favicon_is_answered_without_a_404(open_server):
    with open_server.client() as http:
        assert http.get("/favicon.ico").status_code == 204


# --- recordings judged by their header (issue 36) ------------------------------------------------------------------


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) / 1024


def flac_bomb(channels: int, seconds: int = 30, rate: int = 655_350) -> bytes:
    """A small FLAC of silence that decodes to hundreds of megabytes: 8 channels at 655,350 Hz, 30 s."""
    out = io.BytesIO()
    with soundfile.SoundFile(out, "w", samplerate=rate, channels=channels, format="FLAC", subtype="PCM_16") as fh:
        second = np.zeros((rate, channels), dtype=np.int16)
        for _ in range(seconds):
            fh.write(second)
    return out.getvalue()


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="needs /proc for RSS")
@pytest.mark.parametrize("channels, seconds", [(8, 30), (2, 1)], ids=["8-channels", "stereo-655kHz"])
def test_a_flac_bomb_is_refused_from_its_header(open_server, channels, seconds):
    """Refused before a sample is decoded: neither the server nor its worker grows by 50 MB."""
    bomb = flac_bomb(channels, seconds)
    assert len(bomb) < 1_000_000
    pids = [open_server.process.pid, open_server.worker_pid(0)]
    before = [_rss_mb(pid) for pid in pids]
    with open_server.client() as http:
        upload = http.post("/v1/audio/voices", data={"name": f"bomb{channels}"},
                           files={"audio": ("bomb.flac", bomb, "audio/flac")})
        inline = http.post("/v1/audio/speech", json={**GREEDY, "input": "Hi.", "max_new_frames": 2,
                                                      "ref_audio": base64.b64encode(bomb).decode()})
    for r in (upload, inline):
        assert assert_error(r, 400)["code"] == "invalid_audio"
    grown = [_rss_mb(pid) - rss for pid, rss in zip(pids, before)]
    assert max(grown) < 50, grown
