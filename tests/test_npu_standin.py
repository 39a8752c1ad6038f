"""The stand-in NPU (tests/npu_standin): a PrivateUse1 device registered as ``npu`` the way torch_npu registers
itself. These tests pin what it must do for the product runs on it to mean something: refuse what a device
refuses, count what crosses to the host, keep memory per device, and capture graphs that run nothing until
replayed. Each runs a program in a subprocess (the stand-in registers itself process-wide).
"""

import pytest
import torch

from tests.npu_standin.fixtures import standin  # noqa: F401 - the fixture

DEVICE = r'''
import torch, torch_npu

npu = torch.npu
assert torch.npu.device_count() == 2 and torch.device("npu", 0).type == "npu"
x = torch.arange(6.0).reshape(2, 3).npu()
assert x.device == torch.device("npu", 0) and x.is_npu

# memory: counted per device, exactly
before = npu.memory_allocated(0)
y = torch.empty(1000, dtype=torch.float32, device="npu:0")
assert npu.memory_allocated(0) == before + 4000 and npu.max_memory_allocated(0) >= before + 4000
free, total = npu.mem_get_info(0)
assert free == total - npu.memory_allocated(0) and npu.memory_allocated(1) == 0
del y
assert npu.memory_allocated(0) == before

# refusals: what a device refuses
def refused(fn, text):
    try:
        fn()
    except RuntimeError as exc:
        assert text in str(exc), str(exc)
    else:
        raise AssertionError("not refused: " + text)

refused(lambda: x + torch.ones(2, 3), "found at least two devices, npu:0 and cpu")
refused(lambda: x + torch.ones(2, 3, device="npu:1"), "found at least two devices, npu:0 and npu:1")
refused(lambda: torch.rand(3, device="npu", generator=torch.Generator()), "Expected a 'npu' device type for generator")
assert torch.equal((x + torch.tensor(1.0)).cpu(), torch.arange(1.0, 7.0).reshape(2, 3))  # a 0-dim CPU scalar mixes

# views share device memory
column = x[:, 1]
column.add_(100)
assert x.cpu()[:, 1].tolist() == [101.0, 104.0] and column.device.type == "npu"

# generators: one per device, the device's own stream
npu.manual_seed_all(5)
a = torch.rand(4, device="npu:0")
torch.manual_seed(123)  # the host generator does not feed the device's
npu.manual_seed_all(5)
assert torch.equal(torch.rand(4, device="npu:0").cpu(), a.cpu())
g = torch.Generator(device="npu")
g.manual_seed(5)
assert torch.equal(torch.rand(4, device="npu", generator=g).cpu(), a.cpu())
assert torch.rand(4, device="npu:1").device == torch.device("npu", 1)

# counters: host<->device copies, .item(), every op
npu.reset_counters()
z = torch.ones(3).to("npu")
w = (z * 2).sum()
value = w.item()
host = z.cpu()
c = npu.counters()
assert value == 6.0 and c["host_to_device"] == 1 and c["items"] == 1 and c["device_to_host"] == 1, c
assert c["ops"] == {"aten::mul.out": 1, "aten::sum.IntList_out": 1}, c  # the copies are counted apart

# graphs: a capture runs nothing, a replay runs what it recorded, a host sync while capturing is refused
total, one = torch.zeros(4, device="npu"), torch.ones(4, device="npu")
graph = npu.NPUGraph()
with npu.graph(graph):
    step = total + one
    total.copy_(step)
assert total.cpu().tolist() == [0.0] * 4 and step.isnan().all()  # nothing ran: the capture's own memory is unwritten
graph.replay()
graph.replay()
assert total.cpu().tolist() == [2.0] * 4 and npu.counters()["replays"] == 2
def sync_in_capture():
    with npu.graph(npu.NPUGraph()):
        total.sum().item()
refused(sync_in_capture, "operation not permitted when stream is capturing")
def read_in_capture():
    with npu.graph(npu.NPUGraph()):
        total.cpu()
refused(read_in_capture, "operation not permitted when stream is capturing")
print("ok")
'''


def test_the_device_refuses_counts_and_captures_as_a_device_does(standin):
    done = standin.run("-c", DEVICE)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.parametrize(("visible", "answer"), [("1", "1"), ("0,1", "2"), ("1,0", "2")])
def test_visible_devices_as_cann_counts_them(standin, visible, answer):
    done = standin.run("-c", "import torch, torch_npu; print(torch.npu.device_count())",
                       ASCEND_RT_VISIBLE_DEVICES=visible)
    assert done.returncode == 0 and done.stdout.strip() == answer, done.stderr[-2000:]


def test_a_device_that_does_not_exist_is_refused(standin):
    done = standin.run("-c", "import torch, torch_npu; print(torch.npu.device_count())", ASCEND_RT_VISIBLE_DEVICES="5")
    assert done.returncode != 0 and "ASCEND_RT_VISIBLE_DEVICES=5: device 5 does not exist (2 devices)" in done.stderr


BACKEND = r'''
import json, torch
from moss_npu import device
dev = device.resolve_device("npu:1")
import torch_npu
b = device.backend(dev)
free, total = b.mem_get_info(1)
print(json.dumps({"device": str(dev), "options": torch_npu._C._options, "describe": device.describe(dev),
                  "graph": b.graph_capture().check(dev), "bf16": b.supports_dtype(torch.bfloat16),
                  "memory": [free <= total, b.max_memory_allocated(1) > 0]}))
'''


def test_the_npu_backend_on_the_standin(standin):
    """NpuBackend's own code, end to end: both settings reach torch_npu's option store (before the fix only
    jitCompile did) and are reported as read back; a trial graph capture works; memory and bf16 are answered."""
    import json

    done = standin.run("-c", BACKEND)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    assert got["options"] == {"jitCompile": "disable", "ALLOW_INTERNAL_FORMAT": "disable"}
    assert got["describe"]["process_settings"] == {"jit_compile": False, "allow_internal_format": False}
    assert got["describe"]["torch_npu"] == torch.__version__.split("+")[0] + "+standin" and got["device"] == "npu:1"
    assert got["graph"] is None and got["bf16"] is True and got["memory"] == [True, True]


THREADS = r'''
import threading, torch, torch_npu
from moss_npu import device

dev = device.resolve_device("npu:0")
capture = device.backend(dev).graph_capture()
state, step = torch.zeros(4, device=dev), torch.ones(4, device=dev)
audio = torch.full((8,), 0.5, device=dev)
inside, copied, errors = threading.Event(), threading.Event(), []

def audio_thread():  # what the engine's audio thread does: copy a waveform to the host
    inside.wait()
    try:
        audio.cpu()
    except RuntimeError as exc:
        errors.append(str(exc))
    copied.set()

def frame():
    inside.set()
    copied.wait()
    state.add_(step)

worker = threading.Thread(target=audio_thread)
worker.start()
replay = capture.capture(frame)
worker.join()
replay()
print(errors or state.cpu().tolist())
'''


def test_another_thread_reads_the_device_while_a_frame_is_captured(standin):
    """The engine's audio thread copies waveforms to the host while the decoding thread captures a frame graph:
    with torch's default capture_error_mode ("global") that copy fails on a device; the capture is thread_local."""
    done = standin.run("-c", THREADS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[1.0, 1.0, 1.0, 1.0]"
