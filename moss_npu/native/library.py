"""The package's C library (the one-row products of ``cpu.matvec``, the text search of ``text.lattice``), loaded
with ctypes (docs/native.md).

The installed library is loaded from the package folder, which only whoever can replace the package's Python
modules can write. ``$MOSS_NPU_NATIVE_BUILD=1`` compiles one for this very CPU at first use into the user cache,
used only while this user alone can write it (else into a private temporary folder); a failed build falls back
to the installed library. Where none loads, ``load_library`` raises ``KernelUnavailable`` and each caller takes
its own slower path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np

from moss_npu.native import build as native_build
from moss_npu.cache_dir import CACHE_ENV, default_cache_dir, open_trusted_folder, trusted
from moss_npu.errors import ConfigError

log = logging.getLogger(__name__)

BUILD_ENV = "MOSS_NPU_NATIVE_BUILD"  # "1": compile for this CPU at first use (module docstring)
NATIVE_FLAGS = ("-march=native",)
PRIVATE = "a temporary folder"  # where a library was built when the cache was unusable: compiled at every start


class KernelUnavailable(RuntimeError):
    """No C library could be loaded here (not installed with the package, a failed build); the message says why."""


def installed_library() -> Path:
    """Return where the package's build put the library (inside the package)."""
    return native_build.PACKAGE / native_build.LIBRARY


def cpu_identity() -> str:
    """What ``-march=native`` depends on: the machine and, on Linux, the CPU's model and feature flags."""
    parts = [platform.machine()]
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part"):
                parts.append(line)
                if len(parts) > 4:
                    break
    except OSError:
        parts.append(platform.processor())
    return "\n".join(parts)


def native_build_requested() -> bool:
    """Whether ``$MOSS_NPU_NATIVE_BUILD`` asks for a build for this CPU ("1"; unset, "" or "0": no); any other
    value is refused (ConfigError), not read as either."""
    value = os.environ.get(BUILD_ENV, "")
    if value not in ("", "0", "1"):
        raise ConfigError(f"${BUILD_ENV}={value!r}: use 1 (compile the kernels for this CPU) or 0")
    return value == "1"


def report_build(logger: logging.Logger, what: str, built: Optional[str], took: float) -> None:
    """Say on ``logger`` that ``what`` was compiled (``load_library``'s ``built``) and how long it took; nothing when it
    was loaded as installed or from the cache."""
    if built == PRIVATE:
        logger.warning("compiled %s in %.1f s into a temporary folder: the cache folder is unusable, so every start "
                       "compiles them again (set $%s to a folder of your own)", what, took, CACHE_ENV)
    elif built is not None:
        logger.warning("compiled %s for this CPU in %.1f s (once per CPU and compiler; kept in %s)", what, took,
                       built)


def _load_trusted(folder_fd: int, folder: Path, name: str) -> Optional[ctypes.CDLL]:
    """Load ``name`` inside the opened folder if it is a regular file this user owns that nobody else can write;
    None where there is no such file. The folder is reached through its descriptor where the system has
    /proc/self/fd, so the folder checked is the folder loaded from (its path could be swapped by the owner of a
    folder above it); inside it only this user can change the file."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=folder_fd)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(info.st_mode) or not trusted(info):
        log.warning("kernel cache file %s is not loaded: owned by another user or writable by others", name)
        return None
    through = Path(f"/proc/self/fd/{folder_fd}")
    path = through / name if through.is_dir() else folder / name
    try:
        return ctypes.CDLL(str(path))
    except OSError:  # a damaged file (truncated, overwritten): built again
        log.warning("kernel cache file %s is damaged; building it again", name)
        return None


def _build_key(command: list[str]) -> str:
    try:
        version = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"the C compiler {command[0]} does not run ({exc})") from exc
    return hashlib.sha256("\0".join([native_build.sources_digest(), " ".join(NATIVE_FLAGS), " ".join(command),
                                     (version.splitlines() or [""])[0], cpu_identity()]).encode()).hexdigest()[:16]


def _build(command: list[str], target: Path) -> None:
    """Build with ``-march=native``, else ``-mcpu=native`` (gcc on POWER, which refuses -march), else neither (a
    compiler that knows no "this CPU"); the first failure's message where all fail."""
    failures = []
    for flags in (NATIVE_FLAGS, ("-mcpu=native",), ()):
        try:
            native_build.build(target, command, platform.machine(), flags)
            return
        except (native_build.BuildError, OSError) as exc:
            failures.append(exc)
    raise KernelUnavailable(str(failures[0])) from failures[0]


def build_for_this_cpu(cache: Optional[Path] = None) -> tuple[ctypes.CDLL, Optional[str]]:
    """Return the library compiled for this CPU (``-march=native``) and where this call built it: None when it was
    in ``cache/kernels`` already (default: the user cache), that folder when built there, ``PRIVATE`` when built
    in a temporary folder (a missing, unwritable or untrusted cache). Raises KernelUnavailable where it cannot be
    built or loaded."""
    try:
        command = native_build.compiler_command(os.environ.get("CC") or "cc")
    except native_build.BuildError as exc:
        raise KernelUnavailable(str(exc)) from exc
    name = f"{Path(native_build.LIBRARY).stem}-{_build_key(command)}.so"
    root = cache if cache is not None else default_cache_dir()
    folder_fd = None if root is None else open_trusted_folder(Path(root) / "kernels", "kernel cache", log)
    if folder_fd is not None:
        folder = Path(root) / "kernels"
        try:
            library = _load_trusted(folder_fd, folder, name)
            if library is not None:
                return library, None
            _build(command, folder / name)
            library = _load_trusted(folder_fd, folder, name)
            if library is not None:
                return library, str(folder)
            (folder / name).unlink(missing_ok=True)  # not loadable here (noexec, $CC for another machine)
            raise KernelUnavailable(f"the compiled {native_build.LIBRARY} does not load")
        finally:
            os.close(folder_fd)
    with tempfile.TemporaryDirectory(prefix="moss-npu-kernels-") as private:
        target = Path(private) / name
        _build(command, target)
        try:
            return ctypes.CDLL(str(target)), PRIVATE  # the mapping outlives the file
        except OSError as exc:
            raise KernelUnavailable(f"the compiled {native_build.LIBRARY} does not load ({exc})") from exc


def load_library(cache: Optional[Path] = None) -> tuple[ctypes.CDLL, Optional[str]]:
    """Return the package's C library and where this call compiled it (None: installed, or cached): the installed
    one, or with ``$MOSS_NPU_NATIVE_BUILD=1`` the one built for this CPU (``build_for_this_cpu``; a failed build
    says why once and takes the installed one). Raises KernelUnavailable where neither loads."""
    if native_build_requested():
        try:
            return build_for_this_cpu(cache)
        except KernelUnavailable as exc:
            log.warning("$%s=1: the kernels for this CPU cannot be built (%s); using the installed ones", BUILD_ENV,
                        exc)
    path = installed_library()
    if not path.is_file():
        raise KernelUnavailable(f"the package's C library {path.name} is not installed beside it ({path.parent}): "
                                f"reinstall moss-npu with a C compiler (pip install .), or set ${BUILD_ENV}=1")
    return _installed(str(path)), None


@functools.lru_cache(maxsize=None)
def _installed(path: str) -> ctypes.CDLL:
    """Load the installed library at ``path`` once per process, warning once when it was built from other sources
    than those beside it (an editable install after a pull)."""
    try:
        library = ctypes.CDLL(path)
    except OSError as exc:
        raise KernelUnavailable(f"the installed {Path(path).name} does not load ({exc}): reinstall moss-npu") from exc
    library.moss_sources.restype, library.moss_sources.argtypes = ctypes.c_char_p, []
    if library.moss_sources().decode() != native_build.sources_digest():
        log.warning("%s was built from other C sources than those beside it in %s: run pip install -e . to build "
                    "it again", Path(path).name, Path(path).parent)
    return library


def line_aligned(count: int) -> np.ndarray:
    """An uninitialized float32 array of ``count`` values starting on a 64-byte cache line: a kernel's scratch,
    whose buffers the pool's threads fill tile by tile. From wherever numpy's allocator happened to start one, a
    one-slot frame ran 5-8 % slower in some processes than in others, on one kernel thread and on two
    (docs/performance.md)."""
    room = np.empty(count + 16, np.float32)
    skip = (-room.ctypes.data % 64) // 4
    return room[skip:skip + count]


def require(array: np.ndarray, dtype, shape: tuple, name: str) -> None:
    """Check that ``array`` is what a kernel reads: a C-contiguous numpy array of ``dtype`` and ``shape``, aligned
    to its item size; raise ValueError naming ``name`` and what differs (a wrong pointer would read garbage or out
    of bounds, never fail)."""
    if not isinstance(array, np.ndarray):
        raise ValueError(f"{name}: a numpy array expected, got {type(array).__name__}")
    if array.dtype != dtype:
        raise ValueError(f"{name}: dtype {array.dtype}, the kernel reads {np.dtype(dtype)}")
    if array.shape != shape:
        raise ValueError(f"{name}: shape {array.shape}, the kernel reads {shape}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{name}: not C-contiguous (np.ascontiguousarray makes a copy that is)")
    if not array.flags.aligned:  # numpy's own test (cheaper than reading the address here)
        raise ValueError(f"{name}: address not aligned for its {array.dtype} items")
