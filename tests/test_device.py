"""The device layer, every branch on CPU.

NPU code runs for real against a fake ``torch.npu`` namespace and a fake ``torch_npu`` module (what importing
torch_npu registers), so ``NpuBackend``'s own method bodies are what is tested; real NPU runs (torch_npu + CANN
on an Ascend machine) are out of CI, which has no accelerator. CUDA answers are checked only for what this
machine can say (unavailable → clear error).
"""

import sys

import pytest
import torch

from moss_npu import device
from moss_npu.errors import DeviceError

from .fake_npu import GIB, FakeTorchNpu, install_fake_torch_npu


@pytest.fixture
def npu(monkeypatch):
    fake = FakeTorchNpu()
    install_fake_torch_npu(monkeypatch, fake)
    yield fake
    device.register_backend("npu", None)


@pytest.fixture
def no_torch_npu(monkeypatch):
    """Make ``import torch_npu`` fail as it does on a machine without CANN."""
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    device.register_backend("npu", None)
    yield
    device.register_backend("npu", None)


@pytest.mark.parametrize("spec", ["cpu", "CPU", " cpu "])
def test_cpu_spellings(spec):
    assert device.resolve_device(spec) == torch.device("cpu")


def test_auto_prefers_npu_then_falls_back_to_cpu(npu, monkeypatch):
    assert device.resolve_device("auto") == torch.device("npu", 0)
    npu.count = 0
    monkeypatch.setattr(device.CudaBackend, "is_available", lambda self: False)
    monkeypatch.setattr(device.MpsBackend, "is_available", lambda self: False)
    assert device.resolve_device(None) == torch.device("cpu")


def test_npu_index_and_visible_devices_message(npu, monkeypatch):
    assert device.resolve_device("npu") == torch.device("npu", 0)
    assert device.resolve_device("npu:1") == torch.device("npu", 1)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "0,1")
    with pytest.raises(DeviceError, match=r"only 2 NPUs visible \(ASCEND_RT_VISIBLE_DEVICES=0,1\); use npu:0 or npu:1"):
        device.resolve_device("npu:3")


def test_npu_without_torch_npu_says_how_to_fix(no_torch_npu):
    with pytest.raises(DeviceError, match="torch_npu is not importable.*set_env.sh.*torch_npu") as info:
        device.resolve_device("npu:0")
    assert "\n" not in str(info.value)
    assert not device.get_backend("npu").is_available()


def test_auto_skips_npu_without_torch_npu(no_torch_npu):
    assert device.resolve_device("auto").type in ("cpu", "cuda", "mps")


@pytest.mark.parametrize("spec,pattern", [
    ("tpu", "unknown device"),
    ("npu:x", "must be a number"),
    ("cpu:abc", "must be a number"),
])
def test_bad_specs(spec, pattern):
    with pytest.raises(DeviceError, match=pattern):
        device.resolve_device(spec)


def test_cuda_unavailable_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without CUDA
    with pytest.raises(DeviceError, match="CUDA is not available"):
        device.resolve_device("cuda:0")


def test_npu_backend_calls_torch_npu(npu):
    """NpuBackend's own bodies, run against the fake torch.npu: each call reaches it with the device's index."""
    dev = device.resolve_device("npu:1")
    assert isinstance(device.backend(dev), device.NpuBackend)
    b = device.backend(dev)
    b.synchronize(1)
    b.empty_cache()
    device.seed_everything(7, dev)
    assert b.max_memory_allocated(1) == 3 * GIB and b.mem_get_info(1) == (40 * GIB, 64 * GIB)
    b.reset_peak_memory_stats(1)
    # torch.manual_seed reaches the NPU module itself, then the backend seeds it explicitly
    assert npu.calls == [("synchronize", 1), ("empty_cache",), ("manual_seed_all", 7), ("manual_seed_all", 7),
                         ("max_memory_allocated", 1), ("mem_get_info", 1), ("reset_peak_memory_stats", 1)]
    info = device.describe(dev)
    assert info["name"] == "Ascend910B4" and info["torch_npu"] == "2.1.0.post13"
    assert info["torch"] == torch.__version__


def test_npu_bf16_is_refused_when_it_cannot_be_confirmed(monkeypatch):
    """An old torch_npu without is_bf16_supported: a bf16 probe that cannot run means no, not yes."""
    install_fake_torch_npu(monkeypatch, FakeTorchNpu(bf16=None))
    try:
        dev = device.resolve_device("npu:0")
        monkeypatch.setattr(device, "_probe_matmul", lambda kind, dtype: False)  # no NPU kernels here
        with pytest.raises(DeviceError, match="--dtype bfloat16: not supported on npu:0"):
            device.resolve_dtype(dev, "bfloat16")
        assert device.resolve_dtype(dev, "float16") == torch.float16
    finally:
        device.register_backend("npu", None)


def test_kind_facts_are_backend_attributes():
    """resolve_device reads indexing, the visible-devices variable and the auto order from the classes, so a new
    backend is one subclass (defining it in device.py registers it)."""
    assert device.auto_order() == ["npu", "cuda", "mps", "cpu"]
    assert device.NpuBackend.visible_devices_env == "ASCEND_RT_VISIBLE_DEVICES"
    assert device.CudaBackend.visible_devices_env == "CUDA_VISIBLE_DEVICES"
    assert device.NpuBackend.indexed and device.CudaBackend.indexed and not device.CpuBackend.indexed
    assert set(device.Backend.builtin) == {"cpu", "cuda", "mps", "npu"}


def test_visible_devices_message_comes_from_the_backend(npu, monkeypatch):
    monkeypatch.setattr(device.NpuBackend, "visible_devices_env", "MY_VISIBLE")
    monkeypatch.setenv("MY_VISIBLE", "4,5")
    with pytest.raises(DeviceError, match=r"only 2 NPUs visible \(MY_VISIBLE=4,5\)"):
        device.resolve_device("npu:2")


def test_cpu_backend_reports_memory_and_name():
    b = device.backend(torch.device("cpu"))
    free, total = b.mem_get_info()
    assert 0 < free <= total
    assert isinstance(b.name(), str) and b.name()
    assert b.max_memory_allocated() > 0
    assert "torch_npu" not in device.describe(torch.device("cpu"))


def test_dtype_policy(npu):
    cpu = torch.device("cpu")
    assert device.resolve_dtype(cpu, None) == torch.float32
    assert device.resolve_dtype(cpu, "auto") == torch.float32
    assert device.resolve_dtype(cpu, "bf16") == torch.bfloat16
    with pytest.raises(DeviceError, match="unknown dtype"):
        device.resolve_dtype(cpu, "float8")
    dev = device.resolve_device("npu:0")
    assert device.resolve_dtype(dev, "bfloat16") == torch.bfloat16
    npu.is_bf16_supported = lambda: False
    with pytest.raises(DeviceError, match="not supported on npu:0 \\(Ascend910B4\\); use float32"):
        device.resolve_dtype(dev, "bfloat16")


def test_attention_impl():
    assert device.attention_impl() == "sdpa"
    assert device.attention_impl("flash_attention_2") == "sdpa"
    assert device.attention_impl("eager") == "eager"
    with pytest.raises(DeviceError, match="unknown"):
        device.attention_impl("xformers")


def test_chunk_batch_size_from_memory(npu):
    dev = device.resolve_device("npu:0")
    # 0.9 × 40 GiB / 1 GiB per sample = 36, capped by the chunk count
    assert device.chunk_batch_size(dev, chunks=10, gb_per_sample=1.0) == 10
    assert device.chunk_batch_size(dev, chunks=100, gb_per_sample=1.0) == 36
    assert device.chunk_batch_size(dev, chunks=100, gb_per_sample=1.0, max_batch=4) == 4
    npu.free_bytes = GIB // 2
    assert device.chunk_batch_size(dev, chunks=100, gb_per_sample=1.0) == 1
    assert ("mem_get_info", 0) in npu.calls


def test_chunk_batch_size_on_cpu_is_one_unless_asked():
    cpu = torch.device("cpu")
    assert device.chunk_batch_size(cpu, chunks=8, gb_per_sample=0.001) == 1
    assert device.chunk_batch_size(cpu, chunks=8, gb_per_sample=0.001, max_batch=3) == 3
    assert device.chunk_batch_size(cpu, chunks=1, gb_per_sample=0.001, max_batch=3) == 1


def test_register_backend_rejects_unknown_kind():
    with pytest.raises(DeviceError, match="unknown device kind"):
        device.register_backend("tpu", device.Backend())


def test_onnx_provider_names():
    assert device.onnx_provider("cpu") == "CPUExecutionProvider"
    assert device.onnx_provider("npu") == device.onnx_provider("cann") == "CANNExecutionProvider"
    with pytest.raises(DeviceError, match="unknown"):
        device.onnx_provider("tpu")


def test_emulated_bf16_warns_for_torch_arithmetic_on_the_cpu(monkeypatch, caplog):
    """Torch's own bf16 arithmetic (the official code in bf16) on a CPU without native bf16 warns once that
    float32 is faster; with native bf16, unknown, another dtype or another device, nothing is said."""
    import logging

    cpu = device.backend(torch.device("cpu"))
    cases = [(False, torch.bfloat16, True), (True, torch.bfloat16, False), (None, torch.bfloat16, False),
             (False, torch.float32, False)]
    for native, dtype, warned in cases:
        monkeypatch.setattr(type(cpu), "native_bf16", lambda self, native=native: native)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="moss_npu.device"):
            device.warn_if_bf16_is_emulated(torch.device("cpu"), dtype, "the official code")
        assert [("no native bf16" in r.getMessage()) for r in caplog.records] == ([True] if warned else [])
