"""Prepared CPU weights: the arrays a CPU decoder derives from a checkpoint's weights (the one-row kernels' tiles,
the local decoder's first-layer tables), built once per checkpoint and CPU into the user cache and mapped into
memory by every later start (docs/performance.md#start-up).

An arena (``PreparedArena``) hands out its arrays in the order a frame reads them, each filled by its maker only
when the arena is built here. ``WeightCache`` writes a built arena atomically to ``root/prepared/<key>-<name>.bin``
under a key naming everything its bytes depend on (``entry_key``), and maps it back after checking its header,
layout and CRC-32; a missing, damaged or stale entry, or one in a folder others can write, is built again with one
warning line.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import mmap
import os
import stat
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

import numpy as np

from moss_npu import __version__
from moss_npu.cache_dir import CACHE_ENV, default_cache_dir, open_trusted_folder, trusted
from moss_npu.native import build as native_build

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # raise it whenever what an arena holds, or its order, changes
MAGIC = b"MOSSPREP"
PAGE = 4096  # the payload starts on a page boundary, so every array keeps its arena alignment when mapped
KEEP = 4  # entries of each name kept in the folder: the most recently used
FOLDER = "prepared"
Fill = Callable[[np.ndarray], None]  # writes an array's values into the (uninitialized) array it is given


class StaleEntry(ValueError):
    """A cached arena's layout is not what the code asks for (a build whose layout changed without
    ``FORMAT_VERSION``): its arrays cannot be trusted to mean what they are asked for."""


class PageArena:
    """One anonymous memory map of ``nbytes`` handing out arrays one after another (``array``), on transparent huge
    pages where offered (a frame streams hundreds of MB: fewer page walks), or with ``huge_pages=False`` on 4 KB
    pages, for memory first touched a little at a time in many places (a KV cache: each touch zeroes a page)."""

    ALIGN = 64  # a cache line: every array starts on one

    def __init__(self, nbytes: int, huge_pages: bool = True) -> None:
        size = max(nbytes, 1)
        # Private anonymous memory: a shared mapping (mmap's default) is shmem, which gets no huge pages.
        private = getattr(mmap, "MAP_PRIVATE", None)
        self._map = (mmap.mmap(-1, size) if private is None
                     else mmap.mmap(-1, size, flags=private | mmap.MAP_ANONYMOUS))
        advice = getattr(mmap, "MADV_HUGEPAGE" if huge_pages else "MADV_NOHUGEPAGE", None)
        if advice is not None:
            with contextlib.suppress(OSError):  # no transparent huge pages here: 4 KB pages work the same
                self._map.madvise(advice)
        self._used = 0

    @classmethod
    def room(cls, nbytes: int) -> int:
        """Return the arena bytes an array of ``nbytes`` takes (aligned)."""
        return -(-nbytes // cls.ALIGN) * cls.ALIGN

    def array(self, shape: tuple, dtype) -> np.ndarray:
        """Return the next uninitialized array of ``shape`` and ``dtype``; raises ValueError when full."""
        count = math.prod(shape)
        nbytes = count * np.dtype(dtype).itemsize
        if self._used + nbytes > len(self._map):
            raise ValueError(f"arena of {len(self._map)} bytes is full")
        out = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._used).reshape(shape)
        self._used += self.room(nbytes)
        return out

    @property
    def buffer(self) -> mmap.mmap:
        return self._map

    def nbytes(self) -> int:
        return len(self._map)


@dataclass(frozen=True)
class Slot:
    """Where one array of an arena lies: numpy dtype string, shape, byte offset in the payload."""

    dtype: str
    shape: tuple[int, ...]
    offset: int


class PreparedArena:
    """Arrays handed out one after another (``array``): filled by their makers in a ``PageArena`` of ``nbytes``, or
    views of a cached entry's payload (``cached``), whose stored layout every request must match."""

    def __init__(self, nbytes: int = 0, *, mapped: Optional[mmap.mmap] = None, start: int = 0,
                 layout: Optional[list[Slot]] = None, payload: int = 0) -> None:
        self._pages = PageArena(nbytes) if mapped is None else None
        self._buffer = self._pages.buffer if mapped is None else mapped
        self._start, self._expected = start, layout
        self._size = nbytes if mapped is None else payload
        self.layout: list[Slot] = []
        self._used = 0

    @property
    def cached(self) -> bool:
        """Whether the arrays are read from the cache (their makers were not called)."""
        return self._expected is not None

    def array(self, shape: tuple, dtype, fill: Fill) -> np.ndarray:
        """Return the next array of ``shape`` and ``dtype``, written by ``fill`` unless the arena is cached; ValueError
        when full, StaleEntry when a cached arena's next array is another one."""
        shape, kind = tuple(int(n) for n in shape), np.dtype(dtype)
        count = math.prod(shape)
        nbytes = count * kind.itemsize
        slot = Slot(kind.str, shape, self._used)
        if self._expected is not None:
            index = len(self.layout)
            if index >= len(self._expected) or self._expected[index] != slot:
                found = self._expected[index] if index < len(self._expected) else "nothing"
                raise StaleEntry(f"array {index} is {found}, this build asks for {slot}")
        if self._used + nbytes > self._size:
            raise ValueError(f"arena of {self._size} bytes is full")
        out = np.frombuffer(self._buffer, dtype=kind, count=count, offset=self._start + self._used).reshape(shape)
        if self._expected is None:
            fill(out)
        self.layout.append(slot)
        self._used += PageArena.room(nbytes)
        return out

    def finish(self) -> None:
        """Check that a cached arena handed out every array it holds (StaleEntry otherwise)."""
        if self._expected is not None and len(self.layout) != len(self._expected):
            raise StaleEntry(f"the entry holds {len(self._expected)} arrays, this build asked for {len(self.layout)}")

    def payload(self) -> memoryview:
        """The bytes of the arrays handed out so far (what ``WeightCache.save`` writes)."""
        return memoryview(self._buffer)[self._start:self._start + self._used]

    def nbytes(self) -> int:
        return self._size


def fresh_arena(nbytes: int) -> PreparedArena:
    """A ``PreparedArena`` built here, for a decoder without a cache."""
    return PreparedArena(nbytes)


def code_digest() -> str:
    """Return a digest of the code that decides what the prepared bytes are (the C sources and this package's
    modules): an edited checkout keeps its version, which alone would serve tiles computed the old way."""
    digest = hashlib.sha256()
    for path in [*native_build.SOURCES, *sorted(Path(__file__).parent.glob("*.py"))]:
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def entry_key(parts: Mapping[str, str]) -> str:
    """Return the name of the entries prepared from ``parts`` (what their bytes depend on) by this code."""
    text = json.dumps({**parts, "format": FORMAT_VERSION, "package": __version__, "code": code_digest()},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class WeightCache:
    """The prepared-weights folder (``root/prepared``) for the entries of one key: ``arena`` maps an entry or
    starts building it, ``save`` writes it; ``sources`` says where each came from (``cache``, ``built``, ``built,
    not cached``)."""

    def __init__(self, key: str, root: Optional[Path] = None) -> None:
        root = root if root is not None else default_cache_dir()
        self.folder = None if root is None else Path(root) / FOLDER
        self.key = key
        self.sources: dict[str, str] = {}
        self._usable = self.folder is not None
        self._announced = False

    def arena(self, name: str, nbytes: int, label: str) -> PreparedArena:
        """Return entry ``name``'s arena of ``nbytes``: the cached one if it holds, else one to build (the first
        for this key says in one line that ``label`` is being prepared)."""
        found = self._read(name, nbytes)
        if found is not None:
            self.sources[name] = "cache"
            return found
        if not self._announced:
            self._announced = True
            where = f"into {self.folder}" if self._usable else "in memory (no usable cache folder)"
            log.warning("preparing the CPU weights of %s %s: once per checkpoint and CPU, later starts map them",
                        label, where)
        self.sources[name] = "built" if self._usable else "built, not cached"
        return PreparedArena(nbytes)

    def _file(self, name: str) -> str:
        return f"{self.key}-{name}.bin"

    def _read(self, name: str, nbytes: int) -> Optional[PreparedArena]:
        """The cached arena ``name``, or None where there is none or it does not hold (a warning says which)."""
        folder_fd = self._open_folder()
        if folder_fd is None:
            return None
        try:
            try:
                fd = os.open(self._file(name), os.O_RDONLY | os.O_NOFOLLOW, dir_fd=folder_fd)
            except FileNotFoundError:
                return None
            except OSError as exc:
                log.warning("prepared weights %s are not read (%s); building them again", self._file(name), exc)
                return None
            try:
                return self._map(fd, name, nbytes)
            finally:
                os.close(fd)
        finally:
            os.close(folder_fd)

    def _map(self, fd: int, name: str, nbytes: int) -> Optional[PreparedArena]:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or not trusted(info):
            log.warning("prepared weights %s are not used: not a regular file of this user's that only they can "
                        "write; building them again", self._file(name))
            return None
        try:
            mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)  # writable views: torch takes them without a copy
            start, layout, payload = _check(mapped, self.key, name, nbytes)
        except (OSError, ValueError, KeyError, TypeError) as exc:  # a header that is not what this code writes
            log.warning("prepared weights %s are damaged or stale (%s); building them again", self._file(name), exc)
            return None
        with contextlib.suppress(OSError):
            os.utime(fd)  # most recently used: kept by the pruning of later saves
        return PreparedArena(mapped=mapped, start=start, layout=layout, payload=payload)

    def _open_folder(self) -> Optional[int]:
        if not self._usable:
            return None
        fd = open_trusted_folder(self.folder, "prepared-weights cache", log)
        if fd is None:
            self._usable = False
        return fd

    def save(self, name: str, arena: PreparedArena) -> None:
        """Write a built arena as entry ``name``, whole or not at all (one warning where it cannot)."""
        if arena.cached:
            return
        folder_fd = self._open_folder()
        if folder_fd is None:
            self.sources[name] = "built, not cached"
            return
        target = self._file(name)
        temporary = f".{target}.{os.getpid()}.{time.monotonic_ns()}.part"
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=folder_fd)
            with os.fdopen(fd, "wb") as out:
                payload = arena.payload()
                out.write(_header(self.key, name, arena, zlib.crc32(payload)))
                out.write(payload)
            os.replace(temporary, target, src_dir_fd=folder_fd, dst_dir_fd=folder_fd)
            _prune(folder_fd, name)
        except OSError as exc:
            self.sources[name] = "built, not cached"
            log.warning("cannot write the prepared weights %s into %s (%s); every start prepares them again (set "
                        "$%s to a writable folder of your own)", target, self.folder, exc, CACHE_ENV)
            _unlink(folder_fd, temporary)
        finally:
            os.close(folder_fd)


def _header(key: str, name: str, arena: PreparedArena, crc: int) -> bytes:
    """The file's bytes before the payload: magic, header length, the JSON header, padding to ``PAGE``."""
    body = json.dumps({"format": FORMAT_VERSION, "key": key, "name": name, "payload": len(arena.payload()),
                       "nbytes": arena.nbytes(), "crc32": crc,
                       "arrays": [[s.dtype, list(s.shape), s.offset] for s in arena.layout]}).encode()
    head = MAGIC + len(body).to_bytes(8, "little") + body
    return head + bytes(-len(head) % PAGE)


def _check(mapped: mmap.mmap, key: str, name: str, nbytes: int) -> tuple[int, list[Slot], int]:
    """Return (payload start, layout, arena bytes) of a mapped entry; ValueError saying what does not hold."""
    if len(mapped) < len(MAGIC) + 8 or mapped[:len(MAGIC)] != MAGIC:
        raise ValueError("not a prepared-weights file")
    length = int.from_bytes(mapped[len(MAGIC):len(MAGIC) + 8], "little")
    end = len(MAGIC) + 8 + length
    if end > len(mapped):
        raise ValueError("truncated header")
    header = json.loads(bytes(mapped[len(MAGIC) + 8:end]))
    if (header.get("format"), header.get("key"), header.get("name")) != (FORMAT_VERSION, key, name):
        raise ValueError("written for another format or key")
    if header["nbytes"] != nbytes:
        raise ValueError(f"an arena of {header['nbytes']} bytes, this build needs {nbytes}")
    start = end + (-end % PAGE)
    if len(mapped) != start + header["payload"]:
        raise ValueError(f"{len(mapped)} bytes, the header says {start + header['payload']} (truncated?)")
    if zlib.crc32(memoryview(mapped)[start:]) != header["crc32"]:
        raise ValueError("checksum mismatch")
    layout = [Slot(dtype, tuple(shape), offset) for dtype, shape, offset in header["arrays"]]
    return start, layout, nbytes


def _prune(folder_fd: int, name: str) -> None:
    """Remove all but the ``KEEP`` most recently used entries named ``name``, and hour-old temporary files."""
    suffix, entries, now = f"-{name}.bin", [], time.time()
    for file in os.listdir(folder_fd):
        try:
            info = os.stat(file, dir_fd=folder_fd, follow_symlinks=False)
        except OSError:
            continue
        if file.endswith(suffix) and not file.startswith("."):
            entries.append((info.st_mtime, file))
        elif file.startswith(".") and file.endswith(".part") and now - info.st_mtime > 3600:
            _unlink(folder_fd, file)
    for _, file in sorted(entries, reverse=True)[KEEP:]:
        _unlink(folder_fd, file)


def _unlink(folder_fd: int, file: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(file, dir_fd=folder_fd)
