"""The codec's streamed attention on the CPU in one call of the package's C library (``window_attention.c``).

A streamed codec chunk attends T queries per row and head against the sliding-window ring of its layer
(``codec.streaming.KVCache``). torch's flash attention runs the codec's shapes (32 queries against ~1,900 keys of
64 values) far below the core's FMA rate and attends every ring slot, the ones no query sees too; the library's
kernel lists a head's live keys and keeps scores and outputs in registers: about 2.5x faster with AVX-512 and
1.3x with AVX2 on the codec's last stage (docs/performance.md). It is used where it is faster: float32 on the
AVX-512 and AVX2 targets. The sums run in another order, so the audio agrees with torch's to float rounding.
``write_chunk`` is the step before: the chunk's queries and keys rotated and its keys and values written into the
ring (``codec_ring.c``), the same bits as torch's ops in one call.
Shapes: B rows, H heads, T steps, N ring slots, D head size.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Optional

import torch

from moss_npu.cpu.matvec import KernelThreads
from moss_npu.cpu.targets import choose_target
from moss_npu.native.library import KernelUnavailable, load_library

_POINTER, _LONG = ctypes.c_void_p, ctypes.c_long
FASTER_ON = ("avx512", "avx2")  # the targets where the kernel beats torch's (the portable one does not)


class WindowAttention:
    """The library's streamed window attention for one instruction set; ``load`` returns None where there is none
    or it would be slower than torch's. Each calling thread shares the heads over a pool of its own, of as many
    threads as torch's intra-op setting in that thread."""

    def __init__(self, library: ctypes.CDLL, target: str) -> None:
        self.target = target
        self._call = getattr(library, f"moss_window_attention_{target}")
        self._call.argtypes = [_POINTER] * 8 + [_LONG] * 7 + [ctypes.c_float]
        self._call.restype = ctypes.c_int
        self._library = library
        self._local = threading.local()  # a pool per calling thread: a pool has one caller (KernelThreads)
        self._chunk = library.moss_codec_chunk
        self._chunk.argtypes = [_POINTER] * 9 + [_LONG] * 6
        self._chunk.restype = ctypes.c_int

    @classmethod
    def load(cls) -> Optional["WindowAttention"]:
        """The kernel of the installed library for the instruction set the CPU kernels run, or None (no library,
        or a target where torch's attention is as fast)."""
        try:
            library = load_library()[0]
        except KernelUnavailable:
            return None
        target = choose_target(library)
        return cls(library, target) if target in FASTER_ON else None

    def write_chunk(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor,
                    lengths: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    key_positions: torch.Tensor) -> Optional[torch.Tensor]:
        """Write a streamed chunk into its layer's ring and return its rotated queries ``(B, H, T, D)`` (the library's
        ``codec_ring.c``: the same bits as ``modules.rotate_pairs`` and ``streaming.KVCache.write``, in one pass).
        ``qkv`` ``(B, T, 3·H·D)`` are the in_proj rows, ``rope`` the steps' (cos, sin) ``(B, 1, T, D/2)``,
        ``positions`` ``(B, T)`` and ``lengths`` ``(B,)`` as in ``__call__``; the ring ``keys``/``values``
        ``(B', H, N, D)`` and ``key_positions`` ``(B', N)``, rows [0, B) written. None, with nothing written, where
        the tensors do not fit (another dtype or layout): the caller then writes with torch."""
        b, t = qkv.shape[:2]
        _, heads, slots, dim = keys.shape
        cos, sin = rope
        floats = (qkv, cos, sin, keys, values)
        if (any(x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous() for x in floats)
                or qkv.shape != (b, t, 3 * heads * dim) or values.shape != keys.shape or keys.shape[0] < b
                or cos.shape != (b, 1, t, dim // 2) or sin.shape != cos.shape or key_positions.dtype != torch.int64
                or not key_positions.is_contiguous() or key_positions.shape != (keys.shape[0], slots)
                or positions.shape != (b, t) or lengths.shape != (b,)):
            return None
        positions = positions.to(torch.int64).contiguous()
        lengths = lengths.to(torch.int64).contiguous()
        queries = torch.empty(b, heads, t, dim, dtype=torch.float32)
        status = self._chunk(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), lengths.data_ptr(),
                             queries.data_ptr(), keys.data_ptr(), values.data_ptr(), key_positions.data_ptr(), b, t,
                             heads, dim, keys.shape[0], slots)
        return queries if status == 0 else None

    def __call__(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_positions: torch.Tensor,
                 filled: int, query_positions: torch.Tensor, lengths: torch.Tensor,
                 context: int) -> Optional[torch.Tensor]:
        """Return the chunk's attention ``(B, T, H·D)`` over windows of ``context`` steps, zero for padded steps
        (t >= lengths[b]): ``queries`` ``(B, H, T, D)`` rotated, ring ``keys``/``values`` ``(B', H, N, D)`` and
        ``key_positions`` ``(B', N)`` of which rows [0, B) and slots [0, filled) are read, the steps'
        ``query_positions`` ``(B, T)``. None where the kernel does not take these tensors (another dtype or layout,
        a head size it has no step for): the caller then attends with torch."""
        b, h, t, d = queries.shape
        slots = keys.shape[2]
        tensors = (queries, keys, values)
        if (any(x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous() for x in tensors)
                or keys.shape[1:] != (h, slots, d) or values.shape != keys.shape or keys.shape[0] < b
                or key_positions.dtype != torch.int64 or not key_positions.is_contiguous()
                or key_positions.shape[1] != slots):
            return None
        query_positions = query_positions.to(torch.int64).contiguous()
        lengths = lengths.to(torch.int64).contiguous()
        out = torch.empty(b, t, h * d, dtype=torch.float32)
        threads = getattr(self._local, "threads", None)
        if threads is None:
            threads = self._local.threads = KernelThreads(self._library, 1)
        threads.use(torch.get_num_threads())
        status = self._call(threads.handle, queries.data_ptr(), keys.data_ptr(), values.data_ptr(),
                            key_positions.data_ptr(), query_positions.data_ptr(), lengths.data_ptr(), out.data_ptr(),
                            b, h, t, slots, filled, d, context, d ** -0.5)
        return out if status == 0 else None
