"""Which optional part (a setup.py extra) provides which top-level module, and the command that installs it.

A ``ModuleNotFoundError`` for one of these modules is a missing optional part, not a bug: the CLIs answer it with
one line naming the install command (exit 2) and the conformance runner skips the case naming it.
"""

from __future__ import annotations

from typing import Optional

from moss_npu.errors import MissingDependency

NANO_INSTALL = 'pip install -e ".[nano]"'  # after the torch build for the machine (README, Install)
LLAMA_INSTALL = 'pip install -e ".[llama]"'
ONNX_INSTALL = 'pip install -e ".[onnx]"'
TEMPO_INSTALL = 'pip install -e ".[tempo]"'  # a speaking rate other than 1.0 (moss_npu.tempo)
OPTIONAL_MODULES = {
    "torch": NANO_INSTALL, "sentencepiece": NANO_INSTALL, "safetensors": NANO_INSTALL, "kaldifst": NANO_INSTALL,
    "psutil": NANO_INSTALL, "threadpoolctl": NANO_INSTALL, "llama_cpp": LLAMA_INSTALL, "tokenizers": LLAMA_INSTALL,
    "onnxruntime": ONNX_INSTALL, "onnx": ONNX_INSTALL, "transformers": 'pip install -e ".[upstream]"',
    "pylibrb": TEMPO_INSTALL,
}


def missing_optional_part(exc: ModuleNotFoundError) -> Optional[MissingDependency]:
    """Return a MissingDependency naming the install command when ``exc`` is about a module of an optional
    part; None for any other module (a real failure)."""
    top = (exc.name or "").split(".")[0]
    command = OPTIONAL_MODULES.get(top)
    if command is None:
        return None
    return MissingDependency(f"this needs {top}, which is not installed here; install it with `{command}`")
