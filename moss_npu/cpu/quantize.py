"""Reduced-precision weights on the CPU, opt-ins: int8 (``--quantize int8``) and bf16 (``--dtype bfloat16``).

int8 rounds each block linear of both decoders to a symmetric int8 grid (one scale per output channel) and writes
the rounded values back into the float32 parameters, so every path computes with exactly the quantized weights;
the CPU step then reads the int8 values themselves. bf16 rounds every parameter to bf16 and keeps the model
float32: bf16 weights, float32 arithmetic. docs/performance.md#reduced-precision-on-the-cpu says what each runs.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from moss_npu.errors import InputError
from moss_npu.origin import origin_identity, stamp_origin

QUANTIZE_MODES = ("none", "int8")


def int8_kernel_available() -> bool:
    """Return whether this torch has the CPU int8 weight-only matmul the frame step uses."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (out, in) float ``weight`` as int8 values and their per-row float32 scales (symmetric, max/127)."""
    scale = weight.abs().amax(dim=1).float().clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    values = torch.round(weight.float() / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return values, scale


def check_int8(device: torch.device, dtype: torch.dtype) -> None:
    """Raise InputError unless int8 quantization can run for a model in ``dtype`` on ``device`` (before loading)."""
    if device.type != "cpu" or dtype != torch.float32:
        raise InputError(f"--quantize int8 runs on the CPU in float32, not "
                         f"{str(dtype).removeprefix('torch.')} on {device}: use --device cpu --dtype float32")
    if not int8_kernel_available():
        raise InputError(f"--quantize int8 needs torch >= 2.4 (torch.ops.aten._weight_int8pack_mm); this is "
                         f"torch {torch.__version__}: upgrade torch or leave --quantize at none")


def quantize_int8(model: nn.Module) -> None:
    """Round the block weights of ``model`` (one with ``parts()``: ``cpu.contract``) to int8 in place; mark it
    ``int8``. InputError unless the model is float32 on the CPU and this torch has the int8 kernel."""
    parts = model.parts()
    check_int8(parts.local_norm.weight.device, parts.local_norm.weight.dtype)
    origin = origin_identity(model)
    with torch.no_grad():
        for layer in parts.block_linears():
            values, scale = int8_rows(layer.weight)
            layer.weight.copy_(values.float() * scale[:, None])
    model.quantization = "int8"
    if origin is not None:  # still the checkpoint's weights, rounded by this step
        stamp_origin(model, f"{origin}:int8")


def store_bf16(model: nn.Module) -> None:
    """Round every parameter of a float32 CPU ``model`` to its nearest bf16 value in place; mark it
    ``weight_dtype = "bfloat16"``."""
    weight = next(model.parameters())
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        raise InputError(f"bf16 weights with float32 arithmetic are a CPU float32 model's; this one is "
                         f"{weight.dtype} on {weight.device}")
    origin = origin_identity(model)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.to(torch.bfloat16).float())
    model.weight_dtype = "bfloat16"
    if origin is not None:  # still the checkpoint's weights, rounded by this step
        stamp_origin(model, f"{origin}:bf16")


def dtype_name(model: nn.Module) -> str:
    """Return the dtype a user asked ``model`` for: ``bfloat16`` for bf16 weights with float32 arithmetic
    (``store_bf16``), else the parameters' dtype (``float32``, ``bfloat16`` on an accelerator, ...)."""
    if getattr(model, "weight_dtype", "float32") == "bfloat16":
        return "bfloat16"
    return str(next(model.parameters()).dtype).removeprefix("torch.")
