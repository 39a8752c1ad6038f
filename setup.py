"""Packaging for moss-npu. torch, torch_npu and CANN must be a matching trio on Ascend machines.

torch is not a core requirement: the Delay fallback (extra "llama") exists for machines where torch cannot run.
"""

import importlib.util
import os
import platform
from pathlib import Path

from setuptools import Distribution, find_packages, setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1: the wheel package's, where installed
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:
        bdist_wheel = None

HERE = Path(__file__).resolve().parent


def _native_build():
    """moss_npu/native/build.py, loaded by path: the package's dependencies are not installed yet."""
    spec = importlib.util.spec_from_file_location("moss_npu_native_build", HERE / "moss_npu" / "native" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildKernels(build_ext):
    """Compile the package's C library (moss_npu.native.build: every instruction set of the architecture in one
    plain shared library, chosen at run time) into the package, beside the modules (in the source tree for an
    editable install)."""

    def run(self):
        recipe = _native_build()
        inplace = self.inplace or getattr(self, "editable_mode", False)
        root = HERE if inplace else Path(self.build_lib)
        try:
            compiler = recipe.compiler_command(os.environ.get("CC") or "cc")
            self._built = recipe.build(root / "moss_npu" / "native" / recipe.LIBRARY, compiler, platform.machine())
        except recipe.BuildError as exc:
            # Installed without it, the package still runs: numpy's GEMV and kaldifst's search, slower, each saying
            # so once. The tests fail in CI without it.
            self.warn(f"moss-npu: the C library is not built ({exc}); the CPU kernels and the compiled text search "
                      "will be missing (install gcc and reinstall)")

    def get_outputs(self):
        return [str(self._built)] if getattr(self, "_built", None) else []

    def get_output_mapping(self):
        return {}


COMMANDS = {"build_ext": BuildKernels}
if bdist_wheel is not None:
    class KernelWheel(bdist_wheel):
        """A wheel per architecture, not per Python: the library is loaded with ctypes (no Python C API)."""

        def get_tag(self):
            _, _, plat = super().get_tag()
            return "py3", "none", plat

    COMMANDS["bdist_wheel"] = KernelWheel


class BinaryDistribution(Distribution):
    """A distribution with compiled code (platform wheels), though it has no Python extension module."""

    def has_ext_modules(self):
        return True

# The Nano backend. Text normalization (moss_npu.text) runs WeTextProcessing's grammars with kaldifst (x86-64 and
# aarch64 wheels); the grammars come from WeTextProcessing==1.2.0, installed with --no-deps (README): its pynini
# requirement has no aarch64 wheel and is not needed here.
NANO = ["torch>=2.1", "sentencepiece", "safetensors", "psutil", "kaldifst>=1.7", "threadpoolctl>=3"]
# The speech server (moss_npu.serve): its workers run the Nano backend. uvicorn's range is the one whose h11
# protocol internals moss_npu/serve/connections.py extends (0.29 brought the signal capture cli.py relies on;
# 0.55 is the newest checked): raise the ceiling after running tests/serve on a newer one.
SERVE = ["fastapi", "uvicorn>=0.29,<0.56", "prometheus_client", "python-multipart", "websockets"]  # websockets: /v1/audio/speech/stream
# Speaking rate other than 1.0 (moss_npu.tempo): Rubber Band's real-time stretcher. Wheels for x86-64 (aarch64
# builds it from source), so it is its own extra; the server and the dev install include it.
TEMPO = ["pylibrb>=0.1.2"]

setup(
    name="moss-npu",
    version="0.1.0",
    description="MOSS-TTS-Nano on Ascend NPU, CUDA and CPU through one device layer, with accuracy checks",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # moss_npu is the runtime; moss_npu_verify the conformance runner and its case handlers, which import the
    # runtime (never the other way round) and ship so that a deployment can check itself against the fixtures.
    packages=find_packages(include=["moss_npu", "moss_npu.*", "moss_npu_verify", "moss_npu_verify.*"]),
    # The C sources travel too: the opt-in build for this very CPU ($MOSS_NPU_NATIVE_BUILD) compiles them again;
    # static/: the server's page at /; ray.yaml: the Ray Serve config file (moss_npu.serve.ray).
    package_data={"moss_npu.cpu": ["matvec.c", "matvec.h", "matvec_tiles.c", "window_attention.c", "fused_block.c",
                                  "fused_block.h", "local_loop.c", "codec_ring.c"], "moss_npu.text": ["lattice.c"],
                  "moss_npu.serve": ["static/*.html", "static/*.js", "static/*.css", "ray.yaml"]},
    distclass=BinaryDistribution,
    cmdclass=COMMANDS,
    # Torch-free core: the llama.cpp Delay fallback runs on exactly this plus the "llama" extra.
    install_requires=[
        "numpy",
        "soundfile>=0.12.1",  # MP3 reading needs libsndfile >= 1.1
        "soxr",  # librosa's default resampler (soxr HQ), for Delay reference audio
        "pyyaml",
        "huggingface_hub>=0.23",  # snapshot_download(local_dir=...) without symlinks; python -m moss_npu.hub wraps it
        "tqdm",
    ],
    extras_require={
        # The Nano backend. Install the torch build for the machine first (CPU, CUDA or the one torch_npu names).
        "nano": NANO,
        # torch_npu must match the installed torch exactly, and CANN must be installed and sourced.
        "npu": NANO + ["torch-npu"],
        # The MOSS-TTS Delay fallback: no torch (GPU builds of llama-cpp-python: see README).
        "llama": ["llama-cpp-python>=0.3.17", "tokenizers", "onnxruntime"],
        "onnx": ["onnx", "onnxruntime"],
        "upstream": NANO + ["transformers==4.57.1"],  # torchaudio not needed: audio goes through moss_npu.audio
        "tempo": TEMPO,
        "serve": NANO + SERVE + TEMPO,
        # The server as a Ray Serve application (python -m moss_npu.serve.ray): replicas across machines.
        "ray": NANO + SERVE + TEMPO + ["ray[serve]>=2.40"],
        # The README's install line: everything Nano needs and the test runner; everything the README's test line
        # needs except llama-cpp-python (a ~6 min source build: the README's optional line). The server tests
        # call the server with the official openai client and httpx.
        # selenium drives Debian's chromium for the page test (tests/serve/test_page.py).
        "dev": NANO + SERVE + TEMPO + ["pytest", "onnx", "onnxruntime", "tokenizers", "openai", "httpx", "selenium"],
    },
    entry_points={"console_scripts": ["moss-npu-serve=moss_npu.serve.cli:main"]},
)
