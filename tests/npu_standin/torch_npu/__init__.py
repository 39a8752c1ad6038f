"""A test-only torch_npu: registers the stand-in device (``tests/npu_standin/standin.cpp``) as ``npu``, the way
torch_npu registers itself (rename the PrivateUse1 backend, generate its tensor methods, register ``torch.npu``).
"""

import atexit
import os

import torch

from . import _C, npu

__version__ = torch.__version__.split("+")[0] + "+standin"  # built against this torch

torch.utils.rename_privateuse1_backend("npu")
torch._register_device_module("npu", npu)
torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)


def npu_fusion_attention(*args, **kwargs):
    """torch_npu's fused attention kernel, which transformers imports whenever torch_npu is installed (its flash
    attention integration). The stand-in has no such kernel: the official code runs sdpa here, as the patch set
    asks (``patches/manifest.yaml``), and a call is an error."""
    raise NotImplementedError("the stand-in npu has no fused attention kernel; run attention as sdpa")


def _write_report(path: str) -> None:
    """Write the stand-in's counters and peak memory as JSON (``MOSS_NPU_STANDIN_REPORT``: a test reads them)."""
    import json

    report = {**npu.counters(), "peak_bytes": [npu.max_memory_allocated(i) for i in range(npu.device_count())]}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f)


if os.environ.get("MOSS_NPU_STANDIN_REPORT"):
    atexit.register(_write_report, os.environ["MOSS_NPU_STANDIN_REPORT"])
