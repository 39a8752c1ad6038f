"""The CLIs as a person runs them: in a real (pseudo-)terminal, with stderr in a pipe, and stopped by signals.

Issue 10: every ``inference.py`` run started from a terminal crashed on the progress bar, and nothing ran the
CLI in a terminal. These tests start the CLIs as subprocesses on a pty from the ``pty`` module's
``openpty`` (stdin, stdout and stderr all terminals, as in a shell), on the tiny fixture checkpoints.
"""

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from moss_npu_verify import goldens
from tests.optional import needs

REPO = Path(__file__).resolve().parent.parent
NANO = goldens.fixtures_root() / "nano-tiny"
AUDIO = goldens.fixtures_root() / "audio"
pytestmark = needs(NANO.is_dir(), f"fixtures not found at {NANO} (set MOSS_NPU_FIXTURES)")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
LONG_TEXT = "The first sentence is here. A second one follows it. And a third one closes the text."


def nano(*extra):
    return [sys.executable, "inference.py", "--model", str(NANO / "tts"), "--codec", str(NANO / "codec"),
            "--device", "cpu", "--greedy", *map(str, extra)]


def run_in_pty(cmd, timeout=300):
    """Run ``cmd`` with a pseudo-terminal as stdin, stdout and stderr; return (exit code, everything shown)."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    shown, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every copy of the terminal's slave side is closed
                break
            if not data:
                break
            shown += data
        else:
            proc.kill()
            pytest.fail(f"{cmd} ran past {timeout} s in a terminal; shown so far: {shown[-2000:]!r}")
    finally:
        os.close(master)
    return proc.wait(timeout=30), shown.decode("utf-8", "replace")


def assert_valid_audio(path, min_frames=1):
    data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    assert rate == 48000 and data.shape[1] == 2 and data.shape[0] >= min_frames * 3840
    assert np.isfinite(data).all() and np.abs(data).max() > 0
    return data


@pytest.mark.parametrize("extra", [
    pytest.param([], id="plain"),
    pytest.param(["--stream"], id="stream"),
    pytest.param(["--prompt-audio-path", AUDIO / "zh_1.wav", "--voice-clone-max-text-tokens", "8"], id="voice-clone"),
])
def test_inference_in_a_terminal(tmp_path, extra):
    out = tmp_path / "t.wav"
    rc, shown = run_in_pty(nano("--text", LONG_TEXT, "--max-new-frames", "6", "--output", out, *extra))
    assert rc == 0, shown
    assert "Traceback" not in shown and "error:" not in shown, shown
    assert f"wrote {out}" in shown
    assert_valid_audio(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.wav"]


def test_eval_accuracy_in_a_terminal(tmp_path):
    report = tmp_path / "r.json"
    rc, shown = run_in_pty([sys.executable, "eval_accuracy.py", "--model", str(NANO / "tts"), "--codec",
                            str(NANO / "codec"), "--device", "cpu", "--max-new-frames", "3", "--seed", "1",
                            "--text", "Hello world.", "--report", str(report)])
    assert rc == 0, shown
    assert "Traceback" not in shown and "loading reference" in shown and report.is_file()


def test_progress_lines_when_stderr_is_not_a_terminal(tmp_path):
    """Piped stderr: one line per text chunk, no bar (no carriage returns), the result line on stdout."""
    out = tmp_path / "p.wav"
    done = subprocess.run(nano("--text", LONG_TEXT, "--max-new-frames", "4", "--output", out,
                               "--prompt-audio-path", AUDIO / "zh_1.wav", "--voice-clone-max-text-tokens", "8"),
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    chunk_lines = [line for line in lines if re.fullmatch(r"chunk \d+: \d+ frames \(\d+\.\d\d s of audio\) in "
                                                          r"\d+\.\d s", line)]
    numbers = [int(line.split()[1].rstrip(":")) for line in chunk_lines]
    assert len(numbers) >= 3 and numbers == list(range(1, len(numbers) + 1)), done.stderr
    assert "\r" not in done.stderr
    assert all(line in chunk_lines or line.startswith("warning: ") for line in lines), done.stderr
    assert done.stdout.startswith(f"wrote {out}")
    assert_valid_audio(out)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_mid_run_exits_130_and_leaves_nothing(tmp_path, signum):
    """Stopped while streaming (the temp file exists then): one error line, exit 130, no file at all."""
    out = tmp_path / "s.wav"
    proc = subprocess.Popen(nano("--text", LONG_TEXT * 4, "--max-new-frames", "40", "--output", out,
                                 "--stream", "--prompt-audio-path", AUDIO / "zh_1.wav",
                                 "--voice-clone-max-text-tokens", "8"),
                            cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline()  # the first chunk line: generation is under way
        assert first.startswith("chunk 1:"), first + proc.stderr.read()
        assert any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 130, stderr
    assert len(errors) == 1 and "interrupted" in errors[0] and "Traceback" not in stderr, stderr
    assert stdout == "" and list(tmp_path.iterdir()) == []
