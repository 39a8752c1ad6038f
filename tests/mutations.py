"""The mutation check of issue 27: code changes that once left every test green must each fail a test now.

``python -m tests.mutations`` copies the working tree into a temporary folder once per mutation, applies the
change there, runs the tests that should catch it (with ``CI=true``, so nothing can pass by skipping) and reports
KILLED (some test failed) or SURVIVED (all passed: the tests cannot see that change). The same tests first run on
an unchanged copy and must pass there, so a failure means the mutation, not the set-up. It exits 0 when every
mutation is killed, 1 otherwise, 2 when a mutation no longer applies (the code it edits changed: update it here).

It is not part of the pytest run (several minutes: a server starts for the serve mutations). Options: ``--only
NAME`` (repeatable), ``--no-baseline`` (skip the unchanged runs), ``--list``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 1200


@dataclass(frozen=True)
class Edit:
    """Replace ``pattern`` (a regular expression) in ``path`` with ``replacement``: at least ``count`` matches."""

    path: str
    pattern: str
    replacement: str
    count: int = 1


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]  # pytest arguments (paths, -k expressions)
    note: str = ""


MUTATIONS = (
    Mutation("sampling-dropped", "the server ignores text_temperature, audio_top_k and audio_repetition_penalty "
             "(dropped from the body fields handed to RunConfig, serve/schema.py)",
             (Edit("moss_npu/serve/schema.py", r'"(text_temperature|audio_top_k|audio_repetition_penalty)",\s*', "",
                   count=3),),
             ("tests/serve/test_parity.py", "-k", "sampling")),
    Mutation("ref-text-dropped", "the server drops ref_text and a stored voice's transcript (serve/app.py _job)",
             (Edit("moss_npu/serve/app.py", r'"prompt_text": body\.ref_text', '"prompt_text": None'),
              Edit("moss_npu/serve/app.py", r'job\["prompt_text"\] = body\.ref_text if .*', 'job["prompt_text"] = None')),
             ("tests/serve/test_parity.py", "-k", "continuation or stored_voice")),
    Mutation("cancel-never-sent", "the pool never sends the worker its cancel (serve/pool.py Ticket.abandon)",
             (Edit("moss_npu/serve/pool.py", r'self\.worker\.send\("cancel", self\.rid\)', "pass  # mutation"),),
             ("tests/serve/test_hardening.py", "-k", "leaves"),
             note="caught by the cancellation tests (a 7500-frame request that cannot finish inside the test's "
                  "window, frames counted on the worker side)"),
    Mutation("handler-missing", "a golden case kind whose handler is missing (its module is not there): it "
             "becomes SKIP (not implemented)",
             (Edit("moss_npu_verify/goldens.py", r'"moss_npu_verify\.cases\.nano:check_split_text"',
                   '"moss_npu_verify.cases.no_such_cases:check_split_text"'),),
             ("tests/test_goldens.py", "-k", "nano-tiny")),
    Mutation("runner-passes-skips", "the conformance runner exits 0 on a case it could not check (goldens.run)",
             (Edit("moss_npu_verify/goldens.py", r'return 1 if counts\["FAIL"\] or counts\["SKIP"\] else 0',
                   'return 1 if counts["FAIL"] else 0'),),
             ("tests/test_goldens.py", "-k", "handler or runner")),
    Mutation("graph-reads-host-keys", "the captured frame takes its key count from host state (the slots' lengths, "
             "which a real graph freezes at capture) instead of the static max_len (nano/decoder.py _static_frame)",
             (Edit("moss_npu/nano/decoder.py", r"self\._frame\(n, self\.state\.max_len,",
                   "self._frame(n, max(self._lengths[:n]) + 1,"),),
             ("tests/nano/test_graphs.py",)),
)


class NotApplicable(Exception):
    """A mutation's pattern no longer matches the code."""


def copy_tree(target: Path) -> Path:
    """Copy the working tree (tracked and untracked files git does not ignore) into ``target``."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source = REPO / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


def apply(edits: tuple[Edit, ...], root: Path) -> None:
    for edit in edits:
        path = root / edit.path
        text = path.read_text(encoding="utf-8")
        changed, matches = re.subn(edit.pattern, edit.replacement, text)
        if matches < edit.count:
            raise NotApplicable(f"{edit.path}: {edit.pattern!r} matches {matches} time(s), expected {edit.count}")
        path.write_text(changed, encoding="utf-8")


def pytest_args(tests: tuple[str, ...], root: Path) -> list[str]:
    """Expand globs of test paths in ``root``; a glob that matches nothing is dropped."""
    args: list[str] = []
    for item in tests:
        if "*" in item:
            args += sorted(str(p.relative_to(root)) for p in root.glob(item))
        else:
            args.append(item)
    return args


def run_tests(root: Path, tests: tuple[str, ...]) -> tuple[int, list[str], float]:
    """Run the tests in ``root`` under CI; return pytest's exit code, the failing tests, and the seconds taken."""
    from moss_npu_verify.goldens import fixtures_root

    env = {**os.environ, "CI": "true", "MOSS_NPU_FIXTURES": str(fixtures_root()), "PYTHONPATH": str(root)}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider",
                           *pytest_args(tests, root)], cwd=root, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    failed = [line.split(" ", 2)[1] for line in done.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    if done.returncode not in (0, 1):
        failed = failed or [done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-300:]]
    return done.returncode, failed, time.monotonic() - started


def check(mutation: Mutation, baseline: bool) -> str:
    """Run one mutation; return its report line's verdict."""
    with tempfile.TemporaryDirectory(prefix=f"mutation-{mutation.name}-") as folder:
        root = copy_tree(Path(folder))
        if baseline:
            code, failed, seconds = run_tests(root, mutation.tests)
            if code != 0:
                return f"BASELINE FAILS (exit {code} on the unchanged code in {seconds:.0f} s): {', '.join(failed)}"
        apply(mutation.edits, root)
        code, failed, seconds = run_tests(root, mutation.tests)
    if code == 0:
        return f"SURVIVED (every test passed in {seconds:.0f} s)"
    if code != 1:
        return f"ERROR (pytest exit {code}): {', '.join(failed)}"
    return f"KILLED in {seconds:.0f} s by {len(failed)}: {', '.join(failed[:3])}{' …' if len(failed) > 3 else ''}"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutations", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], help="run only this mutation (repeatable)")
    parser.add_argument("--no-baseline", action="store_true", help="do not first run the tests on the unchanged code")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args(argv)
    unknown = set(args.only) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"--only {', '.join(sorted(unknown))}: unknown; use {', '.join(m.name for m in MUTATIONS)}")
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.what}; tests: {' '.join(m.tests)}{f' ({m.note})' if m.note else ''}")
        return 0
    verdicts = {}
    for mutation in chosen:
        print(f"{mutation.name}: {mutation.what}", flush=True)
        try:
            verdicts[mutation.name] = check(mutation, baseline=not args.no_baseline)
        except NotApplicable as exc:
            verdicts[mutation.name] = f"NOT APPLICABLE: {exc}"
        print(f"  -> {verdicts[mutation.name]}{f'  [{mutation.note}]' if mutation.note else ''}", flush=True)
    killed = sum(v.startswith("KILLED") for v in verdicts.values())
    print(f"{killed} of {len(verdicts)} mutations killed")
    if any(v.startswith("NOT APPLICABLE") for v in verdicts.values()):
        return 2
    return 0 if killed == len(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
