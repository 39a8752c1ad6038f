"""How the package's C library (``LIBRARY``: the one-row products and the text search) is compiled: one recipe
for ``setup.py``, the opt-in build for this very CPU (``native.library``) and the tests' aarch64 cross build.
The tile kernels and the codec's window attention are compiled once per instruction set of the architecture
(``matvec.c`` and ``cpu.window_attention`` pick one at run time).
Standard library only: ``setup.py`` runs it before anything is installed.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

PACKAGE = Path(__file__).resolve().parent  # moss_npu/native: the library is built into it, beside its loader
LIBRARY = "libmoss_npu_kernels.so"  # inside the package; loaded with ctypes (no Python C API: one wheel per architecture)
CPU = PACKAGE.parent / "cpu"
MATVEC = CPU / "matvec.c"
TILES = CPU / "matvec_tiles.c"
FUSED_BLOCK = CPU / "fused_block.c"
LOCAL_LOOP = CPU / "local_loop.c"
CODEC_RING = CPU / "codec_ring.c"
WINDOW_ATTENTION = CPU / "window_attention.c"
LATTICE = PACKAGE.parent / "text" / "lattice.c"
# what the library is made of
SOURCES = (MATVEC, CPU / "matvec.h", TILES, WINDOW_ATTENTION, CODEC_RING, FUSED_BLOCK, CPU / "fused_block.h", LOCAL_LOOP,
           LATTICE)
BASE_FLAGS = ("-O3", "-fPIC", "-std=gnu11")
# The tile kernels' instruction sets by architecture: (name, flags). The names are matvec.c's targets.
TARGETS = {
    "x86_64": (("portable", ()), ("avx2", ("-mavx2", "-mfma")), ("avx512", ("-mavx512f", "-mfma"))),
    "aarch64": (("portable", ()), ("neon", ())),
}
ARCHITECTURES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}


class BuildError(RuntimeError):
    """The library could not be compiled; the message holds the compiler's first error line."""


def architecture(machine: str) -> str:
    """Return the recipe's name for a machine name (``platform.machine()``, a triplet's first part)."""
    machine = machine.lower()
    return ARCHITECTURES.get(machine, machine)


def compiler_command(name: str) -> list[str]:
    """Return ``name`` ($CC as make reads it: a command that may carry options, or a path with spaces) as argv;
    raise BuildError when its program is not on PATH."""
    try:
        words = [name] if shutil.which(name) else shlex.split(name)
    except ValueError:  # unbalanced quotes: not a command
        words = [name]
    path = shutil.which(words[0]) if words else None
    if path is None:
        raise BuildError(f"no C compiler ({name!r} is not on PATH; install gcc or set $CC)")
    return [path, *words[1:]]


def _run(command: Sequence[str], what: str) -> None:
    try:
        done = subprocess.run(list(command), capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"compiling {what} failed ({exc})") from exc
    if done.returncode != 0:
        first = next((line for line in done.stderr.splitlines() if "error" in line), None)
        raise BuildError(f"compiling {what} failed: {first or (done.stderr.strip().splitlines() or ['no message'])[0]}")


def sources_digest() -> str:
    """Return a digest of the library's sources, compiled into it (``moss_sources``): the loader compares the two
    and says when the library is older than the sources beside it (an editable install after a pull)."""
    return hashlib.sha256(b"\0".join(path.read_bytes() for path in SOURCES)).hexdigest()[:16]


def compile_objects(folder: Path, compiler: Sequence[str], machine: str, extra: Sequence[str] = ()) -> list[Path]:
    """Compile the library's objects for ``machine`` with ``compiler`` (argv) into ``folder``: the tile kernels once
    per instruction set of the architecture, with its flags, then the rest; ``extra`` flags go to every compile."""
    targets = TARGETS.get(architecture(machine), (("portable", ()),))
    objects = []
    for name, flags in targets:
        for source in (TILES, WINDOW_ATTENTION):
            obj = Path(folder) / f"{source.stem}_{name}.o"
            _run([*compiler, *BASE_FLAGS, *extra, *flags, f"-DMOSS_TARGET={name}", f"-DMOSS_{name.upper()}",
                  "-c", str(source), "-o", str(obj)], f"{source.name} for {name}")
            objects.append(obj)
    for source in (MATVEC, CODEC_RING, FUSED_BLOCK, LOCAL_LOOP, LATTICE):
        obj = Path(folder) / f"{source.stem}.o"
        # No multiply fused into an add: WIDEST's clones (matvec.h) and every CPU then give the same bits.
        _run([*compiler, *BASE_FLAGS, *extra, "-ffp-contract=off", f'-DMOSS_SOURCES="{sources_digest()}"', "-c",
              str(source), "-o", str(obj)], source.name)
        objects.append(obj)
    return objects


def link(objects: Sequence[Path], output: Path, compiler: Sequence[str], flags: Sequence[str] = ("-shared",)) -> None:
    """Link ``objects`` with the libraries they use into ``output`` (a shared library by default)."""
    _run([*compiler, *flags, "-o", str(output), *map(str, objects), "-lpthread", "-lm"], output.name)


def build(target: Path, compiler: Sequence[str], machine: str, extra: Sequence[str] = ()) -> Path:
    """Compile the library for ``machine`` with ``compiler`` (argv) into ``target``, written whole and then
    renamed (a reader never sees half a file); ``extra`` flags go to every compile (``-march=native``)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="moss-npu-build-") as folder:
        partial = Path(folder) / LIBRARY
        link(compile_objects(Path(folder), compiler, machine, extra), partial, compiler, ("-shared", *extra))
        staged = target.with_name(f".{target.name}.{os.getpid()}.partial")
        try:
            shutil.copyfile(partial, staged)
            os.chmod(staged, 0o755)
            os.replace(staged, target)
        finally:
            staged.unlink(missing_ok=True)
    return target
