"""The package's C library (``moss_npu.native``: ``library`` and ``build``): loaded as installed without any compiler, its
kernels right on every instruction set this CPU runs and, cross-built, on aarch64 under qemu-user; the opt-in
build for this CPU kept only in a cache folder nobody else can write, built again when damaged, and falling
back to the installed library when it cannot be built."""

import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moss_npu.cpu import targets
from moss_npu.native import build as native_build, library as native
from moss_npu.errors import ConfigError
from moss_npu.cpu.matvec import Bf16Tiles, Fp32Tiles, MatVecKernels
from tests.optional import missing

CHECK = Path(__file__).parent / "native" / "check_kernels.c"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def installed():
    """The installed library (skips where the package was not built: pip install -e .)."""
    if not native.installed_library().is_file():
        missing(f"{native.installed_library()} is not built: run pip install -e . (builds it into the package)")
    return native.installed_library()


def _check_program(tmp_path: Path, compiler: list, machine: str, link: tuple = ()) -> Path:
    objects = native_build.compile_objects(tmp_path, compiler, machine)
    program = tmp_path / "check_kernels"
    native_build.link([*objects, CHECK], program, compiler, ("-O2", *link))
    return program


def test_the_kernels_agree_on_every_target_this_cpu_runs(installed, tmp_path):
    """check_kernels.c: the three formats against float64 sums of the stored values, odd shapes, one thread and
    two (the same bits), the fused block against a float64 block (two rows in one call: each row's bits alone)
    and the local loop's decision against the sampling chain in float64, for each target; on x86 the portable C and AVX2 at least (AVX-512 where the CPU has it)."""
    compiler = shutil.which("cc") or missing("no C compiler (cc) to build the kernel check")
    done = subprocess.run([str(_check_program(tmp_path, [compiler], platform.machine()))], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    expected = [name for name in targets.TARGETS if name in targets.runnable_targets(native.load_library()[0])]
    assert [line.split(":")[0] for line in done.stdout.splitlines()] == expected


def test_the_aarch64_build_is_right_under_qemu(tmp_path):
    """The library cross-built for aarch64 (Kunpeng and the other Arm hosts beside Ascend): NEON and the portable C
    pass the same checks under qemu-user. Speed on real Arm hardware is not measured here."""
    compiler, emulator = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if compiler is None or emulator is None:
        missing("no aarch64 cross compiler or qemu-user: apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross "
                "qemu-user")
    program = _check_program(tmp_path, [compiler], "aarch64", ("-static",))
    done = subprocess.run([emulator, str(program)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == ["portable: 146 of 146 cases agree", "neon: 146 of 146 cases agree"]


def test_the_installed_library_loads_with_no_compiler_anywhere(installed, tmp_path):
    """No cc on PATH and no $CC: the kernels and the text search load as installed, without a build line."""
    script = ("import logging, numpy, torch; logging.basicConfig(); from moss_npu.cpu.matvec import *; "
              "from moss_npu.text.lattice import LatticeKernels; k = MatVecKernels.load(); LatticeKernels.load(); "
              "print(k.built, Fp32Tiles(k, torch.ones(32, 8), None)(numpy.ones(8, numpy.float32))[0])")
    env = {**os.environ, "PATH": str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("CC", None)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "None 8.0\n" and "compiled" not in done.stderr


FORK_AFTER_PRODUCTS = """
import os, numpy, torch
from moss_npu.cpu.matvec import Fp32Tiles, MatVecKernels
kernels = MatVecKernels.load(threads=2)
kernels.threads.use(2)
tiles = Fp32Tiles(kernels, torch.ones(1024, 64), None)
x = numpy.ones(64, numpy.float32)
assert tiles(x)[0] == 64.0
pid = os.fork()
if pid == 0:
    right = tiles(x)[0] == 64.0  # the pool's workers did not come along: started again
    kernels.threads.use(3)  # a larger pool: the parent's is freed (no thread of it to join here)
    os._exit(0 if right and tiles(x)[0] == 64.0 else 3)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), tiles(x)[0])
"""


def test_a_process_forked_after_shared_products_can_use_and_free_the_pool(installed):
    """A library user who forks after a decode: the child's products still share out (over workers started again)
    and its pool is freed without waiting for the parent's threads (on 96bcbaf the child hung in that join)."""
    done = subprocess.run([sys.executable, "-c", FORK_AFTER_PRODUCTS], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "0 64.0\n"


def test_a_missing_library_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "installed_library", lambda: tmp_path / native_build.LIBRARY)
    with pytest.raises(native.KernelUnavailable, match=r"not installed beside it.*pip install \."):
        native.load_library()


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_an_unknown_build_setting_is_refused(monkeypatch, value):
    monkeypatch.setenv(native.BUILD_ENV, value)
    with pytest.raises(ConfigError, match=f"MOSS_NPU_NATIVE_BUILD='{value}': use 1"):
        native.load_library()


def test_a_target_this_cpu_cannot_run_is_refused(installed, monkeypatch):
    library = native.load_library()[0]
    absent = [name for name in targets.TARGETS if name not in targets.runnable_targets(library)]
    for name in [*absent, "sse9"]:
        monkeypatch.setenv(targets.TARGET_ENV, name)
        with pytest.raises(ConfigError, match=f"MOSS_NPU_KERNEL_TARGET='{name}': this CPU runs"):
            MatVecKernels.load()


def test_the_fastest_target_is_the_default(installed, monkeypatch):
    monkeypatch.delenv(targets.TARGET_ENV, raising=False)
    library = native.load_library()[0]
    assert MatVecKernels.load().target == targets.runnable_targets(library)[0]
    assert targets.runnable_targets(library)[-1] == "portable"


# --- the opt-in build for this CPU ($MOSS_NPU_NATIVE_BUILD=1) ---------------------------------------------------

@pytest.fixture
def native_build_on(monkeypatch):
    shutil.which("cc") or missing("no C compiler (cc): the build for this CPU needs one")
    monkeypatch.setenv(native.BUILD_ENV, "1")


def _product(kernels) -> float:
    return float(Bf16Tiles(kernels, torch.ones(32, 8), None)(np.ones(8, np.float32))[0])


def test_it_builds_once_into_a_private_cache(native_build_on, tmp_path):
    assert MatVecKernels.load(tmp_path).built == str(tmp_path / "kernels")
    folder = tmp_path / "kernels"
    built = list(folder.iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"  # no partial files left beside it
    assert folder.stat().st_mode & 0o777 == 0o700
    stamp = built[0].stat().st_mtime_ns
    again = MatVecKernels.load(tmp_path)
    assert again.built is None and _product(again) == 8.0
    assert list(folder.iterdir()) == built and built[0].stat().st_mtime_ns == stamp


def test_a_cache_folder_others_can_write_is_not_used(native_build_on, tmp_path, caplog):
    """A group- or world-writable folder (a shared cache): someone else could have put the file there, so nothing
    is loaded from it or built into it; the build goes to a private folder for this process."""
    folder = tmp_path / "kernels"
    folder.mkdir()
    folder.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="moss_npu.native.library"):
        kernels = MatVecKernels.load(tmp_path)
    assert kernels.built == native.PRIVATE and _product(kernels) == 8.0
    assert list(folder.iterdir()) == []
    assert any("owned by another user or writable by others" in r.getMessage() for r in caplog.records)


def test_a_cache_file_of_another_user_is_not_loaded(native_build_on, tmp_path, caplog):
    if os.getuid() != 0:
        missing("giving a file to another user needs root (CI runs as root)")
    MatVecKernels.load(tmp_path)
    (built,) = (tmp_path / "kernels").iterdir()
    os.chown(built, 12345, 12345)
    with caplog.at_level(logging.WARNING, logger="moss_npu.native.library"):
        kernels = MatVecKernels.load(tmp_path)
    assert kernels.built == str(tmp_path / "kernels")  # built again, over it, as this user's own
    assert built.stat().st_uid == os.getuid()
    assert any("is not loaded: owned by another user" in r.getMessage() for r in caplog.records)


def test_a_group_writable_cache_file_is_not_loaded(native_build_on, tmp_path, caplog):
    MatVecKernels.load(tmp_path)
    (built,) = (tmp_path / "kernels").iterdir()
    built.chmod(0o775)
    with caplog.at_level(logging.WARNING, logger="moss_npu.native.library"):
        assert MatVecKernels.load(tmp_path).built == str(tmp_path / "kernels")
    assert built.stat().st_mode & 0o022 == 0


def test_a_damaged_cache_file_is_built_again(native_build_on, tmp_path):
    """A truncated kernel file is compiled again with one warning (in fresh processes: a process never reopens a
    library it has loaded)."""
    script = ("import logging, sys, numpy, torch; logging.basicConfig(); from moss_npu.cpu.matvec import *; "
              "k = MatVecKernels.load(sys.argv[1]); "
              "print(Bf16Tiles(k, torch.ones(32, 8), None)(numpy.ones(8, numpy.float32))[0])")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True,
                           env=env)
    (built,) = (tmp_path / "kernels").iterdir()
    damaged = tmp_path / "damaged"
    damaged.write_bytes(built.read_bytes()[:100])
    os.replace(damaged, built)
    again = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True,
                           env=env)
    assert first.stdout == again.stdout == "8.0\n"
    assert "is damaged" not in first.stderr and again.stderr.count("is damaged; building it again") == 1
    assert built.stat().st_size > 100 and list((tmp_path / "kernels").iterdir()) == [built]


def test_without_a_compiler_it_says_why_and_takes_the_installed_one(native_build_on, installed, monkeypatch,
                                                                    tmp_path, caplog):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with caplog.at_level(logging.WARNING, logger="moss_npu.native.library"):
        kernels = MatVecKernels.load(tmp_path)
    assert kernels.built is None and _product(kernels) == 8.0
    (line,) = [r.getMessage() for r in caplog.records]
    assert "no C compiler" in line and "no-such-compiler-here" in line and "using the installed ones" in line


def test_cc_may_carry_options(native_build_on, monkeypatch, tmp_path):
    """$CC as make reads it: a command with options ("ccache gcc", "zig cc"), or a path with spaces."""
    compiler = shutil.which("cc")
    spaced = tmp_path / "my tools" / "cc"
    spaced.parent.mkdir()
    spaced.symlink_to(compiler)
    for cc, cache in ((f"{compiler} -DMOSS_NPU_UNUSED=1", "options"), (str(spaced), "spaced")):
        monkeypatch.setenv("CC", cc)
        kernels = MatVecKernels.load(tmp_path / cache)
        assert kernels.built == str(tmp_path / cache / "kernels")
        np.testing.assert_allclose(Fp32Tiles(kernels, torch.ones(32, 8), None)(np.ones(8, np.float32)), 8.0)


def test_a_failed_build_says_why(native_build_on, monkeypatch, tmp_path):
    broken = tmp_path / "matvec.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(native_build, "MATVEC", broken)
    with pytest.raises(native.KernelUnavailable, match="compiling matvec.c failed"):
        native.build_for_this_cpu(tmp_path)
    assert not any((tmp_path / "kernels").iterdir())


def test_a_build_that_does_not_load_says_why(native_build_on, monkeypatch, tmp_path):
    """A compiler that succeeds but makes a library this process cannot load ($CC a cross compiler, a folder
    mounted noexec) is KernelUnavailable, not an OSError; nothing unloadable is kept."""
    compiler = tmp_path / "cross-cc"
    compiler.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo cross-cc 1.0; exit 0; }\n'
                        'while [ $# -gt 0 ]; do [ "$1" = -o ] && { shift; echo not-a-library > "$1"; }; shift; done\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    with pytest.raises(native.KernelUnavailable, match="does not load"):
        native.build_for_this_cpu(tmp_path / "cache")
    assert not any((tmp_path / "cache" / "kernels").iterdir())


def test_a_compiler_without_march_native_still_builds(native_build_on, monkeypatch, tmp_path):
    """gcc on POWER knows "this CPU" as -mcpu=native and refuses -march=native: the kernels are built with that
    (or, failing it too, without either) instead of not at all."""
    real = shutil.which("cc")
    compiler = tmp_path / "power-cc"
    compiler.write_text(f'#!/bin/sh\nfor a in "$@"; do case "$a" in -march=native)\n'
                        f'  echo "error: unrecognized command-line option \'-march=native\'" >&2; exit 1;;\n'
                        f'  -mcpu=native) echo "error: unknown -mcpu" >&2; exit 1;; esac; done\nexec {real} "$@"\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    assert _product(MatVecKernels.load(tmp_path / "cache")) == 8.0


def test_a_library_older_than_its_sources_says_so(installed, monkeypatch, caplog):
    """An editable install after the C sources changed (a pull): one warning naming the command that rebuilds."""
    native._installed.cache_clear()
    monkeypatch.setattr(native_build, "sources_digest", lambda: "0123456789abcdef")
    with caplog.at_level(logging.WARNING, logger="moss_npu.native.library"):
        native.load_library()
        native.load_library()
    monkeypatch.undo()
    native._installed.cache_clear()
    stale = [r.getMessage() for r in caplog.records if "built from other C sources" in r.getMessage()]
    assert len(stale) == 1 and "pip install -e ." in stale[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moss_npu.native.library"):
        native.load_library()
    assert not caplog.records  # the library as built by this checkout's sources


def test_kernel_scratch_starts_on_a_cache_line():
    """``line_aligned`` gives ``count`` writable float32 values starting on a 64-byte line, wherever numpy's
    allocator starts its block (a smaller array first shifts where the next one lands)."""
    starts = set()
    for count in (1, 7, 16, 1000, 12345):
        for shift in range(4):
            filler = np.empty(shift * 3 + 1, np.float32)  # noqa: F841 - moves the allocator's next block
            scratch = native.line_aligned(count)
            assert scratch.dtype == np.float32 and scratch.shape == (count,) and scratch.flags.c_contiguous
            assert scratch.ctypes.data % 64 == 0
            scratch[:] = 1.0
            starts.add(scratch.base.ctypes.data % 64)
    assert starts != {0}  # numpy's own blocks did not all start on a line: the test exercised the shift
