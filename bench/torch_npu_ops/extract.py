"""Extract the aten ops each torch_npu wheel registers for the NPU, as data for the op-coverage check.

    pip download torch-npu==2.5.1 --no-deps -d /tmp/wheels        # never installed, never imported
    python -m bench.torch_npu_ops.extract /tmp/wheels/torch_npu-2.5.1-*.whl ...

For each wheel it reads ``torch_npu/csrc/aten/npu_native_functions.yaml`` and
``npu_native_functions_by_codegen.yaml`` (the ``supported``, ``symint``, ``quant`` and ``custom`` sections: every
op with an NPU kernel) straight from the zip and writes ``ops-<version>.txt`` beside this file: one
``name.overload`` per line (``name`` alone for the default overload), sorted. ``bench.torch_npu_ops.coverage``
checks the ops the product dispatches against these files.
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

import yaml

HERE = Path(__file__).parent
FILES = ("torch_npu/csrc/aten/npu_native_functions.yaml", "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml")
SECTIONS = ("supported", "symint", "quant", "custom", "autograd")


def op_name(entry) -> str:
    """``add.Tensor`` from a yaml entry: a bare name, or a dict whose ``func`` is a name or a full schema."""
    text = entry if isinstance(entry, str) else entry.get("func", "")
    return re.split(r"[(\s]", text.strip(), maxsplit=1)[0]


def wheel_ops(wheel: Path) -> tuple[str, set[str]]:
    """The wheel's version and the ops its yaml files give NPU kernels."""
    version = wheel.name.split("-")[1]
    ops: set[str] = set()
    with zipfile.ZipFile(wheel) as z:
        for name in FILES:
            if name not in z.namelist():
                continue
            data = yaml.safe_load(z.read(name)) or {}
            for section in SECTIONS:
                ops.update(op_name(e) for e in data.get(section) or [] if op_name(e))
    return version, ops


def main(paths: list[str]) -> int:
    """Write ``ops-<version>.txt`` for each wheel given."""
    for path in paths:
        version, ops = wheel_ops(Path(path))
        if not ops:
            print(f"error: {path}: no op list found in {', '.join(FILES)}", file=sys.stderr)
            return 1
        (HERE / f"ops-{version}.txt").write_text("".join(f"{op}\n" for op in sorted(ops)), encoding="utf-8")
        print(f"{version}: {len(ops)} ops")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
