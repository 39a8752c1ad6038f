"""The product on the stand-in npu (tests/npu_standin), in CI: the CLI, a cloned voice, streaming, graphs, the
engine, a server worker and the accuracy check, each on ``npu:0`` (and ``npu:1``) in a subprocess, compared with
the CPU. The stand-in runs torch's CPU kernels, so what these prove is the product's device discipline: nothing
left on the host, no second device touched, graphs equal to eager bit for bit, the same codes as the CPU. What
only a card shows (CANN's numerics, its kernels, aclgraph's limits, speed) is in docs/testing.md.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import soundfile as sf

from moss_npu_verify import goldens
from tests.npu_standin.build import PACKAGE_ROOT
from tests.npu_standin.fixtures import standin  # noqa: F401 - the fixture
from tests.optional import needs

NANO = goldens.fixtures_root() / "nano-tiny"
pytestmark = needs(NANO.is_dir(), f"fixtures not found at {NANO} (set MOSS_NPU_FIXTURES)")
TEXT = "Hello there, how are you?"


def speak(standin, tmp_path, name: str, *flags: str, device: str = "npu:0", **env: str):
    """Run inference.py; return (waveform, counters of the stand-in)."""
    out, report = tmp_path / f"{name}.wav", tmp_path / f"{name}.json"
    done = standin.run("inference.py", "--model", str(NANO / "tts"), "--codec", str(NANO / "codec"), "--device", device,
                       "--output", str(out), "--quiet", *flags, report=report, **env)
    assert done.returncode == 0, done.stderr[-3000:]
    return sf.read(str(out), dtype="float32", always_2d=True)[0], (standin.counters(report) if report.exists() else None)


def test_inference_on_npu0_matches_the_cpu_and_leaves_npu1_alone(standin, tmp_path):
    flags = ("--text", TEXT, "--max-new-frames", "12", "--seed", "0")  # default sampling: the device's generator
    on_npu, counted = speak(standin, tmp_path, "npu", *flags)
    on_cpu, _ = speak(standin, tmp_path, "cpu", *flags, device="cpu")
    assert on_npu.shape == on_cpu.shape and np.abs(on_npu - on_cpu).max() < 1e-5
    assert counted["peak_bytes"][0] > 0 and counted["peak_bytes"][1] == 0 and sum(counted["ops"].values()) > 1000


def test_graphs_equal_eager_bit_for_bit(standin, tmp_path):
    flags = ("--text", TEXT, "--max-new-frames", "12", "--seed", "0", "--host-rng")
    eager, _ = speak(standin, tmp_path, "eager", *flags, "--graph", "off")
    graphed, counted = speak(standin, tmp_path, "graph", *flags, "--graph", "on")
    assert np.array_equal(eager, graphed)
    assert counted["replays"] > 2  # two are the trial capture's; the rest are frames


def test_a_cloned_voice_and_streaming(standin, tmp_path):
    clone = ("--text", "The first sentence is here. A second one follows it.", "--greedy", "--max-new-frames", "4",
             "--prompt-audio-path", str(NANO / "goldens" / "reference.wav"), "--voice-clone-max-text-tokens", "8")
    on_npu, _ = speak(standin, tmp_path, "clone-npu", *clone)
    on_cpu, _ = speak(standin, tmp_path, "clone-cpu", *clone, device="cpu")
    assert on_npu.shape == on_cpu.shape and np.abs(on_npu - on_cpu).max() < 1e-5
    flags = ("--text", TEXT, "--max-new-frames", "12", "--seed", "0")
    streamed, _ = speak(standin, tmp_path, "stream", *flags, "--stream")
    offline, _ = speak(standin, tmp_path, "offline", *flags)
    assert streamed.shape == offline.shape and np.abs(streamed - offline).max() < 1e-5


def test_npu1_through_the_visible_devices(standin, tmp_path):
    flags = ("--text", "Hello.", "--max-new-frames", "6", "--seed", "0")
    _, second = speak(standin, tmp_path, "npu1", *flags, device="npu:1")
    assert second["peak_bytes"][0] == 0 and second["peak_bytes"][1] > 0
    _, only = speak(standin, tmp_path, "visible", *flags, device="npu:0", ASCEND_RT_VISIBLE_DEVICES="1")
    assert len(only["peak_bytes"]) == 1 and only["peak_bytes"][0] > 0
    done = standin.run("inference.py", "--model", str(NANO / "tts"), "--codec", str(NANO / "codec"), "--device",
                       "npu:1", "--text", "Hello.", "--output", str(tmp_path / "no.wav"), ASCEND_RT_VISIBLE_DEVICES="1")
    assert done.returncode == 2 and "only 1 NPUs visible (ASCEND_RT_VISIBLE_DEVICES=1); use npu:0" in done.stderr


@pytest.mark.parametrize("extra", [
    (), ("--prompt-audio-path", str(NANO / "goldens" / "reference.wav"), "--greedy"),
    ("--dtype", "bfloat16", "--max-mse", "1e-3", "--max-rel", "5e-2", "--min-token-agreement", "0"),  # its --help's
], ids=["sampled", "clone-greedy", "bf16"])
def test_eval_accuracy_passes_every_tier_on_npu0(standin, tmp_path, extra):
    report = tmp_path / "eval.json"
    done = standin.run("eval_accuracy.py", "--model", str(NANO / "tts"), "--codec", str(NANO / "codec"),
                       "--device", "npu:0", "--max-new-frames", "8", "--quiet", "--report", str(report), *extra)
    assert done.returncode == 0 and "PASS: every tier passed" in done.stdout, done.stdout + done.stderr[-2000:]
    target = json.loads(report.read_text())["target"]
    assert target["process_settings"] == {"jit_compile": False, "allow_internal_format": False}
    assert "jit_compile=False, allow_internal_format=False" in done.stdout


def test_the_engine_batches_and_admits_mid_flight_on_npu0(standin):
    """Four requests (two cloned voices, one continuation) in one batch and a fifth admitted while they run, on
    the device with its frame graphs and on the CPU: the same codes, the same audio up to rounding."""
    done = standin.run(str(PACKAGE_ROOT / "programs" / "engine_batch.py"), str(NANO), "npu:0")
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["same_codes"] == [True] * 5, got
    assert all(d is not None and d < 1e-5 for d in got["audio_max_abs"]), got


def test_a_server_worker_on_npu0_answers_the_openai_route(standin, tmp_path, monkeypatch):
    from tests.serve.conftest import ServerProcess, serve_module

    serve_module("fastapi")
    for key, value in standin.env().items():
        monkeypatch.setenv(key, value)
    server = ServerProcess(tmp_path, "--device", "npu:0")
    try:
        health = server.health()
        (worker,) = health["workers"]
        assert worker["device"] == "npu:0" and worker["state"] == "ready"
        assert worker["setup"]["process_settings"] == {"jit_compile": False, "allow_internal_format": False}
        with server.client() as http:
            response = http.post("/v1/audio/speech", json={"model": "moss-tts-nano", "input": "Hello there.",
                                                           "response_format": "wav", "greedy": True,
                                                           "max_new_frames": 6})
        assert response.status_code == 200, response.text
        samples, rate = sf.read(io.BytesIO(response.content), dtype="float32", always_2d=True)
        assert rate == 48000 and samples.shape[1] == 2 and np.abs(samples).max() > 0
    finally:
        assert server.stop() in (0, 130), server.output()


def test_the_doctor_on_npu0_passes_every_check(standin, tmp_path):
    out = tmp_path / "doctor.json"
    done = standin.run("-m", "moss_npu.doctor", "--device", "npu:0", "--model", str(NANO / "tts"), "--codec",
                       str(NANO / "codec"), "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line[:4] in ("ok  ", "FAIL", "--  ")]
    assert lines and all(line.startswith("ok") for line in lines), done.stdout
    assert "host reads per frame" in done.stdout and "tier A PASS" in done.stdout
