"""C sources of this package compiled at first use with the system C compiler and loaded with ctypes.

``load_library`` compiles a ``.c`` file of the package (``$CC``, else ``cc``; ``-O3 -march=native``, then
``-mcpu=native`` or neither where the compiler refuses it) into the user cache (``moss_npu.cache_dir``,
``kernels/``), named by the source, the flags, the compiler and this CPU, and loads it: ~0.4 s once, then
milliseconds. Concurrent builds are safe (a file is written whole, then renamed), a damaged file is compiled
again, an unwritable cache gives a build in a temporary folder for this process. Where nothing can be built
it raises ``KernelUnavailable`` saying why; each caller then has its own slower path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

from moss_npu.cache_dir import CACHE_ENV, default_cache_dir

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")
PRIVATE = "a temporary folder"  # where a library was built when the cache was unusable: compiled at every start


class KernelUnavailable(RuntimeError):
    """A C library could not be built or loaded here (no compiler, a failed build); the message says why."""


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


def compiler() -> tuple[list[str], str]:
    """Return the C compiler command to use and its version line; raise KernelUnavailable without one.

    ``$CC`` is read as make reads it, a command that may carry options ("ccache gcc", "zig cc"); a path with
    spaces that names a program is taken whole.
    """
    name = os.environ.get("CC") or "cc"
    try:
        words = [name] if shutil.which(name) else shlex.split(name)
    except ValueError:  # unbalanced quotes: not a command
        words = [name]
    path = shutil.which(words[0]) if words else None
    if path is None:
        raise KernelUnavailable(f"no C compiler ({name!r} is not on PATH; install gcc or set $CC)")
    command = [path, *words[1:]]
    try:
        version = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"the C compiler {path} does not run ({exc})") from exc
    return command, (version.splitlines() or [""])[0]


def _native_variants(flags: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Return ``flags``, then, where they hold ``-march=native``, the same with ``-mcpu=native`` (gcc on POWER, which
    refuses ``-march``) and with neither (a compiler that knows no "this CPU"): tried in turn until one builds."""
    if "-march=native" not in flags:
        return [flags]
    swapped = tuple("-mcpu=native" if f == "-march=native" else f for f in flags)
    return [flags, swapped, tuple(f for f in flags if f != "-march=native")]


def _build(command: list[str], source: Path, target: Path, flags: tuple[str, ...]) -> None:
    """Compile ``source`` into ``target`` through a temporary file beside it (readers never see half a file)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=target.parent, prefix=target.stem, suffix=".partial")
    os.close(handle)
    try:
        failures = []
        for variant in _native_variants(flags):
            done = subprocess.run([*command, *variant, "-o", partial, str(source)], capture_output=True, text=True,
                                  timeout=300)
            if done.returncode == 0:
                break
            failures.append(done)
        else:  # the first attempt's message: the others differ from it only by the flag
            first = (failures[0].stderr.strip().splitlines() or ["no message"])[0]
            raise KernelUnavailable(f"compiling {source.name} failed: {first}")
        os.chmod(partial, 0o755)  # mkstemp makes 0600: another user sharing the cache loads it too
        os.replace(partial, target)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"compiling {source.name} failed ({exc})") from exc
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def report_build(logger: logging.Logger, what: str, built: Optional[str], took: float) -> None:
    """Say on ``logger`` that ``what`` was compiled (``load_library``'s ``built``) and how long it took; nothing when it
    was read from the cache."""
    if built == PRIVATE:
        logger.warning("compiled %s in %.1f s into a temporary folder: the cache folder is unusable, so every start "
                       "compiles them again (set $%s to a writable folder)", what, took, CACHE_ENV)
    elif built is not None:
        logger.warning("compiled %s in %.1f s (once per CPU and compiler; kept in %s)", what, took, built)


def load_library(source: Path, cache: Optional[Path] = None,
                 flags: tuple[str, ...] = FLAGS) -> tuple[ctypes.CDLL, Optional[str]]:
    """Return ``source`` compiled with ``flags`` and loaded, and where this call built it: None when it was read
    from ``cache/kernels`` (default: the user cache), that folder when built there, ``PRIVATE`` when built in a
    temporary folder (an unwritable or missing cache). Raises KernelUnavailable where it cannot be built."""
    command, version = compiler()
    key = hashlib.sha256("\0".join([source.read_text(), " ".join(flags), " ".join(command), version,
                                    cpu_identity()]).encode()).hexdigest()[:16]
    root = cache if cache is not None else default_cache_dir()
    if root is not None:
        target = Path(root) / "kernels" / f"{source.stem}-{key}.so"
        try:
            if target.is_file():
                try:
                    return ctypes.CDLL(str(target)), None
                except OSError:  # a damaged file (truncated, overwritten): build it again
                    log.warning("kernel cache file %s is damaged; building it again", target)
            _build(command, source, target, flags)
            try:
                return ctypes.CDLL(str(target)), str(target.parent)
            except OSError:  # not loadable here (a folder mounted noexec, $CC for another machine): not kept
                target.unlink(missing_ok=True)
                raise
        except OSError as exc:  # an unwritable folder: build privately below
            log.debug("kernel cache %s unusable (%s); building in a temporary folder", target.parent, exc)
    with tempfile.TemporaryDirectory(prefix="moss-npu-kernels-") as folder:
        target = Path(folder) / f"{source.stem}-{key}.so"
        _build(command, source, target, flags)
        try:
            return ctypes.CDLL(str(target)), PRIVATE  # the mapping outlives the file
        except OSError as exc:
            raise KernelUnavailable(f"the compiled {source.stem} library does not load ({exc})") from exc
