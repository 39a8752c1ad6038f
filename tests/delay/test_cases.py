"""Every case of every delay fixture through this room's handlers (generate cases need llama-cpp-python)."""

import json
import os

import pytest

from moss_npu.goldens import fixture_dirs, load_fixture, run_case


def _delay_cases():
    params = []
    for root in fixture_dirs():
        if (root / "weights" / "config.json").is_file():
            for case in json.loads((root / "cases.json").read_text())["cases"]:
                params.append(pytest.param(root, case, id=f"{root.name}-{case['id']}"))
    return params or [pytest.param(None, None, id="no-delay-fixture")]


_FIXTURES = {}


@pytest.mark.parametrize("root, case", _delay_cases())
def test_case(root, case, request):
    if root is None:
        if os.environ.get("CI"):
            pytest.fail("no delay fixture under the fixtures root in CI")
        pytest.skip("no delay fixture found (set MOSS_NPU_FIXTURES)")
    if case["kind"] == "generate":
        request.getfixturevalue("llama_cpp")
    fx = _FIXTURES.setdefault(root, load_fixture(root))  # one loaded model per fixture
    outcome = run_case(case, fx)
    assert outcome.status == "PASS", outcome.detail
