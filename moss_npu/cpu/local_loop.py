"""A frame's audio channels for n slots in one call of the package's C library (``local_loop.c``).

Each audio channel is a local block step, a head, a sampling decision and two table lookups, whose calls between
kernels in Python cost about as much as the products (docs/performance.md). ``LocalLoop`` runs a frame's channels
for n rows in one call: the blocks through ``FusedRowBlock``'s C code, the heads through their tiles, the penalty
and greedy argmax or sampling in C (``sampling.py``'s filters, then ``torch.multinomial``'s pick with the Exp(1)
variates torch drew, or ``sample_with_noise``'s with a uniform).
A row's blocks and heads give the bits the one-slot step gives (so greedy codes are today's); sampled codes differ
from torch's only where two ids' p / q, a uniform and a CDF boundary, or the mass and top_p lie within rounding.
Shapes: n rows, S slots, E hidden, Q channels, V codebook size, M local cache rows (Q + 1).
"""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import numpy as np

from moss_npu.cpu.fused_block import FusedRowBlock, _Block, _Product
from moss_npu.cpu.matvec import FORMATS, MatVecKernels, Tiles
from moss_npu.native.library import line_aligned, require
from moss_npu.sampling import TokenParams

_POINTER, _LONG, _INT = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


class _Loop(ctypes.Structure):
    """local_loop.c's LocalLoop."""

    _fields_ = [("blocks", _POINTER), ("layers", _LONG), ("head_format", _INT), ("heads", _POINTER),
                ("vocab", _POINTER), ("embeddings", _POINTER), ("qkv", _POINTER), ("channels", _LONG)]


class _Sampling(ctypes.Structure):
    """local_loop.c's Sampling: per-row parameters and uniforms."""

    _fields_ = [("do_sample", _POINTER), ("temperature", _POINTER), ("top_p", _POINTER), ("penalty", _POINTER),
                ("top_k", _POINTER), ("noise", _POINTER), ("noise_width", _LONG), ("exponential", _POINTER),
                ("exponential_width", _LONG)]


def decide(kernels: MatVecKernels, logits: np.ndarray, seen: np.ndarray, params: TokenParams, uniform: float,
           exponential: Optional[np.ndarray] = None) -> int:
    """Return the library's code for one row of float32 ``logits`` (V,) whose ids ``seen`` (V,) bool the channel
    has produced, drawn with ``exponential`` (V,) float32 Exp(1) variates where given, else with ``uniform``: what
    a frame's channel decides (``LocalLoop``), one row at a time, for the checks against ``sampling``."""
    library = kernels.library
    library.moss_local_decide.argtypes = ([_POINTER, _LONG, _POINTER, _INT, ctypes.c_float, ctypes.c_int64]
                                          + [ctypes.c_float] * 3 + [_POINTER] * 2)
    library.moss_local_decide.restype = _LONG
    vocab = logits.shape[0] if getattr(logits, "ndim", 0) == 1 else -1
    require(logits, np.float32, (vocab,), "logits")
    require(seen, np.bool_, (vocab,), "seen")
    if exponential is not None:
        require(exponential, np.float32, (vocab,), "exponential")
    scratch = np.empty(4 * vocab, np.float32)
    temperature = params.temperature if params.do_sample else 1.0
    return library.moss_local_decide(logits.ctypes.data, vocab, seen.ctypes.data, params.do_sample, temperature,
                                     params.top_k, params.top_p, params.repetition_penalty, uniform,
                                     None if exponential is None else exponential.ctypes.data, scratch.ctypes.data)


def _pointers(arrays: Sequence[np.ndarray]) -> ctypes.Array:
    return (_POINTER * max(1, len(arrays)))(*(a.ctypes.data for a in arrays))


class LocalLoop:
    """The audio channels of a frame in one C call (see the module docstring), over the local decoder's fused
    ``blocks`` (the final norm on the last), the channels' ``heads`` (tiles of one format) and ``embeddings``
    (Q float32 tables (V, E), the next inputs). Raises ValueError for parts it cannot run."""

    def __init__(self, kernels: MatVecKernels, blocks: Sequence[FusedRowBlock], heads: Sequence[Tiles],
                 embeddings: Sequence[np.ndarray]) -> None:
        if not blocks or len(heads) != len(embeddings) or not heads:
            raise ValueError(f"a local loop needs blocks and one head per embedding table, got {len(blocks)} blocks, "
                             f"{len(heads)} heads, {len(embeddings)} tables")
        formats = {h.format for h in heads}
        if len(formats) != 1 or not all(isinstance(h, Tiles) for h in heads):
            raise ValueError(f"a local loop needs every head in tiles of one format, got {sorted(map(str, formats))}")
        e = blocks[0].embed
        for c, (head, table) in enumerate(zip(heads, embeddings)):
            if head.in_features != e:
                raise ValueError(f"head {c} reads {head.in_features} features; the blocks give {e}")
            require(table, np.float32, (head.out_features, e), f"embedding table {c}")
        self.embed, self.heads, self.dim, self.layers = e, blocks[0].heads, blocks[0].dim, len(blocks)
        self.channels, self.vocab = len(heads), [h.out_features for h in heads]
        self._blocks = (_Block * len(blocks))(*(b._spec for b in blocks))
        self._heads = (_Product * len(heads))(*(_Product(*h.fields()) for h in heads))
        self._vocab = np.array(self.vocab, dtype=ctypes.c_long)
        self._embeddings = _pointers(embeddings)
        self._kept = (list(blocks), list(heads), list(embeddings))  # the library reads them
        self._spec = _Loop(ctypes.addressof(self._blocks), len(blocks), FORMATS[formats.pop()],
                           ctypes.addressof(self._heads), self._vocab.ctypes.data, ctypes.addressof(self._embeddings),
                           None, len(heads))
        self._tables: tuple = ((), None)  # the qkv tables last given and their pointers
        self._kernels, self._library = kernels, kernels.library
        library = self._library
        library.moss_local_audio.argtypes = ([_POINTER, _POINTER, _LONG, _LONG, _LONG, _POINTER, _LONG, _LONG]
                                             + [_POINTER] * 5 + [_LONG] + [_POINTER] * 5)
        library.moss_local_audio.restype = _INT
        library.moss_local_audio_scratch.argtypes = [_POINTER, _LONG, _LONG]
        library.moss_local_audio_scratch.restype = _LONG

    def _qkv_tables(self, tables: Sequence[np.ndarray]) -> None:
        """Point the loop at ``tables`` (Q - 1 of (V, 3E)), checked when they are not the last ones given."""
        if [t.ctypes.data for t in tables] == [t.ctypes.data for t in self._tables[0]]:
            return
        if len(tables) != self.channels - 1:
            raise ValueError(f"{len(tables)} qkv tables for {self.channels} channels; one per channel but the last")
        for c, table in enumerate(tables):
            require(table, np.float32, (self.vocab[c], 3 * self.embed), f"qkv table {c}")
        pointers = _pointers(tables)
        self._tables = (list(tables), pointers)
        self._spec.qkv = ctypes.addressof(pointers)

    def __call__(self, first: np.ndarray, first_qkv: np.ndarray, tables: Sequence[np.ndarray], cache: np.ndarray,
                 rotation: np.ndarray, start: int, channels: int, sampling: dict[str, np.ndarray],
                 noise: np.ndarray, seen: np.ndarray, nq: np.ndarray, embed: np.ndarray,
                 exponential: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
        """Decide channels [0, ``channels``) for rows [0, n) and return their codes (n, channels) int64 (also past a
        row's ``nq``: the caller pads those) and whether every logits row below ``nq`` was finite (n,) bool.

        ``first`` (n, E) and ``first_qkv`` (n, 3E) are channel 0's inputs; ``tables`` the Q - 1 qkv tables;
        ``cache`` (layers, 2, S, H, M, D) the local keys/values, row r in slot r, written at local positions
        ``start`` onwards; ``rotation`` (M, D/2) complex64 the local RoPE table; ``sampling`` the rows' arrays
        ``do_sample`` (bool), ``temperature``, ``top_p``, ``penalty`` (float32), ``top_k`` (int64);
        ``noise`` (n, Q + 1) float32 uniforms (channel c at c + 1), or ``exponential`` (n, Q, W >= V) float32 the
        official sampler's Exp(1) variates; ``seen`` (S, Q, W >= V) bool; ``nq`` (n,)
        int64. Each code's embedding below ``nq`` is added to ``embed`` (n, E) in place. Every array is checked
        first (ValueError)."""
        n, e = first.shape[0] if getattr(first, "ndim", 0) == 2 else -1, self.embed
        slots, rows = (cache.shape[2], cache.shape[4]) if getattr(cache, "ndim", 0) == 6 else (-1, -1)
        require(first, np.float32, (n, e), "first")
        require(first_qkv, np.float32, (n, 3 * e), "first_qkv")
        require(embed, np.float32, (n, e), "embed")
        require(cache, np.float32, (self.layers, 2, slots, self.heads, rows, self.dim), "cache")
        require(rotation, np.complex64, (rows, self.dim // 2), "rotation")
        require(noise, np.float32, (n, self.channels + 1), "noise")
        require(nq, np.int64, (n,), "nq")
        if exponential is not None:
            require(exponential, np.float32, (n, self.channels, max(max(self.vocab), exponential.shape[-1])),
                    "exponential")
        if seen.ndim != 3 or seen.shape[2] < max(self.vocab):
            raise ValueError(f"seen: (S, {self.channels}, >= {max(self.vocab)}) expected, got {seen.shape}")
        require(seen, np.bool_, (slots, self.channels, seen.shape[2]), "seen")
        for name, dtype in (("do_sample", np.bool_), ("temperature", np.float32), ("top_p", np.float32),
                            ("penalty", np.float32), ("top_k", np.int64)):
            require(sampling[name], dtype, (n,), name)
        if not (0 < n <= slots and 0 < channels <= self.channels and 0 <= start and start + channels <= rows):
            raise ValueError(f"{n} rows, channels {start}..{start + channels} do not fit {slots} slots of {rows} "
                             f"local rows and {self.channels} channels")
        self._qkv_tables(tables)
        drawn = (None, 0) if exponential is None else (exponential.ctypes.data, exponential.shape[-1])
        rates = _Sampling(*(sampling[name].ctypes.data for name in ("do_sample", "temperature", "top_p", "penalty",
                                                                     "top_k")), noise.ctypes.data, noise.shape[1],
                          *drawn)
        spec = ctypes.byref(self._spec)
        scratch = line_aligned(self._library.moss_local_audio_scratch(spec, n, start + channels))
        codes, finite = np.empty((n, channels), np.int64), np.empty(n, np.bool_)
        status = self._library.moss_local_audio(
            self._kernels.threads.handle, spec, n, start, channels, cache.ctypes.data, slots, rows,
            rotation.ctypes.data, first.ctypes.data, first_qkv.ctypes.data, ctypes.byref(rates), seen.ctypes.data,
            seen.shape[2], nq.ctypes.data, codes.ctypes.data, finite.ctypes.data, embed.ctypes.data,
            scratch.ctypes.data)
        if status != 0:
            raise ValueError(f"the local loop refused {n} rows of channels {start}..{start + channels}")
        return codes, finite
