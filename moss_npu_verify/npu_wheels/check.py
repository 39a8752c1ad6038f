"""Check what our code asks of torch_npu against what each kept torch_npu line offers (``extract``'s data).

- ``api_uses``: every ``torch.npu.*`` / ``torch_npu.*`` path our Python files read, write or call, with the
  keywords and the number of positional arguments of each call; found by parsing (the device layer reaches
  ``torch.npu`` through ``self._npu()`` and ``torch_npu`` through ``self._extension``, names bound from those
  count too).
- ``api_problems``: the uses a line cannot honour: a missing name, a keyword its function does not take, an
  attribute read from an object that only accepts writes (``torch.npu.config``), a ``torch_npu._C`` name its
  binaries lack. A name probed with ``hasattr``/``getattr(..., default)`` may be missing.
- ``missing_ops``: operators from a list (``aten::name.overload``) that a line has no NPU kernel for.

``python -m moss_npu_verify.npu_wheels.check [FILES...]`` prints the problems of every kept line (default: the
package, ``inference.py`` and ``eval_accuracy.py``) and exits 1 if there are any.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from moss_npu_verify.npu_wheels.extract import lines, load

ROOT = Path(__file__).resolve().parents[2]
HANDLES = {("self", "_npu()"): "torch.npu", ("self", "_extension"): "torch_npu"}


@dataclass(frozen=True)
class Use:
    """One use of a torch_npu path: ``action`` is get, set, call or probe (hasattr/getattr with a default)."""

    where: str
    path: tuple[str, ...]
    action: str
    keywords: tuple[str, ...] = ()
    positional: int = 0


@dataclass
class _Scope:
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)


class _Scanner(ast.NodeVisitor):
    def __init__(self, where: str) -> None:
        self.where, self.uses, self.scopes = where, [], [_Scope()]

    def path(self, node: ast.AST) -> Optional[tuple[str, ...]]:
        """The torch_npu path an expression stands for, or None."""
        if isinstance(node, ast.Name):
            if node.id == "torch_npu":
                return ("torch_npu",)
            for scope in reversed(self.scopes):
                if node.id in scope.aliases:
                    return scope.aliases[node.id]
            return None
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)):
            base = self.path(node.args[0])
            return None if base is None else base + (node.args[1].value,)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.args and not node.keywords:
            owner = getattr(node.func.value, "id", None)
            if (owner, f"{node.func.attr}()") in HANDLES:
                return (HANDLES[(owner, f"{node.func.attr}()")],)
        if isinstance(node, ast.Attribute):
            owner = getattr(node.value, "id", None)
            if (owner, node.attr) in HANDLES:
                return (HANDLES[(owner, node.attr)],)
            if owner == "torch" and node.attr == "npu":
                return ("torch.npu",)
            base = self.path(node.value)
            return None if base is None else base + (node.attr,)
        return None

    def record(self, node: ast.AST, path: tuple[str, ...], action: str, **call) -> None:
        self.uses.append(Use(f"{self.where}:{node.lineno}", path, action, **call))

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.scopes.append(_Scope())
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node: ast.Assign) -> None:
        path = self.path(node.value)
        for target in node.targets:
            if isinstance(target, ast.Name) and path is not None:
                self.scopes[-1].aliases[target.id] = path
            elif isinstance(target, ast.Attribute) and (base := self.path(target.value)) is not None:
                self.record(target, base + (target.attr,), "set")
                self.visit(target.value)
                continue
            self.visit(target)
        self.visit(node.value)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        path = self.path(node)
        if path is not None and len(path) > 1:
            self.record(node, path, "get")
        elif path is None:
            self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = getattr(node.func, "id", None)
        if name in ("hasattr", "getattr") and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            base = self.path(node.args[0])
            if base is not None:
                probe = name == "hasattr" or len(node.args) == 3
                self.record(node, base + (node.args[1].value,), "probe" if probe else "get")
        path = self.path(node.func)
        if path is not None and len(path) > 1:
            self.record(node, path, "call", keywords=tuple(k.arg for k in node.keywords if k.arg),
                        positional=len(node.args))
            for argument in node.args + [k.value for k in node.keywords]:
                self.visit(argument)
            return
        self.generic_visit(node)


def default_files() -> list[Path]:
    """The package's Python files and the two top-level commands."""
    return sorted((ROOT / "moss_npu").rglob("*.py")) + [ROOT / "inference.py", ROOT / "eval_accuracy.py"]


def api_uses(files: Iterable[Path]) -> list[Use]:
    """Every use of a torch_npu path in ``files`` (see the module docstring)."""
    uses = []
    for file in files:
        scanner = _Scanner(str(Path(file).resolve().relative_to(ROOT)) if Path(file).resolve().is_relative_to(ROOT) else str(file))
        scanner.visit(ast.parse(Path(file).read_text(encoding="utf-8")))
        uses += scanner.uses
    return uses


def _call_problem(params: dict, use: Use, bound: bool) -> Optional[str]:
    """Why a call with ``use``'s arguments does not fit a function's parameters, or None."""
    positional = params["positional"][1:] if bound else params["positional"]
    names = set(positional) | set(params["keyword_only"])
    unknown = [k for k in use.keywords if k not in names]
    if unknown and not params["varkw"]:
        return f"takes no keyword {', '.join(unknown)} (parameters: {', '.join(positional + params['keyword_only']) or 'none'})"
    if use.positional > len(positional) and not params["varargs"]:
        return f"takes {len(positional)} positional arguments, given {use.positional}"
    required = positional[: params["required"] - (1 if bound else 0)]
    given = set(positional[: use.positional]) | set(use.keywords)
    missing = [p for p in required if p not in given] + [p for p in params["required_keyword_only"] if p not in given]
    if missing:
        return f"needs {', '.join(missing)}"
    return None


def api_problems(uses: Iterable[Use], data: dict) -> list[str]:
    """The uses that torch_npu ``data['version']`` cannot honour, one line each."""
    problems = []
    for use in uses:
        problem = _problem(use, data)
        if problem:
            problems.append(f"{use.where}: {'.'.join(use.path)} {problem}")
    return sorted(set(problems))


def _problem(use: Use, data: dict) -> Optional[str]:
    root, name, rest = use.path[0], use.path[1], use.path[2:]
    if rest and f"{root}.{name}" in data["api"]:  # a submodule kept as its own namespace (torch.npu.utils)
        root, name, rest = f"{root}.{name}", rest[0], rest[1:]
    if root == "torch_npu" and name == "_C":
        return None if not rest or rest[0] in data["c_names"] else "is not in this line's compiled _C module"
    spec = data["api"][root].get(name)
    if spec is None:
        return None if use.action == "probe" and not rest else "does not exist in this line"
    if spec["kind"] == "instance" and rest:
        cls, attr = spec["of"], rest[0]
        if attr in cls["methods"]:
            return _call_problem(cls["methods"][attr], use, bound=True) if use.action == "call" and len(rest) == 1 else None
        if attr in cls.get("settable", []):
            return None if use.action == "set" else ("can only be written: its object has a __setattr__ and "
                                                     "nothing to read, so hasattr/getattr never find it")
        return None if use.action == "probe" else f"is neither a method nor a settable attribute of {name}"
    if use.action == "call" and not rest:
        if spec["kind"] == "function":
            return _call_problem(spec, use, bound=False)
        if spec["kind"] == "class" and "__init__" in spec["methods"]:
            return _call_problem(spec["methods"]["__init__"], use, bound=True)
    if spec["kind"] == "class" and len(rest) == 1 and use.action == "call" and rest[0] in spec["methods"]:
        return _call_problem(spec["methods"][rest[0]], use, bound=False)
    return None


def missing_ops(ops: Iterable[str], data: dict) -> list[str]:
    """The operators of ``ops`` (``aten::name.overload`` or ``aten::name`` for the default overload) without an
    NPU kernel in torch_npu ``data['version']``; other namespaces than ``aten`` are left out."""
    kernels = set(data["ops"])
    missing = set()
    for op in ops:
        namespace, _, name = op.rpartition("::")
        if namespace != "aten":
            continue
        name = name.removesuffix(".default")
        if name not in kernels:
            missing.add(op)
    return sorted(missing)


def main(argv: Optional[list[str]] = None) -> int:
    files = [Path(a) for a in (argv if argv is not None else sys.argv[1:])] or default_files()
    uses = api_uses(files)
    failed = False
    for version in lines():
        problems = api_problems(uses, load(version))
        failed |= bool(problems)
        print(f"torch_npu {version}: {len(uses)} uses, " + ("ok" if not problems else f"{len(problems)} problems"))
        for line in problems:
            print(f"  {line}")
    return int(failed)


if __name__ == "__main__":
    raise SystemExit(main())
