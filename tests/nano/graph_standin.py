"""A stand-in device-graph capture that freezes what a real graph freezes.

A CUDA/NPU graph records the kernels a function launches, each with its arguments: tensors by address, every
other value (a Python int, a slice bound, a shape) as it was at capture. A replay runs those kernels again on
whatever the addressed memory then holds; the Python function is not run again. A frame that reads host state
(a Python counter, a list, a ``.item()``) therefore replays with the value of the capture.

``FrozenCapture`` does the same on the CPU with torch's dispatch layer: capture runs the function once under a
recording mode, keeping every aten call with its arguments (tensors are kept by object, so by address), then puts
back every tensor the run wrote, as a real capture executes nothing. A replay calls the recorded ops in order
with the recorded arguments and writes each result into the tensor the capture produced (an intermediate keeps
its address, as in a graph's memory pool). Host reads during capture (``.item()``, ``bool(tensor)``) raise, as
they do on a capturing stream.

Each replay is also checked: the frame is first run as Python would run it now, on a copy of what it writes, and
the replay must leave exactly the same values (NaN for NaN). A frame that reads host state after capture gives
other values there and the replay raises, whether or not the codes of a tiny test model happen to change.

What it cannot see: work outside torch's dispatcher (numpy, ctypes kernels), so the frame must run its torch ops
(the decoder's CPU step is off on this stand-in device, as on a real one); and device-specific limits (which
kernels a driver can capture, memory pools, streams), which only hardware shows.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from moss_npu import device as devices

_aten = torch.ops.aten
HOST_READS = (_aten._local_scalar_dense.default, _aten.item.default, _aten.is_nonzero.default, _aten.equal.default,
              _aten.nonzero.default)


def _written(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an aten call writes (its schema's mutable arguments, ``out=`` included)."""
    tensors = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        tensors += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return tensors


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))


class _Recorder(TorchDispatchMode):
    """Keeps every aten call of a capture, the contents of each tensor before its first write, and the memory the
    capture allocated (what it writes elsewhere is the state it shares with the eager code)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []  # (func, args, kwargs, result)
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.allocated: set[int] = set()  # storage addresses of the tensors the capture created

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            raise RuntimeError(f"{func}: a host read of device values while capturing (operation not permitted "
                               "when stream is capturing)")
        for tensor in _written(func, args, kwargs):
            self.saved.append((tensor, tensor.clone()))
        result = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, result))
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        for out in tree_flatten(result)[0]:
            if isinstance(out, torch.Tensor) and not any(_same_memory(out, t) for t in inputs):
                self.allocated.add(out.untyped_storage().data_ptr())
        return result

    def shared(self) -> list[torch.Tensor]:
        """The tensors the capture wrote that it did not create: the frame's outputs into the decoder's state."""
        return [t for t, _ in self.saved if t.untyped_storage().data_ptr() not in self.allocated]


class FrozenCapture(devices.GraphCapture):
    """The stand-in capture API: ``capture(fn)`` records, returns a replay of the recorded ops (see the module).

    ``captures`` counts captures and ``replays`` replays; ``fail`` makes capture raise like a driver without graph
    support.
    """

    def __init__(self, fail: bool = False) -> None:
        super().__init__(None, None)
        self.fail, self.captures, self.replays = fail, 0, 0

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        recorder = _Recorder()
        try:
            with recorder:
                fn()
        finally:
            for tensor, before in reversed(recorder.saved):  # a capture runs nothing: undo what it wrote
                tensor.copy_(before)
        self.captures += 1
        ops, shared = recorder.ops, recorder.shared()

        def replay() -> None:
            self.replays += 1
            before = [t.clone() for t in shared]
            fn()  # the frame as Python runs it now: what the replay must reproduce
            eager = [t.clone() for t in shared]
            for tensor, value in zip(shared, before):
                tensor.copy_(value)
            for func, args, kwargs, captured in ops:
                fresh = func(*args, **kwargs)
                for old, new in zip(tree_flatten(captured)[0], tree_flatten(fresh)[0]):
                    if isinstance(old, torch.Tensor) and not _same_memory(old, new):
                        old.copy_(new)
            for index, (tensor, want) in enumerate(zip(shared, eager)):
                if not _same(tensor, want):
                    raise AssertionError(f"replay {self.replays}: output {index} {tuple(tensor.shape)} differs from "
                                         "the frame run now: the frame reads host state that a graph freezes at "
                                         "capture")
        return replay
