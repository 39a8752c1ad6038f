"""The benchmark's --compare machinery end to end on a tiny generated checkpoint (no timing asserts)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import run
from bench.checkpoints import ensure_checkpoints


def test_compare_runs_end_to_end(tmp_path, capsys):
    stem = tmp_path / "out" / "bench"
    code = run.main(["--size", "tiny", "--cache-dir", str(tmp_path / "cache"), "--compare", "reference,optimized",
                     "--frames", "2", "--runs", "1", "--warmup", "0", "--cases", "short-en", "--out", str(stem),
                     "--quiet"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    assert re.fullmatch(r"speedup optimized/reference: \d+\.\d\d", out[-1])
    report = json.loads(stem.with_suffix(".json").read_text(encoding="utf-8"))
    rows = {r["config"]: r for r in report["summary"]}
    assert set(rows) == {"reference", "optimized"}
    # The biased random weights never stop early: every run made exactly --frames frames.
    assert all(r["frames"] == 2 and r["ttfa_ms"] > 0 and r["rtf"] > 0 for r in rows.values())
    assert "| short-en | optimized |" in stem.with_suffix(".md").read_text(encoding="utf-8")
    setup = report["setup"]  # what ran, beside the numbers: a new checkpoint prepares its weights into the cache
    assert setup["dtype"] == "float32" and setup["step"].startswith("cpu-fp32/") and setup["threads"] >= 1
    assert setup["prepared_weights"] == "built" and setup["load_s"] > 0
    assert "prepared weights: built" in stem.with_suffix(".md").read_text(encoding="utf-8")


def test_checkpoints_are_cached(tmp_path):
    first = ensure_checkpoints("tiny", tmp_path)
    stamp = (first[0] / "model.safetensors").stat().st_mtime_ns
    assert ensure_checkpoints("tiny", tmp_path) == first
    assert (first[0] / "model.safetensors").stat().st_mtime_ns == stamp
    assert (first[0] / "tokenizer.model").is_file() and (first[1] / "config.json").is_file()


def test_bad_configuration_is_usage_error(tmp_path, capsys):
    assert run.main(["--compare", "reference,turbo", "--cache-dir", str(tmp_path)]) == 2
    assert "error:" in capsys.readouterr().err


def test_batch_mode_end_to_end(tmp_path, capsys):
    stem = tmp_path / "out" / "batch"
    code = run.main(["--size", "tiny", "--cache-dir", str(tmp_path / "cache"), "--batch", "1,3", "--frames", "2",
                     "--runs", "1", "--warmup", "0", "--cases", "short-en", "--out", str(stem), "--quiet"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    assert re.fullmatch(r"batch speedup 3/1: \d+\.\d\d", out[-1])
    report = json.loads(stem.with_suffix(".json").read_text(encoding="utf-8"))
    rows = {r["batch"]: r for r in report["summary"]}
    assert set(rows) == {1, 3} and all(r["frames"] == 2 and r["aggregate_fps"] > 0 and r["rtf"] > 0
                                       for r in rows.values())
    assert report["batch_speedup"]["batch"] == 3 and rows[3]["graph"] == "off"


def test_graph_on_without_capture_is_a_usage_error(tmp_path, capsys):
    code = run.main(["--size", "tiny", "--cache-dir", str(tmp_path / "cache"), "--batch", "1", "--graph", "on",
                     "--frames", "1", "--runs", "1", "--warmup", "0", "--cases", "short-en", "--quiet",
                     "--out", str(tmp_path / "x")])
    assert code == 2 and "no device-graph capture" in capsys.readouterr().err


def test_an_unwritable_out_is_refused_before_any_timing(tmp_path, capsys, monkeypatch):
    """The reports are written after minutes of timing: a folder in their place is refused first."""
    (tmp_path / "bench.json").mkdir()
    monkeypatch.setattr(run, "run_once", lambda *a, **k: pytest.fail("timed before checking --out"))
    assert run.main(["--size", "tiny", "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "bench")]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_the_bench_imports_no_torch_before_it_runs():
    """`python -m bench.run` answers --help, bad flags, Ctrl-C and a torch-free machine under the exit-code
    policy, so importing it loads no torch."""
    code = "import sys, bench.run; sys.exit(any(m.split('.')[0] == 'torch' for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2]).returncode == 0


def test_every_case_reports_its_frame_split_and_floors(tmp_path, capsys):
    """The stream case (what the CLI runs: sampled, normalized, streamed) and a greedy case both
    report global, local, codec and host per frame, and each part's floor from a bandwidth probe of its size."""
    stem = tmp_path / "split"
    code = run.main(["--size", "tiny", "--cache-dir", str(tmp_path / "cache"), "--cases", "stream-en,short-en",
                     "--frames", "3", "--runs", "1", "--warmup", "0", "--out", str(stem), "--quiet"])
    assert code == 0
    report = json.loads(stem.with_suffix(".json").read_text(encoding="utf-8"))
    rows = {r["case"]: r for r in report["summary"]}
    for row in rows.values():
        assert row["frames"] == 3 and row["ttfa_ms"] > 0 and row["codec_calls"] >= 1
        assert all(row[key] > 0 for key in ("global_ms", "local_ms", "codec_ms")) and row["host_ms"] is not None
        assert set(row["floor"]) == {"global", "local", "codec"}
        for part in row["floor"].values():
            assert part["mb_per_frame"] > 0 and part["probe_mib"] >= 1
            assert part["gb_s"] is None or part["floor_ms"] == pytest.approx(part["mb_per_frame"] / part["gb_s"])
    # the global stack reads more keys and values per frame for the longer prompt of the stream case
    assert rows["stream-en"]["floor"]["global"]["mb_per_frame"] > rows["short-en"]["floor"]["global"]["mb_per_frame"]
    table = stem.with_suffix(".md").read_text(encoding="utf-8")
    assert "| stream-en | optimized |" in table and "host ms" in table


def test_only_runs_that_borrow_count_borrowed_threads_and_the_codec_floor_has_its_own(tmp_path):
    """The ``threads`` column counts borrowed cores only where the frames borrow them (the optimized CPU step under
    the default setting, not the reference decoder), and the codec's floor is probed on the codec's own threads."""
    import torch

    from moss_npu.cpu.threads import borrowed_cores

    stem = tmp_path / "threads"
    code = run.main(["--size", "tiny", "--cache-dir", str(tmp_path / "cache"), "--cases", "short-en",
                     "--compare", "reference,optimized", "--frames", "2", "--runs", "1", "--warmup", "0",
                     "--out", str(stem), "--quiet"])
    assert code == 0
    rows = {r["config"]: r for r in json.loads(stem.with_suffix(".json").read_text(encoding="utf-8"))["summary"]}
    own = torch.get_num_threads()  # the default setting's, which the last run left in place
    assert rows["optimized"]["borrowed"] == borrowed_cores(0) and rows["reference"]["borrowed"] == 0
    for row in rows.values():
        assert row["threads"] == own + row["borrowed"]
        floor = row["floor"]
        assert floor["global"]["threads"] == floor["local"]["threads"] == row["threads"]
        assert floor["codec"]["threads"] == own


def test_a_stream_case_refuses_what_it_would_ignore(tmp_path, capsys):
    """--batch decodes greedy cases only, and a stream case is always streamed: both refused, not ignored."""
    common = ["--size", "tiny", "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "x"), "--quiet"]
    assert run.main([*common, "--batch", "1", "--cases", "stream-en"]) == 2
    assert "with --batch" in capsys.readouterr().err
    assert run.main([*common, "--no-stream", "--cases", "stream-en,stream-zh"]) == 2
    assert "always streamed" in capsys.readouterr().err


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("normalize", [False, True])
def test_numbered_runs_share_only_the_template(tmp_path, lang, normalize):
    """Each run's text is new from its first row on, so the prefix cache leaves the whole text to prefill: with the
    numbered-list form (``11. text``) the preparation dropped the number and every prompt was the same."""
    from moss_npu.tts.pipeline import MossTTSNano
    from moss_npu.tts.settings import RunConfig

    model, codec = ensure_checkpoints("tiny", tmp_path)
    tts = MossTTSNano.from_pretrained(str(model), str(codec), device="cpu")
    settings = RunConfig(text_normalization=normalize, wetext=False)

    def rows(text: str) -> torch.Tensor:
        plan = tts.preparer.plan(text, settings, None)
        return tts.preparer.prompt_rows(plan, plan.chunks[0])

    def shared(a: torch.Tensor, b: torch.Tensor) -> int:
        n = min(len(a), len(b))
        return int((a[:n] == b[:n]).all(dim=-1).long().cumprod(dim=0).sum())

    bare, other = rows(run.SHORT[lang]), rows(run.LONG["zh" if lang == "en" else "en"])
    template = shared(bare, other)  # two unrelated texts share the template alone
    first, second = rows(run.numbered(11, run.SHORT[lang])), rows(run.numbered(12, run.SHORT[lang]))
    assert shared(first, bare) == template and shared(second, bare) == template
    assert len(first) > template + 2 and shared(first, second) < len(first)
