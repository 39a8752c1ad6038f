"""The Qwen3 backbone of the Delay model, run by llama.cpp through llama-cpp-python's low-level API
(docs/delay.md#backbone): embedding rows in at explicit positions, the post-norm hidden state and the GGUF head's
text logits out. One sequence (id 0). H hidden size, V text vocabulary.
"""

from __future__ import annotations

import ctypes
import logging
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from moss_npu.delay.config import FLASH_ATTN_MODES, KV_CACHE_TYPES, DelayRunConfig
from moss_npu.errors import CheckpointError, DeviceError, InputError, MissingDependency
from moss_npu.extras import LLAMA_INSTALL

log = logging.getLogger(__name__)


def import_llama_cpp():
    """Import llama-cpp-python, or raise ``MissingDependency``/``DeviceError`` naming the install command."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise MissingDependency(f"the llama-cpp backend needs llama-cpp-python>=0.3.17, which is not installed; "
                                f"install it with `{LLAMA_INSTALL}` (docs/delay.md for CUDA / CANN builds)") from exc
    except Exception as exc:  # a broken native build raises more than ImportError
        raise DeviceError(f"the llama-cpp backend needs llama-cpp-python>=0.3.17 (import failed: {exc}); "
                          f"install it with `{LLAMA_INSTALL}` (docs/delay.md for CUDA / CANN builds)") from exc
    if not hasattr(llama_cpp.llama_context_params, "_fields_") or "flash_attn_type" not in dict(
            llama_cpp.llama_context_params._fields_):
        raise DeviceError(f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')} is too old (no flash_attn_type); "
                          f"upgrade with `{LLAMA_INSTALL}`")
    return llama_cpp


class _NativeLog:
    """Routes llama.cpp's log lines to Python logging (debug level unless ``verbose``)."""

    def __init__(self, llama_cpp) -> None:
        self.verbose = False

        def forward(_level: int, text: bytes, _user: ctypes.c_void_p) -> None:
            level = logging.INFO if self.verbose else logging.DEBUG
            log.log(level, "%s", text.decode("utf-8", "replace").rstrip("\n"))

        self.callback = llama_cpp.llama_log_callback(forward)  # kept alive: C holds the pointer
        llama_cpp.llama_log_set(self.callback, ctypes.c_void_p(0))


_native_log = None


class LlamaBackbone:
    """One GGUF model + context; feeds embedding rows and reads hidden states and text logits."""

    def __init__(self, gguf: Path, run: DelayRunConfig) -> None:
        global _native_log
        self._lib = lib = import_llama_cpp()
        if _native_log is None:
            _native_log = _NativeLog(lib)
        _native_log.verbose = run.verbose
        gguf = Path(gguf)
        if not gguf.is_file():
            raise CheckpointError(f"GGUF backbone {gguf} does not exist; download or convert it first")
        self._stack = ExitStack()
        lib.llama_backend_init()
        model_params = lib.llama_model_default_params()
        model_params.n_gpu_layers = run.n_gpu_layers
        if run.device_index is not None:  # one given accelerator holds the whole model
            model_params.split_mode = lib.LLAMA_SPLIT_MODE_NONE
            model_params.main_gpu = run.device_index
        self._model = lib.llama_model_load_from_file(str(gguf).encode("utf-8"), model_params)
        if not self._model:
            raise CheckpointError(f"llama.cpp could not load {gguf} (not a GGUF, an unsupported quantisation for "
                                  "this build, or out of memory); run with verbose: true to see llama.cpp's reason")
        self._stack.callback(lib.llama_model_free, self._model)

        params = lib.llama_context_default_params()
        params.n_ctx = run.n_ctx
        params.n_batch = params.n_ubatch = run.n_batch  # every prompt chunk must fit one physical batch
        params.n_threads = params.n_threads_batch = run.n_threads
        params.embeddings = True
        params.pooling_type = lib.LLAMA_POOLING_TYPE_NONE
        params.type_k = KV_CACHE_TYPES[run.kv_cache_type_k]
        params.type_v = KV_CACHE_TYPES[run.kv_cache_type_v]
        params.flash_attn_type = FLASH_ATTN_MODES[run.flash_attn]
        self._ctx = lib.llama_init_from_model(self._model, params)
        if not self._ctx:
            self.close()
            raise DeviceError(f"llama.cpp could not create a context (n_ctx={run.n_ctx}, n_batch={run.n_batch}, "
                              f"kv {run.kv_cache_type_k}/{run.kv_cache_type_v}, flash_attn={run.flash_attn}); lower "
                              "n_ctx or n_gpu_layers, or pick a KV type this build supports")
        self._stack.callback(lib.llama_free, self._ctx)
        self.n_embd = int(lib.llama_model_n_embd(self._model))
        self.n_vocab = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model)))
        self.n_ctx = int(lib.llama_n_ctx(self._ctx))
        self.n_batch = run.n_batch
        self._batch = lib.llama_batch_init(self.n_batch, self.n_embd, 1)  # one prompt chunk, or one step's row
        self._stack.callback(lib.llama_batch_free, self._batch)

    def clear(self) -> None:
        """Empty the KV cache (start of an utterance)."""
        self._lib.llama_memory_clear(self._lib.llama_get_memory(self._ctx), True)

    def prefill(self, embeddings: np.ndarray) -> None:
        """Feed prompt embeddings ``(S, H)`` at positions 0..S-1 in ``n_batch`` chunks; output the last row."""
        rows = embeddings.shape[0]
        for start in range(0, rows, self.n_batch):
            chunk = embeddings[start: start + self.n_batch]
            self._decode(chunk, start, output_last=start + chunk.shape[0] == rows)

    def step(self, embedding: np.ndarray, position: int) -> None:
        """Feed one row's embedding ``(H,)`` at ``position`` and output it."""
        self._decode(embedding[None, :], position, output_last=True)

    def hidden_state(self) -> np.ndarray:
        """Return the post-final-norm hidden state of the last output row, ``(H,)`` float32 (a copy)."""
        return self._read(self._lib.llama_get_embeddings_ith(self._ctx, -1), self.n_embd, "hidden state")

    def text_logits(self) -> np.ndarray:
        """Return the GGUF head's logits of the last output row, ``(V,)`` float32 (a copy)."""
        return self._read(self._lib.llama_get_logits_ith(self._ctx, -1), self.n_vocab, "logits")

    def close(self) -> None:
        """Free the context, the model and the batch."""
        self._stack.close()

    def _decode(self, rows: np.ndarray, first_position: int, output_last: bool) -> None:
        n, batch = rows.shape[0], self._batch
        if rows.shape[1] != self.n_embd:
            raise InputError(f"embeddings of width {rows.shape[1]}, the backbone expects {self.n_embd}")
        if first_position + n > self.n_ctx:
            raise InputError(f"positions up to {first_position + n} exceed n_ctx={self.n_ctx}; raise n_ctx")
        data = np.ascontiguousarray(rows, dtype=np.float32)
        batch.n_tokens = n
        ctypes.memmove(batch.embd, data.ctypes.data, data.nbytes)
        for i in range(n):
            batch.pos[i] = first_position + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1 if (output_last and i == n - 1) else 0
        code = self._lib.llama_decode(self._ctx, batch)
        if code != 0:
            raise DeviceError(f"llama_decode returned {code} at positions {first_position}..{first_position + n - 1} "
                              f"(1 = no KV slot: raise n_ctx={self.n_ctx}; <0 = backend error, see verbose log)")

    @staticmethod
    def _read(pointer, size: int, what: str) -> np.ndarray:
        if not pointer:
            raise DeviceError(f"llama.cpp returned no {what}; this llama-cpp-python build predates logits + "
                              f"embeddings together, upgrade with `{LLAMA_INSTALL}`")
        return np.ctypeslib.as_array(pointer, shape=(size,)).copy()
