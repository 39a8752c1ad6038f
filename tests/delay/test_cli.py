"""``inference.py`` picks its backend and runs the Delay fallback without torch.

torch is made unimportable in-process with ``sys.modules["torch"] = None`` (what a machine without it
looks like to ``import torch``), and in subprocesses the same way, so these run in the torch venv too; CI
also runs the Delay CLI in a virtualenv that has no torch at all (.ci/run).
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

import inference
from moss_npu_verify import goldens
from tests.optional import require

REPO = Path(__file__).resolve().parents[2]
DELAY = goldens.fixtures_root() / "delay-tiny"
AUDIO = goldens.fixtures_root() / "audio"
PRESET = REPO / "configs" / "llama_cpp" / "cpu-only.yaml"
DELAY_PATH = ["inference", "moss_npu.delay.pipeline", "moss_npu.delay.flags", "moss_npu_verify.cases.delay",
              "moss_npu.delay.reference", "moss_npu.wavfile", "moss_npu.device", "moss_npu_verify.goldens"]
# Runs inference.main with torch unimportable; exits 3 if any torch module got loaded anyway.
NO_TORCH_MAIN = ("import sys; sys.modules['torch'] = None; import inference; code = inference.main(sys.argv[1:]); "
                 "leaked = [m for m, v in sys.modules.items() if v is not None and m.split('.')[0] == 'torch']; "
                 "print('torch modules loaded:', leaked, file=sys.stderr) if leaked else None; "
                 "sys.exit(3 if leaked else code)")


def run(args, capsys):
    code = inference.main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def no_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)


@pytest.fixture(scope="module")
def codec_dir(tmp_path_factory):
    from moss_npu_verify.make_test_codec import write_test_codec

    return write_test_codec(tmp_path_factory.mktemp("codec"))[0].parent


def delay_args(codec_dir, out, *extra):
    return ["--config", PRESET, "--weights", DELAY / "weights", "--codec-onnx-dir", codec_dir, "--text", "Hello",
            "--output", out, "--seed", "0", *extra]


def test_importing_the_delay_path_loads_no_torch():
    """Even where torch is installed, the Delay modules and the CLI module import none of it."""
    code = (f"import importlib, sys; [importlib.import_module(m) for m in {DELAY_PATH!r}]; "
            "sys.exit(sorted(m for m in sys.modules if m.split('.')[0] == 'torch') or 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_without_torch_and_without_weights_one_line_names_both_installs(no_torch, tmp_path, capsys):
    code, out, err = run(["--text", "hi", "--output", tmp_path / "x.wav"], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert 'pip install -e ".[nano]"' in err and 'pip install -e ".[llama]"' in err
    assert not (tmp_path / "x.wav").exists()


def test_explicit_nano_without_torch_names_its_install(no_torch, tmp_path, capsys):
    code, _, err = run(["--backend", "nano", "--text", "hi", "--output", tmp_path / "x.wav"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("error: --backend nano needs torch") and 'pip install -e ".[nano]"' in err


def test_auto_with_torch_never_quietly_drops_the_delay_flags(tmp_path, capsys):
    require("torch", "pip install torch (the README's install line)")
    code, _, err = run(["--weights", tmp_path, "--text", "hi", "--output", tmp_path / "x.wav"], capsys)
    assert code == 2 and "--weights belong to the llama-cpp backend" in err and "--backend llama-cpp" in err


@pytest.mark.parametrize("reference", [None, "en_7.wav"], ids=["no-reference", "mp3-stereo-reference"])
def test_auto_without_torch_runs_the_delay_fallback(no_torch, delay_fixture, llama_cpp, codec_dir, tmp_path,
                                                    capsys, reference):
    out = tmp_path / "d.wav"
    extra = ["--prompt-audio-path", AUDIO / reference] if reference else []
    code, stdout, err = run(delay_args(codec_dir, out, *extra), capsys)
    assert code == 0, err
    assert stdout.startswith(f"wrote {out}: ") and stdout.rstrip().endswith("backend llama-cpp (MOSS-TTS Delay)")
    info = sf.info(str(out))
    assert info.samplerate == 24000 and info.channels == 1 and info.frames > 0 and info.frames % 1920 == 0


def test_max_new_frames_caps_the_delay_audio(delay_fixture, llama_cpp, codec_dir, tmp_path, capsys):
    out = tmp_path / "f.wav"
    code, _, err = run(["--backend", "llama-cpp", *delay_args(codec_dir, out, "--max-new-frames", "3", "--greedy")],
                       capsys)
    assert code == 0, err
    assert sf.info(str(out)).frames == 3 * 1920  # greedy tiny model runs longer than 3 frames: the cap cut it


def test_the_seed_makes_delay_runs_repeatable(delay_fixture, llama_cpp, codec_dir, tmp_path, capsys):
    waves = []
    for name in ("a.wav", "b.wav", "c.wav"):
        seed = "1" if name != "c.wav" else "2"
        args = delay_args(codec_dir, tmp_path / name)
        args[args.index("--seed") + 1] = seed
        assert run(["--backend", "llama-cpp", *args], capsys)[0] == 0
        waves.append(sf.read(str(tmp_path / name), dtype="float32")[0])
    assert np.array_equal(waves[0], waves[1])
    assert waves[0].shape != waves[2].shape or not np.array_equal(waves[0], waves[2])


def test_stream_with_the_delay_backend_is_refused_before_loading(delay_fixture, codec_dir, tmp_path, capsys):
    out = tmp_path / "s.wav"
    code, _, err = run(["--backend", "llama-cpp", *delay_args(codec_dir, out, "--stream")], capsys)
    assert code == 2 and err.startswith("error: --stream is not available with the llama-cpp (Delay) backend")
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_the_delay_cli_in_a_process_where_torch_cannot_import(delay_fixture, llama_cpp, codec_dir, tmp_path):
    """As a user without torch runs it: a subprocess, reference recording included, no torch module loaded."""
    out = tmp_path / "p.wav"
    args = [str(a) for a in delay_args(codec_dir, out, "--prompt-audio-path", AUDIO / "zh_1.wav")]
    done = subprocess.run([sys.executable, "-c", NO_TORCH_MAIN, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "backend llama-cpp" in done.stdout and sf.info(str(out)).samplerate == 24000


def test_on_a_terminal_the_delay_run_shows_progress(delay_fixture, llama_cpp, codec_dir, tmp_path, capsys, monkeypatch):
    """A tqdm without a total raises on bool(): the progress path must only test it against None."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    out = tmp_path / "t.wav"
    code, stdout, err = run(["--backend", "llama-cpp", *delay_args(codec_dir, out)], capsys)
    assert code == 0, err
    assert "step" in err and stdout.startswith(f"wrote {out}")
