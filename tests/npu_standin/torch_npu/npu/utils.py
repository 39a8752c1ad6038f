"""``torch.npu.utils`` of the stand-in: the CANN version query and the sync debug mode (torch_npu's names)."""

from .. import _C

MODES = {"default": 0, "warn": 1, "error": 2}


def get_cann_version(module="CANN") -> str:
    return "8.0.0 (stand-in)"


def get_sync_debug_mode() -> int:
    return _C.ext.get_sync_debug_mode()


def set_sync_debug_mode(debug_mode) -> None:
    """0/"default", 1/"warn" (each host sync warns "called a synchronizing NPU operation"), 2/"error"."""
    _C.ext.set_sync_debug_mode(MODES[debug_mode] if isinstance(debug_mode, str) else int(debug_mode))
