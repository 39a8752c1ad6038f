"""Shared fixtures of the text-normalization tests.

The WeTextProcessing grammar files are installed with ``pip install --no-deps WeTextProcessing==1.2.0``.
Tests that need them skip (saying so) in a clone without them, and fail in CI, where .ci/run installs them.
"""

import pytest

from moss_npu.native.library import KernelUnavailable
from moss_npu.text.lattice import LatticeKernels
from moss_npu.text.wetext import Grammars, WeTextUnavailable
from tests.optional import missing


def _missing() -> str:
    try:
        import kaldifst  # noqa: F401

        Grammars.locate()
    except (ImportError, WeTextUnavailable) as exc:
        return str(exc)
    return ""


MISSING = _missing()


@pytest.fixture
def needs_wetext():
    """Skip (fail in CI) when kaldifst or the WeTextProcessing grammar files are not installed."""
    if MISSING:
        missing(f"text normalization grammars missing: {MISSING}")


@pytest.fixture(scope="module")
def kernels():
    """The compiled search (``moss_npu.text.lattice``); skip (fail in CI) where no C compiler builds it."""
    try:
        return LatticeKernels.load()
    except KernelUnavailable as exc:
        missing(f"no compiled search here: {exc}")
