"""moss-npu: MOSS-TTS-Nano on Ascend NPU, CUDA and CPU through one device layer.

Importing the package probes no device, downloads nothing and sets no environment variable.
"""

__version__ = "0.1.0"
