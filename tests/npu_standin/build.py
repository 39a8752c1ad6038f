"""Build (once, cached) and load the stand-in device's C++ extension against the installed torch's own headers.

The build folder is ``$MOSS_NPU_STANDIN_CACHE`` or ``~/.cache/moss_npu/npu_standin``, one subfolder per torch
version; ``torch.utils.cpp_extension.load`` rebuilds only when ``standin.cpp`` changed. ``python -m
tests.npu_standin.build`` builds it and prints the library's path (the tests do so in a subprocess first).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("standin.cpp")
PACKAGE_ROOT = Path(__file__).parent  # holds the test-only torch_npu package


def build_dir() -> Path:
    """Where the compiled extension is kept between runs."""
    import torch

    root = os.environ.get("MOSS_NPU_STANDIN_CACHE") or Path.home() / ".cache" / "moss_npu" / "npu_standin"
    folder = Path(root) / f"torch-{torch.__version__}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def extension():
    """Compile (when the source changed) and import the extension; it registers the PrivateUse1 backend."""
    from torch.utils import cpp_extension

    return cpp_extension.load(name="moss_npu_standin", sources=[str(SOURCE)], build_directory=str(build_dir()),
                              extra_cflags=["-O1"], verbose=False)


if __name__ == "__main__":
    module = extension()
    print(module.__file__)
    sys.exit(0)
