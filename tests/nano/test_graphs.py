"""Device-graph lifecycle of the frame decoder through a stand-in capture API injected into the device layer.

The stand-in (``graph_standin.FrozenCapture``) freezes what a real graph freezes: a replay runs the ops recorded
at capture on the tensors of the capture, with every host value (a Python count, a slice bound) as it was then,
so a frame that reads host state after capture gives other codes than the eager frame here. Real CUDA/NPU
capture is out of CI (the two allowed skips at the end).
"""

import logging

import pytest
import torch

from moss_npu import device as devices
from moss_npu.errors import DeviceError, InputError
from moss_npu.nano.checkpoint import load_model
from moss_npu.cpu.step import CpuStep
from moss_npu.nano.decoder import FrameDecoder, RequestParams
from moss_npu.nano.graphs import WARMUP_FRAMES
from moss_npu.nano.prompt import build_prompt_rows
from moss_npu.nano.tokenizer import TextTokenizer
from moss_npu.sampling import SamplingParams
from tests.optional import allowed_skip

from .graph_standin import FrozenCapture
from .test_decoder import TEXTS, steer

SAMPLED = SamplingParams.runtime_defaults()


class GraphCpu(devices.CpuBackend):
    def __init__(self, capture) -> None:
        self.capture = capture

    def graph_capture(self):
        return self.capture


@pytest.fixture
def standin(monkeypatch):
    """Install the stand-in capture on the CPU backend. Its frames run torch ops, as on a device: the CPU step
    (numpy and C kernels, which no graph records) is off for the decoders of the test."""
    def install(fail=False):
        capture = FrozenCapture(fail)
        devices.register_backend("cpu", GraphCpu(capture))
        monkeypatch.setattr(CpuStep, "build", classmethod(lambda cls, model, compile_mode="auto", **kwargs: None))
        return capture
    yield install
    devices.register_backend("cpu", None)


@pytest.fixture(scope="module")
def setup(tiny_ckpt):
    model = steer(load_model(tiny_ckpt, device="cpu"))
    tok = TextTokenizer.from_dir(tiny_ckpt)
    return model, [build_prompt_rows(tok, model.config, t) for t in TEXTS]


def decode(decoder, prompts, frames=6, join_at=None, sampling=SAMPLED):
    """Run prompts (the last one joining at frame ``join_at``); return every request's codes."""
    def params(i):
        return RequestParams(sampling, max_new_frames=frames, generator=torch.Generator().manual_seed(i))

    first = prompts if join_at is None else prompts[:-1]
    slots = {decoder.admit(p, params(i)): i for i, p in enumerate(first)}
    out = {i: [] for i in range(len(prompts))}
    step = 0
    while decoder.active_slots or (join_at is not None and step <= join_at):
        if step == join_at:
            slots[decoder.admit(prompts[-1], params(len(prompts) - 1))] = len(prompts) - 1
        batch = decoder.step()
        for s, i in slots.items():
            if bool(batch.active[s]):
                out[i].append(batch.codes[s])
        step += 1
    return [torch.stack(out[i]) for i in range(len(prompts))]


def test_the_standin_replays_the_capture_on_the_tensors_of_now():
    """Capture runs nothing; a replay reads the captured tensors as they are at that moment."""
    out, x = torch.zeros(3), torch.ones(3)
    with torch.inference_mode():
        replay = FrozenCapture().capture(lambda: out.copy_(x * 2.0))
        assert torch.equal(out, torch.zeros(3))
        x.fill_(3.0)
        replay()
    assert torch.equal(out, torch.full((3,), 6.0))


def test_a_frame_reading_host_state_after_capture_fails_its_replay():
    """The replay keeps the host value of the capture (2.0); the frame run now would use 5.0: the replay raises."""
    out, x, scale = torch.zeros(3), torch.ones(3), [2.0]
    with torch.inference_mode():
        replay = FrozenCapture().capture(lambda: out.copy_(x * scale[0]))
        replay()
        scale[0] = 5.0
        with pytest.raises(AssertionError, match="reads host state that a graph freezes at capture"):
            replay()
    assert torch.equal(out, torch.full((3,), 2.0))  # what the graph computed: the captured scale


def test_the_standin_refuses_host_reads_while_capturing():
    x = torch.ones(3)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
        FrozenCapture().capture(lambda: x.add_(1) if x.sum() > 0 else None)
    assert torch.equal(x, torch.ones(3))  # what the capture wrote before it failed is put back too


def test_capture_once_per_bucket_then_replay(setup, standin):
    model, prompts = setup
    capture = standin()
    eager = decode(FrameDecoder(model, slots=4, max_len=256, sampler="noise", graph="off"), prompts, join_at=3)
    decoder = FrameDecoder(model, slots=4, max_len=256, sampler="noise", graph="auto")
    assert decoder.graphs_active
    graphed = decode(decoder, prompts, join_at=3)
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)  # the captured frame (all keys under a mask, all channels) = the eager one
    # Two slots run first (bucket 2), the third joins at frame 3 (bucket 4): one capture each, after warm-up.
    assert sorted(decoder.graphs.replays) == [2, 4] and capture.captures == 2
    assert decoder.graphs.warm[2] == WARMUP_FRAMES and decoder.graphs.warm[4] == WARMUP_FRAMES
    total_frames = decoder.frame_index
    assert capture.replays == total_frames - 2 * WARMUP_FRAMES


def test_noise_is_copied_into_the_static_buffer_before_replay(setup, standin):
    model, prompts = setup
    standin()
    decoder = FrameDecoder(model, slots=1, max_len=256, sampler="noise", graph="on")
    decoder.admit(prompts[0], RequestParams(SAMPLED, max_new_frames=8, generator=torch.Generator().manual_seed(1)))
    buffer = decoder.state.noise
    seen = []
    for _ in range(WARMUP_FRAMES + 3):
        decoder.step()
        seen.append(buffer[0].clone())
    assert decoder.state.noise is buffer and decoder.graphs.replays
    assert all(not torch.equal(a, b) for a, b in zip(seen, seen[1:]))  # fresh uniforms every frame
    g = torch.Generator().manual_seed(1)
    want = [torch.rand(buffer.shape[1], generator=g) for _ in seen]
    assert torch.equal(torch.stack(seen), torch.stack(want))


def test_capture_failure_falls_back_to_eager_with_one_warning(setup, standin, caplog):
    model, prompts = setup
    capture = standin(fail=True)
    eager = decode(FrameDecoder(model, slots=2, max_len=256, sampler="noise"), prompts[:2])
    with caplog.at_level(logging.WARNING, logger="moss_npu.nano.graphs"):
        decoder = FrameDecoder(model, slots=2, max_len=256, sampler="noise", graph="auto")
        got = decode(decoder, prompts[:2])
        again = FrameDecoder(model, slots=2, max_len=256, sampler="noise", graph="auto")  # the process knows
    assert [torch.equal(a, b) for a, b in zip(eager, got)] == [True, True]
    assert len([r for r in caplog.records if "capture failed" in r.message]) == 1
    assert capture.broken and not decoder.graphs_active and again.graphs is None


def test_graph_on_refuses_up_front_when_a_trial_capture_fails(setup, standin):
    model, _ = setup
    capture = standin(fail=True)
    with pytest.raises(DeviceError, match=r"--graph on: a trial device-graph capture on cpu failed \(RuntimeError: "
                                          r"operation not permitted when stream is capturing\); use --graph auto or off"):
        FrameDecoder(model, slots=2, max_len=256, sampler="noise", graph="on")
    assert capture.broken


def test_graph_on_runs_after_a_trial_capture_that_replays(setup, standin):
    model, _ = setup
    capture = standin()
    decoder = FrameDecoder(model, slots=2, max_len=256, sampler="noise", graph="on")
    assert capture.checked and capture.broken is None and capture.captures == 1 and capture.replays == 2
    assert decoder.graphs is not None


def test_graph_modes_refuse_what_cannot_be_captured(setup, standin):
    model, _ = setup
    with pytest.raises(InputError, match="no device-graph capture"):
        FrameDecoder(model, sampler="noise", graph="on")  # the real CPU backend has none
    assert FrameDecoder(model, sampler="noise", graph="auto").graphs is None
    standin()
    with pytest.raises(InputError, match="noise-fed sampler"):
        FrameDecoder(model, sampler="official", graph="on")
    with pytest.raises(InputError, match="hook"):
        FrameDecoder(model, sampler="noise", graph="on", logits_hook=lambda *a: None)
    with pytest.raises(InputError, match="unknown"):
        FrameDecoder(model, graph="sometimes")
    assert FrameDecoder(model, sampler="official", graph="auto").graphs is None


def accelerator():
    """The first CUDA or NPU device with a real capture API, or None (CI has none)."""
    for kind in ("cuda", "npu"):
        try:
            backend = devices.get_backend(kind)
            if backend.is_available() and backend.device_count() > 0 and backend.graph_capture() is not None:
                return backend.torch_device(0)
        except devices.DeviceError:
            continue
    return None


@allowed_skip(accelerator() is None, "needs a CUDA or NPU device with graph capture (not in CI)")
@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "noise-fed"])
def test_real_graphs_match_eager_frame_by_frame(tiny_ckpt, sampling):
    """On real hardware: captured frames give the same codes as eager ones, frame by frame, with requests joining."""
    dev = accelerator()
    model = steer(load_model(tiny_ckpt, device=dev))
    tok = TextTokenizer.from_dir(tiny_ckpt)
    prompts = [build_prompt_rows(tok, model.config, t).to(dev) for t in TEXTS]

    def run(graph):
        decoder = FrameDecoder(model, slots=4, max_len=256, sampler="noise", graph=graph)
        return decode(decoder, prompts, frames=8, join_at=3, sampling=sampling), decoder.graphs_active

    eager, _ = run("off")
    graphed, active = run("on")
    assert active
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)
