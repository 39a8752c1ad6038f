"""A fake ``torch.npu`` namespace and ``torch_npu`` module: ``NpuBackend``'s own code runs against them in CI.

Real NPU runs (torch_npu + CANN on an Ascend machine) are out of CI, which has no accelerator.
"""

import sys
import types

import torch

from moss_npu import device

GIB = 1 << 30


class FakeTorchNpu:
    """The part of ``torch.npu`` that the backend calls, answering like a two-card Ascend 910B box; records calls."""

    def __init__(self, free_bytes=40 * GIB, count=2, bf16=True):
        self.free_bytes, self.count = free_bytes, count
        self.calls = []
        if bf16 is not None:  # None: an old torch_npu without the query
            self.is_bf16_supported = lambda: bf16

    def is_available(self):
        return True

    def device_count(self):
        return self.count

    def mem_get_info(self, index=0):
        self.calls.append(("mem_get_info", index))
        return self.free_bytes, 64 * GIB

    def synchronize(self, index=None):
        self.calls.append(("synchronize", index))

    def empty_cache(self):
        self.calls.append(("empty_cache",))

    def manual_seed_all(self, seed):
        self.calls.append(("manual_seed_all", seed))

    def _is_in_bad_fork(self):  # with manual_seed_all, lets torch.manual_seed seed the NPU too, as with torch_npu
        return False

    def get_device_name(self, index=0):
        return "Ascend910B4"

    def max_memory_allocated(self, index=0):
        self.calls.append(("max_memory_allocated", index))
        return 3 * GIB

    def reset_peak_memory_stats(self, index=0):
        self.calls.append(("reset_peak_memory_stats", index))


def install_fake_torch_npu(monkeypatch, fake):
    """Make ``import torch_npu`` succeed and ``torch.npu`` be ``fake``, as a real torch_npu import would."""
    module = types.ModuleType("torch_npu")
    module.__version__ = "2.1.0.post13"
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    torch.utils.rename_privateuse1_backend("npu")  # what importing torch_npu does
    device.register_backend("npu", None)  # a fresh NpuBackend, which imports the fake on first use
