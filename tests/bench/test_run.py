"""The benchmark's --compare machinery end to end on a tiny generated checkpoint (no timing asserts)."""

import json
import re

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


def test_checkpoints_are_cached(tmp_path):
    first = ensure_checkpoints("tiny", tmp_path)
    stamp = (first[0] / "model.safetensors").stat().st_mtime_ns
    assert ensure_checkpoints("tiny", tmp_path) == first
    assert (first[0] / "model.safetensors").stat().st_mtime_ns == stamp
    assert (first[0] / "tokenizer.model").is_file() and (first[1] / "config.json").is_file()


def test_bad_configuration_is_usage_error(tmp_path, capsys):
    assert run.main(["--compare", "reference,turbo", "--cache-dir", str(tmp_path)]) == 2
    assert "error:" in capsys.readouterr().err
