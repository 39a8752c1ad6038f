"""torch_npu's ``torch.npu.config``: a class-level ``__setattr__`` only, forwarding to the option store."""

from .. import _C


class NpuConfig:
    @classmethod
    def __setattr__(cls, name, value):
        if name == "allow_internal_format":
            _C._npu_setOption({"ALLOW_INTERNAL_FORMAT": "enable" if value else "disable"})
