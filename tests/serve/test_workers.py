"""Two CPU workers (``--device cpu,cpu``): least-loaded dispatch, a killed worker's request fails with 503
at once, the other worker keeps serving, and the dead one is started again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest

from tests.serve.conftest import LONG, MODEL, REPO, ServerProcess, assert_error, serve_module, tiny_dirs

serve_module("fastapi")
httpx = serve_module("httpx")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("pair"), "--device", "cpu,cpu", "--max-batch", "2")
    proc.wait_ready(workers=2)
    yield proc
    proc.stop()


def _busy_workers(server) -> list[dict]:
    return [w for w in server.health()["workers"] if w["in_flight"]]


def test_requests_spread_over_workers_and_a_killed_worker_restarts(pair):
    assert len(pair.health()["workers"]) == 2
    with pair.client() as a, pair.client() as b:
        with a.stream("POST", "/v1/audio/speech", json=LONG) as first, \
                b.stream("POST", "/v1/audio/speech", json=LONG) as second:
            first_chunks, second_chunks = first.iter_bytes(), second.iter_bytes()
            next(first_chunks), next(second_chunks)
            busy = _busy_workers(pair)
            assert sorted(w["index"] for w in busy) == [0, 1]  # least loaded: one each
            victim = pair.worker_pid(0)
            os.kill(victim, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(httpx.HTTPError):  # the stream is cut, not ended as if complete
                for _ in first_chunks:
                    pass
            assert time.monotonic() - start < 5.0  # no hang
            # The other worker's request is unaffected.
            received = sum(len(c) for c in second_chunks)
            assert received > 0
    with pair.client() as http:
        short = {"model": MODEL, "input": "Meanwhile.", "max_new_frames": 2, "greedy": True}
        assert http.post("/v1/audio/speech", json=short).status_code == 200  # served by the live worker
        state = pair.wait_ready(workers=2)
        restarted = next(w for w in state["workers"] if w["index"] == 0)
        assert restarted["restarts"] == 1 and pair.worker_pid(0) != victim
        assert http.post("/v1/audio/speech", json=short).status_code == 200


def test_killed_worker_fails_a_waiting_whole_file_request_with_503(pair):
    pair.wait_ready(workers=2)
    with pair.client() as http:
        result = {}

        def call():
            result["r"] = http.post("/v1/audio/speech", json={**LONG, "response_format": "wav"})

        thread = threading.Thread(target=call)
        thread.start()
        end = time.monotonic() + 10
        while not _busy_workers(pair) and time.monotonic() < end:
            time.sleep(0.05)
        os.kill(pair.worker_pid(_busy_workers(pair)[0]["index"]), signal.SIGKILL)
        thread.join(timeout=10)
        assert not thread.is_alive()
    error = assert_error(result["r"], 503)
    assert error["code"] == "worker_unavailable"
    pair.wait_ready(workers=2)


def test_bad_model_folder_is_refused_before_serving(tmp_path):
    _, codec = tiny_dirs()
    run = subprocess.run([sys.executable, "-m", "moss_npu.serve", "--model", str(tmp_path / "missing"),
                          "--codec", str(codec), "--device", "cpu", "--voices-dir", str(tmp_path / "v")],
                         cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "missing" in lines[0]


def test_taken_port_is_refused_before_workers_start(tmp_path):
    import socket

    model, codec = tiny_dirs()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        run = subprocess.run([sys.executable, "-m", "moss_npu.serve", "--model", str(model), "--codec", str(codec),
                              "--device", "cpu", "--port", str(taken.getsockname()[1]),
                              "--voices-dir", str(tmp_path / "v")],
                             cwd=REPO, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot listen")


def test_cpu_workers_leave_a_core_to_the_server(monkeypatch):
    """Without --num-threads, CPU workers share every core but one; other devices and a given count are kept."""
    from moss_npu.serve import pool
    from moss_npu.serve.spec import WorkerSpec

    base = WorkerSpec(model="m", codec="c", device="cpu")
    monkeypatch.setattr(pool, "usable_cores", lambda: 16)
    assert [s.num_threads for s in pool.specs_for(["cpu"], base)] == [15]
    assert [s.num_threads for s in pool.specs_for(["cpu", "cpu"], base)] == [7, 7]
    assert [s.num_threads for s in pool.specs_for(["npu:0", "cpu"], base)] == [0, 15]
    assert [s.num_threads for s in pool.specs_for(["cpu"], replace(base, num_threads=4))] == [4]
    monkeypatch.setattr(pool, "usable_cores", lambda: 2)
    assert [s.num_threads for s in pool.specs_for(["cpu"], base)] == [1]
    assert [s.num_threads for s in pool.specs_for(["cpu", "cpu", "cpu"], base)] == [1, 1, 1]


def test_usage_names_how_the_server_was_started(monkeypatch):
    from moss_npu.serve.cli import build_parser

    monkeypatch.setattr(sys, "argv", ["/opt/venv/bin/moss-npu-serve", "--help"])
    assert build_parser().format_usage().startswith("usage: moss-npu-serve ")
    monkeypatch.setattr(sys, "argv", ["/repo/moss_npu/serve/__main__.py", "--help"])
    assert build_parser().format_usage().startswith("usage: python -m moss_npu.serve ")


@pytest.mark.parametrize("flags, problem", [
    (["--shutdown-grace", "-1"], "--shutdown-grace -1.0: use 0 or more seconds"),
    (["--shutdown-grace", "nan"], "--shutdown-grace nan"),
    (["--max-voice-seconds", "500"], "--max-voice-seconds 500: use at most 120"),
])
def test_stop_and_recording_limits_are_checked_before_serving(tmp_path, capsys, flags, problem):
    from moss_npu.serve.cli import main

    model, codec = tiny_dirs()
    code = main(["--model", str(model), "--codec", str(codec), "--device", "cpu",
                 "--voices-dir", str(tmp_path / "v"), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: {problem}"), err


def test_max_reference_seconds_is_the_recording_limit():
    """``--max-reference-seconds`` (the issue's name) and ``--max-voice-seconds`` set the one limit on voice uploads
    and ref_audio alike."""
    from moss_npu.serve.cli import build_parser, server_config

    for flag in ("--max-reference-seconds", "--max-voice-seconds"):
        args = build_parser().parse_args(["--model", "m", "--codec", "c", flag, "12"])
        assert server_config(args).max_voice_seconds == 12.0
