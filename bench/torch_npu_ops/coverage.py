"""Check the ops the product dispatched on the stand-in npu against each torch_npu line's NPU kernels.

    python -m bench.torch_npu_ops.coverage REPORT.json ...     # reports written by MOSS_NPU_STANDIN_REPORT

An op is covered when its ``name.overload`` has an NPU kernel in ``ops-<version>.txt`` (bench.torch_npu_ops.extract),
or when its name does under another overload (the stand-in sees the ``.out`` overload of an op whose functional
form torch routes there, where torch_npu registers both). Prints, per version, the ops with no NPU kernel of that
name: torch_npu runs those on the CPU (a copy there and back, and a sync) or fails. Exit code 1 when any line misses
an op that ``KNOWN_MISSING`` does not name (docs/install.md names them for users).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
# Ops the product dispatches that no torch_npu line registers under any overload (docs/install.md explains each).
KNOWN_MISSING: dict[str, set[str]] = {}


def registered() -> dict[str, set[str]]:
    """torch_npu version -> the ops with NPU kernels (the extracted files)."""
    return {path.stem.removeprefix("ops-"): set(path.read_text(encoding="utf-8").split())
            for path in sorted(HERE.glob("ops-*.txt"))}


def dispatched(reports: list[Path]) -> set[str]:
    """The ops the stand-in counted in ``reports``, as ``name.overload`` without the ``aten::`` namespace."""
    ops: set[str] = set()
    for report in reports:
        ops.update(name.removeprefix("aten::") for name in json.loads(report.read_text())["ops"])
    return ops


def missing(ops: set[str], kernels: set[str]) -> list[str]:
    """The ops of ``ops`` whose name has no kernel in ``kernels`` under any overload."""
    names = {k.split(".")[0] for k in kernels}
    return sorted(op for op in ops if op not in kernels and op.split(".")[0] not in names)


def main(paths: list[str]) -> int:
    ops = dispatched([Path(p) for p in paths])
    failed = False
    for version, kernels in registered().items():
        gaps = missing(ops, kernels)
        unexplained = [op for op in gaps if op.split(".")[0] not in KNOWN_MISSING.get(version, set())]
        failed |= bool(unexplained)
        print(f"torch_npu {version}: {len(ops) - len(gaps)} of {len(ops)} ops have NPU kernels"
              + (f"; missing: {', '.join(gaps)}" if gaps else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
