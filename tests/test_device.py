"""The device layer, every branch on CPU.

NPU dispatch is tested through a stand-in backend injected with ``device.register_backend``: real NPU
runs (torch_npu + CANN on an Ascend machine) are out of CI, which has no accelerator. CUDA answers are
checked only for what this machine can say (unavailable → clear error).
"""

import sys

import pytest
import torch

from moss_npu import device
from moss_npu.errors import DeviceError

GIB = 1 << 30


class StandInNpu(device.NpuBackend):
    """Answers like torch_npu on a two-card Ascend 910B box, without importing torch_npu."""

    def __init__(self, free_bytes=40 * GIB, count=2, bf16=True):
        super().__init__()
        self.free_bytes, self.count, self.bf16 = free_bytes, count, bf16
        self.calls = []

    def _npu(self):
        return self

    # the subset of torch.npu that the backend calls
    def is_available(self):
        return True

    def device_count(self):
        return self.count

    def torch_device(self, index):
        torch.utils.rename_privateuse1_backend("npu")  # what importing torch_npu does
        return super().torch_device(index)

    def mem_get_info(self, index=0):
        self.calls.append(("mem_get_info", index))
        return self.free_bytes, 64 * GIB

    def synchronize(self, index=None):
        self.calls.append(("synchronize", index))

    def empty_cache(self):
        self.calls.append(("empty_cache",))

    def manual_seed_all(self, seed):
        self.calls.append(("manual_seed_all", seed))

    def get_device_name(self, index=0):
        return "Ascend910B4"

    def is_bf16_supported(self):
        return self.bf16

    def version(self):
        return "2.1.0.post13"


@pytest.fixture
def npu():
    stand_in = StandInNpu()
    device.register_backend("npu", stand_in)
    yield stand_in
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_unavailable_is_a_clear_error():
    with pytest.raises(DeviceError, match="CUDA is not available"):
        device.resolve_device("cuda:0")


def test_backend_dispatch_goes_to_the_stand_in(npu):
    dev = device.resolve_device("npu:1")
    device.synchronize(dev)
    device.empty_cache(dev)
    device.seed_everything(7, dev)
    assert npu.calls == [("synchronize", 1), ("empty_cache",), ("manual_seed_all", 7)]
    info = device.describe(dev)
    assert info["name"] == "Ascend910B4" and info["torch_npu"] == "2.1.0.post13"
    assert info["torch"] == torch.__version__


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
    npu.bf16 = False
    with pytest.raises(DeviceError, match="not supported on npu:0 \\(Ascend910B4\\); use float32"):
        device.resolve_dtype(dev, "bfloat16")


def test_attention_impl():
    cpu = torch.device("cpu")
    assert device.attention_impl(cpu, torch.float32) == "sdpa"
    assert device.attention_impl(cpu, torch.float32, "flash_attention_2") == "sdpa"
    assert device.attention_impl(cpu, torch.float32, "eager") == "eager"
    with pytest.raises(DeviceError, match="unknown"):
        device.attention_impl(cpu, torch.float32, "xformers")


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
