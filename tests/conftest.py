"""Suite-wide pytest settings: the ``slow`` marker (real-size model checks) runs only when asked for.

Run them with ``MOSS_NPU_SLOW_TESTS=1 python -m pytest -m slow tests``.
"""

import os

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: real-size model checks (set MOSS_NPU_SLOW_TESTS=1 to run)")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("MOSS_NPU_SLOW_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set MOSS_NPU_SLOW_TESTS=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
