"""The ``standin`` fixture: the stand-in NPU built once per session (in a subprocess: the pytest process keeps its
own torch, with the fakes other tests install) and a runner for programs on it."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from tests.optional import missing

from .build import PACKAGE_ROOT

REPO = PACKAGE_ROOT.parents[1]


class Standin:
    """Runs Python programs with the stand-in torch_npu importable; each run can report the device's counters."""

    def env(self, **extra: str) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in ("TORCH_DEVICE_BACKEND_AUTOLOAD", "ASCEND_RT_VISIBLE_DEVICES")}
        env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), str(REPO)])
        env.update(extra)
        return env

    def run(self, *args: str, report: Optional[Path] = None, timeout: float = 600,
            **env: str) -> subprocess.CompletedProcess:
        """Run ``python ARGS`` from the repository root on the stand-in; ``report``: where its counters go."""
        if report is not None:
            env["MOSS_NPU_STANDIN_REPORT"] = str(report)
        return subprocess.run([sys.executable, *args], cwd=REPO, env=self.env(**env), capture_output=True, text=True,
                              timeout=timeout)

    @staticmethod
    def counters(report: Path) -> dict:
        """The counters a run wrote (``ops`` by name, copies each way, ``items``, ``replays``, ``peak_bytes``)."""
        return json.loads(report.read_text())


@pytest.fixture(scope="session")
def standin() -> Standin:
    """Build the stand-in NPU's C++ extension (cached: ``tests/npu_standin/build.py``), or skip saying what is
    missing (under CI: fail)."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        missing(f"the stand-in NPU is C++ built against torch's headers: no compiler {compiler!r} (apt-get install g++)")
    if shutil.which("ninja") is None and importlib.util.find_spec("ninja") is None:
        missing("the stand-in NPU is built with torch.utils.cpp_extension, which needs ninja (pip install ninja)")
    done = subprocess.run([sys.executable, "-m", "tests.npu_standin.build"], cwd=REPO, capture_output=True, text=True,
                          timeout=1200)
    if done.returncode != 0:
        pytest.fail(f"the stand-in NPU did not build:\n{done.stderr[-4000:]}", pytrace=False)
    return Standin()
