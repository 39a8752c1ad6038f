"""The user cache folder: where files built once per machine (prepared grammars, compiled kernels, prepared CPU
weights) are kept, never inside the installed package; and the checks that keep a cache folder this user's own.

A file loaded from the cache as code (a compiled library) or as trusted data (weights a decoder reads without
recomputing them) is used only when this user owns it and its folder and nobody else can write either: a shared
or group-writable cache could hand this process someone else's bytes.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Optional

CACHE_ENV = "MOSS_NPU_CACHE_DIR"


def default_cache_dir() -> Optional[Path]:
    """``$MOSS_NPU_CACHE_DIR``, else ``$XDG_CACHE_HOME/moss-npu``, else ``~/.cache/moss-npu``; None when there is no
    home folder to find (no ``$HOME`` and no user entry: a container's arbitrary user id)."""
    chosen = os.environ.get(CACHE_ENV)
    if chosen:
        return Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = Path.home() / ".cache"
        except RuntimeError:
            return None
    return Path(base) / "moss-npu"


def trusted(info: os.stat_result) -> bool:
    """Whether a cache folder or file is this user's alone: owned by this user, writable by nobody else."""
    return info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def open_trusted_folder(folder: Path, what: str, log: logging.Logger) -> Optional[int]:
    """Return a descriptor of ``folder`` (made 0700 where missing) if this user owns it and nobody else can write
    it, else None: with a warning on ``log`` naming ``what`` when it is someone else's or writable by others, a
    debug line when it cannot be made or opened."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        log.debug("%s %s unusable (%s)", what, folder, exc)
        return None
    if not trusted(os.fstat(fd)):
        os.close(fd)
        log.warning("%s %s is not used: it is owned by another user or writable by others (make it yours, mode "
                    "0700, or set $%s to a folder of your own)", what, folder, CACHE_ENV)
        return None
    return fd
