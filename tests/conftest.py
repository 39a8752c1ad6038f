"""Suite-wide pytest settings: the ``slow`` marker (real-size model checks) runs only when asked for (and always
in CI), the environment marks of ``tests/optional.py``, the skip rule of CI, and a cache folder of the session's
own, so that no test writes into the user's ``~/.cache/moss-npu``.

Run the slow ones with ``MOSS_NPU_SLOW_TESTS=1 python -m pytest -m slow tests``.

Under ``CI`` a skipped test fails the run unless it is an ``allowed_skip`` (``tests/optional.py``); the allowed
ones are listed by name at the end, so a green CI says exactly what it did not run. A run without the fixtures
ends with one line counting the tests skipped for them and saying how to point ``MOSS_NPU_FIXTURES`` at them.
"""

import os

import pytest

from moss_npu_verify.goldens import fixtures_root
from tests import optional

FIXTURES_VARIABLE = "MOSS_NPU_FIXTURES"  # a skip for a missing fixture names it or the fixtures folder


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: real-size model checks (set MOSS_NPU_SLOW_TESTS=1 to run)")
    config.addinivalue_line("markers", f"{optional.NEEDS}(message): an environment condition (tests/optional.py)")
    config.addinivalue_line("markers", f"{optional.ALLOWED_SKIP}(reason): a skip CI allows (tests/optional.py)")
    config.pluginmanager.register(optional.SkipRule(), "moss-npu-skip-rule")


def pytest_runtest_setup(item):
    optional.check_marks(item)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("MOSS_NPU_SLOW_TESTS") == "1" or optional.in_ci():
        return
    skip = pytest.mark.skip(reason="slow: set MOSS_NPU_SLOW_TESTS=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """Count the tests skipped because the fixtures are missing (the per-test reasons show only with -rs)."""
    root = str(fixtures_root())
    skipped = [report for report in terminalreporter.stats.get("skipped", [])
               if any(mark in str(getattr(report, "longrepr", "")) for mark in (FIXTURES_VARIABLE, root))]
    if skipped:
        terminalreporter.write_line(
            f"{len(skipped)} tests skipped: the fixtures are not at {root}; point {FIXTURES_VARIABLE} at "
            "the project's fixtures folder (README.md, Tests) and run again", yellow=True)


@pytest.fixture(autouse=True, scope="session")
def _user_cache(tmp_path_factory):
    """Point ``MOSS_NPU_CACHE_DIR`` (the prepared grammars of text normalization, the kernels built for this CPU
    where asked) at a folder of this session."""
    folder = tmp_path_factory.mktemp("moss-npu-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MOSS_NPU_CACHE_DIR", str(folder))
        yield folder
