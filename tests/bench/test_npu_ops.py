"""bench.npu_ops on the stand-in npu: the per-frame budgets that decide an NPU frame's time (no timing here).

With graphs a frame is one replay, at most one device->host read (the frame's codes) and one host->device
upload (the host-drawn uniforms); eager frames dispatch their ops one by one, fewer than half the official
code's on the same stand-in (its column needs the official remote code, so its count is kept here).
"""

import json

from tests.npu_standin.fixtures import REPO, standin  # noqa: F401 - the fixture

# The official code's eager ops per frame on nano-tiny (`--upstream-code`, torch 2.13, docs/performance.md).
OFFICIAL_NANO_TINY_OPS = 1688.0


def test_per_frame_budgets_eager_and_graph(standin, tmp_path):
    out = tmp_path / "ops.json"
    done = standin.run("-m", "bench.npu_ops", "--frames", "4,10", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| mode | ops | host_syncs |" in done.stdout
    rows = json.loads(out.read_text())["per_frame"]
    graph, eager = rows["graph"], rows["eager"]
    assert graph["replays"] == 1 and graph["device_to_host"] <= 1 and graph["items"] == 0
    assert graph["host_to_device"] <= 1 and graph["ops"] <= 8
    assert eager["replays"] == 0 and eager["ops"] > 50 * graph["ops"] and eager["host_syncs"] <= 2
    assert eager["ops"] < OFFICIAL_NANO_TINY_OPS / 2


def test_without_the_standin_on_the_path_it_says_so_in_one_line(standin):
    done = standin.run("-m", "bench.npu_ops", PYTHONPATH=str(REPO))
    assert done.returncode == 2 and done.stderr.startswith("error: --device npu:0: torch_npu is not importable")
