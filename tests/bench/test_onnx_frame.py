"""bench.onnx_frame end to end on the tiny generated checkpoint: the official modules exported to ONNX give our greedy
codes (no timing asserts). Needs the official remote code: set MOSS_NPU_UPSTREAM_CODE (tests/upstream)."""

import importlib.util
import os
import re
import sys

import pytest

from bench import onnx_frame
from tests.optional import allowed_skip, needs

CODE = os.environ.get("MOSS_NPU_UPSTREAM_CODE")
HAS = {name: importlib.util.find_spec(name) is not None for name in ("transformers", "onnxruntime")}


# 16 frames: a graph with wrong rotary angles (docs/performance.md#against-the-official-onnx-runtime) agreed for ten.
@allowed_skip(not CODE, "MOSS_NPU_UPSTREAM_CODE is not set: no official remote code to export")
@needs(HAS["transformers"], 'transformers is not installed: pip install -e ".[upstream]"')
@needs(HAS["onnxruntime"], 'onnxruntime is not installed: pip install -e ".[onnx]"')
@pytest.mark.parametrize("local", onnx_frame.LOCAL_MODES)
def test_the_exported_official_graphs_give_our_codes(tmp_path, capsys, local):
    code = onnx_frame.main(["--upstream-code", CODE, "--size", "tiny", "--cache-dir", str(tmp_path), "--frames", "16",
                            "--rounds", "1", "--warmup", "0", "--local", local])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "codes agree: 256/256 in each of 4 runs" in out
    for when in ("before", "after"):  # the probe the ratios are read beside, both thread counts
        assert re.search(rf"^{when} the rounds, read bandwidth .*: 1 thread [\d.]+ GB/s, 2 threads [\d.]+ GB/s", out, re.M)
    assert re.search(r"^fp32@1 / onnx@1: \d+\.\d\d$", out, re.M)
    assert re.search(r"^fp32@2 / onnx best \(@[12]\): \d+\.\d\d$", out, re.M)


def test_bad_counts_are_a_usage_error(capsys):
    assert onnx_frame.main(["--upstream-code", "DIR", "--frames", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: --frames 0")


def test_without_onnxruntime_it_names_the_extra_before_loading_anything(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime now raises ModuleNotFoundError
    assert onnx_frame.main(["--upstream-code", "DIR", "--size", "tiny", "--cache-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().endswith('install it with `pip install -e ".[onnx]"`')
    assert not any(tmp_path.iterdir())  # no checkpoint was written
