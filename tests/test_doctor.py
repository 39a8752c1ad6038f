"""``python -m moss_npu.doctor``: the self-check a user runs first on a new machine and attaches to a bug report."""

import json
import subprocess
import sys

import pytest

from moss_npu import device, doctor
from moss_npu_verify import goldens

from .fake_npu import FakeTorchNpu, install_fake_torch_npu
from .optional import missing


def _run(argv, capsys):
    code = doctor.main(argv)
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def test_the_cpu_check_passes_on_a_fresh_clone_and_writes_its_json(tmp_path):
    report = tmp_path / "doctor.json"
    done = subprocess.run([sys.executable, "-m", "moss_npu.doctor", "--device", "cpu", "--json", str(report)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("ok   python: ") and any(line.startswith("ok   device: cpu") for line in lines)
    assert "--   frames and accuracy: not run: add --model and --codec" in lines
    data = json.loads(report.read_text())
    assert data["passed"] is True and data["device"] == "cpu"
    assert [c["name"] for c in data["checks"]][:3] == ["python", "torch", "device"]


def test_with_a_model_it_times_frames_and_checks_accuracy_against_the_cpu(capsys):
    root = goldens.fixtures_root() / "nano-tiny"
    if not (root / "tts" / "config.json").is_file():
        missing(f"nano-tiny fixture not found under {goldens.fixtures_root()}; set MOSS_NPU_FIXTURES")
    code, lines, _ = _run(["--device", "cpu", "--model", str(root / "tts"), "--codec", str(root / "codec")], capsys)
    assert code == 0, lines
    frames = next(line for line in lines if line.startswith("ok   frames, eager: "))
    assert "ms per frame over" in frames and "not reported on this device" in frames
    assert "ok   accuracy against the CPU: tier A PASS, tier B PASS, tier C PASS" in lines


def test_a_torch_npu_built_for_another_torch_is_one_failed_line_with_its_fix(monkeypatch, capsys):
    fake = FakeTorchNpu(version="2.1.0.post13")
    install_fake_torch_npu(monkeypatch, fake)
    monkeypatch.setattr(device.torch, "__version__", "2.5.1")
    try:
        code, lines, _ = _run(["--device", "npu:0"], capsys)
    finally:
        device.register_backend("npu", None)
    assert code == 1
    extension = next(line for line in lines if line.startswith("FAIL torch_npu: 2.1.0.post13 -> "))
    assert "built for torch 2.1.0, not 2.5.1" in extension and "pip install torch==2.1.0" in extension
    assert "ok   process settings: jit_compile False, allow_internal_format False" in lines  # read back from torch_npu


def test_a_missing_torch_npu_is_a_failed_device_line_naming_the_fix(capsys):
    device.register_backend("npu", None)
    code, lines, _ = _run(["--device", "npu:0"], capsys)
    assert code == 1
    failed = [line for line in lines if line.startswith("FAIL ")]
    assert len(failed) == 1 and failed[0].startswith("FAIL device: DeviceError -> ") and "set_env.sh" in failed[0]


@pytest.mark.parametrize("argv", [["--model", "m"], ["--codec", "c"], ["--device", "tpu"]])
def test_bad_usage_is_one_error_line_and_exit_2(argv, capsys):
    code, lines, err = _run(argv, capsys)
    assert code == 2 and lines == []
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
