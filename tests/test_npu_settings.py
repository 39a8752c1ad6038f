"""The NPU backend applies its eager process settings once, when a device is resolved, and reports them as
torch_npu reads them back.

The fake ``torch.npu`` (tests/fake_npu.py) has torch_npu's setter-only config and option store; real NPU runs are
out of CI.
"""

import pytest
import torch

from moss_npu import device
from moss_npu.errors import DeviceError
from moss_npu.nano.graphs import resolve_graph

from .fake_npu import FakeTorchNpu, install_fake_torch_npu


@pytest.fixture
def npu(monkeypatch):
    monkeypatch.delenv("MOSS_NPU_JIT_COMPILE", raising=False)
    monkeypatch.delenv("MOSS_NPU_ALLOW_INTERNAL_FORMAT", raising=False)
    fake = FakeTorchNpu()
    install_fake_torch_npu(monkeypatch, fake)
    yield fake
    device.register_backend("npu", None)


def test_the_config_is_a_setter_only_as_in_torch_npu(npu):
    with pytest.raises(AttributeError):
        npu.config.allow_internal_format  # noqa: B018 - reading it is what the real class cannot do
    npu.config.allow_internal_format = True
    assert npu.c.options == {"ALLOW_INTERNAL_FORMAT": "enable"}


def test_settings_reach_torch_npu_once_and_are_reported_as_read_back(npu):
    dev = device.resolve_device("npu:0")
    device.resolve_device("npu")
    assert npu.c.options == {"jitCompile": "disable", "ALLOW_INTERNAL_FORMAT": "disable"}
    assert device.describe(dev)["process_settings"] == {"jit_compile": False, "allow_internal_format": False}


def test_environment_overrides_the_settings(npu, monkeypatch):
    monkeypatch.setenv("MOSS_NPU_JIT_COMPILE", "1")
    monkeypatch.setenv("MOSS_NPU_ALLOW_INTERNAL_FORMAT", "1")
    dev = device.resolve_device("npu")
    assert npu.c.options == {"jitCompile": "enable", "ALLOW_INTERNAL_FORMAT": "enable"}
    assert device.describe(dev)["process_settings"] == {"jit_compile": True, "allow_internal_format": True}


def test_a_setting_torch_npu_does_not_keep_is_refused(npu, monkeypatch):
    monkeypatch.setattr(npu, "set_compile_mode", lambda jit_compile=False: npu.c._npu_setOption({"jitCompile": "enable"}))
    with pytest.raises(DeviceError, match="torch_npu kept jitCompile=True after it was set to False"):
        device.resolve_device("npu:0")


def test_an_option_torch_npu_cannot_read_back_is_reported_unknown(npu, monkeypatch):
    monkeypatch.setattr(npu.c, "_npu_getOption", lambda name: None)
    dev = device.resolve_device("npu:0")
    assert device.describe(dev)["process_settings"] == {"jit_compile": None, "allow_internal_format": None}


@pytest.mark.parametrize("version", ["2.1.0.post13", "2.13.0"])
def test_bf16_query_with_either_signature(monkeypatch, version):
    install_fake_torch_npu(monkeypatch, FakeTorchNpu(version=version, bf16=True))
    try:
        assert device.resolve_dtype(device.resolve_device("npu:0"), "bfloat16") == torch.bfloat16
    finally:
        device.register_backend("npu", None)


def test_graph_on_refuses_when_a_trial_capture_fails(monkeypatch):
    """NPUGraph exists in every torch_npu; where capture is absent only capture_begin says so, so ``--graph on``
    tries one capture when the decoder is built and refuses with the reason. (The fake has no device memory: the
    trial's two tensors live on the host.)"""
    install_fake_torch_npu(monkeypatch, FakeTorchNpu(capture=False))
    for name in ("zeros", "ones"):
        monkeypatch.setattr(torch, name, lambda *size, device, real=getattr(torch, name): real(*size))
    try:
        dev = device.resolve_device("npu:0")
        assert device.backend(dev).graph_capture() is not None
        with pytest.raises(DeviceError, match="--graph on: a trial device-graph capture on npu:0 failed "
                                              r"\(RuntimeError: capture_begin: .*\); use --graph auto or off"):
            resolve_graph("on", dev, "noise", has_hook=False)
        assert resolve_graph("auto", dev, "noise", has_hook=False) is None  # the process knows now
    finally:
        device.register_backend("npu", None)


def test_cpu_reports_no_process_settings():
    assert "process_settings" not in device.describe(device.resolve_device("cpu"))
    assert device.backend("cpu").graph_capture() is None


def test_eval_report_shows_the_settings_read_back(npu):
    from moss_npu.evaluation.report import _side

    info = {"impl": "native", "dtype": "float32", **device.describe(device.resolve_device("npu:0"))}
    assert _side(info) == "native float32 on npu:0 (Ascend910B4, jit_compile=False, allow_internal_format=False)"
    assert device.settings_report(torch.device("npu", 0)) == {
        "process_settings": {"jit_compile": False, "allow_internal_format": False}}
