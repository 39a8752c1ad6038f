"""Write a tiny TEST codec (``encoder.onnx`` / ``decoder.onnx``) with the official I/O layout.

``python -m moss_npu_verify.make_test_codec DIR``. These graphs make noise, not speech: they exist so that
the ONNX runner, the CLI and CI can run end to end without the 1.5 GB MOSS-Audio-Tokenizer-ONNX download.
Layout as docs/delay.md#codec: encoder ``input_values (B, 1, S)`` float32 + ``n_quantizers`` 0-d int64 ->
codes ``(Q, B, S / 1920)`` int64 + lengths ``(B,)``; decoder ``audio_codes (Q, B, T)`` + ``n_quantizers`` ->
audio ``(B, 1, T * 1920)`` float32 + lengths ``(B,)``. Codebooks at or above ``n_quantizers`` read 0,
as the real graphs mask them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import numpy as np

FRAME_SAMPLES = 1920
N_QUANTIZERS = 32
CODEBOOK_SIZE = 1024
OPSET = 17
IR_VERSION = 8  # loadable by onnxruntime releases from 2021 on


def _const(name: str, value: np.ndarray):
    from onnx import helper, numpy_helper

    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value), name))


def encoder_model():
    """Return the test encoder: per frame, a code from the frame's mean amplitude, shifted per codebook."""
    from onnx import TensorProto, helper

    n = helper.make_node
    nodes = [
        _const("frame_shape", np.array([0, -1, FRAME_SAMPLES], dtype=np.int64)),
        _const("scale", np.array(1000.0, dtype=np.float32)),
        _const("book_offsets", (np.arange(N_QUANTIZERS, dtype=np.int64) * 37).reshape(N_QUANTIZERS, 1, 1)),
        _const("book_index", np.arange(N_QUANTIZERS, dtype=np.int64).reshape(N_QUANTIZERS, 1, 1)),
        _const("codebook", np.array(CODEBOOK_SIZE, dtype=np.int64)),
        _const("zero", np.array(0, dtype=np.int64)),
        _const("axis0", np.array([0], dtype=np.int64)),
        n("Reshape", ["input_values", "frame_shape"], ["frames"]),              # (B, T, 1920)
        n("ReduceMean", ["frames"], ["level"], axes=[2], keepdims=0),            # (B, T)
        n("Abs", ["level"], ["magnitude"]),
        n("Mul", ["magnitude", "scale"], ["scaled"]),
        n("Cast", ["scaled"], ["base"], to=TensorProto.INT64),
        n("Unsqueeze", ["base", "axis0"], ["base_q"]),                           # (1, B, T)
        n("Add", ["base_q", "book_offsets"], ["shifted"]),                       # (Q, B, T)
        n("Mod", ["shifted", "codebook"], ["codes_all"]),
        n("Less", ["book_index", "n_quantizers"], ["kept"]),
        n("Where", ["kept", "codes_all", "zero"], ["audio_codes"]),
        n("Shape", ["frames"], ["frames_shape"]),
        n("Slice", ["frames_shape", "axis0", "one_end"], ["batch"]),
        _const("one_end", np.array([1], dtype=np.int64)),
        _const("two", np.array([1], dtype=np.int64)),
        _const("three", np.array([2], dtype=np.int64)),
        n("Slice", ["frames_shape", "two", "three"], ["n_frames"]),
        n("Expand", ["n_frames", "batch"], ["audio_codes_lengths"]),
    ]
    nodes = _topological(nodes)
    graph = helper.make_graph(
        nodes, "moss_npu_test_codec_encoder",
        [helper.make_tensor_value_info("input_values", TensorProto.FLOAT, ["batch", 1, "samples"]),
         helper.make_tensor_value_info("n_quantizers", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("audio_codes", TensorProto.INT64, [N_QUANTIZERS, "batch", "frames"]),
         helper.make_tensor_value_info("audio_codes_lengths", TensorProto.INT64, ["batch"])],
    )
    return _model(graph)


def decoder_model():
    """Return the test decoder: each frame is a fixed 1920-sample tone scaled by its mean code."""
    from onnx import TensorProto, helper

    n = helper.make_node
    tone = (0.5 * np.sin(2 * np.pi * 440.0 * np.arange(FRAME_SAMPLES) / 24000.0)).astype(np.float32)
    nodes = [
        _const("tone", tone.reshape(1, 1, FRAME_SAMPLES)),
        _const("inv_codebook", np.array(1.0 / CODEBOOK_SIZE, dtype=np.float32)),
        _const("book_index", np.arange(N_QUANTIZERS, dtype=np.int64).reshape(N_QUANTIZERS, 1, 1)),
        _const("zero", np.array(0, dtype=np.int64)),
        _const("axis_last", np.array([2], dtype=np.int64)),
        _const("flat_shape", np.array([0, 1, -1], dtype=np.int64)),
        _const("second", np.array([1], dtype=np.int64)),
        _const("third", np.array([2], dtype=np.int64)),
        _const("third_end", np.array([3], dtype=np.int64)),
        _const("frame_len", np.array([FRAME_SAMPLES], dtype=np.int64)),
        n("Less", ["book_index", "n_quantizers"], ["kept"]),
        n("Where", ["kept", "audio_codes", "zero"], ["used"]),                   # (Q, B, T)
        n("Cast", ["used"], ["used_f"], to=TensorProto.FLOAT),
        n("ReduceMean", ["used_f"], ["level"], axes=[0], keepdims=0),             # (B, T)
        n("Mul", ["level", "inv_codebook"], ["gain"]),
        n("Unsqueeze", ["gain", "axis_last"], ["gain3"]),                         # (B, T, 1)
        n("Mul", ["gain3", "tone"], ["frames"]),                                  # (B, T, 1920)
        n("Reshape", ["frames", "flat_shape"], ["audio"]),                        # (B, 1, T * 1920)
        n("Shape", ["audio_codes"], ["codes_shape"]),
        n("Slice", ["codes_shape", "second", "third"], ["batch"]),
        n("Slice", ["codes_shape", "third", "third_end"], ["n_frames"]),
        n("Mul", ["n_frames", "frame_len"], ["n_samples"]),
        n("Expand", ["n_samples", "batch"], ["audio_lengths"]),
    ]
    graph = helper.make_graph(
        _topological(nodes), "moss_npu_test_codec_decoder",
        [helper.make_tensor_value_info("audio_codes", TensorProto.INT64, [N_QUANTIZERS, "batch", "frames"]),
         helper.make_tensor_value_info("n_quantizers", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("audio", TensorProto.FLOAT, ["batch", 1, "samples"]),
         helper.make_tensor_value_info("audio_lengths", TensorProto.INT64, ["batch"])],
    )
    return _model(graph)


def _topological(nodes: list) -> list:
    """Order nodes so every input is produced first (constants may be listed anywhere above)."""
    ready = {"input_values", "n_quantizers", "audio_codes"}
    ordered, pending = [], list(nodes)
    while pending:
        node = next(nd for nd in pending if all(i in ready for i in nd.input))
        pending.remove(node)
        ordered.append(node)
        ready.update(node.output)
    return ordered


def _model(graph):
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="moss_npu_verify.make_test_codec", doc_string="TEST codec: noise, not speech")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    return model


def write_test_codec(folder: Path | str) -> tuple[Path, Path]:
    """Write ``encoder.onnx`` and ``decoder.onnx`` into ``folder`` (created if needed); return their paths."""
    import onnx

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / "encoder.onnx", folder / "decoder.onnx"
    for path, model in zip(paths, (encoder_model(), decoder_model())):
        tmp = path.with_suffix(".onnx.tmp")
        try:
            onnx.save(model, str(tmp))
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
    return paths


def main(argv: Optional[list[str]] = None) -> int:
    """CLI: write the test codec under the exit-code policy (moss_npu.cli): 0 written, 2 bad usage or onnx
    missing, 1 a failed write, 130 interrupted."""
    from moss_npu.cli import ArgumentParser, run_cli

    parser = ArgumentParser(prog="python -m moss_npu_verify.make_test_codec",
                            description="Write a tiny TEST codec (noise, not speech) with the official "
                            "MOSS-Audio-Tokenizer ONNX input/output layout. Exit codes: 0 ok, 2 bad usage or onnx "
                            "missing, 1 a failed write, 130 interrupted.")
    parser.add_argument("folder", help="output folder for encoder.onnx and decoder.onnx")

    def body() -> int:
        for path in write_test_codec(parser.parse_args(argv).folder):
            print(path)
        return 0

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
