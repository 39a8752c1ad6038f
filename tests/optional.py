"""Optional packages in tests: skip with the install command in a user's clone, fail in CI.

CI (``CI=true``) installs every optional part the way the README says, so a missing one there is a broken
install, never a silent skip.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def require(module: str, install: str) -> ModuleType:
    """Import ``module``; when it is missing, skip naming ``install`` (or fail under CI)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        message = f"{module} is not installed ({exc}); install it with `{install}`"
        if os.environ.get("CI"):
            pytest.fail(f"CI installs every optional part: {message}")
        pytest.skip(message)
