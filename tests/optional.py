"""What tests may not find: skip with the fix in a user's clone, fail in CI.

CI (``CI=true``; ``.ci/run`` sets it) installs every optional part the way the README says and has the fixtures
beside the repo, so a missing one there is a broken set-up, never a silent skip. Every skip that depends on the
environment goes through this module: ``missing`` inside a test or fixture, ``require`` for an optional package,
``needs`` as a mark where the condition is known when the module loads.

The only skips CI allows are the tests that need what CI cannot have (a real CUDA/NPU device with graph capture,
the official remote code): they are marked ``allowed_skip`` and listed by name at the end of the run. Any other
skip under ``CI`` fails the run (``tests/conftest.py``), including a plain ``pytest.skip`` that bypassed this
module.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

ALLOWED_SKIP = "allowed_skip"  # the mark of the skips CI allows, and the user property of a test it skipped
NEEDS = "needs"  # the mark of an environment condition: its argument is the message, None when present


def in_ci() -> bool:
    """Whether this run is CI's, where nothing the tests need may be missing."""
    return bool(os.environ.get("CI"))


def missing(message: str) -> None:
    """Skip the test (or module) with ``message``; under CI fail with it instead."""
    if in_ci():
        pytest.fail(f"missing in CI: {message}", pytrace=False)
    pytest.skip(message, allow_module_level=True)


def require(module: str, install: str) -> ModuleType:
    """Import ``module``; when it is missing, skip naming ``install`` (or fail under CI)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing(f"{module} is not installed ({exc}); install it with `{install}`")


def needs(present: bool, message: str) -> pytest.MarkDecorator:
    """Mark a test (or ``pytestmark``) that needs something of the environment: when ``present`` is false it
    skips with ``message`` in a user's clone and fails under CI (checked at set-up, ``tests/conftest.py``)."""
    return pytest.mark.needs(None if present else message)


def allowed_skip(skip: bool, reason: str) -> pytest.MarkDecorator:
    """Mark a test that needs what no CI machine has (real device graphs, the official remote code): when ``skip``
    it skips even under CI, and the run lists it by name."""
    return pytest.mark.allowed_skip(reason if skip else None)


def check_marks(item: pytest.Item) -> None:
    """Apply an item's ``allowed_skip`` and ``needs`` marks (allowed skips first: a test CI cannot run at all
    does not fail for what else it would need)."""
    for mark in item.iter_markers(ALLOWED_SKIP):
        reason = mark.args[0]
        if reason:
            item.user_properties.append((ALLOWED_SKIP, reason))
            pytest.skip(reason)
    for mark in item.iter_markers(NEEDS):
        reason = mark.args[0]
        if reason:
            missing(reason)


class SkipRule:
    """The pytest plugin of the rule: collects every skip; under CI one that is not allowed fails the run. The
    allowed ones are listed by name at the end of every run."""

    def __init__(self) -> None:
        self.skips: list[tuple[str, str, bool]] = []  # (test id, reason, allowed)

    def pytest_runtest_logreport(self, report) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            self._record(report)

    def pytest_collectreport(self, report) -> None:
        if report.skipped:
            self._record(report)

    def _record(self, report) -> None:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        allowed = ALLOWED_SKIP in dict(getattr(report, "user_properties", ()))
        self.skips.append((report.nodeid, reason, allowed))

    def pytest_sessionfinish(self, session) -> None:
        if in_ci() and any(not allowed for _, _, allowed in self.skips):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        allowed = [(nodeid, reason) for nodeid, reason, ok in self.skips if ok]
        if allowed:
            terminalreporter.section(f"allowed skips ({len(allowed)})")
            for nodeid, reason in allowed:
                terminalreporter.line(f"{nodeid}: {reason}")
        others = [(nodeid, reason) for nodeid, reason, ok in self.skips if not ok]
        if others and in_ci():
            terminalreporter.section(f"skipped under CI ({len(others)})", red=True)
            terminalreporter.line("each of these fails the run: install what it names, or fix the set-up")
            for nodeid, reason in others:
                terminalreporter.line(f"{nodeid}: {reason}")
