"""inference.py's text-normalization flags: what they set, what --print-normalized shows, where they apply."""

import inference
from moss_npu_verify import goldens
from moss_npu.tts.settings import merge
from tests.optional import missing

NANO = goldens.fixtures_root() / "nano-tiny"


def settings_for(*flags):
    args = inference.build_parser().parse_args(["--text", "x", *flags])
    return merge(None, inference.run_overrides(args)).run


def test_flags_set_the_run_settings():
    assert (settings_for().text_normalization, settings_for().wetext) == (True, True)  # on by default
    assert (settings_for("--no-wetext").text_normalization, settings_for("--no-wetext").wetext) == (True, False)
    off = settings_for("--no-text-normalization")
    assert (off.text_normalization, off.wetext) == (False, False)


def test_print_normalized_shows_what_the_model_reads(capsys, needs_wetext, tmp_path):
    if not NANO.is_dir():
        missing(f"fixtures not found at {NANO} (set MOSS_NPU_FIXTURES)")
    code = inference.main(["--model", str(NANO / "tts"), "--codec", str(NANO / "codec"), "--device", "cpu",
                           "--quiet", "--greedy", "--max-new-frames", "2", "--output", str(tmp_path / "a.wav"),
                           "--text", "今天是2026年12月1日", "--prompt-text", "共3个", "--prompt-audio-path",
                           str(NANO / "goldens" / "reference.wav"), "--print-normalized"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "normalized (robust_pre+wetext:zh+robust_post): 今天是二零二六年十二月一日。" in err
    assert "normalized prompt text: 共三个。" in err


def test_normalization_flags_are_refused_for_the_delay_backend(capsys):
    code = inference.main(["--backend", "llama-cpp", "--weights", "W", "--codec-onnx-dir", "C", "--text", "Hi",
                           "--no-wetext"])
    assert code == 2
    assert "--no-wetext is not available with the llama-cpp (Delay) backend" in capsys.readouterr().err
