"""Servers for the HTTP tests: real ``python -m moss_npu.serve`` processes on free loopback ports.

They serve the tiny official-format models of the nano-tiny fixture (its tiny LM is biased so that greedy runs never stop
before ``max_new_frames``, so a greedy request of N frames yields exactly N × 3840 samples per channel).
Without the fixture or the serve packages (a user's clone) these tests skip; in CI (``CI=true``) they fail.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Optional

import pytest

from moss_npu_verify import goldens
from tests.optional import missing, require

SERVE_INSTALL = "pip install -e '.[dev]'"  # the serve extra plus openai and httpx

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
FRAME = 3840  # samples per codec frame at 48 kHz
STARTUP_S = 300.0  # a loaded machine preparing the grammars for the first time takes minutes
MODEL = "moss-tts-nano"  # the model id the server answers to
# A request that runs for seconds (the frame cap, greedy so it does not stop early): to hold a slot busy.
LONG = {"model": MODEL, "input": "A long one.", "max_new_frames": 375, "greedy": True, "response_format": "pcm"}


def serve_module(name: str) -> ModuleType:
    """Import a serve package for a test module: skip the module when it is missing (a user's clone without
    the serve extra), fail loudly under CI, which installs it."""
    return require(name, SERVE_INSTALL)


def tiny_dirs() -> tuple[Path, Path]:
    """The nano-tiny tts/ and codec/ folders; skip (fail in CI) when the fixture is missing."""
    root = goldens.fixtures_root() / "nano-tiny"
    if not (root / "tts" / "config.json").is_file():
        missing(f"fixture {root} is missing (set MOSS_NPU_FIXTURES)")
    return root / "tts", root / "codec"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess; ``url``, ``client()``; ``stop()`` sends Ctrl-C and returns the exit code."""

    def __init__(self, tmp: Path, *args: str, voices_dir: Optional[Path] = None, api_key: Optional[str] = API_KEY,
                 wait: bool = True, module: str = "moss_npu.serve") -> None:
        model, codec = tiny_dirs()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.voices_dir = voices_dir or tmp / "voices"
        self.log = tmp / f"server-{self.port}.log"
        command = [sys.executable, "-m", module, "--model", str(model), "--codec", str(codec),
                   "--port", str(self.port), "--voices-dir", str(self.voices_dir), "--num-threads", "1", *args]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        env.pop("MOSS_NPU_API_KEY", None)
        if api_key:
            env["MOSS_NPU_API_KEY"] = api_key  # not --api-key: that shows in ps (and the server warns)
        self._log_file = open(self.log, "wb")
        self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=self._log_file, stderr=subprocess.STDOUT)
        if wait:
            try:
                self.wait_ready()
            except BaseException:
                self.stop()  # a server that never became ready must not outlive the test run
                raise

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, timeout: float = 60.0):
        import httpx

        return httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)

    def health(self) -> dict:
        import httpx

        return httpx.get(f"{self.url}/health", timeout=5).json()

    def wait_ready(self, deadline_s: float = STARTUP_S, workers: Optional[int] = None) -> dict:
        """Wait until /health says ready (and, with ``workers``, that many workers are ready)."""
        import httpx

        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.process.poll() is not None:
                raise AssertionError(f"server exited with {self.process.returncode}:\n{self.output()}")
            try:
                state = self.health()
                ready = sum(w["state"] == "ready" for w in state["workers"])
                if state["status"] == "ready" and (workers is None or ready >= workers):
                    return state
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"server not ready after {deadline_s} s:\n{self.output()}")

    def worker_pid(self, index: int) -> int:
        """The process id of worker ``index`` (its latest start), from the server's log: /health does not show it."""
        pids = re.findall(rf"worker {index} ready on \S+ \(pid (\d+),", self.output(tail=None))
        assert pids, f"worker {index} never said it was ready:\n{self.output()}"
        return int(pids[-1])

    def output(self, tail: Optional[int] = 4000) -> str:
        if not self._log_file.closed:
            self._log_file.flush()
        text = self.log.read_text(encoding="utf-8", errors="replace")
        return text if tail is None else text[-tail:]

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._log_file.close()
        return self.process.returncode


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The shared server: one CPU worker, API key, roomy queue."""
    proc = ServerProcess(tmp_path_factory.mktemp("serve"), "--device", "cpu", "--max-input-chars", "200",
                         "--max-upload-mb", "1", "--max-voice-seconds", "20")
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def keyless_server(tmp_path_factory):
    """A server without an API key (the page and the WebSocket from their own origin need none)."""
    proc = ServerProcess(tmp_path_factory.mktemp("keyless"), "--device", "cpu", api_key=None)
    yield proc
    proc.stop()


def metric(text: str, name: str) -> float:
    """The value of an unlabelled metric in Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"metric {name} not found")


def wait_idle(server: ServerProcess, within_s: float) -> float:
    """Seconds until the server has nothing in flight and no active slot (fails after ``within_s``)."""
    start = time.monotonic()
    with server.client() as http:
        while time.monotonic() - start < within_s:
            text = http.get("/metrics").text
            if metric(text, "moss_npu_in_flight_requests") == 0 and metric(text, "moss_npu_active_slots") == 0:
                return time.monotonic() - start
            time.sleep(0.02)
    raise AssertionError(f"still busy after {within_s} s")


def assert_error(response, status: int, param: Optional[str] = None) -> dict:
    """The answer has ``status`` and the OpenAI error shape; return its error object."""
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param
    return error
