"""An installed torch_npu >= 2.5 loads itself when torch is imported (its ``torch.backends`` entry point); without
CANN's environment that import fails, and with it ``import torch``, whatever device was asked for.

The tests install a package named torch_npu with the same entry point, whose import fails as the real one does
without ``set_env.sh`` (a CANN library is missing), into a site folder on PYTHONPATH, and run the commands in a
subprocess: each must print the project's one ``error:`` line with both fixes and exit 2 (DeviceError), and never
import torch a second time (which raises an unrelated error about a TORCH_LIBRARY namespace).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moss_npu.errors import DeviceError

ROOT = Path(__file__).resolve().parents[1]
MISSING = "libhccl.so: cannot open shared object file: No such file or directory"


@pytest.fixture(scope="module")
def broken_site(tmp_path_factory):
    """A site folder holding a torch_npu whose autoload entry point fails on import, as without CANN."""
    site = tmp_path_factory.mktemp("site")
    (site / "torch_npu").mkdir()
    (site / "torch_npu" / "__init__.py").write_text(f"raise ImportError({MISSING!r})\n")
    meta = site / "torch_npu-2.5.1.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.5.1\n")
    (meta / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_autoload\n")
    return site


def run(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_site_breaks_import_torch_as_torch_npu_does(broken_site):
    done = run(broken_site, "-c", "import torch")
    assert done.returncode == 1 and "Failed to load the backend extension: torch_npu" in done.stderr


def assert_one_error_line(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == DeviceError.exit_code, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and done.stderr.startswith("error:"), done.stderr
    assert ("torch cannot be imported: it loads the installed device extension torch_npu, which failed "
            f"(ImportError: {MISSING}); source <CANN>/set_env.sh") in errors[0]
    assert "set TORCH_DEVICE_BACKEND_AUTOLOAD=0 to run without it" in errors[0]
    assert "TORCH_LIBRARY" not in done.stderr and done.stdout == ""


@pytest.mark.parametrize("command", [
    ("inference.py", "--device", "cpu", "--text", "Hello.", "--output", "{tmp}/out.wav"),
    ("eval_accuracy.py", "--device", "cpu", "--text", "Hello."),
    ("-m", "moss_npu.serve", "--device", "cpu", "--port", "0", "--model", "{tmp}/model", "--codec", "{tmp}/model",
     "--voices-dir", "{tmp}/voices"),
], ids=["inference", "eval_accuracy", "serve"])
def test_commands_say_how_to_fix_it_in_one_line(broken_site, tmp_path, command):
    (tmp_path / "model").mkdir()
    for name in ("config.json", "tokenizer.model"):  # the server checks that its folders hold these first
        (tmp_path / "model" / name).write_text("{}")
    done = run(broken_site, *(part.format(tmp=tmp_path) for part in command))
    assert_one_error_line(done)
    assert not (tmp_path / "out.wav").exists()


def test_the_failure_is_raised_again_without_a_second_import(broken_site):
    """Every later use of torch through the device layer gets the same error, not the second import's."""
    done = run(broken_site, "-c", """
from moss_npu import device
from moss_npu.errors import DeviceError
seen = []
for attempt in (device.import_torch, lambda: device.resolve_device("cpu"), lambda: device.resolve_device("npu:0")):
    try:
        attempt()
    except DeviceError as exc:
        seen.append(exc)
assert len(seen) == 3 and seen[0] is seen[1] is seen[2], seen
print(seen[0])
""")
    assert done.returncode == 0, done.stderr
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in done.stdout and "TORCH_LIBRARY" not in done.stdout + done.stderr
