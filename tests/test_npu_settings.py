"""The NPU backend applies its eager process settings once, when a device is resolved, and reports them.

A stand-in ``torch.npu`` namespace records the calls; real NPU runs are out of CI.
"""

import types

import pytest
import torch

from moss_npu import device


class RecordingNpu(device.NpuBackend):
    """An NPU backend whose torch.npu is a namespace that records set_compile_mode and config writes."""

    def __init__(self):
        super().__init__()
        self.modes = []
        self.ns = types.SimpleNamespace(set_compile_mode=lambda jit_compile: self.modes.append(jit_compile),
                                        config=types.SimpleNamespace(allow_internal_format=True),
                                        is_available=lambda: True, device_count=lambda: 1,
                                        get_device_name=lambda i: "Ascend910B4")

    def _npu(self):
        return self.ns

    def torch_device(self, index):
        torch.utils.rename_privateuse1_backend("npu")
        return super().torch_device(index)

    def version(self):
        return "2.1.0.post8"


@pytest.fixture
def npu():
    stand_in = RecordingNpu()
    device.register_backend("npu", stand_in)
    yield stand_in
    device.register_backend("npu", None)


def test_settings_applied_once_and_reported(npu, monkeypatch):
    monkeypatch.delenv("MOSS_NPU_JIT_COMPILE", raising=False)
    monkeypatch.delenv("MOSS_NPU_ALLOW_INTERNAL_FORMAT", raising=False)
    dev = device.resolve_device("npu:0")
    device.resolve_device("npu")
    assert npu.modes == [False] and npu.ns.config.allow_internal_format is False
    info = device.describe(dev)
    assert info["process_settings"] == {"jit_compile": False, "allow_internal_format": False}


def test_environment_overrides_the_settings(npu, monkeypatch):
    monkeypatch.setenv("MOSS_NPU_JIT_COMPILE", "1")
    monkeypatch.setenv("MOSS_NPU_ALLOW_INTERNAL_FORMAT", "1")
    device.resolve_device("npu")
    assert npu.modes == [True] and npu.ns.config.allow_internal_format is True


def test_cpu_reports_no_process_settings():
    assert "process_settings" not in device.describe(device.resolve_device("cpu"))
    assert device.backend("cpu").graph_capture() is None
