"""bench.serve end to end against a server it starts on a tiny generated checkpoint (no timing asserts)."""

import json
import re

import pytest

from bench import serve
from tests.serve.conftest import serve_module

serve_module("fastapi")
serve_module("httpx")


def test_serve_bench_reports_every_level(tmp_path, capsys):
    stem = tmp_path / "out" / "serve"
    code = serve.main(["--size", "tiny", "--cache-dir", str(tmp_path / "cache"), "--concurrency", "1,2",
                       "--requests", "1", "--frames", "2", "--warmup", "0", "--num-threads", "1", "--rounds", "3",
                       "--out", str(stem), "--quiet"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    assert re.fullmatch(r"concurrency speedup 2/1: \d+\.\d\d", out[-1])
    report = json.loads(stem.with_suffix(".json").read_text(encoding="utf-8"))
    rows = {r["concurrency"]: r for r in report["summary"]}
    assert set(rows) == {1, 2} and rows[2]["requests"] == 2 * 3
    for r in rows.values():  # a level's rate is the median of its rounds
        assert len(r["audio_s_per_s_rounds"]) == 3 and len(r["load_avg_by_round"]) == 3
        assert r["audio_s_per_s"] == sorted(r["audio_s_per_s_rounds"])[1]
    # The biased random weights never stop early: each request is exactly 2 frames (0.16 s) of audio.
    assert all(r["errors"] == 0 and r["audio_s"] == pytest.approx(0.16 * r["requests"]) for r in rows.values())
    assert all(r["ttfa_p50_ms"] > 0 for r in rows.values())
    assert "| 2 | 6 | 0 |" in stem.with_suffix(".md").read_text(encoding="utf-8")
    assert report["startup_s"] > 0  # from the server command to /health ready
    setup = report["workers"][0]["setup"]  # what the worker ran, from /health
    assert setup["dtype"] == "float32" and setup["step"].startswith("cpu-fp32/")
    assert setup["threads"] == 1 and setup["prepared_weights"] in ("built", "cache")


def test_bad_levels_are_usage_errors(capsys):
    assert serve.main(["--concurrency", "0,x"]) == 2
    assert "error:" in capsys.readouterr().err
    assert serve.main(["--concurrency", "1,8", "--rounds", "0"]) == 2
    assert "--rounds" in capsys.readouterr().err


def test_a_started_server_s_voice_store_is_removed_when_it_stops():
    """Each run gives its server a fresh voice store in a temporary folder; stopping the server removes it
    (runs used to leave one folder per run behind)."""
    import tempfile
    from pathlib import Path

    from bench.serve import Target

    voices = tempfile.TemporaryDirectory(prefix="moss-npu-bench-voices-")
    (Path(voices.name) / "alice.json").write_text("{}")
    target = Target("http://127.0.0.1:9", None, None, voices)
    target.stop()
    assert not Path(voices.name).exists()
    target.stop()  # a second stop (the finally after an error) is harmless
