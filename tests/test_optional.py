"""The skip rule of tests/optional.py, run on a small suite in a pytest subprocess: with ``CI`` set, a missing
environment part fails, a plain skip fails the run, and the allowed skips are listed by name; without it they
all skip with their message."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SUITE = '''
import pytest
from tests.optional import allowed_skip, missing, needs

def test_runs():
    pass

@needs(False, "the frobnicator is not installed")
def test_needs_a_part():
    pass

def test_missing_inside():
    missing("no fixture here")

def test_plain_skip():
    pytest.skip("bypassed the rule")

@allowed_skip(True, "needs a real device")
def test_on_hardware():
    pass

@allowed_skip(False, "needs a real device")
@needs(False, "and a part")
def test_allowed_only_when_skipped():
    pass
'''


def run_suite(tmp_path: Path, ci: bool) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_configure, pytest_runtest_setup  # noqa\n")
    (tmp_path / "test_suite.py").write_text(SUITE)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_in_a_users_clone_everything_missing_skips(tmp_path):
    done = run_suite(tmp_path, ci=False)
    assert done.returncode == 0, done.stdout
    assert "1 passed, 5 skipped" in done.stdout
    assert "allowed skips (1)" in done.stdout and "test_suite.py::test_on_hardware: needs a real device" in done.stdout


def test_under_ci_a_missing_part_or_a_plain_skip_fails_and_allowed_skips_are_listed(tmp_path):
    done = run_suite(tmp_path, ci=True)
    assert done.returncode == 1
    assert "1 failed, 1 passed, 2 skipped, 2 errors" in done.stdout, done.stdout
    lines = done.stdout.splitlines()
    for name, why in [("test_needs_a_part", "missing in CI: the frobnicator is not installed"),
                      ("test_missing_inside", "missing in CI: no fixture here"),
                      ("test_allowed_only_when_skipped", "missing in CI: and a part")]:
        assert any(name in line and why in line for line in lines), (name, done.stdout)
    assert "skipped under CI (1)" in done.stdout
    assert "test_suite.py::test_plain_skip: bypassed the rule" in lines
    assert "allowed skips (1)" in done.stdout and "test_suite.py::test_on_hardware: needs a real device" in lines


def test_a_run_without_the_fixtures_ends_by_counting_their_skips(tmp_path):
    """The skips for missing fixtures are counted in one line that says how to point at them (without -rs a new
    user saw only "309 skipped")."""
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_configure, pytest_runtest_setup, "
                                          "pytest_terminal_summary  # noqa\n")
    (tmp_path / "test_suite.py").write_text(
        "import pytest\nfrom tests.optional import missing\n"
        "@pytest.mark.parametrize('n', range(3))\ndef test_fixture(n):\n"
        "    missing('fixture x not found (set MOSS_NPU_FIXTURES)')\n"
        "def test_other():\n    pytest.skip('not about fixtures')\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
               MOSS_NPU_FIXTURES=str(tmp_path / "nowhere"))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    lines = done.stdout.strip().splitlines()
    assert lines[-1].startswith("4 skipped"), done.stdout
    assert lines[-2].startswith(f"3 tests skipped: the fixtures are not at {tmp_path / 'nowhere'}; point "
                                "MOSS_NPU_FIXTURES at"), done.stdout
