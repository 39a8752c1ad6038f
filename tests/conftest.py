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
    """Point ``MOSS_NPU_CACHE_DIR`` (the prepared grammars of text normalization, the compiled CPU kernels) at a
    folder of this session, with the kernels built in it first: every test then meets them as a user does after
    the first run, whatever order the tests run in (the one-time "compiled" line is tested in test_matvec)."""
    folder = tmp_path_factory.mktemp("moss-npu-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MOSS_NPU_CACHE_DIR", str(folder))
        try:
            from moss_npu.nano.matvec import MatVecKernels
            from moss_npu.native import KernelUnavailable
        except ImportError:  # a torch-free environment (the Delay fallback's checks)
            pass
        else:
            try:
                MatVecKernels.load()
            except KernelUnavailable:
                pass  # no compiler here: the CPU step's fallbacks are what the tests then meet
        yield folder
