"""Patched copies of official model folders, for loading the official remote code (docs/upstream.md#the-patch-set).

The user's folder is never edited: ``mirror_folder`` links its files (and the official ``*.py`` code, from it or
from a code folder) into a work folder beside a rewritten ``config.json`` whose attention comes from the device layer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Optional

from moss_npu.errors import CheckpointError
from moss_npu.hub import DEFAULT_CODEC, DEFAULT_MODEL, download_command
from moss_npu.upstream.manifest import PatchEntry, PatchSet

# How deep to look below a code folder for the official files (e.g. models/llm/repo/ in a clone).
_CODE_SEARCH_DEPTH = 4
_DOWNLOAD_HINT = {
    "tts": download_command(DEFAULT_MODEL),
    "codec": download_command(DEFAULT_CODEC),
}


def remote_modules(config: dict, folder: Path) -> list[str]:
    """Return the module names (``modeling_moss_tts_nano``, ...) that the ``auto_map`` entries of ``config``
    and of the folder's ``tokenizer_config.json`` load."""
    maps = [config.get("auto_map") or {}]
    tokenizer_config = folder / "tokenizer_config.json"
    if tokenizer_config.is_file():
        maps.append(json.loads(tokenizer_config.read_text(encoding="utf-8")).get("auto_map") or {})
    names: list[str] = []
    for auto_map in maps:
        for value in auto_map.values():
            for ref in value if isinstance(value, list) else [value]:
                if isinstance(ref, str) and "." in ref:
                    module = ref.split("--")[-1].rsplit(".", 1)[0]  # "repo--module.Class" also occurs
                    if module not in names:
                        names.append(module)
    return names


def find_code_folder(component: str, model_dir: Path, modules: list[str], code_dir: Optional[Path]) -> Path:
    """Return the folder holding every ``<module>.py`` of ``modules``: ``code_dir`` first, then ``model_dir``.

    Raises:
        CheckpointError: no candidate folder holds all the files, with the command that fetches them.
    """
    if not modules:
        raise CheckpointError(f"{model_dir / 'config.json'} has no auto_map and the patch set supplies none; "
                              f"download the official folder with `{_DOWNLOAD_HINT[component]}`")
    candidates: list[Path] = []
    if code_dir is not None:
        code_dir = Path(code_dir).expanduser()
        if not code_dir.is_dir():
            raise CheckpointError(f"official code folder {code_dir} does not exist; pass a folder holding {modules[0]}.py")
        candidates += [code_dir] + sorted(
            p.parent for p in code_dir.rglob(f"{modules[0]}.py") if len(p.relative_to(code_dir).parts) <= _CODE_SEARCH_DEPTH
        )
    candidates.append(model_dir)
    for folder in candidates:
        if all((folder / f"{m}.py").is_file() for m in modules):
            return folder
    where = f"{code_dir} or {model_dir}" if code_dir is not None else str(model_dir)
    raise CheckpointError(f"official code {', '.join(m + '.py' for m in modules)} not found in {where}; download the "
                          f"official folder with `{_DOWNLOAD_HINT[component]}`, or point code_dir at a folder holding "
                          "the official code")


def code_digest(code_folder: Path) -> str:
    """Return a short hash of the folder's ``*.py`` files: it names the mirror, hence the loaded module."""
    digest = hashlib.sha256()
    for path in sorted(code_folder.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def patch_config(config: dict, entries: tuple[PatchEntry, ...], patches: PatchSet, value: str) -> dict:
    """Return a copy of ``config`` with each entry's ``set`` keys set to ``value``, ``drop`` keys removed and its
    ``auto_map`` filled in where the config has none; CheckpointError where a key has another value than the
    entry ``expects`` (not the folder the patch set was written for)."""
    patched = dict(config)
    for entry in entries:
        for key, expected in entry.expects:
            if str(config.get(key)) != expected:
                raise CheckpointError(f"config.json has {key}={config.get(key)!r}, patch {entry.id} expects "
                                      f"{expected!r} ({entry.where(patches.repo_of(entry))}); pass the matching "
                                      "official folder")
        for key in entry.set:
            patched[key] = value
        for key in entry.drop:
            patched.pop(key, None)
        if entry.auto_map and not patched.get("auto_map"):
            patched["auto_map"] = dict(entry.auto_map)
    return patched


def mirror_folder(component: str, model_dir: Path, workdir: Path, patches: PatchSet, *, attn_implementation: str,
                  code_dir: Optional[Path] = None) -> Path:
    """Build and return ``workdir/<name>_<code hash>``, ready for ``from_pretrained(..., trust_remote_code=True)``:
    links to the folder's files, the official code, and a config whose attention settings are
    ``attn_implementation`` (the device layer's ``attention_impl``).

    Raises:
        CheckpointError: the folder lacks config.json or the official code cannot be found.
    """
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"model folder {model_dir} lacks config.json; download the complete official folder")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    patched = patch_config(config, patches.of("config", component), patches, attn_implementation)
    code_folder = find_code_folder(component, model_dir, remote_modules(patched, model_dir), code_dir)
    mirror = Path(workdir) / f"moss_{component}_{code_digest(code_folder)}"
    mirror.mkdir(parents=True, exist_ok=False)

    code_files = {p.name: p for p in code_folder.glob("*.py")}
    for item in sorted(model_dir.iterdir()):
        if item.name == "config.json" or item.name in code_files or item.name.startswith("."):
            continue
        _link(item, mirror / item.name)
    for name, path in code_files.items():
        _link(path, mirror / name)

    (mirror / "config.json").write_text(json.dumps(patched, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return mirror


def _link(src: Path, dst: Path) -> None:
    """Link ``dst`` to ``src`` (a copy where the filesystem has no symlinks); the source is only read."""
    try:
        os.symlink(src.resolve(), dst, target_is_directory=src.is_dir())
    except OSError:  # e.g. Windows without developer mode
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy2(src, dst)
