"""Packaging for moss-npu. torch, torch_npu and CANN must be a matching trio on Ascend machines."""

from setuptools import find_packages, setup

setup(
    name="moss-npu",
    version="0.1.0",
    description="MOSS-TTS-Nano on Ascend NPU, CUDA and CPU through one device layer, with accuracy checks",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["moss_npu", "moss_npu.*"]),
    install_requires=[
        "torch>=2.1",
        "numpy",
        "sentencepiece",
        "safetensors",
        "soundfile>=0.12.1",  # MP3 reading needs libsndfile >= 1.1
        "scipy",
        "pyyaml",
        "huggingface_hub>=0.23",  # snapshot_download(local_dir=...) without symlinks; python -m moss_npu.hub wraps it
        "tqdm",
        "psutil",
        # Text normalization (moss_npu.text) runs WeTextProcessing's grammars with kaldifst (x86-64 and aarch64
        # wheels). The grammars come from WeTextProcessing==1.2.0, installed with --no-deps (README): its pynini
        # requirement has no aarch64 wheel and is not needed here.
        "kaldifst>=1.7",
    ],
    extras_require={
        # torch_npu must match the installed torch exactly, and CANN must be installed and sourced.
        "npu": ["torch-npu"],
        "llama": ["llama-cpp-python>=0.3.17", "tokenizers", "onnxruntime"],
        "onnx": ["onnx", "onnxruntime"],
        "upstream": ["transformers==4.57.1"],  # torchaudio not needed: audio goes through moss_npu.audio
        # Everything the README's test line needs except llama-cpp-python (a ~6 min source build: its own line).
        "dev": ["pytest", "onnx", "onnxruntime", "tokenizers"],
    },
)
