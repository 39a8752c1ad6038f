"""The patch manifest: ``patches/manifest.yaml`` read into frozen dataclasses and checked for shape.

The manifest is data only (docs/upstream.md#cuda-only-spots lists the spots it covers): each entry names an upstream
setting or function, the parameters it must have, the upstream revision, and the key of its replacement
in ``moss_npu.upstream.patches.REPLACEMENTS``. Nothing in it is imported or executed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from moss_npu.errors import ConfigError

MANIFEST_PATH = Path(__file__).resolve().parents[2] / "patches" / "manifest.yaml"
KINDS = ("config", "method", "function", "module_attr", "runtime")
_ENTRY_KEYS = {
    "id", "kind", "component", "module", "target", "params", "file", "revision", "replacement", "why",
    "expects", "set", "drop", "used_by", "auto_map",
}
_REQUIRED = {
    "config": {"expects", "set", "drop", "auto_map"},
    "method": {"module", "params"},
    "function": {"module", "params"},
    "module_attr": {"module", "used_by"},
    "runtime": set(),
}


@dataclass(frozen=True)
class PatchEntry:
    """One patched upstream setting or function (see the header of patches/manifest.yaml)."""

    id: str
    kind: str
    component: str
    target: str
    file: str
    revision: str
    replacement: str
    why: str
    module: Optional[str] = None
    params: Optional[tuple[str, ...]] = None
    expects: tuple[tuple[str, str], ...] = ()
    set: tuple[str, ...] = ()
    drop: tuple[str, ...] = ()
    used_by: tuple[str, ...] = ()
    auto_map: tuple[tuple[str, str], ...] = ()

    def where(self, repo: str) -> str:
        """Return ``repo@revision file: target`` for error messages."""
        return f"{repo}@{self.revision} {self.file}: {self.target}"


@dataclass(frozen=True)
class PatchSet:
    """The whole manifest: the upstream repositories and revisions plus the entries."""

    code_repo: str
    revision: str
    runtime_repo: str
    runtime_revision: str
    entries: tuple[PatchEntry, ...]
    path: Path

    def of(self, kind: str, component: Optional[str] = None) -> tuple[PatchEntry, ...]:
        """Return the entries of one kind (and component, when given), in manifest order."""
        return tuple(e for e in self.entries if e.kind == kind and (component is None or e.component == component))

    def repo_of(self, entry: PatchEntry) -> str:
        """Return the repository an entry's revision refers to."""
        return self.runtime_repo if entry.kind == "runtime" else self.code_repo


def load_manifest(path: Optional[Path] = None) -> PatchSet:
    """Read and validate the patch manifest.

    Raises:
        ConfigError: the file is missing, or an entry has unknown, missing or ill-typed fields.
    """
    path = MANIFEST_PATH if path is None else Path(path)
    if not path.is_file():
        raise ConfigError(f"patch manifest {path} is missing; --impl upstream needs a source checkout installed "
                          'with pip install -e ".[upstream]"')
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    head = data.get("upstream") or {}
    for key in ("code", "revision", "runtime", "runtime_revision"):
        if not isinstance(head.get(key), str):
            raise ConfigError(f"{path}: upstream.{key} must be a string, got {head.get(key)!r}")
    raw_entries = data.get("patches")
    if not isinstance(raw_entries, list) or not raw_entries:
        raise ConfigError(f"{path}: 'patches' must be a non-empty list")
    entries = tuple(_entry(raw, path) for raw in raw_entries)
    ids = [e.id for e in entries]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ConfigError(f"{path}: duplicate patch ids {', '.join(duplicates)}")
    return PatchSet(head["code"], head["revision"], head["runtime"], head["runtime_revision"], entries, path)


def _entry(raw: object, path: Path) -> PatchEntry:
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: every patch must be a mapping, got {raw!r}")
    name = raw.get("id", "?")
    unknown = sorted(set(raw) - _ENTRY_KEYS)
    if unknown:
        raise ConfigError(f"{path}: patch {name} has unknown keys {', '.join(unknown)}")
    kind = raw.get("kind")
    if kind not in KINDS:
        raise ConfigError(f"{path}: patch {name} has kind {kind!r}; use one of {', '.join(KINDS)}")
    missing = sorted(({"id", "component", "target", "file", "revision", "replacement", "why"} | _REQUIRED[kind]) - set(raw))
    if missing:
        raise ConfigError(f"{path}: patch {name} ({kind}) lacks {', '.join(missing)}")
    return PatchEntry(
        **{key: str(raw[key]) for key in ("id", "component", "target", "file", "revision", "replacement")},
        kind=kind, why=" ".join(str(raw["why"]).split()),
        module=None if raw.get("module") is None else str(raw["module"]),
        params=None if raw.get("params") is None else _names(raw["params"], name, "params", path),
        **{key: _names(raw.get(key) or [], name, key, path) for key in ("set", "drop", "used_by")},
        **{key: tuple((str(k), str(v)) for k, v in (raw.get(key) or {}).items()) for key in ("expects", "auto_map")},
    )


def _names(value: object, name: str, field: str, path: Path) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{path}: patch {name}: {field} must be a list of names, got {value!r}")
    return tuple(value)
