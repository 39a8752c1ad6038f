"""The ``torch.npu`` namespace of each torch_npu wheel, read from its Python files (parsed, never imported), as data
for the API check (tests/test_npu_api.py): which names ``torch.npu`` has and each callable's parameters.

    python -m bench.torch_npu_ops.api /tmp/wheels/torch_npu-2.5.1-*.whl ...   # writes api-<version>.json here

``torch.npu`` is the module ``torch_npu.npu`` (``torch_npu/npu/__init__.py``): its top-level definitions, what it
imports from its submodules (``from .utils import mem_get_info``, ``from .npu_config import *``), followed to their
definitions. A function maps to its parameter names (``*`` / ``**`` for variadic ones), a class to its
``__init__``'s, anything else to None. ``_C_names`` lists the ``torch_npu._C`` attributes the wheel's own Python
calls (C functions have no Python source to read).
"""

from __future__ import annotations

import ast
import json
import sys
import zipfile
from pathlib import Path
from typing import Optional

HERE = Path(__file__).parent
PACKAGE = "torch_npu/npu"


def parameters(node: ast.AST) -> Optional[list[str]]:
    """A function's parameter names, a class's ``__init__``'s (without self/cls), else None."""
    if isinstance(node, ast.ClassDef):
        init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        return parameters(init)[1:] if init is not None else []
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    a = node.args
    names = [p.arg for p in a.posonlyargs + a.args]
    if a.vararg:
        names.append("*")
    names += [p.arg for p in a.kwonlyargs]
    if a.kwarg:
        names.append("**")
    return names


def top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements of a module's top level, with the bodies of its ``if`` and ``try`` blocks flattened in."""
    out = []
    for stmt in body:
        if isinstance(stmt, ast.If):
            out += top_level(stmt.body + stmt.orelse)
        elif isinstance(stmt, ast.Try):
            out += top_level(stmt.body + [s for h in stmt.handlers for s in h.body] + stmt.orelse)
        else:
            out.append(stmt)
    return out


class Package:
    """The Python files of one wheel's ``torch_npu/npu`` package, resolved name by name."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files  # module path (torch_npu/npu/utils) -> source
        self.cache: dict[str, dict[str, Optional[list[str]]]] = {}

    def source(self, module: str) -> Optional[str]:
        return self.files.get(f"{module}.py", self.files.get(f"{module}/__init__.py"))

    def names(self, module: str, depth: int = 0) -> dict[str, Optional[list[str]]]:
        """Every top-level name of ``module`` and its parameters."""
        if module in self.cache or depth > 6:
            return self.cache.get(module, {})
        self.cache[module] = {}
        text = self.source(module)
        if text is None:
            return {}
        tree = ast.parse(text)
        names: dict[str, Optional[list[str]]] = {}
        for stmt in top_level(tree.body):
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[stmt.name] = parameters(stmt)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                for target in stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]:
                    if isinstance(target, ast.Name):
                        names.setdefault(target.id, None)
            elif isinstance(stmt, ast.ImportFrom) and stmt.level >= 1:
                base = module if self.source(module) == self.files.get(f"{module}/__init__.py") else module.rsplit("/", 1)[0]
                for _ in range(stmt.level - 1):
                    base = base.rsplit("/", 1)[0]
                source = f"{base}/{stmt.module.replace('.', '/')}" if stmt.module else base
                found = self.names(source, depth + 1)
                for alias in stmt.names:
                    if alias.name == "*":
                        names.update({k: v for k, v in found.items() if not k.startswith("_")})
                    elif self.source(f"{source}/{alias.name}") is not None:
                        names[alias.asname or alias.name] = None  # a submodule
                    else:
                        names[alias.asname or alias.name] = found.get(alias.name)
            elif isinstance(stmt, ast.ImportFrom) or isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    names.setdefault((alias.asname or alias.name).split(".")[0], None)
        self.cache[module] = names
        return names


def wheel_api(wheel: Path) -> tuple[str, dict]:
    """The wheel's version and its ``torch.npu`` namespace (see the module)."""
    version = wheel.name.split("-")[1]
    with zipfile.ZipFile(wheel) as z:
        files = {name: z.read(name).decode("utf-8-sig", "replace")
                 for name in z.namelist() if name.startswith("torch_npu/") and name.endswith(".py")}
    c_names = sorted({node.attr for text in files.values() for node in ast.walk(ast.parse(text))
                      if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                      and node.value.attr == "_C" and isinstance(node.value.value, ast.Name)
                      and node.value.value.id == "torch_npu"})
    return version, {"torch.npu": Package(files).names(PACKAGE), "_C_names": c_names}


def main(paths: list[str]) -> int:
    """Write ``api-<version>.json`` for each wheel given."""
    for path in paths:
        version, api = wheel_api(Path(path))
        (HERE / f"api-{version}.json").write_text(json.dumps(api, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        print(f"{version}: torch.npu has {len(api['torch.npu'])} names")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
