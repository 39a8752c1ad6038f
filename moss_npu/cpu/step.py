"""The frame decoder's transformer blocks on the CPU: one-row products in tiles, optionally compiled.

Each slot's new row runs each block in one call of the C library (``cpu.fused_block``; several slots' rows in
the same call, each tile read once for all of them), its products through ``cpu.matvec``'s tiles (an arena in
reading order, mapped from ``cpu.prepared``'s cache); without the C library (``moss_npu.native``) one row goes
through numpy's GEMV on a transposed float32 copy (``WeightArena``) and several through oneDNN-packed weights
(``cpu.packed``). A prompt's prefill (``block_rows``) multiplies through the packed weights, an int8 model's
through torch's int8 weight-only kernel (``int8_matmul``). The torch block math is
written once (``cpu.blocks.block_step``), so ``--compile on`` (torch >= 2.4, float32) can fuse its small ops;
``auto`` runs eagerly. Why each choice: docs/performance.md#cpu-speed and
#measurements-behind-the-cpu-steps-choices. Results agree with the torch path to float rounding, not bit for bit.
Shapes: n slots, E hidden, H heads, D head dim, M cache rows, T keys attended.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from moss_npu.errors import InputError
from moss_npu.cpu.fused_block import FusedRowBlock
from moss_npu.cpu.local_loop import LocalLoop
from moss_npu.cpu.matvec import BlasGemv, Bf16Tiles, Fp32Tiles, Int8Tiles, MatVecKernels, tile_bytes
from moss_npu.cpu.contract import BlockParts, DecoderParts
from moss_npu.native.library import KernelUnavailable, report_build
from moss_npu.cpu.packed import pack_linear, packed_matmul, packing_available
from moss_npu.cpu.prepared import PreparedArena, fresh_arena
from moss_npu.cpu.threads import limit_blas, this_thread_limited
from moss_npu.cpu.blocks import (Matmul, RowBlock, Segment, blas_matmul, block_rows, block_step, gemv, rotate_real,
                             rotations, row_block, row_norm)
from moss_npu.cpu.weights import (Int8TileWeights, Int8Weights, ModelWeights, WeightArena, block_weights,
                                  int8_matmul, int8_tile_matmul)

log = logging.getLogger(__name__)

COMPILE_MODES = ("auto", "on", "off")
COMPILE_NOTICE_S = 0.5  # a compiled call slower than this compiled a graph first


def _compiled_matmul() -> Optional[Matmul]:
    """Return ``blas_matmul`` as a torch custom op (opaque to torch.compile), or None where torch lacks the API."""
    custom_op = getattr(torch.library, "custom_op", None)
    if custom_op is None:
        return None
    name = "moss_npu::blas_matmul"
    try:  # registered once per process; a second CpuStep reuses it
        return torch.ops.moss_npu.blas_matmul
    except (AttributeError, RuntimeError):
        pass
    op = custom_op(name, mutates_args=())(blas_matmul)
    op.register_fake(lambda x, w, b, residual=None: x.new_empty(x.shape[0], w.shape[1]))
    return torch.ops.moss_npu.blas_matmul


class CpuStep:
    """The decode blocks and audio heads of one float32 CPU model, whose weights may hold bf16 or int8 values
    (see the module docstring).

    Built by ``CpuStep.build``; holds copies of the weights read then (tiles, a transposed arena, packed or
    int8 copies: ``FrameDecoder.refresh`` rebuilds it after the weights change). ``compiled`` says whether
    blocks run as compiled graphs.
    """

    def __init__(self, model: DecoderParts, compile_mode: str,
                 arena: Callable[[int], PreparedArena] = fresh_arena) -> None:
        """``arena(nbytes)`` gives the arena the tiles are prepared in (``prepared.WeightCache.arena``, which may
        hold them already); it is ``tile_arena``, None without the kernels."""
        self.weight_dtype = model.weight_dtype
        self.int8 = self.weight_dtype == "int8"
        self.compiled = False
        if compile_mode == "on" and self.weight_dtype != "float32":
            flag = "--quantize int8" if self.int8 else "--dtype bfloat16"
            raise InputError(f"--compile on compiles the float32 products; with {flag} use --compile auto or off")
        kernels = self._kernels_used = self._kernels()
        linears = model.block_linears()
        # numpy's GEMV (no kernels) and the compiled blocks read a transposed float32 copy; with the kernels' tiles
        # the torch blocks (several rows: packed copies or GEMM) read the model's own weights as well.
        copied = (linears if not self.int8 else []) + list(model.heads)
        self.arena = WeightArena(copied) if kernels is None or compile_mode == "on" else ModelWeights()
        # One row runs each block as one library call (fused_block) over one-row products in the tiled formats of
        # ``matvec`` (float32, bf16 or int8 as the model stores its weights; the heads are never quantized), all in
        # one arena in reading order. Without the compiled kernels: row_block in numpy with numpy's GEMV on the
        # float32 arena, and for int8 torch's int8 kernel in the torch block. Compiled blocks (float32 only)
        # multiply through the arena: only the heads need tiles then. An int8 model's several rows use its tiles
        # too (``Int8TileWeights``).
        rows = (not self.int8 or kernels is not None) and compile_mode != "on"
        self._tiles, self._int8_tiles = None, {}
        prefill_linears = model.block_linears(local=False) if self.int8 and kernels is not None else []
        if kernels is not None:
            heads = list(model.heads)
            tiled = (linears if rows else []) + heads
            # Tiles in the stored format, except an int8 model's heads (not quantized).
            self._tiles = arena(sum(tile_bytes(layer.weight, "float32" if self.int8 and layer in heads
                                               else self.weight_dtype) for layer in tiled)
                                + Int8Weights.arena_bytes(prefill_linears))
            if self.int8:
                self._int8_tiles = {layer: Int8Tiles.rounded(kernels, layer.weight, layer.bias, self._tiles.array)
                                    for layer in linears}
        if self.int8:
            weights = Int8TileWeights(self._int8_tiles) if self._int8_tiles else Int8Weights(linears)
        else:
            weights = self.arena
        self._int8_matmul = int8_tile_matmul if self._int8_tiles else int8_matmul
        self.global_blocks = [block_weights(b, weights) for b in model.global_blocks]
        self.local_blocks = [block_weights(b, weights) for b in model.local_blocks]
        self._int8_bytes = weights.nbytes() if self.int8 else 0
        # A prompt's prefill (one request's rows, whether it decodes alone or in a batch) multiplies an int8
        # model's global blocks through torch's int8 kernel: bf16 activations, but faster on 20–100 rows than
        # the tiles row by row (docs/performance.md).
        self._prefill_blocks = self.global_blocks
        if self._int8_tiles:
            torch_int8 = Int8Weights(prefill_linears, self._tiles.array)
            self._prefill_blocks = [block_weights(b, torch_int8) for b in model.global_blocks]
            self._int8_bytes = 0  # counted with the tile arena
        self.global_final = (model.global_norm.weight.detach(), model.global_norm.bias.detach())
        self.local_final = (model.local_norm.weight.detach(), model.local_norm.bias.detach())
        self.heads = [self.arena.linear(h) for h in model.heads]
        self.eps, self.n_head = model.eps, model.n_head
        self.scales = ([b.scale for b in model.global_blocks], [b.scale for b in model.local_blocks])
        # numpy's BLAS count is the process's, so it is set here once, to one thread: it multiplies single rows
        # (numpy's GEMV without the kernels or compiled, a prompt's last row), and its workers, spinning between
        # calls, took the cores from torch's OpenMP workers (a prefill 7x slower on 2 threads).
        limit_blas(1)
        self.compile_seconds = 0.0  # time spent compiling graphs so far
        self._block = self._eager_block
        self.packing = packing_available()
        self._packed: dict[int, torch.Tensor] = {}  # arena address -> packed copy (_packed_weight)
        self._packed_bytes = 0
        # numpy views of every arena weight and its bias (the blocks' unless int8, the heads'), by the weight's
        # address: a one-row product skips the two tensor-to-array conversions per call.
        arena_blocks = [] if self.int8 else self.global_blocks + self.local_blocks
        pairs = [pair for w in arena_blocks for pair in (w[2:4], w[4:6], w[8:10], w[10:12])] + self.heads
        self._arrays = {w.data_ptr(): (w.numpy(), b.numpy()) for w, b in pairs}
        self._row_blocks = None
        if rows:
            self._row_blocks = tuple([self._row_block(b, kernels) for b in blocks]
                                     for blocks in (model.global_blocks, model.local_blocks))
        self._row_finals = tuple(tuple(w.numpy() for w in final) for final in (self.global_final, self.local_final))
        # With the kernels each block's one row is one call of the library (``fused_block``): its small ops in C,
        # its attention shared over the pool with its products.
        self._fused = None
        if self._row_blocks is not None and kernels is not None:
            self._fused = tuple(self._fused_blocks(kernels, *decoder)
                                for decoder in zip(self._row_blocks, self.scales, self._row_finals))
        self._row_heads = [self._row_product(h, kernels, head=True) for h in model.heads]
        # With the fused local blocks a frame's audio channels are one library call (``local_audio``).
        self._qkv_tables: tuple = (None, [])  # local_audio's last tables and their arrays
        self.local_loop = None if self._fused is None else LocalLoop(
            kernels, self._fused[1], self._row_heads, [e.weight.detach().numpy() for e in model.embeddings])
        if compile_mode == "on":  # auto = eager: compiled measured slower (module docstring)
            self._compile(compile_mode)

    @property
    def tile_arena(self) -> Optional[PreparedArena]:
        """The arena of the one-row kernels' tiles (None without the kernels)."""
        return self._tiles

    def _kernels(self) -> Optional[MatVecKernels]:
        """Return the one-row kernels (``matvec``), or None where they cannot be built: with one warning line for
        bf16 or int8 weights, which lose their speed (float32 falls back to numpy's GEMV, a little slower)."""
        start = time.perf_counter()
        try:
            kernels = MatVecKernels.load()
        except KernelUnavailable as exc:
            if self.weight_dtype == "float32":
                log.info("one-row kernels unavailable (%s); one-slot frames use numpy's GEMV", exc)
                return None
            fallback = ("torch's int8 kernel (bf16 activations)" if self.int8
                        else "float32 products on the bf16-rounded weights: no faster than --dtype float32")
            log.warning("%s one-row kernels unavailable: %s; using %s", self.weight_dtype, exc, fallback)
            return None
        report_build(log, "the one-row CPU kernels", kernels.built, time.perf_counter() - start)
        return kernels

    def _row_product(self, layer: nn.Linear, kernels: Optional[MatVecKernels], head: bool = False):
        """Return ``layer``'s one-row product: tiles through ``kernels`` where given, else numpy's GEMV on the
        float32 arena (int8 blocks: ``_row_blocks`` is then None and this is not asked)."""
        if kernels is None:
            return BlasGemv(*self._arrays[self.arena.linear(layer)[0].data_ptr()])
        if self.int8 and not head:
            return self._int8_tiles[layer]
        tiles = Bf16Tiles if self.weight_dtype == "bfloat16" else Fp32Tiles
        return tiles(kernels, layer.weight, layer.bias, self._tiles.array)

    def _row_block(self, block: BlockParts, kernels: Optional[MatVecKernels]) -> RowBlock:
        product = functools.partial(self._row_product, kernels=kernels)
        return RowBlock(*(w.detach().numpy() for w in (block.ln_1.weight, block.ln_1.bias)),
                        product(block.c_attn), product(block.c_proj),
                        *(w.detach().numpy() for w in (block.ln_2.weight, block.ln_2.bias)),
                        product(block.fc_in), product(block.fc_out))

    def _fused_blocks(self, kernels: MatVecKernels, blocks: list[RowBlock], scales: list[float],
                      final: tuple[np.ndarray, np.ndarray]) -> list[FusedRowBlock]:
        """Return one decoder's blocks as ``FusedRowBlock``s, its final norm on the last."""
        last = len(blocks) - 1
        return [FusedRowBlock(kernels, block, heads=self.n_head, eps=self.eps, scale=scale,
                              final=final if i == last else None)
                for i, (block, scale) in enumerate(zip(blocks, scales))]

    @classmethod
    def build(cls, model: DecoderParts, compile_mode: str = "auto",
              arena: Callable[[int], PreparedArena] = fresh_arena) -> Optional["CpuStep"]:
        """Return a ``CpuStep`` for an fp32 model on the CPU (its tiles in ``arena``), None for any other (its
        own kernels are fine)."""
        if compile_mode not in COMPILE_MODES:
            raise InputError(f"--compile {compile_mode}: unknown; use one of {', '.join(COMPILE_MODES)}")
        weight = model.local_norm.weight
        # block_step writes out the tanh GELU of the official config; other activations keep the torch path.
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or not model.tanh_gelu:
            if compile_mode == "on":
                raise InputError(f"--compile on compiles the float32 CPU step; this model is {weight.dtype} on "
                                 f"{weight.device}: use --compile auto or off")
            return None
        return cls(model, compile_mode, arena)

    def label(self) -> str:
        """Return what multiplies a one-slot frame, for reports: ``cpu-fp32``, ``cpu-bf16``, ``cpu-int8`` (the
        stored weights, through ``matvec``'s kernels), ``+compiled``, or ``-no-kernel`` where the kernels could not
        be built (numpy's GEMV, or torch's int8 kernel)."""
        name = {"float32": "cpu-fp32", "bfloat16": "cpu-bf16", "int8": "cpu-int8"}[self.weight_dtype]
        missing = self._tiles is None
        return name + ("+compiled" if self.compiled else "") + ("-no-kernel" if missing else "")

    def dispatch(self) -> str:
        """Return ``label()`` and the kernels' instruction set (``kernel_target``), e.g. ``cpu-fp32/avx2``."""
        return f"{self.label()}/{self.kernel_target()}"

    def nbytes(self) -> int:
        """Return the bytes of the weight copies (transposed fp32 or int8 values with their scales, and packed)."""
        tiles = 0 if self._tiles is None else self._tiles.nbytes()
        return self.arena.nbytes() + self._int8_bytes + self._packed_bytes + tiles

    def _eager_block(self, *args, **kwargs) -> torch.Tensor:
        return block_step(*args, **kwargs, matmul=self._int8_matmul if self.int8 else self._matmul)

    def _matmul(self, x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor,
                residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``blas_matmul``, except that several rows (a batch of slots, a prompt) multiply through oneDNN with the
        weight pre-packed (``moss_npu.cpu.packed``), faster than oneDNN on plain weights or torch's GEMM (MKL's
        generic path on AMD; docs/performance.md)."""
        if x.shape[0] == 1:
            return gemv(x, *self._arrays[weight_t.data_ptr()], residual)
        return self._prompt_matmul(x, weight_t, bias, residual)

    def _prompt_matmul(self, x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor,
                       residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``_matmul`` for a prompt's rows: through the packed weight however few they are, so that a row gets
        the same bits whatever rows share its prefill (a prompt whose prefix was cached and only its last row is
        new, prompts admitted together); oneDNN's packed product gives a row the same sums at any row count. A
        torch that cannot pack (``packing_available``) keeps ``blas_matmul``, whose one row takes numpy's GEMV."""
        if not self.packing:
            return blas_matmul(x, weight_t, bias, residual)
        out = packed_matmul(x, self._packed_weight(weight_t), bias)
        return out if residual is None else out.add_(residual)

    def pack(self, batched: bool) -> None:
        """Pack now what several rows will multiply by (``_packed_weight``), so that no request waits for it: a
        prompt's prefill reads the global blocks, and ``batched`` (a decoder of several slots) without the fused
        blocks adds the local blocks and the heads (with them, several slots' rows go through their tiles).
        Nothing where products are not packed (no packing here, int8, compiled)."""
        if not self.packing or self.int8 or self.compiled:
            return
        local = batched and self._fused is None
        blocks = self.global_blocks + (self.local_blocks if local else [])
        weights = [w for block in blocks for w in (block[2], block[4], block[8], block[10])]
        for weight_t in weights + ([w for w, _ in self.heads] if local else []):
            self._packed_weight(weight_t)

    def _packed_weight(self, weight_t: torch.Tensor) -> torch.Tensor:
        """Return the packed copy of an arena weight, made by ``pack`` or the first time several rows multiply by
        it: a one-request run packs the global blocks (its prefill, ~340 MB for the real model), a server's
        batches every block and head (~420 MB)."""
        key = weight_t.data_ptr()
        packed = self._packed.get(key)
        if packed is None:  # from the arena copy, as one-row products read it: the same weights until refresh()
            packed = self._packed[key] = pack_linear(weight_t.t())
            self._packed_bytes += weight_t.numel() * weight_t.element_size()
        return packed

    def _compile(self, mode: str) -> None:
        """Compile ``block_step`` with the BLAS products as a custom op, where this torch can."""
        compile_fn, matmul = getattr(torch, "compile", None), _compiled_matmul()
        if compile_fn is None or matmul is None:
            why = "this torch has no torch.compile / torch.library.custom_op (needs torch >= 2.4)"
            if mode == "on":
                raise InputError(f"--compile on: {why}; use --compile auto or off")
            log.info("CPU frame step runs eagerly: %s", why)
            return
        self._compiled, self._op = compile_fn(block_step, dynamic=True), matmul
        self._block, self.compiled = self._compiled_block, True

    def _compiled_block(self, *args, **kwargs) -> torch.Tensor:
        """Run the compiled block; a call that compiles is timed and logged, one that fails falls back to eager.

        Falling back mid-frame is safe: a block only writes its new cache rows, which the eager rerun rewrites.
        """
        start = time.perf_counter()
        x, rotation, *rest = args
        try:
            out = self._compiled(x, torch.view_as_real(rotation), *rest, **kwargs, matmul=self._op, rotate=rotate_real)
        except Exception as exc:  # noqa: BLE001 - any inductor failure means: run eagerly
            first = str(exc).splitlines()[0] if str(exc) else ""
            log.warning("compiling the CPU frame step failed (%s: %s); running it eagerly", type(exc).__name__, first)
            self._block, self.compiled = self._eager_block, False
            return self._eager_block(*args, **kwargs)
        took = time.perf_counter() - start
        if took > COMPILE_NOTICE_S:  # a call this slow compiled a graph (a new shape bucket)
            self.compile_seconds += took
            log.warning("--compile on: compiling a CPU frame-step graph took %.1f s (once per shape; torch caches "
                        "it on disk for later runs)", took)
        return out

    def run(self, local: bool, x: torch.Tensor, rotation: torch.Tensor, kv: torch.Tensor,
            index: torch.Tensor, keys: int, mask: Optional[torch.Tensor],
            qkv: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run (n, E) rows through the local or global decoder's blocks and final norm; return (n, E).

        ``kv`` (N, 2, S, H, M, D) is the decoder's cache; see ``block_step`` for the rest.
        """
        if x.shape[0] == 1 and mask is None and self._row_blocks is not None and not self.compiled:
            return self._run_row(local, x, rotation, kv, int(index[0]), keys, qkv)
        if self._fused is not None and not self.compiled:
            return self._run_rows(local, x, rotation, kv, index, keys, mask, qkv)
        blocks, (norm_w, norm_b) = ((self.local_blocks, self.local_final) if local
                                    else (self.global_blocks, self.global_final))
        scales = self.scales[0 if not local else 1]
        for i, weights in enumerate(blocks):
            x = self._block(x, rotation, kv[i], index, keys, mask, qkv if i == 0 else None, *weights,
                            heads=self.n_head, eps=self.eps, scale=scales[i])
        return F.layer_norm(x, (x.shape[-1],), norm_w, norm_b, self.eps)

    def _run_row(self, local: bool, x: torch.Tensor, rotation: torch.Tensor, kv: torch.Tensor, position: int,
                 keys: int, qkv: Optional[torch.Tensor]) -> torch.Tensor:
        """``run`` for slot 0 alone, block by block through ``FusedRowBlock`` (``row_block`` without the library):
        its row is written at ``position`` (the first entry of ``run``'s index, slot 0's first head) and attends to
        the first ``keys`` rows."""
        blocks, (norm_w, norm_b) = self._row_blocks[local], self._row_finals[local]
        scales, cache = self.scales[local], kv.numpy()
        row, turn = x.numpy()[0], rotation.numpy()[0]
        ready = qkv.numpy()[0] if qkv is not None else None
        if self._fused is not None:  # the final norm comes with the last block
            for i, block in enumerate(self._fused[local]):
                row = block(row, turn, cache[i, 0, 0], cache[i, 1, 0], position, keys, ready if i == 0 else None)
            return torch.from_numpy(row)[None]
        with np.errstate(all="ignore"):  # non-finite values propagate silently, as in torch: the decoder reports them
            for i, weights in enumerate(blocks):
                row = row_block(row, turn, cache[i, 0, 0], cache[i, 1, 0], position, keys, ready if i == 0 else None,
                                weights, heads=self.n_head, eps=self.eps, scale=scales[i])
            row = row_norm(row, norm_w, norm_b, self.eps)
        return torch.from_numpy(row)[None]

    def _run_rows(self, local: bool, x: torch.Tensor, rotation: torch.Tensor, kv: torch.Tensor, index: torch.Tensor,
                  keys: int, mask: Optional[torch.Tensor], qkv: Optional[torch.Tensor]) -> torch.Tensor:
        """``run`` for slots [0, n) through the fused blocks' rows (``FusedRowBlock.rows``): every tile read once
        for all rows, each row the bits it gets alone. Row r is written at its slot's position (its ``index``
        entry within the slot's cache rows) and attends up to it where ``mask`` says so (the decoder's masks
        are the causal ones), else the first ``keys``."""
        n, rows = x.shape[0], kv.shape[4]
        positions = (index.view(n, -1)[:, 0] % rows).numpy()
        attended = positions + 1 if mask is not None else np.full(n, keys, dtype=np.int64)
        turns, cache = np.ascontiguousarray(rotation.numpy()), kv.numpy()
        out, ready = np.ascontiguousarray(x.numpy()), None if qkv is None else qkv.numpy()
        for i, block in enumerate(self._fused[local]):
            out = block.rows(out, turns, cache[i, 0], cache[i, 1], positions, attended, ready if i == 0 else None)
        return torch.from_numpy(out)

    def prefill(self, x: torch.Tensor, rotation: torch.Tensor, kv: torch.Tensor,
                segments: list[Segment]) -> torch.Tensor:
        """Run the new embedded rows of one or more prompts (ΣL, E), one after another, through the global
        decoder into their slots' caches (``block_rows``); return each prompt's last hidden state after the final
        norm (segments, E).

        Several rows multiply through the packed weights, about twice torch's speed on a prompt's 10–30 rows
        (an int8 model's through torch's int8 kernel); prompts prefilled together share each pass over the
        weights, which a prompt's few new rows (the template comes from the prefix cache) leave memory-bound.
        """
        matmul = int8_matmul if self.int8 else self._prompt_matmul
        final = len(self._prefill_blocks) - 1
        for i, weights in enumerate(self._prefill_blocks):
            x = block_rows(x, rotation, kv[i], segments, *weights, heads=self.n_head, eps=self.eps,
                           scale=self.scales[0][i], matmul=matmul, last_only=i == final)
        norm_w, norm_b = self.global_final
        return F.layer_norm(x, (x.shape[-1],), norm_w, norm_b, self.eps)

    def threads(self, slots: int) -> contextlib.AbstractContextManager:
        """Return the thread setting a frame of ``slots`` slots runs under (``moss_npu.cpu.threads``): where the
        kernels run its rows (one slot's, or several through the fused blocks), torch on one thread in this thread
        and the kernels' products shared over the process setting; else (several slots through torch) the
        process setting in torch and the kernels on one thread (their pools would fight)."""
        kernels_run = slots == 1 or (self._fused is not None and not self.compiled)
        if self._kernels_used is not None:
            self._kernels_used.threads.use(torch.get_num_threads() if kernels_run else 1, lendable=kernels_run)
        return this_thread_limited(1) if kernels_run else contextlib.nullcontext()

    def lend(self, threads: int) -> None:
        """Let the frame's kernel products use ``threads`` more threads than the frame's own, from the next product
        on (0 takes them back): the cores another thread of the process leaves idle meanwhile. Safe from any
        thread; frames whose rows run through torch ignore it (its pool and the kernels' would fight)."""
        if self.borrows:
            self._kernels_used.threads.lend(threads)

    @property
    def borrows(self) -> bool:
        """Whether ``lend`` adds threads to this step's frames (it has the kernels' pool)."""
        return self._kernels_used is not None

    def kernel_target(self) -> str:
        """Return the instruction set of the one-row kernels (``targets.choose_target``), or ``none`` without them."""
        return "none" if self._kernels_used is None else self._kernels_used.target

    def rotation_table(self, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE rows (P, D) as ``run`` takes them: complex rotations (``blocks.rotations``)."""
        return rotations(cos, sin)

    def local_audio(self, first: torch.Tensor, first_qkv: torch.Tensor, tables: Sequence[torch.Tensor],
                    rotation: torch.Tensor, state, n: int, start: int, channels: int, pad: int,
                    exponential: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decide a frame's audio channels [0, ``channels``) for slots [0, n) in one call (``local_loop``): return
        the frame (n, Q) (pad from each slot's nq on), the next global row's embedding (n, E) and whether every
        logits row below nq was finite (n,), as ``FrameDecoder._audio`` computes them: greedy, or sampled with the
        official sampler's Exp(1) variates ``exponential`` (n, Q, W >= V) where given, else with the noise-fed
        sampler's uniforms.

        ``first`` (n, E) and ``first_qkv`` (n, 3E) are channel 0's input (the text decision's embedding, also
        the start of the row's embedding) and its first-block qkv; ``tables`` the Q - 1 audio qkv tables
        (``LocalTables.audio_qkv``); ``rotation`` (Q + 1, D/2) the local RoPE table; ``state`` the decoder's
        ``DecodeState`` (local cache, written at local positions ``start`` onwards, audio sampling parameters,
        uniforms, presence masks, nq).
        """
        rates = state.audio
        sampling = {"do_sample": rates.do_sample[:n], "temperature": rates.temperature[:n], "top_p": rates.top_p[:n],
                    "penalty": rates.repetition_penalty[:n], "top_k": rates.top_k[:n]}
        embed = first.clone()
        nq = state.nq[:n]
        if self._qkv_tables[0] is not tables:  # the decoder's tables: the same tuple frame after frame
            self._qkv_tables = (tables, [t.numpy() for t in tables])
        codes, finite = self.local_loop(first.numpy(), first_qkv.numpy(), self._qkv_tables[1],
                                        state.local_kv.numpy(), rotation.numpy(), start, channels,
                                        {k: v.numpy() for k, v in sampling.items()}, state.noise[:n].numpy(),
                                        state.seen.numpy(), nq.numpy(), embed.numpy(),
                                        None if exponential is None else exponential.numpy())
        within = torch.arange(channels)[None] < nq[:, None]
        frame = torch.full((n, self.local_loop.channels), pad, dtype=torch.long)
        frame[:, :channels] = torch.where(within, torch.from_numpy(codes), pad)
        return frame, embed, torch.from_numpy(finite)

    def head(self, channel: int, x: torch.Tensor) -> torch.Tensor:
        """Return audio head ``channel``'s logits (n, V) of (n, E) local hidden states."""
        if x.shape[0] == 1:
            return torch.from_numpy(self._row_heads[channel](x.numpy()[0]))[None]
        weight, bias = self.heads[channel]
        return self._matmul(x, weight, bias)
