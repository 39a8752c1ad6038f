"""eval_accuracy.py and moss_npu.evaluation on the nano-tiny fixture: CPU against CPU must agree exactly, bf16
must show its real error and pass or fail by the given thresholds, the reference must be freed before the target
loads, and bad input must exit 2 with one error line. Real NPU/CUDA runs are out of CI."""

import gc
import json
import sys
import weakref
from pathlib import Path

import pytest
import torch

from moss_npu import device as devices
from moss_npu_verify import goldens
from moss_npu.evaluation import EvalInput, EvalRequest, SideSpec, Thresholds, evaluate, generation_settings, load_side
from moss_npu.evaluation.sides import NativeSide, UpstreamSide
from moss_npu.evaluation.sides import Capture, InputCapture
from moss_npu.evaluation.tiers import comparable_decisions, tier_c
from moss_npu.tts.loop import generate
from moss_npu.nano.prompt import build_prompt_rows
from moss_npu.sampling import SamplingParams
from moss_npu.upstream import UpstreamGeneration
from tests.optional import missing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import eval_accuracy  # noqa: E402  (the CLI lives at the repo root)

# Few frames keep each run to a few seconds; seed 1 makes the tiny random model speak past frame 0.
FAST = ["--max-new-frames", "3", "--seed", "1", "--text", "Hello world.", "--quiet"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matrices: a second OpenMP thread only spins (badly so on a busy 2-core box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def fixture_dir() -> Path:
    root = goldens.fixtures_root() / "nano-tiny"
    if not (root / "tts" / "config.json").is_file():
        missing(f"nano-tiny fixture not found under {goldens.fixtures_root()}; set MOSS_NPU_FIXTURES")
    return root


def _cli(fixture_dir, tmp_path, *extra):
    report = tmp_path / "report.json"
    rc = eval_accuracy.main(["--model", str(fixture_dir / "tts"), "--codec", str(fixture_dir / "codec"),
                             "--device", "cpu", "--report", str(report), *FAST, *extra])
    return rc, json.loads(report.read_text(encoding="utf-8"))


def _items(report, tier, name):
    return [i for i in report["tiers"][tier]["items"] if i["name"] == name]


def test_cpu_against_cpu_agrees_exactly(fixture_dir, tmp_path, capsys):
    rc, report = _cli(fixture_dir, tmp_path)
    assert rc == 0 and report["passed"]
    assert all(t["passed"] for t in report["tiers"].values())
    for tier in ("A", "B"):
        for item in report["tiers"][tier]["items"]:
            assert item["passed"] is True, item
            if item["kind"] != "tokens":
                assert item["metrics"]["max_abs"] == 0.0 and item["metrics"]["snr_db"] == "inf", item
    codes = _items(report, "C", "codes")[0]["metrics"]
    assert codes["agreement"] == 1.0 and codes["first_divergent_frame"] is None and codes["frames"] == 3
    assert codes["decision_logits_max_abs"] == 0.0 and codes["decisions_compared"] == 3 * (1 + 16)  # per frame: continue/stop, 16 channels
    # The target decodes as streamed, the reference in one call: equal to rounding, and compared.
    assert _items(report, "C", "waveform")[0]["metrics"]["snr_db"] != "-inf"
    assert _items(report, "C", "waveform")[0]["passed"] is True
    assert report["reference"]["name"] == devices.describe(torch.device("cpu"))["name"]
    assert report["versions"]["torch"] == torch.__version__ and report["thresholds"]["max_mse"] == 1e-6
    out = capsys.readouterr().out
    assert "tier A" in out and "tier C" in out and out.rstrip().endswith("PASS: every tier passed")


def test_bfloat16_error_is_reported_and_judged_by_the_thresholds(fixture_dir, tmp_path):
    loose = ["--dtype", "bfloat16", "--max-new-frames", "1", "--max-mse", "1e-2", "--max-rel", "0.1", "--min-snr", "20",
             "--min-token-agreement", "0"]
    rc, report = _cli(fixture_dir, tmp_path, *loose)
    assert rc == 0 and report["passed"] and report["target"]["dtype"] == "bfloat16"
    hidden = _items(report, "A", "global_hidden")[0]["metrics"]
    assert hidden["max_abs"] > 0 and 0 < hidden["mse"] <= 1e-2 and 0 < hidden["rel"] <= 0.1
    # The codec stays fp32 on both sides, so decoding the same codes is exact.
    assert _items(report, "B", "waveform")[0]["metrics"]["max_abs"] == 0.0

    rc, strict = _cli(fixture_dir, tmp_path, "--dtype", "bfloat16", "--max-new-frames", "1")
    assert rc == 1 and not strict["passed"] and not strict["tiers"]["A"]["passed"]
    failed = [i for i in strict["tiers"]["A"]["items"] if i["passed"] is False]
    assert {i["name"] for i in failed} >= {"global_hidden", "audio_logits", "decode_step_hidden"}
    assert all("mse > 1e-06" in i["note"] for i in failed)
    # Same inputs, same numbers: only the verdict moved with the thresholds.
    assert _items(strict, "A", "global_hidden")[0]["metrics"] == hidden


def test_reference_is_freed_before_the_target_loads(fixture_dir):
    events, models = [], []

    def loader(spec):
        gc.collect()
        events.append(("load", spec.role, [m() is None for m in models]))
        side = load_side(spec)
        models.append(weakref.ref(side.tts.model))
        return side

    cpu = torch.device("cpu")
    ref = SideSpec("reference", "native", cpu, torch.float32, str(fixture_dir / "tts"), str(fixture_dir / "codec"))
    tgt = SideSpec("target", "native", cpu, torch.float32, str(fixture_dir / "tts"), str(fixture_dir / "codec"))
    settings = generation_settings(ref, tgt, max_new_frames=2, seed=1, greedy=True)
    voice = EvalInput("en", "Hi.", fixture_dir / "goldens" / "reference.wav")
    report = evaluate(EvalRequest(ref, tgt, (voice,), settings), load=loader,
                      on_event=lambda what, spec: events.append((what, spec.role)))
    assert events[:4] == [("load", "reference"), ("load", "reference", []), ("capture", "reference"),
                          ("release", "reference")]
    # When the target is about to load, the reference model has already been garbage-collected.
    assert events[4:7] == [("released", "reference"), ("load", "target"), ("load", "target", [True])]
    assert report.order[0].startswith("load reference") and report.order[-1].startswith("released target")
    # Voice clone: the target re-encodes the reference recording, and the codes must agree.
    encode = [i for i in report.tiers[0].items if i.name == "codec_encode"]
    assert len(encode) == 1 and encode[0].passed and encode[0].metrics["agreement"] == 1.0
    assert report.inputs[0]["mode"] == "voice_clone" and report.passed
    gc.collect()
    assert all(m() is None for m in models)


@pytest.mark.parametrize("argv, message", [
    pytest.param(["--device", "tpu"], "unknown device", id="unknown-device"),
    pytest.param(["--max-mse", "-1"], "--max-mse -1.0", id="negative-mse"),
    pytest.param(["--min-token-agreement", "2"], "--min-token-agreement", id="agreement-above-1"),
    pytest.param(["--max-new-frames", "0"], "--max-new-frames 0", id="no-frames"),
    pytest.param(["--dtype", "int8"], "--dtype int8", id="unknown-dtype"),
    pytest.param(["--text-file", "/nonexistent/texts.txt"], "--text-file", id="missing-text-file"),
    pytest.param(["--report", "/nonexistent/dir/r.json"], "--report", id="unwritable-report"),
    pytest.param(["--against", "upstream", "--impl", "upstream"], "--against upstream", id="against-and-impl"),
])
def test_bad_input_exits_2_with_one_error_line(fixture_dir, capsys, argv, message):
    rc = eval_accuracy.main(["--model", str(fixture_dir / "tts"), "--codec", str(fixture_dir / "codec"),
                             "--device", "cpu", "--quiet", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_missing_model_folder_exits_2(tmp_path, capsys):
    rc = eval_accuracy.main(["--model", str(tmp_path / "absent"), "--codec", str(tmp_path / "absent"),
                             "--device", "cpu", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "absent does not exist" in err[0]


def test_a_report_over_an_input_file_is_refused_before_anything_runs(tmp_path, capsys):
    """--report naming the --text-file would replace the user's text with JSON."""
    texts = tmp_path / "texts.json"
    texts.write_text("Hello there.\n", encoding="utf-8")
    rc = eval_accuracy.main(["--model", str(tmp_path / "absent"), "--codec", str(tmp_path / "absent"),
                             "--text-file", str(texts), "--report", str(texts), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [f"error: --report {texts}: is the --text-file file; choose another path"]
    assert texts.read_text(encoding="utf-8") == "Hello there.\n"


def test_upstream_without_transformers_exits_2_before_loading(fixture_dir, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as where it is not installed
    rc = eval_accuracy.main(["--model", str(fixture_dir / "tts"), "--codec", str(fixture_dir / "codec"),
                             "--device", "cpu", "--impl", "upstream", "--greedy"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.err.strip().splitlines() == [captured.err.strip()]
    assert "needs transformers" in captured.err and "loading" not in captured.err


def test_sampled_upstream_on_another_device_is_refused():
    ref = SideSpec("reference", "native", torch.device("cpu"), torch.float32, "m", "c")
    tgt = SideSpec("target", "upstream", torch.device("meta"), torch.float32, "m", "c")
    with pytest.raises(Exception, match="add --greedy"):
        generation_settings(ref, tgt, max_new_frames=4, seed=0, greedy=False)
    assert generation_settings(ref, tgt, max_new_frames=4, seed=0, greedy=True).rng == "none"


def test_comparable_decisions_stop_at_the_first_divergent_one():
    ref = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    assert comparable_decisions(ref, ref, 3) == (4, 9, "none")
    flipped = ref.clone()
    flipped[1, 2] = 0  # frame 1, channel 2: text decisions 0-1 and audio decisions 0..5 saw the same history
    assert comparable_decisions(flipped, ref, 3) == (2, 6, "audio")
    # One run stopped after frame 1: its stop decision at frame 2 is the divergent one.
    assert comparable_decisions(ref[:2], ref, 3) == (3, 6, "text")


def _generation(codes, text_logits, audio_logits, error=None):
    cap = InputCapture(rows=torch.zeros(1, 3, dtype=torch.long), codes=codes, text_logits=text_logits,
                       audio_logits=audio_logits, error=error)
    cap.tensors["decoded_codes"] = torch.ones(2, 8)
    return Capture({}, torch.zeros(3, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long), {}, {"x": cap})


def test_tier_c_compares_logits_only_up_to_the_divergence_and_no_waveform_after_it():
    ref_codes = torch.tensor([[1, 2], [3, 4], [5, 6]])  # 3 frames, nq = 2
    text, audio = torch.randn(3, 2), torch.randn(6, 4)
    reference = _generation(ref_codes, text, audio)
    codes = ref_codes.clone()
    codes[1, 1] = 0  # frame 1, channel 1: audio decision 3 is the divergent one
    audio_target = audio.clone()
    audio_target[3] += 0.5  # the divergent decision saw logits 0.5 off ...
    audio_target[4:] += 100.0  # ... and what follows ran on other histories: not comparable
    tier = tier_c(_generation(codes, text.clone(), audio_target), reference, 2, Thresholds())
    tokens, wave = tier.items
    assert not tier.passed and tokens.passed is False
    assert tokens.metrics["agreement"] == pytest.approx(5 / 6) and tokens.metrics["first_divergent_frame"] == 1
    assert tokens.metrics["decisions_compared"] == 2 + 4
    assert tokens.metrics["decision_logits_max_abs"] == pytest.approx(0.5)
    assert tokens.metrics["divergent_decision"] == "audio channel 1"
    assert wave.passed is None and "tokens differ from frame 1" in wave.note

    loose = tier_c(_generation(codes, text.clone(), audio_target), reference, 2, Thresholds(min_token_agreement=0.8))
    assert loose.passed and loose.items[1].passed is None

    failed = tier_c(_generation(None, None, None, "Non-finite text logits at frame 0"), reference, 2, Thresholds())
    assert not failed.passed and "target generation failed: Non-finite" in failed.items[0].note


class StandInUpstream:
    """The ``UpstreamTTS`` methods eval_accuracy uses, computed by the native modules the way the official code
    does (local decoder recomputed per prefix, device RNG seeded per call)."""

    def __init__(self, tts):
        self.tts, self.codec, self.device, self.closed = tts, tts.codec, tts.device, False

    def close(self):
        self.tts = self.codec = None
        self.closed = True

    def prompt_rows(self, text, mode="continuation", prompt_text=None, prompt_audio_codes=None):
        return build_prompt_rows(self.tts.tokenizer, self.tts.config, text, mode, prompt_text, prompt_audio_codes)

    @torch.no_grad()
    def teacher_forced(self, rows, frame_row):
        model, q = self.tts.model, self.tts.config.n_vq
        hidden = model(rows[None])
        pieces = [hidden[0, -1:], model.transformer.wte(frame_row[:1])]
        pieces += [model.audio_embeddings[c](frame_row[c + 1:c + 2]) for c in range(q - 1)]
        seq = torch.cat(pieces)[None]
        local = torch.cat([model.local_hidden(seq[:, : k + 1]) for k in range(q + 1)])  # growing prefixes
        cache = model.transformer.init_cache(1, len(rows) + 1)
        model(rows[None], None, cache)
        step = model(frame_row[None, None], torch.ones(1, len(rows) + 1, dtype=torch.bool), cache)
        return {"global_hidden": hidden[0], "local_hidden": local, "text_logits": model.text_lm_head(local[0]),
                "audio_logits": torch.stack([model.audio_lm_heads[c](local[c + 1]) for c in range(q)]),
                "decode_step_hidden": step[0, -1]}

    def generate_codes(self, rows, *, max_new_frames, nq=None, do_sample=False, seed=None, record_logits=False,
                       **sampling):
        seen = {"text": [], "audio": []}
        if seed is not None:
            devices.seed_everything(seed, self.device)
        out = generate(self.tts.model, rows, sampling=SamplingParams(do_sample=do_sample, **sampling), nq=nq,
                       max_new_frames=max_new_frames, logits_hook=lambda k, i, x: seen[k].append(x[0].clone()))
        return UpstreamGeneration(out.frames[0], torch.stack(seen["text"]), torch.stack(seen["audio"]))

    def decode_codes(self, codes):
        return self.tts.codec.decode(codes)[0]


def test_against_upstream_uses_only_the_official_api(fixture_dir):
    stand_ins = []

    def loader(spec):
        native = NativeSide.load(spec.model, spec.codec, spec.device, spec.dtype)
        if spec.impl == "native":
            return native
        stand_ins.append(StandInUpstream(native.tts))
        return UpstreamSide(stand_ins[-1], spec.dtype)

    cpu = torch.device("cpu")
    ref = SideSpec("reference", "native", cpu, torch.float32, str(fixture_dir / "tts"), str(fixture_dir / "codec"))
    tgt = SideSpec("target", "upstream", cpu, torch.float32, str(fixture_dir / "tts"), str(fixture_dir / "codec"))
    settings = generation_settings(ref, tgt, max_new_frames=3, seed=1, greedy=False)
    assert settings.rng == "device"
    report = evaluate(EvalRequest(ref, tgt, (EvalInput("en", "Hello world."),), settings, Thresholds()), load=loader)
    items = {i.name: i for i in report.tiers[0].items}
    assert all(items[name].passed for name in ("prompt_rows", "global_hidden", "local_hidden", "text_logits",
                                               "audio_logits", "decode_step_hidden", "codec_decode"))
    # Recomputing the local decoder per prefix (official) vs one causal pass (native): equal up to rounding.
    assert items["local_hidden"].metrics["max_abs"] < 1e-5
    codes = report.tiers[2].items[0]
    assert codes.metrics["agreement"] == 1.0 and codes.metrics["frames"] == 3
    assert report.passed and report.target["impl"] == "upstream" and stand_ins[0].closed


def test_upstream_code_reaches_the_upstream_side(monkeypatch, tmp_path):
    """--upstream-code is passed to the official-code side, as inference.py does."""
    import moss_npu.upstream

    monkeypatch.setattr(moss_npu.upstream, "import_transformers", lambda: None)
    args = eval_accuracy.build_parser().parse_args(["--device", "cpu", "--against", "upstream", "--greedy",
                                                    "--upstream-code", str(tmp_path)])
    request = eval_accuracy.build_request(args)
    assert request.target.impl == "upstream" and request.target.code_dir == str(tmp_path)
    assert request.reference.code_dir is None


def test_upstream_code_without_an_upstream_side_is_refused(capsys):
    assert eval_accuracy.main(["--device", "cpu", "--upstream-code", "x", "--quiet"]) == 2
    assert "--upstream-code: only used with" in capsys.readouterr().err


def test_int8_target_is_named_as_such(fixture_dir, tmp_path, capsys):
    loose = ["--quantize", "int8", "--max-new-frames", "1", "--max-mse", "1e-2", "--max-rel", "0.1", "--min-snr",
             "20", "--min-token-agreement", "0"]
    rc, report = _cli(fixture_dir, tmp_path, *loose)
    assert rc == 0 and report["target"]["quantize"] == "int8" and report["reference"]["quantize"] == "none"
    out = capsys.readouterr().out
    assert "target:    native float32 with int8 weights on cpu" in out
    assert "reference: native float32 on cpu" in out
