"""Packaging for moss-npu. torch, torch_npu and CANN must be a matching trio on Ascend machines.

torch is not a core requirement: the Delay fallback (extra "llama") exists for machines where torch cannot run.
"""

from setuptools import find_packages, setup

# The Nano backend. Text normalization (moss_npu.text) runs WeTextProcessing's grammars with kaldifst (x86-64 and
# aarch64 wheels); the grammars come from WeTextProcessing==1.2.0, installed with --no-deps (README): its pynini
# requirement has no aarch64 wheel and is not needed here.
NANO = ["torch>=2.1", "sentencepiece", "safetensors", "psutil", "kaldifst>=1.7", "threadpoolctl>=3"]
# The speech server (moss_npu.serve): its workers run the Nano backend.
SERVE = ["fastapi", "uvicorn", "prometheus_client", "python-multipart"]

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
    # C sources compiled at first use (moss_npu.native); the Ray Serve config file (moss_npu.serve.ray).
    package_data={"moss_npu.nano": ["matvec.c"], "moss_npu.text": ["lattice.c"], "moss_npu.serve": ["ray.yaml"]},
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
        "serve": NANO + SERVE,
        # The server as a Ray Serve application (python -m moss_npu.serve.ray): replicas across machines.
        "ray": NANO + SERVE + ["ray[serve]>=2.40"],
        # The README's install line: everything Nano needs and the test runner; everything the README's test line
        # needs except llama-cpp-python (a ~6 min source build: the README's optional line). The server tests
        # call the server with the official openai client and httpx.
        "dev": NANO + SERVE + ["pytest", "onnx", "onnxruntime", "tokenizers", "openai", "httpx"],
    },
    entry_points={"console_scripts": ["moss-npu-serve=moss_npu.serve.cli:main"]},
)
