"""The device layer: the one module that knows about CPU, CUDA, Ascend NPU and Apple MPS.

Everything else holds a ``torch.device`` plus a dtype and asks questions through ``backend(device)``
(docs/architecture.md#devices). Every fact about one kind of device lives on its ``Backend`` subclass, so adding a
device is one subclass: defining it registers it. ``torch_npu`` is imported lazily inside the NPU backend (it
cannot import without Ascend CANN), and torch itself on first use, so the device names also serve the torch-free
Delay fallback. Memory is in bytes, ``None`` when unknown. How the NPU code is tested without one: docs/testing.md.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import math
import os
import platform
import re
import warnings
from typing import Optional

from moss_npu.errors import DeviceError, InputError

log = logging.getLogger(__name__)


class _TorchOnFirstUse:
    """Stands in for the torch module until an attribute is read, then imports torch and takes its place.

    An import that an installed device extension broke is remembered and raised again as it was: importing
    torch a second time in that process raises another error that names neither the extension nor the fix.
    """

    def __init__(self) -> None:
        self.failure: Optional[DeviceError] = None

    def module(self):
        """Import torch, put it in this placeholder's place and return it; raise DeviceError with the fix when a
        device extension it loads fails (``extension_failure``)."""
        if self.failure is not None:
            raise self.failure
        try:
            import torch as module
        except RuntimeError as exc:
            self.failure = extension_failure(exc)
            if self.failure is None:
                raise
            raise self.failure from exc
        globals()["torch"] = module
        return module

    def __getattr__(self, name: str):
        return getattr(self.module(), name)


torch = _TorchOnFirstUse()
_EXTENSION_FAILED = "Failed to load the backend extension: "  # torch's message (torch/__init__.py, torch >= 2.5)
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}  # names of torch dtypes
_GIB = 1 << 30


class GraphCapture:
    """A backend's device-graph API: ``capture(fn)`` records the kernels ``fn`` launches and returns a replay.
    ``graph_type``/``graph_context`` are ``torch.cuda.CUDAGraph``/``torch.cuda.graph`` or the NPU's; ``broken``
    holds why a capture failed in this process (then callers stop trying)."""

    def __init__(self, graph_type, graph_context) -> None:
        self.graph_type, self.graph_context = graph_type, graph_context
        self.broken: Optional[str] = None
        self.checked = False

    def check(self, device: torch.device) -> Optional[str]:
        """Return why device graphs fail on ``device``, None when they work: one trial capture of an in-place
        add, which must run nothing, then two replays that must add twice (``--graph on`` refuses up front
        instead of at the first frame). Tried once per process; a failure turns capture off (``broken``).
        """
        if self.broken is None and not self.checked:
            self.checked = True
            try:
                total, one = torch.zeros(4, device=device), torch.ones(4, device=device)
                replay = self.capture(lambda: total.add_(one))
                after_capture = total.cpu().tolist()
                replay()
                replay()
                after_replays = total.cpu().tolist()
            except Exception as exc:  # what fails, and how, differs by driver and version
                self.broken = f"{type(exc).__name__}: {exc}"
            else:
                if after_capture != [0.0] * 4 or after_replays != [2.0] * 4:
                    self.broken = (f"a trial capture left {after_capture} and two replays {after_replays}, "
                                   "not [0.0]*4 and [2.0]*4")
        return self.broken

    def capture(self, fn):
        """Record ``fn`` (not run: its kernels run on each replay); return the graph's ``replay``.

        Captured with ``capture_error_mode="thread_local"`` where the context takes it (torch and torch_npu 2.1+):
        the default, "global", fails any host sync in any thread while the capture lasts, and the engine's audio
        thread copies waveforms to the host while the decoding thread captures a frame.
        """
        graph = self.graph_type()
        with self.graph_context(graph, **self._mode()):
            fn()
        return graph.replay

    def _mode(self) -> dict:
        try:
            parameters = inspect.signature(self.graph_context).parameters
        except (TypeError, ValueError):  # a context without a signature Python can read
            return {}
        return {"capture_error_mode": "thread_local"} if "capture_error_mode" in parameters else {}


class Backend:
    """One kind of device. Defaults are the conservative answers; subclasses override what they can do.

    A subclass that sets ``kind`` is registered as that kind's built-in backend when it is defined.
    """

    kind: Optional[str] = None  # the torch.device type; None for this abstract base
    extension: Optional[str] = None  # name of the package that provides the backend, reported with its version
    batches_by_default = False  # whether chunk batching is on without the user asking for it
    indexed = False  # devices are numbered (``kind:N``; no index means 0) rather than one unnumbered device
    visible_devices_env: Optional[str] = None  # the environment variable that limits which devices are visible
    auto_rank: Optional[int] = None  # place in ``--device auto``'s order (lower is tried first); None: never
    onnx_provider: Optional[str] = None  # onnxruntime execution provider for this kind of device
    onnx_wheel: Optional[str] = None  # the pip package that brings that provider
    ray_resource: Optional[str] = None  # the Ray resource one device of this kind is scheduled as (not CPUs)
    host = False  # this machine's CPU: memory numpy shares and files map into, cores every process shares
    step_attention: Optional[str] = None  # the attention of a one-row decode step (None: the model's own)
    builtin: dict[str, type["Backend"]] = {}  # kind -> class, filled as subclasses are defined

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__ and cls.kind is not None and cls.__module__ == __name__:
            Backend.builtin[cls.kind] = cls

    def is_available(self) -> bool:
        """Return whether this kind of device can be used in this process."""
        return False

    def unavailable_reason(self) -> str:
        """Return one line saying why the device is unavailable and how to fix it."""
        return f"{self.kind} is not available in this build of torch"

    def device_count(self) -> int:
        """Return how many devices of this kind are visible."""
        return 0

    def torch_device(self, index: Optional[int]) -> torch.device:
        """Return the torch.device for ``index`` (None: the backend's default device)."""
        return torch.device(self.kind) if index is None else torch.device(self.kind, index)

    def mem_get_info(self, index: int = 0) -> Optional[tuple[int, int]]:
        """Return (free, total) memory in bytes, or None when unknown."""
        return None

    def synchronize(self, index: Optional[int] = None) -> None:
        """Wait for queued work on the device to finish (a no-op where work is synchronous)."""

    def empty_cache(self) -> None:
        """Give cached allocator memory back to the device."""

    def manual_seed(self, seed: int) -> None:
        """Seed this device's random generators."""

    def name(self, index: int = 0) -> str:
        """Return the device's product name, e.g. ``Ascend910B4``."""
        return self.kind

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        """Return whether models can compute in ``dtype`` here."""
        return dtype == torch.float32

    def max_memory_allocated(self, index: int = 0) -> Optional[int]:
        """Return the peak memory used so far, in bytes, or None when unknown."""
        return None

    def reset_peak_memory_stats(self, index: int = 0) -> None:
        """Start a new peak-memory measurement."""

    def version(self) -> Optional[str]:
        """Return the version of the extension that provides this backend, if any."""
        return None

    def graph_capture(self) -> Optional[GraphCapture]:
        """Return the device-graph capture API (one per process), or None where frames run eagerly."""
        return None

    def runtime_version(self) -> Optional[str]:
        """The device runtime under torch and its extension (Ascend CANN), where it says; None elsewhere."""
        return None

    def version_mismatch(self) -> Optional[str]:
        """One line with the fix where torch and this backend's extension are not built for each other."""
        return None

    @contextlib.contextmanager
    def counting_host_syncs(self):
        """Count the operations that wait for the device (a read to the host): yields a list that gets one entry
        per such wait, or None where this device does not report them (the CPU is the host)."""
        yield None

    def apply_process_settings(self) -> dict:
        """Apply once the process-wide settings this backend needs when a device is resolved; return them."""
        return {}

    def process_settings(self) -> dict:
        """Return the process-wide settings this backend applied (reported in bench and eval JSON)."""
        return {}

    def frame_step(self, model, compile_mode: str = "auto", **options):
        """Return the step a ``FrameDecoder`` runs a model's blocks (its ``cpu.contract`` parts) through on this
        device, or None where the model's own modules run (``nano.step.TorchStep``). Only the CPU has one
        (``moss_npu.cpu.step``; ``options`` go to its ``build``)."""
        if compile_mode == "on":
            raise InputError(f"--compile on compiles the float32 CPU step; this model is on {self.kind}: "
                              f"use --compile auto or off")
        return None

    def packs_linears(self, dtype) -> bool:
        """Whether the codec's linear layers in ``dtype`` run faster from packed copies here (``cpu.packed``)."""
        return False

    def window_attention(self, dtype):
        """The codec's streamed attention as one kernel call here (``cpu.window_attention``), or None: torch's."""
        return None

    def rounds_weights_only(self, dtype) -> bool:
        """Whether ``dtype`` here means float32 arithmetic on weights rounded to ``dtype`` (the CPU's bf16:
        ``cpu.quantize.store_bf16``) rather than arithmetic in ``dtype``."""
        return False

    def zeros(self, shape: tuple[int, ...], dtype, device):
        """A zeroed tensor for a large state (the decoder's KV cache)."""
        return torch.zeros(shape, dtype=dtype, device=device)

    def kernel_report(self) -> Optional[str]:
        """Which instruction set this device's own kernels run (the CPU's one-row products), for reports."""
        return None


class CpuBackend(Backend):
    """The host CPU: always available; memory from psutil."""

    kind = "cpu"
    host = True
    auto_rank = 3
    onnx_provider = "CPUExecutionProvider"
    onnx_wheel = "onnxruntime"

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def torch_device(self, index: Optional[int]) -> torch.device:
        return torch.device("cpu")

    def mem_get_info(self, index: int = 0) -> Optional[tuple[int, int]]:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def name(self, index: int = 0) -> str:
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                for line in f:
                    if line.startswith("model name"):
                        return line.split(":", 1)[1].strip()
        except OSError:
            pass
        return platform.processor() or platform.machine() or "cpu"

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        return dtype in (torch.float32, torch.bfloat16) or _probe_matmul("cpu", dtype)

    def native_bf16(self) -> Optional[bool]:
        """Return whether the CPU computes bf16 natively (x86 AVX512-BF16 / AMX, ARM BF16); None if unknown."""
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                flags = {word for line in f if line.startswith(("flags", "Features")) for word in line.split()}
        except OSError:
            return None
        return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"}) if flags else None

    def frame_step(self, model, compile_mode: str = "auto", **options):
        from moss_npu.cpu.step import CpuStep

        return CpuStep.build(model, compile_mode, **options)

    def packs_linears(self, dtype) -> bool:
        from moss_npu.cpu.packed import packing_available

        return dtype == torch.float32 and packing_available()

    def window_attention(self, dtype):
        from moss_npu.cpu.window_attention import WindowAttention

        return WindowAttention.load() if dtype == torch.float32 else None

    def rounds_weights_only(self, dtype) -> bool:
        return dtype == torch.bfloat16

    def zeros(self, shape: tuple[int, ...], dtype, device):
        """In fresh anonymous pages (``cpu.prepared.PageArena``), which the kernel zeroes when first touched: a
        request touches only the rows it fills, where ``torch.zeros`` would write the whole cache at start-up."""
        import math

        from moss_npu.cpu.prepared import PageArena

        count = math.prod(shape)
        pages = PageArena(count * torch.empty((), dtype=dtype).element_size(), huge_pages=False)
        return torch.frombuffer(pages.buffer, dtype=dtype, count=count).view(shape)  # holds the map alive

    def kernel_report(self) -> Optional[str]:
        from moss_npu.cpu.targets import kernels_in_use

        return kernels_in_use()

    def max_memory_allocated(self, index: int = 0) -> Optional[int]:
        try:
            import resource
        except ImportError:  # Windows
            return None
        # Linux reports ru_maxrss in KiB: peak resident memory of this process.
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class CudaBackend(Backend):
    """NVIDIA (or ROCm) GPUs through torch.cuda."""

    kind = "cuda"
    ray_resource = "GPU"
    extension = "cuda"
    batches_by_default = True
    indexed = True
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    auto_rank = 1
    onnx_provider = "CUDAExecutionProvider"
    onnx_wheel = "onnxruntime-gpu"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def unavailable_reason(self) -> str:
        return "CUDA is not available: install a CUDA build of torch (pip install torch --index-url ...cu12x) and check nvidia-smi"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def mem_get_info(self, index: int = 0) -> Optional[tuple[int, int]]:
        free, total = torch.cuda.mem_get_info(index)
        return int(free), int(total)

    def synchronize(self, index: Optional[int] = None) -> None:
        torch.cuda.synchronize(index)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def name(self, index: int = 0) -> str:
        return torch.cuda.get_device_name(index)

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        if dtype == torch.bfloat16:
            return torch.cuda.is_bf16_supported()
        return dtype in (torch.float32, torch.float16)

    def max_memory_allocated(self, index: int = 0) -> Optional[int]:
        return int(torch.cuda.max_memory_allocated(index))

    def reset_peak_memory_stats(self, index: int = 0) -> None:
        torch.cuda.reset_peak_memory_stats(index)

    def version(self) -> Optional[str]:
        return torch.version.cuda

    def graph_capture(self) -> Optional[GraphCapture]:
        if getattr(self, "_graphs", None) is None:
            self._graphs = GraphCapture(torch.cuda.CUDAGraph, torch.cuda.graph)
        return self._graphs

    @contextlib.contextmanager
    def counting_host_syncs(self):
        with _sync_warnings(torch.cuda.get_sync_debug_mode, torch.cuda.set_sync_debug_mode) as waits:
            yield waits


class MpsBackend(Backend):
    """Apple GPUs through torch.mps (no memory query, so chunk batching stays at 1)."""

    kind = "mps"
    auto_rank = 2

    def is_available(self) -> bool:
        return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()

    def unavailable_reason(self) -> str:
        return "MPS is not available: it needs macOS 12.3+ on Apple silicon with an MPS build of torch"

    def device_count(self) -> int:
        return 1 if self.is_available() else 0

    def torch_device(self, index: Optional[int]) -> torch.device:
        return torch.device("mps")

    def synchronize(self, index: Optional[int] = None) -> None:
        torch.mps.synchronize()

    def empty_cache(self) -> None:
        torch.mps.empty_cache()

    def manual_seed(self, seed: int) -> None:
        torch.mps.manual_seed(seed)

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        return dtype in (torch.float32, torch.float16)


class NpuBackend(Backend):
    """Ascend NPUs through torch_npu, imported on first use (it needs CANN's set_env.sh to have been sourced).

    Every method asks ``torch.npu`` (registered by importing torch_npu). CI runs these bodies against a fake
    ``torch.npu``; real NPU runs are out of CI.
    """

    kind = "npu"
    ray_resource = "NPU"
    extension = "torch_npu"
    batches_by_default = True
    indexed = True
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    auto_rank = 0
    onnx_provider = "CANNExecutionProvider"
    onnx_wheel = "onnxruntime-cann"
    # Written out (two products and a softmax: ops every torch_npu line has) rather than through the math
    # decomposition sdpa takes on a device without a fused kernel for one query row (docs/performance.md).
    step_attention = "eager"

    def __init__(self) -> None:
        self._module = None
        self._extension = None  # the torch_npu module, once imported
        self._import_error: Optional[BaseException] = None
        self._graphs: Optional[GraphCapture] = None
        self._settings: Optional[dict] = None

    def _npu(self):
        """Import torch_npu once and return ``torch.npu``; raise DeviceError with the fix when it cannot load."""
        if self._module is None and self._import_error is None:
            import_torch()  # torch_npu imports torch: a broken torch import is raised as it was, not retried
            try:
                self._extension = importlib.import_module("torch_npu")
                self._module = torch.npu  # registered by torch_npu
            except Exception as exc:  # torch_npu can raise far more than ImportError without CANN
                self._import_error = exc
        if self._module is None:
            raise DeviceError(self.unavailable_reason()) from self._import_error
        return self._module

    def is_available(self) -> bool:
        try:
            return bool(self._npu().is_available())
        except DeviceError:
            return False

    def unavailable_reason(self) -> str:
        cause = f" ({type(self._import_error).__name__}: {self._import_error})" if self._import_error else ""
        return (
            f"torch_npu is not importable{cause}: source <CANN>/set_env.sh (e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh) "
            f"and install the torch_npu matching torch {torch.__version__} (pip install -e \".[npu]\")"
        )

    def device_count(self) -> int:
        return int(self._npu().device_count())

    def torch_device(self, index: Optional[int]) -> torch.device:
        self._npu()
        return torch.device("npu") if index is None else torch.device("npu", index)

    def mem_get_info(self, index: int = 0) -> Optional[tuple[int, int]]:
        free, total = self._npu().mem_get_info(index)
        return int(free), int(total)

    def synchronize(self, index: Optional[int] = None) -> None:
        self._npu().synchronize(index)

    def empty_cache(self) -> None:
        self._npu().empty_cache()

    def manual_seed(self, seed: int) -> None:
        self._npu().manual_seed_all(seed)

    def name(self, index: int = 0) -> str:
        return str(self._npu().get_device_name(index))

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        """bf16 only where torch_npu says so (``is_bf16_supported``) or a tiny bf16 matmul runs; else no."""
        if dtype == torch.bfloat16:
            probe = getattr(self._npu(), "is_bf16_supported", None)
            return bool(probe()) if probe is not None else _probe_matmul(self.kind, dtype)
        return dtype in (torch.float32, torch.float16)

    def max_memory_allocated(self, index: int = 0) -> Optional[int]:
        return int(self._npu().max_memory_allocated(index))

    def reset_peak_memory_stats(self, index: int = 0) -> None:
        self._npu().reset_peak_memory_stats(index)

    def version(self) -> Optional[str]:
        self._npu()
        return getattr(self._extension, "__version__", None)

    def graph_capture(self) -> Optional[GraphCapture]:
        """``torch.npu.NPUGraph`` and ``torch.npu.graph`` exist in every torch_npu (a dummy class where the build
        has no capture), so their presence proves nothing: whether capture works shows at ``capture_begin``
        (``GraphCapture.check`` tries one)."""
        npu = self._npu()
        if self._graphs is None:
            self._graphs = GraphCapture(npu.NPUGraph, npu.graph)
        return self._graphs

    def apply_process_settings(self) -> dict:
        """Apply the eager-NPU process settings once; return them as torch_npu reads them back (DeviceError where
        it holds another value than the one given).

        ``jit_compile=False`` runs prebuilt binary kernels instead of compiling an operator for every new shape
        (the growing KV length would otherwise compile each frame); internal formats off keeps tensors in ND
        layout. ``MOSS_NPU_JIT_COMPILE=1`` / ``MOSS_NPU_ALLOW_INTERNAL_FORMAT=1`` override them.
        """
        if self._settings is None:
            npu = self._npu()
            wanted = {name: os.environ.get(variable, "0") == "1" for name, (variable, _) in _NPU_OPTIONS.items()}
            npu.set_compile_mode(jit_compile=wanted["jit_compile"])
            # torch.npu.config has a __setattr__ only (it forwards the write to _npu_setOption): nothing to read
            npu.config.allow_internal_format = wanted["allow_internal_format"]
            self._settings = {name: self._option(option) for name, (_, option) in _NPU_OPTIONS.items()}
            for name, value in self._settings.items():
                if value is not None and value != wanted[name]:
                    raise DeviceError(f"torch_npu kept {_NPU_OPTIONS[name][1]}={value} after it was set to "
                                      f"{wanted[name]}: the installed torch_npu ignores this setting; report it "
                                      f"with the output of `python -m moss_npu.doctor --device npu:0`")
        return self._settings

    def _option(self, option: str) -> Optional[bool]:
        """Read an option back from torch_npu's own store (``torch_npu._C._npu_getOption``: b"enable" /
        b"disable"); None where the store does not hold it."""
        value = self._extension._C._npu_getOption(option)
        return None if value is None else value.decode() == "enable"

    def process_settings(self) -> dict:
        return dict(self._settings or {})

    def runtime_version(self) -> Optional[str]:
        """CANN's version as torch_npu reads it (``torch.npu.utils.get_cann_version``, in every supported line)."""
        return str(self._npu().utils.get_cann_version())

    def version_mismatch(self) -> Optional[str]:
        """torch_npu X.Y.Z[.postN] is built for torch X.Y.Z only."""
        ours, theirs = self.version(), torch.__version__
        if ours is None or _release(ours) == _release(theirs):
            return None
        return (f"torch_npu {ours} is built for torch {_release(ours)}, not {theirs}: install the matching pair "
                f"(pip install torch=={_release(ours)}, or the torch_npu for torch {_release(theirs)})")

    @contextlib.contextmanager
    def counting_host_syncs(self):
        npu = self._npu()
        with _sync_warnings(npu.get_sync_debug_mode, npu.set_sync_debug_mode) as waits:
            yield waits


def _release(version: str) -> str:
    """``2.1.0`` of ``2.1.0.post13``, ``2.5.1rc1`` or ``2.1.0+cpu``."""
    return re.match(r"\d+(?:\.\d+)*", version).group(0)


@contextlib.contextmanager
def _sync_warnings(get_mode, set_mode):
    """``set_sync_debug_mode("warn")`` of torch.cuda or torch.npu for the block: each operation that waits for
    the device warns; the warnings are collected into the list yielded."""
    previous = get_mode()
    waits: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_mode("warn")
        try:
            yield waits
        finally:
            set_mode(previous)
            waits.extend(str(w.message) for w in caught if "synchroniz" in str(w.message).lower())


# The NPU process settings: report name -> (the environment variable that turns it on, torch_npu's option name).
_NPU_OPTIONS = {"jit_compile": ("MOSS_NPU_JIT_COMPILE", "jitCompile"),
                "allow_internal_format": ("MOSS_NPU_ALLOW_INTERNAL_FORMAT", "ALLOW_INTERNAL_FORMAT")}
_BACKENDS: dict[str, Backend] = {}
_PROBED: dict[tuple[str, torch.dtype], bool] = {}


def import_torch():
    """Import torch and return it, the way every command should first import it: DeviceError where an installed
    device extension broke the import (``extension_failure``), raised again on every later call."""
    if isinstance(torch, _TorchOnFirstUse):
        return torch.module()
    import torch as module  # already imported: this asks sys.modules, which a caller may have emptied of torch

    return module


def extension_failure(exc: BaseException) -> Optional[DeviceError]:
    """The DeviceError, with its fix, for an ``import torch`` that a device extension broke, else None.

    torch >= 2.5 imports every ``torch.backends`` entry point when it is imported; torch_npu >= 2.5 installs one,
    and without CANN's environment its import fails (a CANN library is missing), so ``import torch`` raises
    ``RuntimeError: Failed to load the backend extension: torch_npu ...`` whatever device was asked for.
    """
    for error in (exc, exc.__cause__, exc.__context__):
        if isinstance(error, RuntimeError) and str(error).startswith(_EXTENSION_FAILED):
            name = str(error)[len(_EXTENSION_FAILED):].split(". ")[0].rstrip(".")
            cause = error.__cause__
            detail = f" ({type(cause).__name__}: {str(cause).strip().splitlines()[0]})" if cause and str(cause).strip() else ""
            cann = ("source <CANN>/set_env.sh (e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh) to use the NPU, or "
                    if name == NpuBackend.extension else "")
            return DeviceError(f"torch cannot be imported: it loads the installed device extension {name}, which "
                               f"failed{detail}; {cann}set TORCH_DEVICE_BACKEND_AUTOLOAD=0 to run without it "
                               "(--device cpu or cuda)")
    return None


def register_backend(kind: str, obj: Optional[Backend]) -> None:
    """Install ``obj`` as the backend for ``kind`` (None restores the built-in one): how tests inject a stand-in
    NPU."""
    if kind not in Backend.builtin:
        raise DeviceError(f"unknown device kind {kind!r}: use one of {', '.join(Backend.builtin)}")
    if obj is None:
        _BACKENDS.pop(kind, None)
    else:
        _BACKENDS[kind] = obj


def get_backend(kind: str) -> Backend:
    """Return the backend object for a device kind (``cpu``, ``cuda``, ``mps``, ``npu``)."""
    if kind not in _BACKENDS:
        if kind not in Backend.builtin:
            raise DeviceError(f"unknown device kind {kind!r}: use one of {', '.join(Backend.builtin)}")
        _BACKENDS[kind] = Backend.builtin[kind]()
    return _BACKENDS[kind]


def backend(device: torch.device | str) -> Backend:
    """Return the backend that answers questions about ``device``."""
    return get_backend(torch.device(device).type if not isinstance(device, torch.device) else device.type)


def parse_device(spec: Optional[str] = "auto") -> tuple[str, Optional[int]]:
    """Split a user's device string into (kind, index) without importing torch; None/"" mean ``auto``.
    DeviceError for an unknown kind or an index that is not a number."""
    text = (spec or "auto").strip().lower()
    if text == "auto":
        return "auto", None
    kind, _, index_text = text.partition(":")
    if kind not in Backend.builtin:
        raise DeviceError(f"--device {spec}: unknown device; use auto, cpu, cuda[:N], npu[:N] or mps")
    if index_text.startswith("-") and index_text[1:].isdigit():
        raise DeviceError(f"--device {spec}: the index must be >= 0, e.g. {kind}:0")
    if index_text and not index_text.isdigit():
        raise DeviceError(f"--device {spec}: the index must be a number, e.g. {kind}:0")
    return kind, int(index_text) if index_text else None


def replica_device(kind: str, cpus: float) -> tuple[str, dict]:
    """The device a Ray Serve replica owning one device of ``kind`` uses, and the Ray actor options that reserve it.

    Ray makes the one device it hands a replica visible as index 0, so the replica speaks on ``kind:0``; a CPU
    replica reserves ``cpus`` cores instead. DeviceError for a kind Ray cannot schedule (mps, auto).
    """
    if kind == "cpu":
        return "cpu", {"num_cpus": cpus}
    resource = Backend.builtin[kind].ray_resource if kind in Backend.builtin else None
    if resource is None:
        raise DeviceError(f"--device {kind}: Ray schedules only cpu, cuda and npu replicas; name one of them")
    options: dict = {"num_cpus": 1}
    if resource == "GPU":
        options["num_gpus"] = 1
    else:
        options["resources"] = {resource: 1}
    return f"{kind}:0", options


def resolve_device(spec: Optional[str] = "auto") -> torch.device:
    """Turn a user's device string into a usable torch.device, or raise DeviceError with the fix.

    Accepts ``auto`` (npu > cuda > mps > cpu), ``cpu``, ``cuda``, ``cuda:1``, ``npu``, ``npu:0``, ``mps``.
    """
    kind, index = parse_device(spec)
    if kind == "auto":
        for kind in auto_order():
            b = get_backend(kind)
            if b.is_available() and b.device_count() > 0:
                b.apply_process_settings()
                return b.torch_device(0 if b.indexed else None)
        return torch.device("cpu")
    b = get_backend(kind)
    if not b.is_available():
        raise DeviceError(f"--device {spec}: {b.unavailable_reason()}")
    count = b.device_count()
    if index is not None and index >= count:
        visible = os.environ.get(b.visible_devices_env) if b.visible_devices_env else None
        where = f" ({b.visible_devices_env}={visible})" if visible else ""
        choices = " or ".join(f"{kind}:{i}" for i in range(count)) or "another device"
        raise DeviceError(f"--device {spec}: only {count} {kind.upper()}s visible{where}; use {choices}")
    if index is None and b.indexed:
        index = 0
    b.apply_process_settings()
    return b.torch_device(index)


def auto_order() -> list[str]:
    """Return the kinds ``--device auto`` tries, first choice first (each backend's ``auto_rank``)."""
    ranked = [cls for cls in Backend.builtin.values() if cls.auto_rank is not None]
    return [cls.kind for cls in sorted(ranked, key=lambda cls: cls.auto_rank)]


def resolve_dtype(device: torch.device, name: Optional[str] = None) -> torch.dtype:
    """Return the compute dtype for ``name`` on ``device`` (None/auto: fp32, accuracy first)."""
    if name in (None, "", "auto"):
        return torch.float32  # everywhere: accuracy first
    if name not in DTYPES:
        raise DeviceError(f"--dtype {name}: unknown dtype; use float32, bfloat16 or float16")
    dtype = getattr(torch, DTYPES[name])
    b = backend(device)
    if not b.supports_dtype(dtype):
        raise DeviceError(f"--dtype {name}: not supported on {device} ({b.name(_index(device))}); use float32")
    return dtype


def warn_if_bf16_is_emulated(device: torch.device, dtype: torch.dtype, who: str) -> None:
    """Warn once where ``who`` will run torch's own bf16 arithmetic on a CPU without native bf16 (emulated:
    slower than float32). The native CPU step never does: its bf16 is bf16 weights with float32 arithmetic."""
    if device.type == "cpu" and dtype == torch.bfloat16 and backend(device).native_bf16() is False:
        log.warning("%s: this CPU (%s) has no native bf16 (AVX512-BF16, AMX or ARM BF16): torch emulates it, "
                    "slower than float32; use --dtype float32", who, backend(device).name())


def attention_impl(requested: Optional[str] = None) -> str:
    """Return the attention implementation name, the same on every device and dtype: ``sdpa``; ``eager`` only when
    asked for.

    ``flash_attention_2`` (what the official config.json asks for) is never used: it needs CUDA and the
    flash-attn package, and sdpa computes the same function.
    """
    if requested in (None, "", "auto", "sdpa", "flash_attention_2"):
        return "sdpa"
    if requested == "eager":
        return "eager"
    raise DeviceError(f"attention implementation {requested!r} is unknown; use sdpa or eager")


def chunk_batch_size(device: torch.device, chunks: int, gb_per_sample: float, max_batch: int = 0) -> int:
    """Return how many text chunks to generate at once: 90 % of free memory over the per-sample need.

    Capped by the chunk count and by ``max_batch`` when that is > 0. On backends that do not batch by
    default (the CPU) the answer is 1 unless the user asked for batching with ``max_batch``.
    """
    if chunks <= 1:
        return 1
    b = backend(device)
    if not b.batches_by_default and max_batch <= 0:
        return 1
    info = b.mem_get_info(_index(device))
    size = 1
    if info is not None and gb_per_sample > 0:
        size = int(math.floor(0.9 * info[0] / (gb_per_sample * _GIB)))
    size = max(1, min(size, chunks))
    return min(size, max_batch) if max_batch > 0 else size


# Device kind (and "cann", onnxruntime's name for the NPU provider) -> execution provider, from the backends.
ONNX_PROVIDERS = {kind: cls.onnx_provider for kind, cls in Backend.builtin.items() if cls.onnx_provider}
ONNX_PROVIDERS["cann"] = NpuBackend.onnx_provider


def onnx_provider_wheel(provider: str) -> str:
    """Return the pip package that brings an onnxruntime execution provider, for the fix in error messages."""
    return next((cls.onnx_wheel for cls in Backend.builtin.values() if cls.onnx_provider == provider),
                "an onnxruntime build with it")


def onnx_provider(kind: str) -> str:
    """Return the onnxruntime execution provider for a device kind (``cpu``, ``cuda``, ``npu``/``cann``)."""
    if kind not in ONNX_PROVIDERS:
        raise DeviceError(f"ONNX provider {kind!r} is unknown; use one of {', '.join(ONNX_PROVIDERS)}")
    return ONNX_PROVIDERS[kind]


def seed_everything(seed: int, device: torch.device) -> None:
    """Seed the host generator and ``device``'s generators (CLIs only: the library passes generators)."""
    torch.manual_seed(seed)
    backend(device).manual_seed(seed)


def describe(device: torch.device) -> dict:
    """Return the device's name and the versions that matter for a report."""
    b = backend(device)
    info = {"device": str(device), "name": b.name(_index(device)), "torch": torch.__version__}
    version = b.version()
    if b.extension is not None and version is not None:
        info[b.extension] = version
    return {**info, **settings_report(device)}


def settings_report(device: torch.device) -> dict:
    """``{"process_settings": ...}``: the settings ``device``'s backend gave its extension, as read back (what
    ``/health`` shows of a worker); empty where none were applied."""
    settings = backend(device).process_settings()
    return {"process_settings": settings} if settings else {}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else 0


def _probe_matmul(kind: str, dtype: torch.dtype) -> bool:
    """Try one tiny matmul once: some torch builds lack half-precision kernels on some devices."""
    key = (kind, dtype)
    if key not in _PROBED:
        try:
            a = torch.ones(2, 2, dtype=dtype, device=kind)
            _PROBED[key] = bool(torch.isfinite((a @ a).float()).all())
        except Exception:  # a missing kernel raises RuntimeError or NotImplementedError depending on version
            _PROBED[key] = False
    return _PROBED[key]
