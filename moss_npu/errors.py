"""Errors a user can act on.

The library raises these and never prints or exits; only the CLIs catch ``MossNpuError`` and turn it into one
``error: ...`` line and exit code 2. Each message says what failed, the value seen, and the fix.
"""


class MossNpuError(Exception):
    """Base class of every error whose cause the user can fix."""


class DeviceError(MossNpuError):
    """A device is unknown, unavailable, or cannot do what was asked (dtype, memory)."""


class MissingDependency(DeviceError):
    """An optional package is not installed; the message names the command that installs it."""


class CheckpointError(MossNpuError):
    """A model folder is missing files or holds weights that do not match its config."""


class ConfigError(MossNpuError):
    """A config file or preset holds unknown keys or values out of range."""


class AudioError(MossNpuError):
    """Reference audio is missing, unreadable, empty, too short or silent."""


class InputError(MossNpuError):
    """Text, mode or generation parameters are invalid."""


class NumericalError(MossNpuError, RuntimeError):
    """Logits became non-finite (usually bf16/fp16 overflow); running in float32 fixes it."""
