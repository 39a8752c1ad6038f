"""What every command-line tool shares: one-line usage errors, the exit-code policy, signals and log lines.

Policy (``moss_npu.errors``): 0 success; 2 bad usage or input; 1 a run that failed on valid input (including
errors nobody foresaw); 130 interrupted (Ctrl-C, SIGTERM, SIGHUP). Whatever goes wrong, stderr gets exactly one
``error: ...`` line and no traceback; ``MOSS_NPU_DEBUG=1`` adds the traceback for bug reports. Temp files are
removed because signals arrive as ``KeyboardInterrupt``, which unwinds every ``with`` block and ``finally``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import math
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Iterator, Optional

from moss_npu.device import extension_failure
from moss_npu.errors import RUNTIME_FAILURE, InputError, Interrupted, MossNpuError, OutputError
from moss_npu.extras import missing_optional_part

DEBUG_ENV = "MOSS_NPU_DEBUG"
_SIGNAL_NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}
if hasattr(signal, "SIGHUP"):
    _SIGNAL_NAMES[signal.SIGHUP] = "SIGHUP (terminal closed)"


def process_seconds() -> Optional[float]:
    """Return the seconds since this process started (what a user waited since the command), None where the
    system does not say: Linux's start time of the process (``/proc/self/stat``, in clock ticks since boot,
    10 ms here) against the clock since boot, so the interpreter's own start-up and every import count."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, counted from field 3 (after the name)
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux
        return None


class ArgumentParser(argparse.ArgumentParser):
    """``argparse`` that reports a usage error as one ``error:`` line (exit 2) instead of usage + message."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if message.startswith("argument "):  # "argument --seed: -1 is out of range" -> "--seed -1 is out of range"
            flag, _, rest = message[len("argument "):].partition(": ")
            message = f"{flag.split('/')[0]} {rest}"
        self.exit(2, f"error: {message}; see {self.prog} --help\n")


def int_in(low: int, high: int) -> Callable[[str], int]:
    """Return an argparse type: an integer in ``low..high`` (a bound, so no value asks for a giant allocation)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range; use {low} .. {high}")
        return value

    return parse


def finite_float(text: str) -> float:
    """argparse type: a finite float (``nan`` and ``inf`` are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


def device_problem(text: str) -> Optional[str]:
    """Return what is wrong with the syntax of a device string (``kind`` or ``kind:N``, N >= 0), or None.

    The kinds themselves are checked by moss_npu.device; this catches ``npu:-1`` and ``npu:x`` early.
    """
    kind, sep, index = text.strip().partition(":")
    if not kind or (sep and not index.lstrip("-").isdigit()):
        return f"{text}: use auto, cpu or a device kind with an optional index >= 0"
    if sep and int(index) < 0:
        return f"{text}: the device index must be >= 0, e.g. {kind}:0"
    return None


def device_spec(text: str) -> str:
    """argparse type: a device string that passes ``device_problem``."""
    problem = device_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text.strip()


def read_utf8(path: Path, flag: str) -> str:
    """Read a UTF-8 text file (a byte-order mark allowed; ``-`` is stdin) or raise InputError naming the problem."""
    try:
        data = sys.stdin.buffer.read() if str(path) == "-" else Path(path).read_bytes()
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"{flag} {path}: not UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
                         "save it as UTF-8") from None
    except OSError as exc:
        raise InputError(f"{flag} {path}: cannot read ({exc.strerror}); check the file") from None
    if "\x00" in text:
        raise InputError(f"{flag} {path}: holds NUL bytes (a binary file?); pass a UTF-8 text file")
    return text


def check_utf8_text(text: str, flag: str) -> None:
    """Refuse text holding undecodable bytes (a shell in a non-UTF-8 locale passes them as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(f"{flag}: character {exc.start} is an undecodable byte, not UTF-8 text; set a UTF-8 "
                         "locale (e.g. LANG=C.UTF-8) or pass --text-file FILE in UTF-8") from None


class _SignalState:
    """Which signal interrupted the run (the handler only records it and raises)."""

    def __init__(self) -> None:
        self.name: Optional[str] = None

    def handle(self, signum: int, frame) -> None:
        if self.name is not None:
            return  # a second signal while cleaning up: let the cleanup finish
        self.name = _SIGNAL_NAMES.get(signum, f"signal {signum}")
        raise KeyboardInterrupt(self.name)


@contextlib.contextmanager
def _signals_interrupt(state: _SignalState) -> Iterator[None]:
    """Turn SIGINT, SIGTERM and SIGHUP into KeyboardInterrupt for the duration of the block (main thread only)."""
    previous = {}
    try:
        for signum in _SIGNAL_NAMES:
            previous[signum] = signal.signal(signum, state.handle)
    except ValueError:  # not the main thread (an embedding application): keep its handlers
        pass
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def one_line(text: str) -> str:
    """Join a possibly multi-line message into one line."""
    return "; ".join(part.strip() for part in str(text).splitlines() if part.strip())


def describe_failure(exc: BaseException) -> tuple[str, int]:
    """Return the ``error:`` message and exit code for any exception a CLI body let escape."""
    if isinstance(exc, ModuleNotFoundError) and missing_optional_part(exc) is not None:
        exc = missing_optional_part(exc)  # an optional part is not installed: bad input, naming the install
    exc = extension_failure(exc) or exc  # an `import torch` that an installed torch_npu broke
    if isinstance(exc, MossNpuError):
        return one_line(str(exc)), exc.exit_code
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        where = f" writing {exc.filename}" if exc.filename else " (writing stdout or a file)"
        return f"no space left on the device{where}; free some space or write somewhere else", RUNTIME_FAILURE
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc):
        return ("out of memory; use a smaller --max-new-frames or --tts-max-batch-size, or shorter text",
                RUNTIME_FAILURE)
    detail = one_line(str(exc)) or "no message"
    return (f"unexpected {type(exc).__name__}: {detail} (a bug: rerun with {DEBUG_ENV}=1 for the traceback "
            "and report it)", RUNTIME_FAILURE)


def run_cli(body: Callable[[], int]) -> int:
    """Run a CLI body under the exit-code policy and return its exit code; never lets a traceback out.

    ``body`` returns the code of a run that finished (0, or 1 when e.g. a threshold failed).
    """
    _fill_closed_std_fds()
    state = _SignalState()
    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        with _signals_interrupt(state):
            return body()
    except SystemExit as done:  # argparse: --help (0) or a usage error it already printed (2)
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 2)
    except KeyboardInterrupt:
        exc: BaseException = Interrupted(f"interrupted by {state.name or 'Ctrl-C'}; nothing was written")
    except BrokenPipeError:
        _silence_stdout()  # stdout went to a closed pipe (e.g. `| head`); the interpreter must not retry it
        exc = OutputError("stdout was closed before the result was printed (files already written are complete)")
    except BaseException as caught:  # noqa: BLE001 - the policy: one line for every failure
        exc = caught
        if debug:
            traceback.print_exc()
    message, code = describe_failure(exc)
    _to_stderr(f"error: {message}")
    return code


def _fill_closed_std_fds() -> None:
    """Open /dev/null on a closed fd 0, 1 or 2 (``2>&-``), so no file we open becomes "stderr" by accident."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            opened = os.open(os.devnull, os.O_RDWR)
            if opened != fd:  # a lower fd was free as well; it is filled on its own turn
                os.dup2(opened, fd)
                os.close(opened)


def _to_stderr(text: str) -> None:
    """Print one line on stderr, or nowhere when the process has none (print(file=None) would use stdout)."""
    if sys.stderr is not None:
        print(text, file=sys.stderr, flush=True)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail again."""
    with contextlib.suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


class _LineFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        label = "warning" if record.levelno >= logging.WARNING else "info"
        return f"{label}: {one_line(record.getMessage())}"


class _StderrHandler(logging.StreamHandler):
    """A stream handler that writes to whatever ``sys.stderr`` is when a record is emitted.

    Binding the stream once would keep writing to a stderr that was since replaced (and perhaps closed) by
    whoever swapped it: an embedding program, or a test harness capturing output.
    """

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; the live sys.stderr wins
        pass

    def emit(self, record: logging.LogRecord) -> None:
        """Write the line above any progress bar on stderr, which is drawn again below it."""
        from tqdm import tqdm

        with tqdm.external_write_mode(file=sys.stderr):
            super().emit(record)


def configure_logging(verbose: bool = False) -> None:
    """Show library warnings as ``warning: ...`` lines on stderr (info lines too when ``verbose``).

    Records still propagate, so a program that configured the root logger (or a test's log capture) sees them.
    """
    handler = _StderrHandler()
    handler.setFormatter(_LineFormatter())
    root = logging.getLogger("moss_npu")
    root.handlers = [handler]
    root.setLevel(logging.INFO if verbose else logging.WARNING)


def warn(message: str) -> None:
    """Print one ``warning:`` line on stderr (a run that succeeded but deserves a look)."""
    _to_stderr(f"warning: {one_line(message)}")
