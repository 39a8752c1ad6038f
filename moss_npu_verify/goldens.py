"""Conformance runner: check this package against golden outputs of the official code.

``python -m moss_npu_verify.goldens FIXTURE_DIR`` reads ``FIXTURE_DIR/cases.json``, runs each case through the
handler registered for its kind, prints one line per case (``id  kind  PASS/FAIL/SKIP  metric``) and a
summary line ``N passed, M failed, K skipped``. It exits 1 if a case fails, has an unknown kind, or cannot be
checked: a SKIP (its optional package, llama-cpp-python for the Delay cases, is not installed: the line names the
install command; or its handler is not written) is a case nobody checked, never a success. Handlers live in
``moss_npu_verify/cases/``, one module per part of the package they check (``nano``, ``codec``, ``tts``,
``text``, ``delay``); this file only dispatches. Tolerances come from each fixture's README.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from moss_npu.cli import ArgumentParser, run_cli
from moss_npu.errors import InputError, MissingDependency
from moss_npu.extras import missing_optional_part

REPO_ROOT = Path(__file__).resolve().parent.parent

# Fixture family -> case kind -> "module:function". A kind listed here whose handler does not exist yet is
# reported as SKIP (not implemented); a kind not listed at all is a failure.
HANDLERS: dict[str, dict[str, str]] = {
    "nano": {
        "tokenize": "moss_npu_verify.cases.nano:check_tokenize",
        "prompt_ids": "moss_npu_verify.cases.nano:check_prompt_ids",
        "forward": "moss_npu_verify.cases.nano:check_forward",
        "generate": "moss_npu_verify.cases.nano:check_generate",
        "split_text": "moss_npu_verify.cases.nano:check_split_text",
        "load_reference_audio": "moss_npu_verify.cases.codec:check_load_reference_audio",
        "codec_encode": "moss_npu_verify.cases.codec:check_codec_encode",
        "codec_decode": "moss_npu_verify.cases.codec:check_codec_decode",
        "inference": "moss_npu_verify.cases.tts:check_inference",
        "inference_stream": "moss_npu_verify.cases.tts:check_inference_stream",
    },
    "delay": {
        "prompt": "moss_npu_verify.cases.delay:check_prompt",
        "embed": "moss_npu_verify.cases.delay:check_embed",
        "delay": "moss_npu_verify.cases.delay:check_delay",
        "sampling": "moss_npu_verify.cases.delay:check_sampling",
        "generate": "moss_npu_verify.cases.delay:check_generate",
    },
    # Text-only fixtures (no model): the official text normalization.
    "text": {
        "normalize_text": "moss_npu_verify.cases.text:check_normalize_text",
        "normalize_robust": "moss_npu_verify.cases.text:check_normalize_robust",
        "normalize_language": "moss_npu_verify.cases.text:check_normalize_language",
    },
}

@dataclass(frozen=True)
class CaseResult:
    """What a handler found: whether the case holds, and the metric that says so."""

    passed: bool
    detail: str = ""


@dataclass
class Fixture:
    """One fixture folder: its cases, and a memo so that a model loads once per run."""

    root: Path
    family: str
    meta: dict
    cases: list[dict]
    _memo: dict = field(default_factory=dict, repr=False)

    def path(self, rel: str) -> Path:
        """Resolve a path written in cases.json (relative to the fixture folder)."""
        return self.root / rel

    def memo(self, key: str, factory: Callable[[], Any]) -> Any:
        """Return the cached value for ``key``, computing it with ``factory`` the first time."""
        if key not in self._memo:
            self._memo[key] = factory()
        return self._memo[key]

    def case(self, case_id: str) -> dict:
        """Return the case with this id (``inference_stream`` cases point at an ``inference`` case)."""
        for case in self.cases:
            if case.get("id") == case_id:
                return case
        raise KeyError(f"no case {case_id!r} in {self.root / 'cases.json'}")


@dataclass(frozen=True)
class Outcome:
    """One printed line of the report."""

    case_id: str
    kind: str
    status: str  # PASS, FAIL or SKIP
    detail: str
    missing_dependency: bool = False  # a SKIP because an optional package is not installed


def fixtures_root() -> Path:
    """Return the fixtures folder: env ``MOSS_NPU_FIXTURES``, else ``../shared/fixtures`` beside the repo."""
    env = os.environ.get("MOSS_NPU_FIXTURES")
    return Path(env).expanduser().resolve() if env else (REPO_ROOT.parent / "shared" / "fixtures").resolve()


def fixture_dirs(root: Optional[Path] = None) -> list[Path]:
    """Return every folder under the fixtures root that holds a cases.json, sorted by name."""
    root = fixtures_root() if root is None else root
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (p / "cases.json").is_file())


def detect_family(root: Path, declared: Optional[str] = None) -> str:
    """Return the fixture family: the one ``cases.json`` declares, else the one its layout shows.

    A nano fixture holds ``tts/`` + ``codec/``, a delay fixture ``weights/``; a ``text`` fixture holds no model.
    """
    if declared is not None:
        if declared not in HANDLERS:
            raise InputError(f"{root}: unknown fixture family {declared!r} (known: {', '.join(HANDLERS)})")
        return declared
    if (root / "tts" / "config.json").is_file():
        return "nano"
    if (root / "weights" / "config.json").is_file():
        return "delay"
    raise InputError(f"{root}: not a fixture folder (expected a \"family\" in cases.json, tts/config.json "
                     "or weights/config.json)")


def load_fixture(root: Path | str) -> Fixture:
    """Read a fixture folder's cases.json.

    Raises:
        InputError: cases.json is missing, not UTF-8 JSON, or not an object whose "cases" is a list of objects;
            or the folder's family is unknown.
    """
    root = Path(root).resolve()
    path = root / "cases.json"
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror}); pass a fixture folder") from None
    except UnicodeDecodeError:
        raise InputError(f"{path}: not UTF-8 text; a fixture's cases.json is UTF-8 JSON") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    cases = data.get("cases") if isinstance(data, dict) else None
    if not isinstance(cases, list) or not all(isinstance(c, dict) for c in cases):
        raise InputError(f"{path}: expected an object whose \"cases\" is a list of case objects")
    meta = {k: v for k, v in data.items() if k != "cases"}
    family = detect_family(root, meta.get("family"))
    return Fixture(root=root, family=family, meta=meta, cases=list(cases))


def _handler(target: str) -> Optional[Callable[[dict, Fixture], CaseResult]]:
    """Import a handler; None when its module or function does not exist yet."""
    module_name, _, function_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            return None  # the room itself is not written yet
        raise  # a dependency of an existing handler is missing: run_case tells optional parts from failures
    return getattr(module, function_name, None)


def run_case(case: dict, fx: Fixture) -> Outcome:
    """Run one case and say PASS, FAIL or SKIP with its metric."""
    case_id, kind = str(case.get("id", "?")), str(case.get("kind", "?"))
    table = HANDLERS[fx.family]
    if kind not in table:
        return Outcome(case_id, kind, "FAIL", f"unknown case kind {kind!r} for a {fx.family} fixture")
    try:
        handler = _handler(table[kind])
        if handler is None:
            return Outcome(case_id, kind, "SKIP", "(not implemented)")
        result = handler(case, fx)
    except MissingDependency as exc:
        return Outcome(case_id, kind, "SKIP", f"(optional package missing) {exc}", missing_dependency=True)
    except ModuleNotFoundError as exc:
        missing = missing_optional_part(exc)
        if missing is None:
            return Outcome(case_id, kind, "FAIL", f"{type(exc).__name__}: {exc}")
        return Outcome(case_id, kind, "SKIP", f"(optional package missing) {missing}", missing_dependency=True)
    except Exception as exc:  # a crashing case is a failed case; the runner goes on with the others
        return Outcome(case_id, kind, "FAIL", f"{type(exc).__name__}: {exc}")
    return Outcome(case_id, kind, "PASS" if result.passed else "FAIL", result.detail)


def iter_outcomes(fx: Fixture) -> Iterator[Outcome]:
    """Run every case of a fixture in file order."""
    for case in fx.cases:
        yield run_case(case, fx)


def main(argv: Optional[list[str]] = None) -> int:
    """Run the cases of FIXTURE_DIR and print the report; exit 1 if any case fails or is skipped (moss_npu.cli
    policy)."""
    return run_cli(lambda: run(argv))


def run(argv: Optional[list[str]] = None) -> int:
    """Parse flags, run the selected cases, print one line each and the summary; return 1 if any failed or could
    not be checked."""
    parser = ArgumentParser(
        prog="python -m moss_npu_verify.goldens",
        description="Check moss-npu against golden outputs of the official code. Exit codes: 0 every case "
        "passes, 1 a case failed, has an unknown kind or could not be checked (SKIP), 2 bad usage, 130 interrupted.",
    )
    parser.add_argument("fixture_dir", help="folder holding cases.json (e.g. ../shared/fixtures/nano-tiny)")
    parser.add_argument("--only", action="append", default=[], help="run only cases with this id or kind")
    args = parser.parse_args(argv)
    root = Path(args.fixture_dir)
    if not (root / "cases.json").is_file():
        raise InputError(f"{root}/cases.json not found; pass a fixture folder")
    fx = load_fixture(root)
    unmatched = [o for o in args.only if not any(o in (c.get("id"), c.get("kind")) for c in fx.cases)]
    if unmatched:  # a filter that selects nothing would report success having checked nothing
        raise InputError(f"--only {', '.join(unmatched)}: no case of {root} has this id or kind")
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    width = max((len(str(c.get("id", ""))) for c in fx.cases), default=10)
    for case in fx.cases:
        if args.only and case.get("id") not in args.only and case.get("kind") not in args.only:
            continue
        outcome = run_case(case, fx)
        counts[outcome.status] += 1
        print(f"{outcome.case_id:<{width}}  {outcome.kind:<20}  {outcome.status}  {outcome.detail}", flush=True)
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] or counts["SKIP"] else 0


if __name__ == "__main__":
    sys.exit(main())
