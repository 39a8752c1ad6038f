"""A fake ``torch.npu`` namespace and ``torch_npu`` module: ``NpuBackend``'s own code runs against them in CI.

Their semantics are those of the real torch_npu's Python files (2.1.0.post13, 2.5.1, 2.13.0, read from the
wheels): ``torch.npu.config`` is an instance of a class whose
only member is a class-level ``__setattr__`` that forwards ``allow_internal_format`` to
``torch_npu._C._npu_setOption`` (reading the attribute raises AttributeError); ``set_compile_mode`` sets the
``jitCompile`` option; ``_npu_getOption`` returns what was set, as bytes, or None; ``mem_get_info(device=None)``
returns ``(free, total)``; ``NPUGraph`` and ``graph(npu_graph, pool=None, stream=None, capture_error_mode=...)``
exist in every version, and where the build or CANN has no capture, ``capture_begin`` raises; 2.13's
``is_bf16_supported`` takes ``including_emulation``, older ones take nothing. Real NPU runs (torch_npu + CANN
on an Ascend machine) are out of CI, which has no accelerator.
"""

import sys
import types

import torch

from moss_npu import device

GIB = 1 << 30


class FakeNpuC:
    """``torch_npu._C``'s option store: ``_npu_setOption`` takes a dict of str -> str, ``_npu_getOption`` reads one."""

    def __init__(self):
        self.options = {}  # every option given to torch_npu, in order

    def _npu_setOption(self, option):
        for key, value in option.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError("_npu_setOption takes a dict of str to str")
            self.options[key] = value

    def _npu_getOption(self, name):
        value = self.options.get(name)
        return None if value is None else value.encode()


def npu_config(c):
    """An instance of torch_npu's config class as the wheels define it: a setter only, forwarding to ``c``."""

    class NpuConfig:
        @classmethod
        def __setattr__(cls, name, value):
            if name == "allow_internal_format":
                c._npu_setOption({"ALLOW_INTERNAL_FORMAT": "enable" if value else "disable"})

    return NpuConfig()


class FakeNpuGraph:
    """``torch.npu.NPUGraph``: records ``fn``'s calls between ``capture_begin`` and ``capture_end`` (the fake runs
    them, no device exists to defer them to) and counts replays. ``capture_begin`` raises where capture is absent."""

    supported = True

    def __init__(self):
        self.replays = 0

    def capture_begin(self, pool=None, capture_error_mode="global"):
        if not self.supported:
            raise RuntimeError("capture_begin: aclmdlRICaptureBegin is not supported by this CANN version")

    def capture_end(self):
        pass

    def replay(self):
        self.replays += 1


class FakeGraph:
    """``torch.npu.graph``: the context manager around ``capture_begin`` / ``capture_end``, with the real signature."""

    def __init__(self, npu_graph, pool=None, stream=None, capture_error_mode="global"):
        self.npu_graph, self.pool, self.capture_error_mode = npu_graph, () if pool is None else (pool,), capture_error_mode

    def __enter__(self):
        self.npu_graph.capture_begin(*self.pool, capture_error_mode=self.capture_error_mode)

    def __exit__(self, *exc):
        self.npu_graph.capture_end()


class FakeTorchNpu:
    """The part of ``torch.npu`` that the backend calls, answering like a two-card Ascend 910B box; records calls.

    ``version`` picks the signature of ``is_bf16_supported`` (2.13 added ``including_emulation``); ``bf16=None``
    removes it; ``capture=False`` makes ``capture_begin`` raise, as on a build or CANN without graph capture.
    """

    def __init__(self, free_bytes=40 * GIB, count=2, bf16=True, version="2.1.0.post13", capture=True):
        self.free_bytes, self.count, self.version = free_bytes, count, version
        self.calls = []
        self.c = FakeNpuC()
        self.config = npu_config(self.c)
        self.NPUGraph = type("NPUGraph", (FakeNpuGraph,), {"supported": capture})
        self.graph = FakeGraph
        if bf16 is not None:  # None: a torch_npu without the query
            if version.startswith("2.13"):
                self.is_bf16_supported = lambda including_emulation=False: bf16
            else:
                self.is_bf16_supported = lambda: bf16

    def is_available(self):
        return True

    def device_count(self):
        return self.count

    def set_compile_mode(self, jit_compile=False):
        self.c._npu_setOption({"jitCompile": "enable" if jit_compile else "disable"})

    def mem_get_info(self, device=None):
        self.calls.append(("mem_get_info", device))
        return self.free_bytes, 64 * GIB

    def synchronize(self, device=None):
        self.calls.append(("synchronize", device))

    def empty_cache(self):
        self.calls.append(("empty_cache",))

    def manual_seed_all(self, seed):
        self.calls.append(("manual_seed_all", seed))

    def _is_in_bad_fork(self):  # with manual_seed_all, lets torch.manual_seed seed the NPU too, as with torch_npu
        return False

    def get_device_name(self, device_name=None):
        return "Ascend910B4"

    def max_memory_allocated(self, device=None):
        self.calls.append(("max_memory_allocated", device))
        return 3 * GIB

    def reset_peak_memory_stats(self, device=None):
        self.calls.append(("reset_peak_memory_stats", device))


def install_fake_torch_npu(monkeypatch, fake):
    """Make ``import torch_npu`` succeed and ``torch.npu`` be ``fake``, as a real torch_npu import would."""
    module = types.ModuleType("torch_npu")
    module.__version__ = fake.version
    module._C = fake.c
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    torch.utils.rename_privateuse1_backend("npu")  # what importing torch_npu does
    device.register_backend("npu", None)  # a fresh NpuBackend, which imports the fake on first use
