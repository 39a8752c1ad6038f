"""The user cache of prepared grammars (docs/text-normalization.md#grammar-cache), never inside the package.

Each grammar file prepared for the compiled search (``lattice.prepare``) is one ``.npz`` under ``grammars/`` of the
cache folder, named by the file's name, the SHA-256 of its content (held inside too) and ``lattice.FORMAT_VERSION``.
An entry missing, damaged (the archive's CRCs, then ``lattice.check``) or built from something else is built again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from moss_npu.cache_dir import CACHE_ENV, default_cache_dir
from moss_npu.text.lattice import FORMAT_VERSION, PreparationError, check

log = logging.getLogger(__name__)

Arrays = dict[str, np.ndarray]


class GrammarCache:
    """Prepared grammars in ``root/grammars`` (``root``: ``default_cache_dir()`` unless given; no folder at all,
    ``folder`` None, when that finds none: grammars are then prepared in memory, as for an unwritable one)."""

    def __init__(self, root: Optional[Path] = None) -> None:
        root = root if root is not None else default_cache_dir()
        self.folder = None if root is None else Path(root) / "grammars"
        self._warned = False

    def prepared(self, source: Path, prepare: Callable[[], Arrays]) -> Arrays:
        """``source`` prepared: read from the cache, else made by ``prepare`` and written there, with a line
        before (it takes seconds) and one after saying how long it took. ``prepare``'s errors pass."""
        data = source.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        path = Path(self.folder or "") / f"{source.stem}-{digest[:16]}-v{FORMAT_VERSION}.npz"
        found = None if self.folder is None else self._read(path, digest)
        if found is not None:
            return found
        log.warning("text normalization: preparing %s for search (once, a few seconds)", source.name)
        start = time.perf_counter()
        arrays = prepare()
        written = self._write(path, {**arrays, "source_sha256": np.frombuffer(bytes.fromhex(digest), np.uint8)})
        log.warning("text normalization: prepared %s for search in %.1f s (%s)", source.name,
                    time.perf_counter() - start, f"once; cached in {self.folder}" if written else "in memory only")
        return arrays

    def _read(self, path: Path, digest: str) -> Optional[Arrays]:
        """The cached arrays, or None when they are missing or do not hold (then they are built again)."""
        if not path.exists():
            return None
        try:
            with np.load(path, allow_pickle=False) as archive:
                arrays = {key: archive[key] for key in archive.files}
            if arrays.pop("source_sha256").tobytes().hex() != digest:
                raise PreparationError("built from another file")
            return check(arrays)
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
            log.warning("text normalization: the cached %s is damaged or stale (%s); building it again", path.name,
                        exc)
            return None

    def _write(self, path: Path, arrays: Arrays) -> bool:
        """Write ``arrays`` as one archive through a temporary file beside it, so that a reader never sees half of
        it; False, after one warning, if the folder cannot be written."""
        try:
            if self.folder is None:
                raise OSError("no folder for it: $HOME is not set and this user has no home directory")
            self.folder.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.folder, prefix=path.name + ".", suffix=".part")
            try:
                with os.fdopen(handle, "wb") as out:
                    np.savez(out, **arrays)
                os.chmod(temporary, 0o644)  # as ``open`` writes under the usual umask: a shared cache serves every user
                os.replace(temporary, path)
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("text normalization: cannot write the grammar cache%s (%s); preparing grammars in "
                            "memory on each load (set %s to a writable folder)",
                            "" if self.folder is None else f" in {self.folder}", exc, CACHE_ENV)
            return False
        return True
