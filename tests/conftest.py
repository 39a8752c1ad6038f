"""Suite-wide pytest settings: the ``slow`` marker (real-size model checks) runs only when asked for, and a
cache folder of the session's own, so that no test writes into the user's ``~/.cache/moss-npu``.

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


@pytest.fixture(autouse=True, scope="session")
def _user_cache(tmp_path_factory):
    """Point ``MOSS_NPU_CACHE_DIR`` (the prepared grammars of text normalization, the kernels built for this CPU
    where asked) at a folder of this session."""
    folder = tmp_path_factory.mktemp("moss-npu-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MOSS_NPU_CACHE_DIR", str(folder))
        yield folder
