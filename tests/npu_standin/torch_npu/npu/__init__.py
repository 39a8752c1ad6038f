"""``torch.npu`` of the stand-in: the names and signatures of torch_npu's own module (2.5.1) that the product and
torch call, answered by the stand-in device."""

import gc

import torch

from .. import _C
from . import utils
from .config import NpuConfig
from .utils import get_sync_debug_mode, set_sync_debug_mode

_ext = _C.ext
config = NpuConfig()


def _index(device=None) -> int:
    if device is None:
        return _ext.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return _ext.current_device() if device.index is None else device.index


def is_available() -> bool:
    return _ext.device_count() > 0


def is_initialized() -> bool:
    return True


def _lazy_init() -> None:
    pass


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return _ext.device_count()


def current_device() -> int:
    return _ext.current_device()


def set_device(device) -> None:
    _ext.set_device(_index(device))


def synchronize(device=None) -> None:
    _ext.synchronize()


def empty_cache() -> None:
    pass


def get_device_name(device_name=None) -> str:
    return f"Ascend910B4 (stand-in npu:{_index(device_name)})"


def is_bf16_supported() -> bool:
    return True


def get_amp_supported_dtype() -> list:
    """The dtypes ``torch.autocast(device_type="npu")`` accepts (torch asks the device module)."""
    return [torch.float16, torch.bfloat16]


def mem_get_info(device=None):
    current, _, total = _ext.memory(_index(device))
    return total - current, total


def memory_allocated(device=None) -> int:
    return _ext.memory(_index(device))[0]


def max_memory_allocated(device=None) -> int:
    return _ext.memory(_index(device))[1]


def reset_peak_memory_stats(device=None) -> None:
    _ext.reset_peak(_index(device))


def default_generator(device=None) -> torch.Generator:
    return _ext.default_generator(_index(device))


def manual_seed(seed) -> None:
    default_generator().manual_seed(int(seed))


def manual_seed_all(seed) -> None:
    for i in range(device_count()):
        _ext.default_generator(i).manual_seed(int(seed))


def seed() -> None:
    default_generator().seed()


def initial_seed() -> int:
    return default_generator().initial_seed()


def get_rng_state(device="npu") -> torch.Tensor:
    return default_generator(device).get_state()


def set_rng_state(new_state, device="npu") -> None:
    default_generator(device).set_state(new_state)


def set_compile_mode(jit_compile=False) -> None:
    _C._npu_setOption({"jitCompile": "enable" if jit_compile else "disable"})


class NPUGraph:
    """torch_npu's NPUGraph: ops between ``capture_begin`` and ``capture_end`` are recorded, run by ``replay``."""

    def __init__(self):
        self._graph = _ext.Graph()

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self._graph.capture_begin(capture_error_mode)

    def capture_end(self):
        self._graph.capture_end()

    def replay(self):
        self._graph.replay()

    def reset(self):
        self._graph.reset()


class graph:
    """torch_npu's ``graph`` context manager (same signature; one stream, so ``stream`` only has to be valid)."""

    def __init__(self, npu_graph, pool=None, stream=None, capture_error_mode="global"):
        self.npu_graph, self.pool, self.capture_error_mode = npu_graph, () if pool is None else (pool,), capture_error_mode

    def __enter__(self):
        synchronize()
        gc.collect()
        empty_cache()
        self.npu_graph.capture_begin(*self.pool, capture_error_mode=self.capture_error_mode)

    def __exit__(self, *exc):
        self.npu_graph.capture_end()


def counters() -> dict:
    """The stand-in's counts since the last ``reset_counters``: ops by name, device->host and host->device copies,
    ``.item()`` calls, graph replays."""
    return _ext.counters()


def reset_counters() -> None:
    _ext.reset_counters()
