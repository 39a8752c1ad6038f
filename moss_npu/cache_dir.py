"""The user cache folder: where files built once per machine (prepared grammars, compiled kernels) are kept,
never inside the installed package."""

from __future__ import annotations

import os
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
