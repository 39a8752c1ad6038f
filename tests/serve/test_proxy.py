"""The README's nginx recipe (deploy/nginx/moss-npu.conf) in front of a real server: uploads of the size the
server allows pass, streamed audio arrives while it is made. Needs Debian's nginx (CI installs it)."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile

from tests.optional import missing
from tests.serve.conftest import API_KEY, FRAME, MODEL, REPO, ServerProcess, free_port, serve_module

serve_module("fastapi")
httpx = serve_module("httpx")
RECIPE = REPO / "deploy" / "nginx" / "moss-npu.conf"


def nginx_config(tmp: Path, upstream_port: int, listen_port: int) -> Path:
    """The recipe with this test's ports, inside the smallest main configuration that runs it unprivileged."""
    recipe = RECIPE.read_text(encoding="utf-8")
    assert "server 127.0.0.1:8000;" in recipe and "listen 80;" in recipe
    recipe = recipe.replace("server 127.0.0.1:8000;", f"server 127.0.0.1:{upstream_port};")
    recipe = recipe.replace("listen 80;", f"listen 127.0.0.1:{listen_port};")
    for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (tmp / name).mkdir(exist_ok=True)
    main = f"""daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
worker_processes 1;
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
{recipe}
}}
"""
    path = tmp / "nginx.conf"
    path.write_text(main, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def proxied(tmp_path_factory):
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if nginx is None:
        missing("nginx is not installed (Debian: apt-get install nginx); the proxy recipe test needs it")
    tmp = tmp_path_factory.mktemp("proxy")
    server = ServerProcess(tmp, "--device", "cpu")
    port = free_port()
    config = nginx_config(tmp, server.port, port)
    command = [nginx, "-c", str(config), "-p", str(tmp)]
    if os.geteuid() == 0:  # nginx started by root hands its workers to "nobody", who cannot read the temp folders
        command += ["-g", "user root;"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    else:
        proc.kill()
        raise AssertionError((tmp / "error.log").read_text())
    assert proc.poll() is None, proc.stdout.read().decode(errors="replace")
    yield url
    proc.terminate()
    proc.wait(timeout=10)
    server.stop()


def recording(seconds: float) -> bytes:
    """Float32 stereo 48 kHz WAV: 384 KB per second, so 24 s is a 9 MiB upload."""
    t = np.arange(int(48000 * seconds)) / 48000
    wave = np.stack([0.3 * np.sin(2 * np.pi * 220 * t)] * 2, axis=1).astype(np.float32)
    out = io.BytesIO()
    soundfile.write(out, wave, 48000, format="WAV", subtype="FLOAT")
    return out.getvalue()


def test_an_upload_the_server_allows_passes_the_proxy(proxied):
    data = recording(24.0)
    assert 8.5 * 2**20 < len(data) < 10 * 2**20
    with httpx.Client(base_url=proxied, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as http:
        r = http.post("/v1/audio/voices", data={"name": "big"}, files={"audio": ("big.wav", data, "audio/wav")})
        assert r.status_code == 200, r.text[:300]
        assert http.delete(f"/v1/audio/voices/{r.json()['id']}").status_code == 200


def test_streamed_audio_is_not_buffered_by_the_proxy(proxied):
    """The first bytes arrive long before the last: nginx passes chunks on as the server sends them."""
    body = {"model": MODEL, "input": "Streamed through the proxy.", "greedy": True, "max_new_frames": 300,
            "response_format": "pcm"}
    with httpx.Client(base_url=proxied, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as http:
        started = time.monotonic()
        with http.stream("POST", "/v1/audio/speech", json=body) as r:
            assert r.status_code == 200
            pieces = r.iter_bytes()
            first = next(pieces)
            first_at = time.monotonic() - started
            total = len(first) + sum(len(p) for p in pieces)
        done_at = time.monotonic() - started
    assert total == 300 * FRAME * 2 * 2
    assert first_at < done_at / 2, (first_at, done_at)
