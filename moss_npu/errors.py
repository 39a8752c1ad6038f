"""Errors a user can act on, each with the exit code the command-line tools give it.

The library raises these and never prints or exits. Every CLI turns one into a single ``error: ...`` line and
exits with the class's ``exit_code``: 2 for bad usage or input (nothing ran), 1 for a run that failed on
valid input, 130 for an interrupted run (``moss_npu.cli`` holds that mapping). Each message says what failed,
the value seen, and the fix.
"""

BAD_INPUT = 2
RUNTIME_FAILURE = 1
INTERRUPTED = 130


class MossNpuError(Exception):
    """Base class of every error whose cause the user can fix; by default the input was bad."""

    exit_code = BAD_INPUT


class DeviceError(MossNpuError):
    """A device is unknown, unavailable, or cannot do what was asked (dtype, memory)."""

    exit_code = BAD_INPUT


class MissingDependency(DeviceError):
    """An optional package is not installed; the message names the command that installs it."""

    exit_code = BAD_INPUT


class CheckpointError(MossNpuError):
    """A model folder is missing files or holds weights that do not match its config."""

    exit_code = BAD_INPUT


class ConfigError(MossNpuError):
    """A config file or preset holds unknown keys, values of the wrong type, or values out of range."""

    exit_code = BAD_INPUT


class AudioError(MossNpuError):
    """Reference audio is missing, unreadable, empty, too short, silent or not finite."""

    exit_code = BAD_INPUT


class AudioTooLong(AudioError):
    """Reference audio lasts longer than the limit it was read under (a server answers 413, not 400)."""

    exit_code = BAD_INPUT


class InputError(MossNpuError):
    """Text, mode, output path or generation parameters are invalid."""

    exit_code = BAD_INPUT


class SettingError(InputError):
    """A setting's value is refused. ``setting`` is its field name (``max_new_frames``): the message names it as the
    command line spells it (``--max-new-frames 0: ...``), ``named`` as another front end does (an API's field), so
    no front end edits another's text."""

    exit_code = BAD_INPUT

    def __init__(self, setting: str, value: object, reason: str) -> None:
        self.setting, self.value, self.reason = setting, value, reason
        self.detail = f"{value}: {reason}"
        super().__init__(self.named("--" + setting.replace("_", "-")))

    def named(self, name: str) -> str:
        """Return the message with the setting called ``name``."""
        return f"{name} {self.detail}"


class DownloadError(CheckpointError):
    """A hub download failed on the way (network, mirror, disk) for an id that may well be right."""

    exit_code = RUNTIME_FAILURE


class NumericalError(MossNpuError, RuntimeError):
    """Logits became non-finite (usually bf16/fp16 overflow); running in float32 fixes it."""

    exit_code = RUNTIME_FAILURE


class GenerationError(MossNpuError, RuntimeError):
    """A run on valid input produced nothing usable (e.g. the model stopped before the first audio frame)."""

    exit_code = RUNTIME_FAILURE


class OutputError(MossNpuError):
    """Writing the result failed on a valid path (disk full, I/O error); no partial file is left."""

    exit_code = RUNTIME_FAILURE


class Interrupted(MossNpuError):
    """The run was stopped by Ctrl-C, SIGTERM or SIGHUP; temp files are removed, nothing is written."""

    exit_code = INTERRUPTED

