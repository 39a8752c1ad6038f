"""``inference.py`` end to end on the fixture checkpoints, and its answers to bad input.

Each bad input must give one ``error:`` line naming the problem and the fix, exit code 2, and leave no
output file; a run that produces nothing exits 1. The fixture-based runs skip (with a message) in a clone without ../shared/fixtures.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

import inference
from moss_npu_verify import goldens
from moss_npu.extras import LLAMA_INSTALL
from tests.optional import missing, needs, require

NANO = goldens.fixtures_root() / "nano-tiny"
AUDIO = goldens.fixtures_root() / "audio"
needs_fixtures = needs(NANO.is_dir(), f"fixtures not found at {NANO} (set MOSS_NPU_FIXTURES)")
REPO = Path(__file__).resolve().parent.parent


def run(args, capsys):
    """Run the CLI in-process; return (exit code, stdout, stderr)."""
    code = inference.main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def model_args(tmp_path, *extra):
    return ["--model", NANO / "tts", "--codec", NANO / "codec", "--device", "cpu", "--quiet", *extra]


def assert_valid_wav(path, min_seconds):
    data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    assert rate == 48000 and data.shape[1] == 2
    assert data.shape[0] >= min_seconds * rate
    assert np.abs(data).max() > 0, "the waveform is silent"
    return data


@needs_fixtures
def test_readme_command_as_a_new_user(tmp_path):
    """The README's main command, run as a subprocess from the repo root."""
    out = tmp_path / "a.wav"
    cmd = [sys.executable, "inference.py", "--model", str(NANO / "tts"), "--codec", str(NANO / "codec"),
           "--text", "Hello", "--output", str(out), "--max-new-frames", "8", "--seed", "0"]
    # seeded: an unseeded sampled run of the tiny model may stop before any audio (exit 1 by design)
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out}: ") and "RTF" in done.stdout
    seconds = float(done.stdout.split(": ")[1].split(" s of audio")[0])
    # sampled: up to 8 frames × 80 ms (the normalized "Hello。" may end earlier)
    assert 0 < seconds <= 0.64 and round(seconds / 0.08, 6).is_integer()
    assert_valid_wav(out, seconds)


@needs_fixtures
def test_voice_clone_with_flac_reference_and_long_text(tmp_path, capsys):
    out = tmp_path / "clone.wav"
    text = "The first sentence is here. A second one follows it. And a third closes the text."
    code, stdout, err = run(model_args(tmp_path, "--text", text, "--output", out, "--greedy",
                                       "--prompt-audio-path", AUDIO / "zh_1.wav", "--max-new-frames", "4",
                                       "--voice-clone-max-text-tokens", "8"), capsys)
    assert code == 0, err
    data = assert_valid_wav(out, 0.32)
    # several chunks: 4 frames each plus the pauses between them
    assert data.shape[0] > 2 * 4 * 3840


@needs_fixtures
def test_stream_writes_a_complete_file_equal_to_offline(tmp_path, capsys):
    offline, streamed = tmp_path / "offline.wav", tmp_path / "stream.wav"
    common = model_args(tmp_path, "--text", "Streaming test.", "--greedy", "--max-new-frames", "6")
    assert run(common + ["--output", offline], capsys)[0] == 0
    code, stdout, err = run(common + ["--output", streamed, "--stream"], capsys)
    assert code == 0, err
    assert "first audio after" in stdout
    a, b = assert_valid_wav(offline, 0.48), assert_valid_wav(streamed, 0.48)
    assert a.shape == b.shape
    assert np.max(np.abs(a - b)) < 1e-4


@needs_fixtures
@pytest.mark.parametrize("threads, spare", [(0, 1), (1, 0)], ids=["default", "explicit"])
def test_the_default_threads_lend_the_frames_the_idle_core(tmp_path, capsys, monkeypatch, threads, spare):
    """On two cores the default setting runs one thread and its frames borrow the other; ``--num-threads 1``
    keeps the run on one core."""
    import torch

    from moss_npu.cpu import threads as threads_module
    from moss_npu.tts import MossTTSNano

    loaded, load = [], MossTTSNano.from_pretrained
    monkeypatch.setattr(threads_module, "usable_physical_cores", lambda: 2)
    monkeypatch.setattr(MossTTSNano, "from_pretrained", lambda *a, **k: loaded.append(load(*a, **k)) or loaded[-1])
    before = torch.get_num_threads()
    try:
        args = model_args(tmp_path, "--text", "Hi.", "--greedy", "--max-new-frames", "2", "--stream",
                          "--num-threads", threads, "--output", tmp_path / "out.wav")
        assert run(args, capsys)[0] == 0
        assert torch.get_num_threads() == 1 and loaded[0].spare_threads == spare
    finally:
        torch.set_num_threads(before)


@needs_fixtures
def test_config_preset_and_cli_precedence(tmp_path, capsys):
    preset = tmp_path / "p.yaml"
    preset.write_text("device: cpu\nmax_new_frames: 3\n")
    out = tmp_path / "p.wav"
    code, _, err = run(model_args(tmp_path, "--text", "Hi", "--output", out, "--config", preset, "--greedy",
                                  "--max-new-frames", "5"), capsys)
    assert code == 0, err
    assert sf.info(str(out)).frames == 5 * 3840  # the flag beat the preset's 3 frames


BAD_INPUTS = [
    pytest.param(["--text", "   "], "text is empty", id="whitespace-text"),
    pytest.param(["--text-file", "/nonexistent/t.txt"], "--text-file", id="missing-text-file"),
    pytest.param(["--text", "hi", "--prompt-audio-path", "/nonexistent.wav"], "file not found", id="missing-reference"),
    pytest.param(["--text", "hi", "--device", "tpu"], "unknown device", id="unknown-device"),
    pytest.param(["--text", "hi", "--nq", "17"], "--nq 17", id="nq-out-of-range"),
    pytest.param(["--text", "hi", "--nq", "0"], "--nq 0", id="nq-zero"),
    pytest.param(["--text", "hi", "--audio-temperature", "0"], "temperature", id="temperature-zero"),
    pytest.param(["--text", "hi", "--top-p", "1.5"], "top-p 1.5: outside (0, 1]", id="top-p-above-one"),
    pytest.param(["--text", "hi", "--top-p", "0"], "top-p 0.0: outside", id="top-p-zero"),
    pytest.param(["--text", "hi", "--top-k", "-1"], "top-k -1: outside", id="top-k-negative"),
    pytest.param(["--text", "hi", "--repetition-penalty", "0"], "repetition-penalty 0.0: outside", id="penalty-zero"),
    pytest.param(["--text", "hi", "--config", "/nonexistent.yaml"], "--config", id="missing-config"),
    pytest.param(["--text", "hi", "--text-file", "/etc/hostname"], "not allowed with argument", id="text-and-file"),
    pytest.param(["--text", "hi", "--seed", "-1"], "--seed -1", id="seed-negative"),
    pytest.param(["--text", "hi", "--seed", str(2**63)], "--seed 9223372036854775808", id="seed-too-big"),
    pytest.param(["--text", "hi", "--max-new-frames", "0"], "--max-new-frames 0", id="frames-zero"),
    pytest.param(["--text", "hi", "--max-new-frames", "1000000000"], "1 .. 7500", id="frames-giant"),
    pytest.param(["--text", "hi", "--device", "npu:-1"], "must be >= 0", id="device-index-negative"),
    pytest.param(["--text", "hi", "--top-p", "nan"], "not a finite number", id="top-p-nan"),
    pytest.param(["--text", "hi", "--output", "out.txt"], "unknown audio extension .txt", id="output-extension"),
    pytest.param(["--text", "hi", "--output", "/dev/null"], "is a device file", id="output-dev-null"),
    pytest.param(["--text", "hi", "--output", "x.flac", "--wav-subtype", "PCM_16"], "only applies to .wav",
                 id="wav-subtype-on-flac"),
    pytest.param(["--text", "hi", "--impl", "upstream", "--stream", "--host-rng", "--decoder", "reference"],
                 "--stream, --host-rng, --decoder: not used by --impl upstream", id="upstream-unused-flags"),
    pytest.param(["--text", "hi", "--speed", "5"], "--speed 5.0: out of range; use 0.25 .. 4.0", id="speed-range"),
    pytest.param(["--text", "hi", "--speed", "fast"], "--speed fast is not a number", id="speed-not-a-number"),
    pytest.param(["--text", "hi", "--greedy", "--temperature", "-1", "--audio-top-k", "3"],
                 "--audio-top-k, --temperature: not used with --greedy", id="sampling-values-with-greedy"),
    pytest.param(["--text", "hi", "--weights", "w"], "--weights belong to the llama-cpp backend", id="weights-on-nano"),
    pytest.param(["--text", "hi", "--upstream-code", "c"], "--upstream-code: not used", id="code-on-native"),
    pytest.param(["--text", "hi", "--backend", "llama-cpp", "--stream", "--dtype", "bfloat16", "--nq", "4"],
                 "is not available with the llama-cpp (Delay) backend", id="llama-cpp-unused-flags"),
    pytest.param(["--text", "hi", "--backend", "llama-cpp", "--prompt-text", "x", "--mode", "continuation"],
                 "is not available with the llama-cpp (Delay) backend", id="llama-cpp-continuation"),
]


@needs_fixtures
@pytest.mark.parametrize("extra,fragment", BAD_INPUTS)
def test_bad_input_exits_2_without_output(tmp_path, capsys, extra, fragment):
    out = tmp_path / "never.wav"
    code, stdout, err = run(model_args(tmp_path, "--output", out, "--max-new-frames", "2", *extra), capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], err
    assert not out.exists() and list(tmp_path.iterdir()) == []


@needs_fixtures
@pytest.mark.parametrize("kind", ["empty", "short", "silent", "garbage"])
def test_bad_reference_audio(tmp_path, capsys, kind):
    ref = tmp_path / "ref.wav"
    if kind == "garbage":
        ref.write_bytes(b"this is not audio at all")
    else:
        samples = {"empty": 0, "short": 1000, "silent": 48000}[kind]
        sf.write(str(ref), np.zeros((samples, 1), dtype=np.float32) if kind != "short" else np.full((samples, 1), 0.1, np.float32), 48000)
    out = tmp_path / "out.wav"
    code, _, err = run(model_args(tmp_path, "--text", "hi", "--output", out, "--prompt-audio-path", ref,
                                  "--max-new-frames", "2"), capsys)
    assert code == 2, err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_missing_model_folder(tmp_path, capsys):
    out = tmp_path / "x.wav"
    code, _, err = run(["--model", tmp_path / "nope", "--codec", tmp_path / "nope", "--device", "cpu",
                        "--text", "hi", "--output", out], capsys)
    assert code == 2 and "does not exist" in err and not out.exists()


def test_model_folder_missing_files(tmp_path, capsys):
    (tmp_path / "tts").mkdir()
    (tmp_path / "tts" / "config.json").write_text("{}")
    code, _, err = run(["--model", tmp_path / "tts", "--codec", tmp_path / "tts", "--device", "cpu",
                        "--text", "hi", "--output", tmp_path / "x.wav"], capsys)
    assert code == 2 and "tokenizer.model" in err


def test_output_folder_missing(tmp_path, capsys):
    code, _, err = run(["--text", "hi", "--output", tmp_path / "no" / "such" / "x.wav"], capsys)
    assert code == 2 and "does not exist" in err


def test_output_folder_not_writable(tmp_path, capsys, monkeypatch):
    """Checked before any model loads (root may write anywhere, so the permission answer is simulated)."""
    from moss_npu import output

    monkeypatch.setattr(output.os, "access", lambda path, mode: False)
    code, _, err = run(["--text", "hi", "--output", tmp_path / "x.wav", "--model", tmp_path / "never-loaded"], capsys)
    assert code == 2 and "is not writable" in err and not (tmp_path / "x.wav").exists()


def test_npu_without_torch_npu(tmp_path, capsys, monkeypatch):
    """``--device npu`` on a machine without torch_npu/CANN: a one-line fix, no traceback (real NPUs are out of CI)."""
    from moss_npu import device

    monkeypatch.setitem(sys.modules, "torch_npu", None)
    device.register_backend("npu", None)
    try:
        code, _, err = run(["--text", "hi", "--device", "npu:0", "--output", tmp_path / "x.wav"], capsys)
    finally:
        device.register_backend("npu", None)
    assert code == 2 and "torch_npu is not importable" in err and "set_env.sh" in err


DELAY = goldens.fixtures_root() / "delay-tiny"


@needs(DELAY.is_dir(), f"fixtures not found at {DELAY} (set MOSS_NPU_FIXTURES)")
def test_llama_cpp_backend_end_to_end(tmp_path, capsys):
    """The README's Delay command with the tiny GGUF fixture and the package's noise-making test codec."""
    require("llama_cpp", LLAMA_INSTALL)
    from moss_npu_verify.make_test_codec import main as make_test_codec

    codec = tmp_path / "codec"
    make_test_codec([str(codec)])
    capsys.readouterr()
    out = tmp_path / "d.wav"
    code, stdout, err = run(["--backend", "llama-cpp", "--config", REPO / "configs/llama_cpp/cpu-only.yaml",
                             "--weights", DELAY / "weights", "--codec-onnx-dir", codec, "--text", "Hello",
                             "--output", out, "--seed", "0"], capsys)
    assert code == 0, err
    info = sf.info(str(out))
    assert info.samplerate == 24000 and info.channels == 1 and info.frames > 0


def test_llama_cpp_backend_without_the_package(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    if not DELAY.is_dir():
        missing(f"fixtures not found at {DELAY}")
    from moss_npu_verify.make_test_codec import main as make_test_codec

    make_test_codec([str(tmp_path / "codec")])
    capsys.readouterr()
    code, _, err = run(["--backend", "llama-cpp", "--weights", DELAY / "weights", "--codec-onnx-dir",
                        tmp_path / "codec", "--text", "Hello", "--output", tmp_path / "d.wav"], capsys)
    assert code == 2 and 'pip install -e ".[llama]"' in err
    assert not (tmp_path / "d.wav").exists()


def test_impl_upstream_without_transformers_says_what_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    if not NANO.is_dir():
        missing(f"fixtures not found at {NANO}")
    code, _, err = run(model_args(tmp_path, "--impl", "upstream", "--text", "hi", "--output", tmp_path / "u.wav"), capsys)
    assert code == 2 and 'pip install -e ".[upstream]"' in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "u.wav").exists()


def _one_error_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("content,fragment", [
    (b"caf\xe9 au lait", "not UTF-8 (byte 0xe9 at offset 3)"),
    (b"\xff\xfeh\x00i\x00", "not UTF-8"),  # UTF-16
    (b"RIFF\x00\x00\x00\x00WAVE", "NUL bytes"),
], ids=["latin-1", "utf-16", "binary"])
def test_text_file_that_is_not_utf8(tmp_path, capsys, content, fragment):
    text = tmp_path / "t.txt"
    text.write_bytes(content)
    code, _, err = run(["--text-file", text, "--output", tmp_path / "o.wav", "--model", tmp_path / "never"], capsys)
    assert code == 2 and fragment in _one_error_line(err) and not (tmp_path / "o.wav").exists()


@pytest.mark.parametrize("yaml_text,fragment", [
    (b"max_new_frames: '20'\n", "max_new_frames must be an integer, got string '20'"),
    (b"do_sample: 1\n", "do_sample must be a boolean (true/false), got integer 1"),
    (b"text_temperature: [1]\n", "text_temperature must be a number, got list [1]"),
    (b"stream_budgets: 4\n", "stream_budgets must be a list of integers, got integer 4"),
    (b"- device\n- cpu\n", "expected a mapping of setting names to values, got a list"),
    (b"\x89PNG\r\n\x1a\n\x00\xff", "not a UTF-8 text file"),
    (b"max_new_frames: 100000000\n", "--max-new-frames 100000000: use 1 .. 7500"),
    (b"seed: -5\n", "--seed -5: use 0 .. 2**63-1"),
], ids=["string-for-int", "int-for-bool", "list-for-float", "int-for-list", "list-file", "binary", "giant-frames",
        "negative-seed"])
def test_preset_values_are_type_checked(tmp_path, capsys, yaml_text, fragment):
    if not NANO.is_dir():
        missing(f"fixtures not found at {NANO}")
    preset = tmp_path / "p.yaml"
    preset.write_bytes(yaml_text)
    code, _, err = run(model_args(tmp_path, "--text", "hi", "--output", tmp_path / "o.wav", "--config", preset), capsys)
    assert code == 2 and fragment in _one_error_line(err)
    assert not (tmp_path / "o.wav").exists()


def test_output_that_is_a_folder_or_fifo_or_an_input(tmp_path, capsys):
    import os

    os.mkfifo(tmp_path / "fifo.wav")
    (tmp_path / "dir.wav").mkdir()
    text = tmp_path / "t.txt"
    text.write_text("hi")
    for output, fragment in [(tmp_path / "dir.wav", "is a folder"), (tmp_path / "fifo.wav", "is a FIFO"),
                             (tmp_path / "missing" / "o.wav", "does not exist")]:
        code, _, err = run(["--text", "hi", "--output", output, "--model", tmp_path / "never"], capsys)
        assert code == 2 and fragment in _one_error_line(err)
    code, _, err = run(["--text-file", text, "--output", tmp_path / "t.wav", "--prompt-audio-path", tmp_path / "t.wav",
                        "--model", tmp_path / "never"], capsys)
    assert code == 2 and "is the --prompt-audio-path file" in _one_error_line(err)
    assert text.read_text() == "hi"


def stop_at_once(decoder):
    """A frame step in which every running request stops before its first frame."""
    import torch

    from moss_npu.nano.frames import FrameBatch

    held = torch.tensor([h and not d for h, d in zip(decoder._held, decoder._done)])
    decoder._done = list(decoder._held)
    none = torch.zeros(decoder.slots, dtype=torch.bool)
    return FrameBatch(0, torch.full((decoder.slots, decoder.model.config.n_vq), decoder.pad), none, held, none)


@needs_fixtures
@pytest.mark.parametrize("stream", [False, True], ids=["offline", "stream"])
def test_zero_frames_is_a_failure_without_file(tmp_path, capsys, monkeypatch, stream):
    """The model stopping before the first frame is exit 1 with one line, not an empty "success"."""
    from moss_npu.nano.decoder import FrameDecoder

    monkeypatch.setattr(FrameDecoder, "step", stop_at_once)
    out = tmp_path / "z.wav"
    code, stdout, err = run(model_args(tmp_path, "--text", "hi", "--output", out, *(["--stream"] * stream)), capsys)
    assert code == 1 and _one_error_line(err) == f"error: {inference.NO_AUDIO}" and stdout == ""
    assert list(tmp_path.iterdir()) == []


@needs_fixtures
def test_frame_cap_and_unspeakable_text_warn(tmp_path, capsys):
    out = tmp_path / "w.flac"
    code, _, err = run(model_args(tmp_path, "--text", "!!! ... 🙂", "--output", out, "--greedy",
                                  "--max-new-frames", "2"), capsys)
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 2 and "no letters or digits" in warnings[0] and "--max-new-frames 2" in warnings[1]
    assert sf.info(str(out)).format == "FLAC"


@needs_fixtures
def test_on_a_terminal_the_nano_run_shows_progress(tmp_path, capsys, monkeypatch):
    """Progress is drawn only when stderr is a terminal; a tqdm without a total raises on bool()."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    out = tmp_path / "t.wav"
    code, stdout, err = run(["--model", NANO / "tts", "--codec", NANO / "codec", "--device", "cpu", "--text", "Hi",
                             "--output", out, "--max-new-frames", "3", "--seed", "0"], capsys)
    assert code == 0, err
    assert "frame" in err and stdout.startswith(f"wrote {out}")


def test_text_file_dash_reads_stdin(tmp_path, capsys, monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xfe not utf-8")))
    code, _, err = run(["--text-file", "-", "--output", tmp_path / "o.wav", "--model", tmp_path / "never"], capsys)
    assert code == 2 and "--text-file -: not UTF-8" in _one_error_line(err)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc for the child's peak memory")
def test_a_huge_reference_that_is_no_recording_is_refused_from_its_header(tmp_path):
    """A 2 GB sparse file (all zeros) is refused as undecodable before it is read whole (it once took 2.4 GB
    of memory and 12 s to say so)."""
    ref = tmp_path / "huge.wav"
    with open(ref, "wb") as fh:
        os.truncate(fh.fileno(), 2 * 2**30)
    argv = ["inference.py", "--text", "hi", "--prompt-audio-path", str(ref), "--output", str(tmp_path / "o.wav"),
            "--model", str(tmp_path / "never")]
    # The child's own peak (VmHWM of its image after exec): a fork's ru_maxrss also counts the parent it was
    # copied from, which is this test run's whole memory.
    peak = ("import atexit, runpy, sys\n"
            "atexit.register(lambda: print('peak-kib', open('/proc/self/status').read().split('VmHWM:')[1].split()[0],"
            " file=sys.stderr))\n"
            f"sys.argv = {argv!r}\n"
            "runpy.run_path('inference.py', run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", peak], cwd=REPO, capture_output=True, text=True, timeout=120)
    err = "".join(line for line in done.stderr.splitlines(keepends=True) if not line.startswith("peak-kib "))
    kib = int(done.stderr.rsplit("peak-kib ", 1)[1].split()[0])
    assert done.returncode == 2, err
    assert _one_error_line(err).startswith(f"error: --prompt-audio-path {ref}: cannot decode")
    assert kib < 1024 * 1024, kib  # far below the file's 2 GiB


def test_reference_that_is_not_a_regular_file(tmp_path, capsys):
    code, _, err = run(["--text", "hi", "--prompt-audio-path", "/dev/null", "--output", tmp_path / "o.wav",
                        "--model", tmp_path / "never"], capsys)
    assert code == 2 and "/dev/null: is not a regular file" in _one_error_line(err)


@needs(DELAY.is_dir(), f"fixtures not found at {DELAY} (set MOSS_NPU_FIXTURES)")
def test_llama_cpp_backend_honours_greedy_and_the_frame_cap(tmp_path, capsys):
    """--greedy is repeatable and --max-new-frames 3 gives exactly 3 frames (80 ms each at 24 kHz)."""
    require("llama_cpp", LLAMA_INSTALL)
    from moss_npu_verify.make_test_codec import main as make_test_codec

    make_test_codec([str(tmp_path / "codec")])
    capsys.readouterr()
    waves = []
    for seed in ("0", "1"):  # greedy: the seed must not matter
        out = tmp_path / f"d{seed}.wav"
        code, _, err = run(["--backend", "llama-cpp", "--config", REPO / "configs/llama_cpp/cpu-only.yaml",
                            "--weights", DELAY / "weights", "--codec-onnx-dir", tmp_path / "codec", "--text", "Hello",
                            "--output", out, "--seed", seed, "--greedy", "--max-new-frames", "3", "--device", "cpu"],
                           capsys)
        assert code == 0, err
        waves.append(sf.read(str(out), dtype="float32")[0])
    assert waves[0].shape == (3 * 1920,) and np.array_equal(waves[0], waves[1])


def test_undecodable_bytes_on_the_command_line(tmp_path, capsys):
    """A non-UTF-8 shell passes bytes as lone surrogates; they are refused, not a crash in the tokenizer."""
    code, _, err = run(["--text", "caf\udcff", "--output", tmp_path / "o.wav", "--model", tmp_path / "never"], capsys)
    assert code == 2 and "undecodable byte" in _one_error_line(err)


@needs_fixtures
def test_preset_device_syntax_is_checked(tmp_path, capsys):
    preset = tmp_path / "p.yaml"
    preset.write_text('device: "npu:-1"\n')
    code, _, err = run(["--model", NANO / "tts", "--codec", NANO / "codec", "--text", "hi",  # no --device flag
                        "--output", tmp_path / "o.wav", "--config", preset], capsys)
    assert code == 2 and "device npu:-1: the device index must be >= 0" in _one_error_line(err)
