"""Read a torch_npu wheel as files (never imported: it needs Ascend CANN) and keep what it offers as data.

``python -m moss_npu_verify.npu_wheels.extract WHEEL... [--out DIR]`` writes ``DIR/torch_npu-VERSION.json`` for
each wheel (``pip download torch-npu==VERSION --no-deps`` brings one). A file holds:

- ``ops``: the ATen operators the wheel has NPU kernels for: the ``supported`` and ``symint`` entries of
  ``torch_npu/csrc/aten/npu_native_functions*.yaml`` as ``name`` or ``name.overload``;
- ``api``: the names of ``torch.npu`` (the module ``torch_npu.npu``, which torch_npu registers as ``torch.npu``),
  of its ``utils`` and of ``torch_npu``, each with its kind and, for functions, classes and instances, its parameters and
  methods; found by parsing the package's Python files, following their imports;
- ``c_names``: the ``_npu_*`` names its compiled ``torch_npu._C`` module defines (strings in its binaries).

The JSON files beside this module are the lines our users run; CI reads them instead of downloading wheels.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import zipfile
from pathlib import Path
from typing import Optional

import yaml

OP_FILES = re.compile(r"torch_npu/csrc/aten/npu_native_functions[^/]*\.yaml$")
OP_SECTIONS = ("supported", "symint")
C_NAME = re.compile(rb"\b_npu_[A-Za-z0-9_]+\b")
NAMESPACES = {"torch.npu": "torch_npu.npu", "torch.npu.utils": "torch_npu.npu.utils", "torch_npu": "torch_npu"}
DATA = Path(__file__).resolve().parent


def op_name(entry) -> Optional[str]:
    """``name`` or ``name.overload`` of one yaml entry (a string, or a mapping whose ``func`` is one, possibly
    with its schema after the name)."""
    text = entry.get("func") if isinstance(entry, dict) else entry
    return text.split("(")[0].strip() if isinstance(text, str) and text.strip() else None


def wheel_ops(wheel: zipfile.ZipFile) -> list[str]:
    """The operator names of the wheel's native-function yaml files (``OP_SECTIONS``)."""
    ops = set()
    for name in wheel.namelist():
        if OP_FILES.search(name):
            data = yaml.safe_load(wheel.read(name)) or {}
            for section in OP_SECTIONS:
                ops.update(filter(None, (op_name(entry) for entry in data.get(section) or [])))
    return sorted(ops)


def wheel_c_names(wheel: zipfile.ZipFile) -> list[str]:
    """``_npu_*`` strings in the compiled ``torch_npu._C`` module and the library it binds (its method names)."""
    names = set()
    for name in wheel.namelist():
        if name.startswith("torch_npu/_C.") or name == "torch_npu/lib/libtorch_npu.so":
            with wheel.open(name) as binary:
                tail = b""
                while block := binary.read(1 << 24):
                    names.update(m.decode() for m in C_NAME.findall(tail + block))
                    tail = block[-128:]
    return sorted(names)


def _params(node: ast.AST) -> dict:
    """A function's parameters: positional names, keyword-only names, how many have defaults, *args/**kwargs."""
    args = node.args
    positional = [a.arg for a in args.posonlyargs + args.args]
    return {"positional": positional, "keyword_only": [a.arg for a in args.kwonlyargs],
            "required": len(positional) - len(args.defaults),
            "required_keyword_only": [a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is None],
            "varargs": args.vararg is not None, "varkw": args.kwarg is not None,
            "classmethod": any(getattr(d, "id", None) in ("classmethod", "staticmethod") for d in node.decorator_list)}


def _setattr_names(node: ast.FunctionDef) -> list[str]:
    """The attribute names a ``__setattr__`` acts on: the strings its body compares its name argument with."""
    arg = node.args.args[1].arg if len(node.args.args) > 1 else None
    names = set()
    for compare in ast.walk(node):
        if isinstance(compare, ast.Compare) and getattr(compare.left, "id", None) == arg:
            for right in compare.comparators:
                elements = right.elts if isinstance(right, (ast.Tuple, ast.List, ast.Set)) else [right]
                names.update(e.value for e in elements if isinstance(e, ast.Constant) and isinstance(e.value, str))
    return sorted(names)


def _class(node: ast.ClassDef) -> dict:
    methods = {item.name: _params(item) for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
    spec = {"kind": "class", "methods": methods, "bases": [ast.unparse(base) for base in node.bases]}
    if "__setattr__" in methods:
        spec["settable"] = _setattr_names(next(i for i in node.body if getattr(i, "name", None) == "__setattr__"))
    return spec


class PackageReader:
    """Resolves the names a module of the wheel defines, following ``from ... import`` (also ``*``)."""

    def __init__(self, wheel: zipfile.ZipFile) -> None:
        self.files = {name: wheel for name in wheel.namelist() if name.endswith(".py")}
        self.wheel = wheel
        self._done: dict[str, dict] = {}
        self._busy: set[str] = set()

    def _source(self, module: str) -> Optional[str]:
        base = module.replace(".", "/")
        for path in (f"{base}/__init__.py", f"{base}.py"):
            if path in self.files:
                return self.wheel.read(path).decode("utf-8", "replace")
        return None

    def is_module(self, module: str) -> bool:
        return self._source(module) is not None

    def names(self, module: str) -> dict:
        """name -> spec for what ``module`` binds at its top level (branches of ``if``/``try`` included)."""
        if module in self._done:
            return self._done[module]
        if module in self._busy:  # an import cycle: what is known so far
            return {}
        self._busy.add(module)
        source = self._source(module)
        names: dict = {}
        if source is not None:
            self._bind(ast.parse(source).body, module, names)
        self._busy.discard(module)
        self._done[module] = names
        return names

    def _bind(self, body: list, module: str, names: dict) -> None:
        package = module if self._source(module) and self.is_package(module) else module.rpartition(".")[0]
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names[stmt.name] = {"kind": "function", **_params(stmt)}
            elif isinstance(stmt, ast.ClassDef):
                names[stmt.name] = _class(stmt)
            elif isinstance(stmt, ast.Assign):
                spec = self._value(stmt.value, names, package)
                for target in stmt.targets:
                    if isinstance(target, ast.Name):
                        names[target.id] = spec
            elif isinstance(stmt, ast.ImportFrom):
                source = self._absolute(stmt, package)
                for alias in stmt.names:
                    if alias.name == "*":
                        exported = self.names(source)
                        public = self._all(source)
                        names.update({k: v for k, v in exported.items()
                                      if (k in public if public is not None else not k.startswith("_"))})
                    elif self.is_module(f"{source}.{alias.name}"):
                        names[alias.asname or alias.name] = {"kind": "module", "module": f"{source}.{alias.name}"}
                    else:
                        names[alias.asname or alias.name] = self.names(source).get(alias.name, {"kind": "unknown"})
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    names[alias.asname or alias.name.split(".")[0]] = {"kind": "module", "module": alias.name}
            elif isinstance(stmt, ast.If):
                self._bind(stmt.body + stmt.orelse, module, names)
            elif isinstance(stmt, ast.Try):
                self._bind(stmt.body + [s for h in stmt.handlers for s in h.body] + stmt.orelse + stmt.finalbody,
                           module, names)

    def is_package(self, module: str) -> bool:
        return f"{module.replace('.', '/')}/__init__.py" in self.files

    @staticmethod
    def _absolute(stmt: ast.ImportFrom, package: str) -> str:
        if not stmt.level:
            return stmt.module or ""
        parts = package.split(".")
        base = ".".join(parts[: len(parts) - stmt.level + 1])
        return f"{base}.{stmt.module}" if stmt.module else base

    def _all(self, module: str) -> Optional[set[str]]:
        source = self._source(module)
        if source is None:
            return None
        for stmt in ast.parse(source).body:
            if isinstance(stmt, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in stmt.targets):
                try:
                    return set(ast.literal_eval(stmt.value))
                except ValueError:
                    return None
        return None

    def _value(self, value: ast.AST, names: dict, package: str) -> dict:
        """An assignment's spec: an instance of a class this package defines (``config = _npuConfig()``, also
        through a submodule: ``npu_config._npuConfig()``), else a plain value."""
        if isinstance(value, ast.Call):
            func = value.func
            owner, attr = (func.value, func.attr) if isinstance(func, ast.Attribute) else (None, getattr(func, "id", None))
            cls = None
            if owner is None:
                cls = names.get(attr)
            elif isinstance(owner, ast.Name):
                module = names.get(owner.id, {}).get("module") or f"{package}.{owner.id}"
                cls = self.names(module).get(attr) if self.is_module(module) else None
            if cls and cls.get("kind") == "class":
                return {"kind": "instance", "of": cls}
        return {"kind": "value"}


def extract(path: Path) -> dict:
    """The data kept for one wheel (see the module docstring)."""
    with zipfile.ZipFile(path) as wheel:
        version = next(re.search(r"^Version: (.+)$", wheel.read(n).decode(), re.M).group(1).strip()
                       for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        reader = PackageReader(wheel)
        api = {space: reader.names(module) for space, module in NAMESPACES.items()}
        return {"version": version, "wheel": path.name, "ops": wheel_ops(wheel), "api": api,
                "c_names": wheel_c_names(wheel)}


def load(version: str) -> dict:
    """The kept data of one torch_npu line (``torch_npu-VERSION.json`` beside this module)."""
    return json.loads((DATA / f"torch_npu-{version}.json").read_text())


def lines() -> list[str]:
    """The torch_npu versions whose data is kept, oldest first."""
    found = [p.stem.removeprefix("torch_npu-") for p in DATA.glob("torch_npu-*.json")]
    return sorted(found, key=lambda v: [int(x) if x.isdigit() else x for x in re.split(r"[.+]|post", v)])


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moss_npu_verify.npu_wheels.extract", description=__doc__.splitlines()[0])
    parser.add_argument("wheels", nargs="+", type=Path, help="torch_npu wheel files")
    parser.add_argument("--out", type=Path, default=DATA, help=f"where the JSON files go (default {DATA})")
    args = parser.parse_args(argv)
    for path in args.wheels:
        if not zipfile.is_zipfile(path):
            print(f"error: {path} is not a wheel (zip) file", file=sys.stderr)
            return 2
        data = extract(path)
        out = args.out / f"torch_npu-{data['version']}.json"
        out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"{out}: {len(data['ops'])} ops, {len(data['api']['torch.npu'])} torch.npu names, "
              f"{len(data['c_names'])} _C names")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
