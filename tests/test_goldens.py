"""Every case of every fixture folder, through the same runner as ``python -m moss_npu_verify.goldens``.

Without fixtures (a user's clone) these tests skip and say so; in CI (``CI=true``) a missing fixtures
folder fails, so parity can never be skipped silently there.
"""

import re

import pytest

from moss_npu.cpu import targets
from moss_npu.native import library as native
from moss_npu_verify import goldens
from moss_npu.errors import InputError
from tests import fixture_sets
from tests.optional import missing

ROOT = goldens.fixtures_root()
DIRS = goldens.fixture_dirs(ROOT)
PARAMS = [
    pytest.param(d, case["id"], id=f"{d.name}/{case['id']}")
    for d in DIRS
    for case in goldens.load_fixture(d).cases
]
_FIXTURES: dict = {}


def _other_targets() -> list:
    """The kernels' instruction sets this CPU runs besides the default (which ``test_golden_case`` meets)."""
    try:
        return targets.runnable_targets(native.load_library()[0])[1:]
    except native.KernelUnavailable:
        return []


DECODING = ("generate", "inference", "inference_stream")  # the Nano cases that run the CPU frame step's kernels
TARGET_PARAMS = [
    pytest.param(d, case["id"], target, id=f"{target}/{d.name}/{case['id']}")
    for target in _other_targets()
    for d in DIRS if goldens.load_fixture(d).family == "nano"
    for case in goldens.load_fixture(d).cases
    if case.get("kind") in DECODING
]


def _fixture(path):
    if path not in _FIXTURES:
        _FIXTURES[path] = goldens.load_fixture(path)
    return _FIXTURES[path]


def test_fixtures_present():
    """Every fixture folder the tests expect is there (a hard failure in CI, naming each missing one): the cases
    below come from whichever folders exist, so a partial fixtures root would otherwise test less, silently."""
    problems = fixture_sets.missing_sets(ROOT)
    if problems:
        missing("; ".join(problems) + " (set MOSS_NPU_FIXTURES)")


def test_the_expected_fixture_folders_name_every_folder_the_code_reads():
    """Each folder named as ``fixtures_root() / <folder>`` in the tests and the package is in ``tests/fixture_sets.EXPECTED``, and
    each folder there with a cases.json is one the runner reads."""
    named = set()
    for folder in ("tests", "moss_npu", "bench"):
        for path in (goldens.REPO_ROOT / folder).rglob("*.py"):
            named |= set(re.findall(r'fixtures_root\(\) / "([\w.-]+)"', path.read_text(encoding="utf-8")))
    assert named and named <= set(fixture_sets.EXPECTED), named - set(fixture_sets.EXPECTED)


@pytest.mark.parametrize("fixture_dir,case_id", PARAMS)
def test_golden_case(fixture_dir, case_id):
    fx = _fixture(fixture_dir)
    outcome = goldens.run_case(fx.case(case_id), fx)
    if outcome.status == "SKIP":  # an optional package or a handler is missing: a skip here, a failure in CI
        missing(f"{case_id}: {outcome.detail}")
    assert outcome.status == "PASS", f"{case_id} ({outcome.kind}): {outcome.detail}"


@pytest.mark.parametrize("fixture_dir,case_id,target", TARGET_PARAMS)
def test_golden_case_on_every_kernel_target(fixture_dir, case_id, target, monkeypatch):
    """The decoding cases again with the one-row kernels forced to each other instruction set this CPU runs
    ($MOSS_NPU_KERNEL_TARGET): every one of them gives the official codes."""
    monkeypatch.setenv(targets.TARGET_ENV, target)
    test_golden_case(fixture_dir, case_id)


def test_text_fixture_needs_no_model(tmp_path):
    """A fixture whose cases.json declares ``"family": "text"`` holds no model folder and still loads."""
    (tmp_path / "cases.json").write_text('{"family": "text", "cases": [{"id": "t", "kind": "normalize_robust"}]}')
    assert goldens.load_fixture(tmp_path).family == "text"


def test_unknown_family_is_refused(tmp_path):
    (tmp_path / "cases.json").write_text('{"family": "speech", "cases": []}')
    with pytest.raises(InputError, match="unknown fixture family 'speech'"):
        goldens.load_fixture(tmp_path)


@pytest.mark.parametrize("body", [b"{bad", b"[1, 2]", b'{"cases": 3}', b'{"cases": [1]}', b"\xff\xfe{}"],
                         ids=["syntax", "list", "cases-not-list", "case-not-object", "not-utf8"])
def test_a_damaged_cases_json_is_bad_input(tmp_path, body):
    (tmp_path / "cases.json").write_bytes(body)
    with pytest.raises(InputError, match="cases.json"):
        goldens.load_fixture(tmp_path)


def test_only_that_matches_nothing_is_refused(tmp_path, capsys):
    """``--only`` selecting no case would report success having checked nothing."""
    (tmp_path / "cases.json").write_text('{"family": "text", "cases": [{"id": "t", "kind": "normalize_robust"}]}')
    assert goldens.main([str(tmp_path), "--only", "t", "--only", "nosuch"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: --only nosuch: no case of {tmp_path} has this id or kind"]


def test_missing_optional_package_is_a_named_skip(tmp_path, monkeypatch):
    """A handler whose optional package is absent SKIPs with the install command instead of failing."""
    from moss_npu.errors import MissingDependency

    def handler(case, fx):
        raise MissingDependency('needs llama-cpp-python; install it with `pip install -e ".[llama]"`')

    monkeypatch.setattr(goldens, "_handler", lambda target: handler)
    fx = goldens.Fixture(root=tmp_path, family="delay", meta={}, cases=[])
    outcome = goldens.run_case({"id": "x", "kind": "prompt"}, fx)
    assert (outcome.status, outcome.missing_dependency) == ("SKIP", True)
    assert 'pip install -e ".[llama]"' in outcome.detail


@pytest.mark.parametrize("module, status", [("torch", "SKIP"), ("torch.nn", "SKIP"), ("no_such_module", "FAIL")])
def test_a_missing_optional_part_is_a_named_skip_and_anything_else_fails(tmp_path, monkeypatch, module, status):
    """torch absent (a torch-free Delay install) skips the Nano cases naming the install command; a module that
    belongs to no optional part is a real failure."""
    def handler(case, fx):
        raise ModuleNotFoundError(f"No module named {module!r}", name=module)

    monkeypatch.setattr(goldens, "_handler", lambda target: handler)
    fx = goldens.Fixture(root=tmp_path, family="nano", meta={}, cases=[])
    outcome = goldens.run_case({"id": "x", "kind": "forward"}, fx)
    assert outcome.status == status
    if status == "SKIP":
        assert outcome.missing_dependency and 'pip install -e ".[nano]"' in outcome.detail


def test_unknown_kind_fails(tmp_path):
    """A case kind the runner does not know is a failure, never a silent pass."""
    fx = goldens.Fixture(root=tmp_path, family="nano", meta={}, cases=[])
    outcome = goldens.run_case({"id": "x", "kind": "no_such_kind"}, fx)
    assert outcome.status == "FAIL" and "unknown case kind" in outcome.detail


def test_runner_cli_reports_and_exits(tmp_path, capsys):
    """The CLI prints one line per case plus the summary, and exits 1 when a case fails."""
    (tmp_path / "tts").mkdir()
    (tmp_path / "tts" / "config.json").write_text("{}")
    (tmp_path / "cases.json").write_text('{"cases": [{"id": "bad", "kind": "no_such_kind"}]}')
    assert goldens.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["bad", "no_such_kind", "FAIL"]
    assert out[-1] == "0 passed, 1 failed, 0 skipped"


def test_a_case_without_handler_is_not_checked_and_the_runner_exits_1(tmp_path, capsys, monkeypatch):
    """A kind whose handler is not written is a SKIP line and exit 1: a case nobody checked is never a success."""
    (tmp_path / "cases.json").write_text('{"family": "text", "cases": [{"id": "t", "kind": "normalize_robust"}]}')
    monkeypatch.setattr(goldens, "_handler", lambda target: None)
    assert goldens.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["t", "normalize_robust", "SKIP"] and "not implemented" in out[0]
    assert out[-1] == "0 passed, 0 failed, 1 skipped"
