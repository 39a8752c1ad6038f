"""The fixture folders the tests expect under the fixtures root, and the check ``.ci/run`` makes before it runs.

``tests/test_goldens.py`` runs the cases of whichever folders it finds, so a fixtures root holding fewer sets
would test less and still pass: under CI that is a failure naming each missing folder. ``python -m
tests.fixture_sets ROOT`` prints one error line per missing folder and exits 1 (it needs neither pytest nor torch).
"""

from __future__ import annotations

import sys
from pathlib import Path

# folder -> the file that shows it is complete
EXPECTED = {
    "audio": "README.md",  # reference recordings (tests/test_audio.py, tests/delay/test_reference.py)
    "delay-tiny": "cases.json",  # the MOSS-TTS Delay goldens and tiny GGUF
    "nano-tiny": "cases.json",  # the MOSS-TTS-Nano goldens and tiny checkpoints
    "text-norm": "cases.json",  # the official text normalization's goldens
}


def missing_sets(root: Path) -> list[str]:
    """Return a line for each expected fixture folder that is not under ``root``."""
    return [f"fixture folder {root / name} is missing (no {marker})" for name, marker in EXPECTED.items()
            if not (root / name / marker).is_file()]


def main(argv: list[str]) -> int:
    """Check the fixtures root ``argv[0]``; print what is missing; 0 when every expected folder is there."""
    if len(argv) != 1:
        print("usage: python -m tests.fixture_sets FIXTURES_ROOT", file=sys.stderr)
        return 2
    problems = missing_sets(Path(argv[0]))
    for line in problems:
        print(f"error: {line}: the tests that need it cannot run (set MOSS_NPU_FIXTURES)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
