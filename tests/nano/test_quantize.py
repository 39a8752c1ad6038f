"""Int8 weight-only quantization (cpu.quantize): the block weights land on a per-row int8 grid, every other
weight stays, it is refused where its kernel cannot run, and the CPU step decodes it with the int8 kernel close
to the float32 math on the same rounded weights."""

import copy

import pytest
import torch

from moss_npu.errors import InputError
from moss_npu.nano.decoder import FrameDecoder, RequestParams
from moss_npu.nano.step import TorchStep
from moss_npu.cpu.quantize import int8_kernel_available, int8_rows, quantize_int8

from tests.optional import needs

from .test_decoder import model, prompts  # noqa: F401 - the tiny steered model and its prompts (fixtures)

needs_kernel = needs(int8_kernel_available(), "torch has no _weight_int8pack_mm")


def test_int8_rows_round_to_the_nearest_grid_point():
    weight = torch.randn(6, 40)
    values, scale = int8_rows(weight)
    assert values.dtype == torch.int8 and int(values.abs().max()) == 127
    torch.testing.assert_close(scale, weight.abs().amax(1) / 127)
    assert bool(((values.float() * scale[:, None] - weight).abs() <= scale[:, None] / 2 + 1e-7).all())


@needs_kernel
def test_quantize_rounds_the_block_weights_only(model):
    quantized = copy.deepcopy(model)
    quantize_int8(quantized)
    assert quantized.quantization == "int8" and model.quantization == "none"
    rounded = {id(layer.weight) for layer in quantized.parts().block_linears()}
    for (name, before), after in zip(model.state_dict().items(), quantized.state_dict().values()):
        if id(dict(quantized.named_parameters()).get(name)) in rounded:
            values, scale = int8_rows(after)
            torch.testing.assert_close(values.float() * scale[:, None], after)  # already on its grid
            assert not torch.equal(before, after)
        else:
            assert torch.equal(before, after), name


def test_quantize_is_refused_off_the_cpu_float32_path(model):
    with pytest.raises(InputError, match="float32"):
        quantize_int8(copy.deepcopy(model).to(torch.bfloat16))


@needs_kernel
def test_int8_step_decodes_close_to_float32_math_on_the_rounded_weights(model, prompts):
    quantized = copy.deepcopy(model)
    quantize_int8(quantized)
    hidden = []
    for use_int8 in (True, False):
        decoder = FrameDecoder(quantized, slots=1, max_len=256)
        assert decoder.frame_step.int8
        if not use_int8:
            decoder.frame_step = TorchStep(decoder.model)  # the torch modules: float32 math on the same rounded weights
        decoder.admit(prompts[0], RequestParams(max_new_frames=2))
        decoder.step()
        decoder.step()  # runs the first frame's deferred global step: the hidden state is past the prefill
        hidden.append(decoder.state.hidden.clone())
    torch.testing.assert_close(hidden[0], hidden[1], rtol=5e-2, atol=5e-2)  # bf16 activations in the kernel
    assert not torch.equal(hidden[0], hidden[1])


@needs_kernel
def test_int8_step_decodes_a_batch(model, prompts):
    quantized = copy.deepcopy(model)
    quantize_int8(quantized)
    decoder = FrameDecoder(quantized, slots=2, max_len=256)
    for rows in prompts[:2]:
        decoder.admit(rows, RequestParams(max_new_frames=2))
    frames = [decoder.step().codes for _ in range(2)]
    assert all(bool((f[:2] != quantized.config.audio_pad_token_id).any()) for f in frames)
