"""The floor of each part of a frame: the bytes the part reads per frame over the rate this machine reads a buffer
of that part's size at, on the same threads (``bench.bandwidth``'s probe). The local layer fits the last-level
cache on the machines measured (27 MiB in float32), so its probe reads a cache-resident buffer; the global stack
(324 MiB) and the codec come from DRAM. A part at its floor cannot go faster without reading fewer bytes.

Bytes per frame, from the model's shapes (weights at the width the kernels read: float32 4, bf16 2, int8 1 for the
blocks' products):

* global: the 12 blocks once, plus the keys and values attended (at the mean length over the run);
* local: the local block once per step (the text step and one per audio channel; the audio steps take their first
  product from a table, so they skip ``c_attn``), plus each channel's head;
* codec: its decoder's weights once per call, shared by the frames of that call.
"""

from __future__ import annotations

from typing import Callable, Optional

WIDTH = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


def _bytes(module, width: int) -> int:
    return sum(p.numel() for p in module.parameters()) * width


def part_bytes(tts, prompt_rows: int, frames: int, codec_calls: int) -> dict[str, tuple[float, int]]:
    """Per part (global, local, codec): (bytes read per frame, bytes of the weights it reads: the probe's size)."""
    import torch

    from moss_npu.cpu.quantize import dtype_name

    model, name = tts.model, dtype_name(tts.model)
    width = WIDTH.get(name, 4)
    heads_width = 4 if name == "int8" else width  # int8 rounds the blocks' products only
    stack = _bytes(model.transformer.h, width)
    hidden, layers = model.transformer.wte.weight.shape[1], len(model.transformer.h)
    kv_width = torch.empty((), dtype=model.dtype).element_size()
    kv = 2 * layers * hidden * kv_width * (prompt_rows + frames / 2)
    block = _bytes(model.local_transformer.h, width)
    first = sum(_bytes(b.attn.c_attn, width) for b in model.local_transformer.h)
    heads = [_bytes(h, heads_width) for h in model.audio_lm_heads]
    local = (len(heads) + 1) * block - len(heads) * first + sum(heads)
    codec = _bytes(tts.codec.decoder, 4) + _bytes(tts.codec.quantizer, 4)
    return {"global": (stack + kv, stack), "local": (local, block),
            "codec": (codec * codec_calls / max(frames, 1), codec)}


class Probe:
    """``bench.bandwidth.read_bandwidth`` per (threads, size), each measured once."""

    def __init__(self, read: Optional[Callable] = None) -> None:
        if read is None:
            from bench.bandwidth import read_bandwidth as read
        self.read, self.rates = read, {}

    def gb_s(self, threads: int, size: int) -> Optional[float]:
        mib = max(1, round(size / 2**20))
        if (threads, mib) not in self.rates:
            rates = self.read((threads,), mib)
            self.rates[(threads, mib)] = None if rates is None else rates[threads]
        return self.rates[(threads, mib)]


def floors(parts: dict[str, tuple[float, int]], threads: dict[str, int], probe: Probe) -> dict:
    """Per part: bytes per frame, the probe's GB/s over a buffer of its size on the part's ``threads``, and the
    floor in ms per frame (None where the kernels that probe are not installed)."""
    out = {}
    for part, (per_frame, size) in parts.items():
        rate = probe.gb_s(threads[part], size)
        out[part] = {"mb_per_frame": per_frame / 1e6, "probe_mib": max(1, round(size / 2**20)),
                     "threads": threads[part], "gb_s": rate,
                     "floor_ms": None if rate is None else per_frame / rate / 1e6}
    return out
