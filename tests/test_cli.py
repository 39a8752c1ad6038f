"""The exit-code policy every CLI shares (``moss_npu.cli``): one ``error:`` line, the class's exit code."""

import errno
import inspect
import signal

import pytest

import eval_accuracy
import inference
from bench import run as bench_run
from moss_npu import cli, errors, hub
from moss_npu_verify import goldens
from moss_npu.errors import MossNpuError

EXPECTED = {
    "MossNpuError": 2, "DeviceError": 2, "MissingDependency": 2, "CheckpointError": 2, "ConfigError": 2,
    "AudioError": 2, "AudioTooLong": 2, "InputError": 2, "SettingError": 2, "DownloadError": 1, "NumericalError": 1, "GenerationError": 1, "OutputError": 1,
    "Interrupted": 130,
}
CLASSES = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, MossNpuError)]


def test_every_error_class_is_in_the_policy_table():
    assert sorted(c.__name__ for c in CLASSES) == sorted(EXPECTED)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_error_class_declares_its_exit_code(cls):
    assert "exit_code" in vars(cls), f"{cls.__name__} must state its exit code, not inherit it silently"
    assert cls.exit_code == EXPECTED[cls.__name__]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_cli_maps_the_class_to_its_exit_code(cls, capsys, monkeypatch):
    """Raised from deep inside a run, the class gives its code and one line in inference and eval_accuracy."""
    error = cls("max_new_frames", 0, "the fix") if cls is errors.SettingError else cls("what failed; the fix")

    def boom(*args, **kwargs):
        raise error

    monkeypatch.setattr(inference, "synthesize_nano", boom)
    assert inference.main(["--text", "hi", "--output", "never.wav"]) == cls.exit_code
    monkeypatch.setattr(eval_accuracy, "build_request", boom)
    assert eval_accuracy.main([]) == cls.exit_code
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"error: {error}"] * 2


def test_keyboard_interrupt_is_130_with_one_line(capsys):
    def body():
        raise KeyboardInterrupt

    assert cli.run_cli(body) == 130
    assert capsys.readouterr().err == "error: interrupted by Ctrl-C; nothing was written\n"


def test_sigterm_becomes_an_interrupt_that_unwinds(capsys):
    cleaned = []

    def body():
        try:
            signal.raise_signal(signal.SIGTERM)
        finally:
            cleaned.append(True)
        return 0

    assert cli.run_cli(body) == 130 and cleaned == [True]
    assert "interrupted by SIGTERM" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers restored afterwards


def test_full_disk_and_unexpected_errors_are_one_line_exit_1(capsys, monkeypatch):
    def full():
        raise OSError(errno.ENOSPC, "No space left on device", "/data/out.wav")

    def bug():
        raise ValueError("first line\nsecond line")

    assert cli.run_cli(full) == 1
    assert cli.run_cli(bug) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("error: no space left on the device writing /data/out.wav")
    assert lines[1] == ("error: unexpected ValueError: first line; second line (a bug: rerun with MOSS_NPU_DEBUG=1 "
                        "for the traceback and report it)")
    assert len(lines) == 2
    monkeypatch.setenv("MOSS_NPU_DEBUG", "1")
    assert cli.run_cli(bug) == 1
    assert "Traceback" in capsys.readouterr().err


def test_a_missing_optional_part_is_one_line_naming_its_install_exit_2(capsys):
    """torch absent in a torch-free Delay install is bad input for a Nano command, not an unexpected bug; a module
    of no optional part stays a bug (exit 1)."""
    def needs(name):
        def body():
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return body

    assert cli.run_cli(needs("torch")) == 2
    assert cli.run_cli(needs("onnx.helper")) == 2
    assert cli.run_cli(needs("no_such_module")) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == 'error: this needs torch, which is not installed here; install it with `pip install -e ".[nano]"`'
    assert lines[1].endswith('`pip install -e ".[onnx]"`')
    assert lines[2].startswith("error: unexpected ModuleNotFoundError")


@pytest.mark.parametrize("main", [inference.main, eval_accuracy.main, bench_run.main, goldens.main, hub.main],
                         ids=["inference", "eval_accuracy", "bench", "goldens", "hub"])
def test_usage_errors_are_one_line_exit_2(main, capsys):
    assert main(["--no-such-flag"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "--help" in err[0], err


@pytest.mark.parametrize("text,ok", [("cpu", True), ("npu:0", True), ("auto", True), ("npu:-1", False),
                                     ("npu:x", False), (":0", False), ("", False)])
def test_device_spec_syntax(text, ok):
    if ok:
        assert cli.device_spec(text) == text
    else:
        with pytest.raises(Exception, match=">= 0" if "-1" in text else "index"):
            cli.device_spec(text)


def test_numeric_flag_types():
    assert cli.int_in(0, 2**63 - 1)("9223372036854775807") == 2**63 - 1
    for bad in ("-1", "9223372036854775808", "1.5"):
        with pytest.raises(Exception):
            cli.int_in(0, 2**63 - 1)(bad)
    for bad in ("nan", "inf", "-inf", "x"):
        with pytest.raises(Exception):
            cli.finite_float(bad)
    assert cli.finite_float("0.5") == 0.5


@pytest.mark.parametrize("exc", [MemoryError(), RuntimeError("NPU out of memory. Tried to allocate 2.00 GiB")],
                         ids=["host", "device"])
def test_out_of_memory_is_one_line_with_what_to_lower(exc, capsys):
    def body():
        raise exc

    assert cli.run_cli(body) == 1
    assert capsys.readouterr().err.startswith("error: out of memory; use a smaller --max-new-frames")
