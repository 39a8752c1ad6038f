"""What tests may not find: skip with the fix in a user's clone, fail in CI.

CI (``CI=true``) installs every optional part the way the README says and has the fixtures beside the repo, so
a missing one there is a broken set-up, never a silent skip.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def missing(message: str) -> None:
    """Skip the test (or module) with ``message``; under CI fail with it instead."""
    if os.environ.get("CI"):
        pytest.fail(f"missing in CI: {message}")
    pytest.skip(message, allow_module_level=True)


def require(module: str, install: str) -> ModuleType:
    """Import ``module``; when it is missing, skip naming ``install`` (or fail under CI)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing(f"{module} is not installed ({exc}); install it with `{install}`")
