"""The user cache of prepared grammar files: built once per grammar file, never inside the installed package.

``$MOSS_NPU_CACHE_DIR`` (else ``$XDG_CACHE_HOME/moss-npu``, else ``~/.cache/moss-npu``) holds, under
``grammars/``, each grammar prepared for lookahead search (``lookahead.relabel``) as two files named by the
grammar file's name, the SHA-256 of its content and ``lookahead.FORMAT_VERSION``: the relabelled FST and a JSON
record (sealed by its own hash) of what it was built from (that hash), of what the search needs to know of
the grammar (its boundary state, final states and which states lead to the boundary on epsilon arcs, so that
a warm start need not work them out) and of the FST file's own size and hash. A file that is missing, truncated, damaged or built
from something else is built again; a cache folder that cannot be written gives one warning and the grammars
are prepared in memory on each load.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from moss_npu.cache_dir import CACHE_ENV, default_cache_dir
from moss_npu.text.lookahead import FORMAT_VERSION, SETS_KEPT, Lookahead, relabel

log = logging.getLogger(__name__)


class GrammarCache:
    """Prepared grammars in ``root/grammars`` (``root``: ``default_cache_dir()`` unless given; no folder at all,
    ``folder`` None, when that finds none: grammars are then prepared in memory, as for an unwritable one)."""

    def __init__(self, root: Optional[Path] = None) -> None:
        root = root if root is not None else default_cache_dir()
        self.folder = None if root is None else Path(root) / "grammars"
        self._warned = False

    def lookahead(self, source: Path, find_boundary: Callable[[], Optional[int]]) -> Optional[Lookahead]:
        """``source`` prepared for lookahead search: read from the cache, else built around the boundary state
        that ``find_boundary`` gives (None: a grammar without one, nothing to prepare) and written there, with
        one line saying so and how long it took. Raises ``lookahead.PreparationError`` for a file that cannot
        be prepared."""
        import kaldifst

        data = source.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        stem = Path(self.folder or "") / f"{source.stem}-{digest[:16]}-v{FORMAT_VERSION}-{SETS_KEPT}"
        fst_path, record_path = stem.with_suffix(".fst"), stem.with_suffix(".json")
        found = None if self.folder is None else self._read(fst_path, record_path, digest)
        if found is not None:
            return found
        boundary = find_boundary()
        if boundary is None:
            return None
        start = time.perf_counter()
        relabelled, signatures, finals, to_boundary = relabel(data, boundary)
        record = {"format": FORMAT_VERSION, "sets_kept": SETS_KEPT, "source": source.name, "source_sha256": digest,
                  "boundary": boundary, "finals": finals, "signatures": [format(mask, "x") for mask in signatures],
                  "states": len(to_boundary), "to_boundary": _pack(to_boundary),
                  "fst_bytes": len(relabelled), "fst_sha256": hashlib.sha256(relabelled).hexdigest()}
        record["record_sha256"] = _seal(record)
        written = self._write(fst_path, record_path, relabelled, record)
        if written:
            fst = kaldifst.StdVectorFst.read(str(fst_path))
        else:
            with tempfile.TemporaryDirectory(prefix="moss_npu_grammar_") as folder:
                fst = kaldifst.StdVectorFst.read(_write_file(Path(folder) / "grammar.fst", relabelled))
        if fst is None:
            raise OSError(f"the prepared {source.name} could not be read back")
        log.warning("text normalization: prepared %s for lookahead search in %.1f s (%s)", source.name,
                    time.perf_counter() - start, f"once; cached in {self.folder}" if written else "in memory only")
        return Lookahead(fst, signatures, boundary, finals, to_boundary)

    def _read(self, fst_path: Path, record_path: Path, digest: str) -> Optional[Lookahead]:
        """The cached preparation, or None when it is missing or does not hold (then it is built again)."""
        import kaldifst

        if not record_path.exists():
            return None
        try:
            record = json.loads(record_path.read_text(encoding="utf-8"))
            if not isinstance(record, dict):
                raise ValueError("the record is not a JSON object")
            fst_bytes = fst_path.read_bytes()
            holds = (record.pop("record_sha256") == _seal(record) and record["format"] == FORMAT_VERSION
                     and record["sets_kept"] == SETS_KEPT and record["source_sha256"] == digest and record["fst_bytes"] == len(fst_bytes)
                     and record["fst_sha256"] == hashlib.sha256(fst_bytes).hexdigest())
            signatures = [int(mask, 16) for mask in record["signatures"]]
            boundary, finals = int(record["boundary"]), [int(s) for s in record["finals"]]
            to_boundary = _unpack(record["to_boundary"], int(record["states"]))
        except (OSError, ValueError, KeyError, TypeError):
            holds = False
        fst = kaldifst.StdVectorFst.read(str(fst_path)) if holds else None
        if fst is not None and (fst.num_states != len(to_boundary) or not 0 <= boundary < fst.num_states):
            fst = None
        if fst is None:
            log.warning("text normalization: the cached %s is damaged or stale; building it again", fst_path.name)
            return None
        return Lookahead(fst, signatures, boundary, finals, to_boundary)

    def _write(self, fst_path: Path, record_path: Path, relabelled: bytes, record: dict[str, Any]) -> bool:
        """Write the FST, then its record (each whole or not at all); False, after one warning, if the folder
        cannot be written."""
        try:
            if self.folder is None:
                raise OSError("no folder for it: $HOME is not set and this user has no home directory")
            self.folder.mkdir(parents=True, exist_ok=True)
            _replace(fst_path, relabelled)
            _replace(record_path, json.dumps(record).encode("utf-8"))
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("text normalization: cannot write the grammar cache%s (%s); preparing grammars in "
                            "memory on each load (set %s to a writable folder)",
                            "" if self.folder is None else f" in {self.folder}", exc, CACHE_ENV)
            return False
        return True


def _replace(path: Path, data: bytes) -> None:
    """Write ``path`` through a temporary file beside it, so that a reader never sees half of it (readable by
    all, as a file written by ``open`` under the usual umask: a shared cache folder serves every user)."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".part")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _seal(record: dict[str, Any]) -> str:
    """The SHA-256 of a record's fields (so that a damaged record is told from a sound one)."""
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode("utf-8")).hexdigest()


def _pack(flags: bytes) -> str:
    """One byte (0 or 1) per state, as base64 of its bits."""
    return base64.b64encode(np.packbits(np.frombuffer(flags, np.uint8)).tobytes()).decode("ascii")


def _unpack(packed: str, states: int) -> bytes:
    bits = np.unpackbits(np.frombuffer(base64.b64decode(packed, validate=True), np.uint8))
    if len(bits) < states or bits[states:].any():
        raise ValueError("state flags of another length")
    return bits[:states].tobytes()


def _write_file(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)
