"""The Ray entry's flag checks and device reservations (no cluster: plain functions)."""

from __future__ import annotations

import pytest

from moss_npu.device import replica_device
from moss_npu.errors import DeviceError, InputError
from tests.serve.conftest import serve_module, tiny_dirs

serve_module("fastapi")


def test_each_device_kind_reserves_its_ray_resource():
    assert replica_device("cpu", 2.0) == ("cpu", {"num_cpus": 2.0})
    assert replica_device("cuda", 1.0) == ("cuda:0", {"num_cpus": 1, "num_gpus": 1})
    assert replica_device("npu", 1.0) == ("npu:0", {"num_cpus": 1, "resources": {"NPU": 1}})
    with pytest.raises(DeviceError, match="only cpu, cuda and npu"):
        replica_device("mps", 1.0)


@pytest.mark.parametrize("extra, message", [
    (["--device", "cuda:1"], "name one kind"),
    (["--device", "cpu,cpu"], "name one kind"),
    (["--device", "mps"], "only cpu, cuda and npu"),
    (["--min-replicas", "3", "--max-replicas", "2"], "1 <= min <= max"),
    (["--keep-alive", "9"], "Ray's HTTP proxy"),
    (["--target-ongoing-requests", "0"], "positive"),
    (["--address", "auto", "--num-cpus", "2"], "local cluster"),
])
def test_bad_ray_flags_are_refused_with_the_reason(tmp_path, extra, message):
    from moss_npu.serve.ray import build_parser, settings_from_args

    model, codec = tiny_dirs()
    args = build_parser().parse_args(["--model", str(model), "--codec", str(codec), "--voices-dir",
                                      str(tmp_path), *extra])
    with pytest.raises(InputError, match=message):
        settings_from_args(args)


def test_cpu_replicas_get_one_intra_op_thread_per_reserved_core(tmp_path):
    from moss_npu.serve.ray import build_parser, settings_from_args

    model, codec = tiny_dirs()
    args = build_parser().parse_args(["--model", str(model), "--codec", str(codec), "--voices-dir", str(tmp_path),
                                      "--cpus-per-replica", "3", "--max-replicas", "4"])
    settings, scaling = settings_from_args(args)
    assert settings.spec.device == "cpu" and settings.spec.num_threads == 3
    assert (scaling.min_replicas, scaling.max_replicas, scaling.device_kind) == (1, 4, "cpu")


def test_replicas_get_the_single_host_servers_config_and_worker_spec_for_the_same_flags(tmp_path):
    from moss_npu.serve import cli
    from moss_npu.serve.ray import build_parser, settings_from_args

    model, codec = tiny_dirs()
    flags = ["--model", str(model), "--codec", str(codec), "--voices-dir", str(tmp_path), "--max-new-frames", "100",
             "--request-timeout", "12", "--max-upload-mb", "2", "--max-voice-seconds", "9", "--body-timeout", "7",
             "--max-input-chars", "99", "--max-batch", "3", "--max-queue", "5", "--num-threads", "2",
             "--model-name", "m", "--allowed-hosts", "a.example", "--cors-origins", "https://b.example"]
    settings, _ = settings_from_args(build_parser().parse_args(flags))
    server = cli.build_parser().parse_args([*flags, "--device", "cpu"])
    cli._check(server)
    assert settings.config == cli.server_config(server)
    assert settings.spec == cli.worker_spec(server, "cpu")
    assert (settings.max_queue, settings.max_ongoing) == (5, 3 + 5)
