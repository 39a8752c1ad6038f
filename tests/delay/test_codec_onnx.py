"""ONNX codec runner on the tiny test codec: I/O layout, frames-first codes, provider errors, bad inputs."""

import numpy as np
import pytest

from moss_npu.delay import codec_onnx
from moss_npu.delay.codec_onnx import OnnxCodec, resolve_provider
from moss_npu_verify.make_test_codec import main as make_test_codec
from moss_npu.errors import AudioError, CheckpointError, DeviceError, InputError


@pytest.fixture(scope="module")
def codec_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("codec")
    assert make_test_codec([str(folder)]) == 0
    return folder


@pytest.fixture(scope="module")
def codec(codec_dir):
    return OnnxCodec(codec_dir, "cpu")


def test_graphs_have_the_official_io(codec):
    enc, dec = codec.encoder.session, codec.decoder.session
    assert [i.name for i in enc.get_inputs()] == ["input_values", "n_quantizers"]
    assert [i.name for i in dec.get_inputs()] == ["audio_codes", "n_quantizers"]
    assert enc.get_inputs()[1].shape == [] and dec.get_inputs()[1].shape == []


def test_encode_pads_to_whole_frames(codec):
    codes = codec.encode(np.random.RandomState(0).randn(1920 * 2 + 7).astype(np.float32) * 0.1)
    assert codes.shape == (3, 32) and codes.dtype == np.int64
    assert codes.min() >= 0 and codes.max() < 1024


def test_decode_gives_1920_samples_per_frame(codec):
    wave = codec.decode(np.full((4, 32), 512, dtype=np.int64))
    assert wave.shape == (4 * 1920,) and wave.dtype == np.float32


def test_a_32_by_32_block_is_read_frames_first(codec):
    codes = np.tile(np.arange(32)[:, None] * 30, (1, 32))  # frame t: code 30 t in every codebook
    peaks = np.abs(codec.decode(codes).reshape(32, 1920)).max(axis=1)
    assert np.all(np.diff(peaks) > 0)  # loudness grows with the frame index, so time was axis 0


@pytest.mark.parametrize("codes, message", [
    (np.full((3, 32), 1024), "pad or out-of-range"),
    (np.zeros((32, 3), dtype=np.int64), "expected integer"),
    (np.zeros((0, 32), dtype=np.int64), "frames >= 1"),
    (np.zeros((2, 32), dtype=np.float32), "expected integer"),
], ids=["pad", "codebooks-first", "empty", "float"])
def test_decode_rejects_bad_codes(codec, codes, message):
    with pytest.raises(InputError, match=message):
        codec.decode(codes)


def test_encode_rejects_stereo_and_empty(codec):
    with pytest.raises(AudioError):
        codec.encode(np.zeros((2, 100), dtype=np.float32))
    with pytest.raises(AudioError):
        codec.encode(np.zeros(0, dtype=np.float32))


def test_a_provider_that_is_not_installed_is_an_error(monkeypatch):
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    with pytest.raises(DeviceError, match="CUDAExecutionProvider is not in this onnxruntime build.*onnxruntime-gpu"):
        resolve_provider("cuda")
    with pytest.raises(DeviceError, match="CANNExecutionProvider.*onnxruntime-cann"):
        resolve_provider("npu")
    with pytest.raises(DeviceError, match="unknown"):
        resolve_provider("tpu")


def test_auto_takes_an_installed_accelerator_else_cpu(monkeypatch):
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert resolve_provider("auto") == "CPUExecutionProvider"
    monkeypatch.setattr(onnxruntime, "get_available_providers",
                        lambda: ["CANNExecutionProvider", "CPUExecutionProvider"])
    assert resolve_provider("auto") == "CANNExecutionProvider"


def test_a_provider_that_fails_to_start_is_not_a_quiet_cpu_run(codec_dir, monkeypatch):
    """ORT drops a provider whose libraries fail to load and runs on the CPU; the runner refuses that."""
    import onnxruntime

    real = onnxruntime.InferenceSession

    def session(path, sess_options=None, providers=None):
        return real(path, sess_options=sess_options, providers=["CPUExecutionProvider"])

    monkeypatch.setattr(onnxruntime, "get_available_providers",
                        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(onnxruntime, "InferenceSession", session)
    with pytest.raises(DeviceError, match="failed to initialise"):
        OnnxCodec(codec_dir, "cuda")


def test_missing_graph(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        OnnxCodec(tmp_path, "cpu")


def test_a_graph_that_is_not_onnx(tmp_path, codec_dir):
    (tmp_path / "encoder.onnx").write_bytes(b"not onnx")
    (tmp_path / "decoder.onnx").write_bytes((codec_dir / "decoder.onnx").read_bytes())
    with pytest.raises(CheckpointError, match="cannot load"):
        OnnxCodec(tmp_path, "cpu")


def test_missing_onnxruntime_names_the_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(DeviceError, match="pip install onnxruntime"):
        codec_onnx.import_onnxruntime()
