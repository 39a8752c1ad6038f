"""``inference.py --speed`` and ``--timestamps`` on the fixture checkpoints, whole and streamed.

The tiny model never stops early under greedy decoding (its README), so a run of N frames per chunk has a
known length: chunks × N × 3840 samples plus the pauses between chunks, which ``--speed`` divides.
"""

import json

import numpy as np
import pytest
import soundfile as sf

from moss_npu_verify import goldens
from moss_npu.nano.text import pause_samples
from tests.optional import require
from tests.test_inference_cli import model_args, run

NANO = goldens.fixtures_root() / "nano-tiny"
needs_fixtures = pytest.mark.skipif(not NANO.is_dir(), reason=f"fixtures not found at {NANO} (set MOSS_NPU_FIXTURES)")
FRAMES, FRAME = 5, 3840
SENTENCES = ["The first sentence is here.", "And a second one follows it!"]
# Voice clone with an 8-token budget: one chunk per sentence.
CLONE = ["--prompt-audio-path", NANO / "goldens" / "reference.wav", "--voice-clone-max-text-tokens", "8",
         "--greedy", "--max-new-frames", str(FRAMES), "--text", " ".join(SENTENCES)]
NATURAL = 2 * FRAMES * FRAME + pause_samples(SENTENCES[0], 48000)


def speak(tmp_path, capsys, *flags):
    out, stamps = tmp_path / "out.wav", tmp_path / "out.json"
    code, _, err = run(model_args(tmp_path, *CLONE, "--output", out, "--timestamps", stamps, *flags), capsys)
    assert code == 0, err
    data, rate = sf.read(str(out), dtype="float32", always_2d=True)
    return data, json.loads(stamps.read_text(encoding="utf-8"))


@needs_fixtures
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("speed", [1.0, 1.5])
def test_speed_sets_the_length_and_timestamps_tile_the_audio(tmp_path, capsys, speed, stream):
    if speed != 1.0:
        require("pylibrb", 'pip install -e ".[tempo]"')
    data, stamps = speak(tmp_path, capsys, "--speed", str(speed), *(["--stream"] if stream else []))
    assert data.shape[0] == round(NATURAL / speed)
    chunks = stamps["chunks"]
    assert [c["text"] for c in chunks] == SENTENCES and [c["index"] for c in chunks] == [0, 1]
    assert chunks[0]["start"] == 0 and chunks[-1]["end"] == pytest.approx(data.shape[0] / 48000, abs=1e-6)
    assert chunks[0]["end"] == chunks[1]["start"]  # no gap, no overlap
    # The first chunk ends after its audio and its pause, at the model's pace divided by the speed.
    first = FRAMES * FRAME + pause_samples(SENTENCES[0], 48000)
    assert chunks[0]["end"] == pytest.approx(round(first / speed) / 48000, abs=1e-6)


@needs_fixtures
def test_speed_one_is_todays_output_bit_for_bit(tmp_path, capsys):
    plain, _ = speak(tmp_path, capsys)
    same, _ = speak(tmp_path, capsys, "--speed", "1.0")
    assert np.array_equal(plain, same)


@needs_fixtures
@pytest.mark.parametrize("flags, fragment", [
    (["--timestamps", "t.txt"], "--timestamps t.txt: give a .json file name"),
    (["--timestamps", "/nonexistent/t.json"], "does not exist"),
])
def test_bad_timestamps_path_exits_2_before_running(tmp_path, capsys, flags, fragment):
    out = tmp_path / "x.wav"
    code, _, err = run(model_args(tmp_path, "--text", "hi", "--output", out, *flags), capsys)
    assert code == 2 and fragment in err and not out.exists()


def test_a_preset_names_its_speed_as_the_file_does(tmp_path):
    from moss_npu.errors import ConfigError, InputError
    from moss_npu.tts import RunConfig
    from moss_npu.tts.settings import load_preset

    preset = tmp_path / "fast.yaml"
    preset.write_text("speed: 9.0\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"fast.yaml: speed 9.0: out of range"):
        load_preset(preset)
    preset.write_text("decoder: reference\nspeed: 1.5\n", encoding="utf-8")
    assert load_preset(preset) == {"decoder": "reference", "speed": 1.5}
    with pytest.raises(InputError, match="--speed 0.1: out of range"):
        RunConfig(speed=0.1)
