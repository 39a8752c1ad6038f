"""What the CPU path reads of a decoder model: the parts a model's own package hands over (``NanoTTSModel.parts``),
so that cpu/ depends on no model class. The parts are the model's own modules: the CPU step reads their
parameters in place or copies them, and quantization rounds them in place."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn


@dataclass(frozen=True)
class BlockParts:
    """One pre-norm GPT-2 block: ``x + c_proj(attention(c_attn(ln_1(x))))``, then ``x + fc_out(gelu(fc_in(ln_2(x))))``
    (``cpu.blocks.block_step``); ``scale`` multiplies the attention scores."""

    ln_1: nn.LayerNorm
    c_attn: nn.Linear
    c_proj: nn.Linear
    ln_2: nn.LayerNorm
    fc_in: nn.Linear
    fc_out: nn.Linear
    scale: float

    def linears(self) -> tuple[nn.Linear, ...]:
        """The four products, in reading order."""
        return self.c_attn, self.c_proj, self.fc_in, self.fc_out


@dataclass(frozen=True)
class DecoderParts:
    """A model's global and local decoders (blocks and final norms), its audio heads and the audio channels' input
    embeddings, and how its weights are held: ``weight_dtype`` float32, or ``bfloat16``/``int8`` values kept in
    float32 parameters (``cpu.quantize``)."""

    global_blocks: tuple[BlockParts, ...]
    local_blocks: tuple[BlockParts, ...]
    global_norm: nn.LayerNorm
    local_norm: nn.LayerNorm
    heads: tuple[nn.Linear, ...]
    embeddings: tuple[nn.Embedding, ...]
    n_head: int
    eps: float
    tanh_gelu: bool  # the blocks' activation is the tanh GELU, the one ``block_step`` writes out
    weight_dtype: str = "float32"

    def block_linears(self, local: bool = True) -> list[nn.Linear]:
        """Every block's products of both decoders (or, ``local`` False, of the global one), in reading order."""
        blocks = self.global_blocks + (self.local_blocks if local else ())
        return [layer for block in blocks for layer in block.linears()]
