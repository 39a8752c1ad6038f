"""What a frame decoder derives from the model's weights, prepared once per loaded model: the local decoder's
first-layer tables (``reuse.audio_qkv_tables``) and, for a float32 CPU model, the CPU step (``cpu.step``).

A pipeline prepares them when it loads and hands them to every decoder it makes; a decoder made without them, or
after the weights changed (``current``), builds its own. For a model loaded from a checkpoint the CPU arrays come
from the prepared-weights cache (``cpu.prepared``), keyed by ``cache_key``; oneDNN's packed copies cannot be
written out and are packed again at every start (docs/performance.md#start-up).
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from moss_npu.cpu.matvec import GROUP, TILE
from moss_npu.cpu.targets import kernels_in_use
from moss_npu.native.library import cpu_identity
from moss_npu.cpu.prepared import PreparedArena, StaleEntry, WeightCache, entry_key, fresh_arena
from moss_npu.cpu.step import CpuStep
from moss_npu.device import backend
from moss_npu.origin import origin_identity, weights_state
from moss_npu.nano.model import NanoTTSModel
from moss_npu.nano.reuse import audio_qkv_bytes, audio_qkv_tables
from moss_npu.nano.step import TorchStep

log = logging.getLogger(__name__)

Arenas = Callable[[str, int], PreparedArena]  # (entry name, bytes) -> the arena to prepare it in


@dataclass(frozen=True)
class DecoderWeights:
    """The weight-derived parts of a frame decoder. ``source`` says where the CPU arrays came from, for reports:
    ``WeightCache.sources``' words, ``computed`` (not cached) or ``none`` (not a CPU model)."""

    audio_qkv: tuple[torch.Tensor, ...]
    frame_step: "CpuStep | TorchStep"  # what the decoder's blocks run through (``Backend.frame_step``)
    compiled: bool  # built for --compile on
    state: tuple  # ``origin.weights_state`` of the model they were built from
    source: str

    @classmethod
    @torch.inference_mode()
    def build(cls, model: NanoTTSModel, compile_mode: str = "auto", cache: bool = False,
              label: str = "the model") -> "DecoderWeights":
        """Prepare the parts from ``model``'s current weights; with ``cache``, read and write the CPU arrays in the
        prepared-weights cache where the model still holds a checkpoint's weights (``label`` names it in the one
        line that says the cache is being built)."""
        cpu = backend(model.device).host and model.dtype == torch.float32
        key = cache_key(model, compile_mode) if cache and cpu else None
        if key is None:
            return cls._build(model, compile_mode, lambda name, nbytes: fresh_arena(nbytes),
                              "computed" if cpu else "none")
        store = WeightCache(key)
        try:
            return cls._build(model, compile_mode, lambda name, nbytes: store.arena(name, nbytes, label), store)
        except StaleEntry as exc:
            log.warning("the prepared CPU weights of %s in %s do not match this build (%s); preparing them in memory",
                        label, store.folder, exc)
            return cls._build(model, compile_mode, lambda name, nbytes: fresh_arena(nbytes), "computed")

    @classmethod
    def _build(cls, model: NanoTTSModel, compile_mode: str, arenas: Arenas,
               store: WeightCache | str) -> "DecoderWeights":
        """Build the parts with arrays from ``arenas``; ``store``: the cache to save built arenas in (and to ask
        where they came from), or the source to report."""
        cpu = backend(model.device).host and model.dtype == torch.float32
        tables = arenas("tables", audio_qkv_bytes(model)) if cpu else None
        audio_qkv = audio_qkv_tables(model, None if tables is None else tables.array)
        step = backend(model.device).frame_step(model.parts(), compile_mode,
                                                arena=lambda nbytes: arenas("tiles", nbytes)) or TorchStep(model)
        built = [("tables", tables), ("tiles", step.tile_arena)]
        for name, arena in built:
            if arena is not None:
                arena.finish()
                if isinstance(store, WeightCache):
                    store.save(name, arena)
        step.pack(batched=False)  # every prompt's prefill multiplies by the global blocks
        source = store if isinstance(store, str) else _source(store, [name for name, arena in built if arena])
        return cls(audio_qkv, step, compile_mode == "on", weights_state(model), source)

    def current(self, model: NanoTTSModel, compile_mode: str) -> bool:
        """Whether these parts still belong to ``model``'s weights (unchanged since) and ``compile_mode``."""
        return self.compiled == (compile_mode == "on") and self.state == weights_state(model)


def _source(store: WeightCache, names: list[str]) -> str:
    sources = {store.sources[name] for name in names}
    return sources.pop() if len(sources) == 1 else ", ".join(sorted(sources))


def cache_key(model: NanoTTSModel, compile_mode: str) -> Optional[str]:
    """Return the prepared-weights cache key of ``model``, naming what its prepared CPU arrays depend on (the
    checkpoint, the weight format, and torch's and the CPU's rounding), or None where they are not cached: weights
    that are no longer a checkpoint's as loaded, or compiled blocks (a measurement mode)."""
    identity = origin_identity(model)
    if identity is None or compile_mode == "on":
        return None
    return entry_key({"checkpoint": identity, "weights": getattr(model, "weight_dtype", "float32"),
                      "quantization": getattr(model, "quantization", "none"), "kernels": kernels_in_use(),
                      "tiles": f"{TILE}x{GROUP}", "torch": torch.__version__, "numpy": np.__version__,
                      "machine": platform.machine(), "cpu": cpu_identity()})
