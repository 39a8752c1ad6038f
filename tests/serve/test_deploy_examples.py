"""The shipped deployment files are what the server takes: the Kubernetes example's flags parse, its KEDA
query names a gauge the server exports, and the Ray Serve config file's args build the application."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.optional import require
from tests.serve.conftest import REPO, serve_module, tiny_dirs

serve_module("fastapi")


def _documents(path: Path) -> dict:
    return {d["kind"]: d for d in yaml.safe_load_all(path.read_text(encoding="utf-8"))}


def test_kubernetes_example_flags_parse_and_its_query_names_an_exported_gauge():
    from moss_npu.serve.cli import build_parser
    from moss_npu.serve.metrics import Metrics

    docs = _documents(REPO / "deploy" / "kubernetes" / "moss-npu.yaml")
    container = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(container["args"])
    assert args.device == "cuda:0"
    query = docs["ScaledObject"]["spec"]["triggers"][0]["metadata"]["query"]
    gauge = query.split("(", 1)[1].split("{", 1)[0]
    assert f"# TYPE {gauge} gauge" in Metrics().render().decode()
    assert docs["Service"]["spec"]["selector"] == docs["Deployment"]["spec"]["selector"]["matchLabels"]


def test_ray_config_file_args_build_the_application(tmp_path):
    require("ray", "pip install -e '.[ray]'")
    from moss_npu.serve.ray import build

    config = yaml.safe_load((REPO / "moss_npu" / "serve" / "ray.yaml").read_text(encoding="utf-8"))
    (app,) = config["applications"]
    module, _, name = app["import_path"].partition(":")
    assert (module, name) == ("moss_npu.serve.ray", "build")
    model, codec = tiny_dirs()
    args = {**app["args"], "model": str(model), "codec": str(codec), "voices_dir": str(tmp_path / "voices")}
    gateway = build(args)._bound_deployment
    assert gateway.name == "gateway" and gateway.ray_actor_options["num_cpus"] == 0  # it relays: no core reserved
    deployment = gateway.init_args[0]._bound_deployment  # the speech replicas, behind the gateway
    assert deployment.name == "speech" and deployment.ray_actor_options["num_cpus"] == args["cpus_per_replica"]
    scaling = deployment._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas) == (args["min_replicas"], args["max_replicas"])
    assert scaling.target_ongoing_requests == args["target_ongoing_requests"]


def test_ray_config_refuses_an_unknown_setting(tmp_path):
    require("ray", "pip install -e '.[ray]'")
    from moss_npu.errors import InputError
    from moss_npu.serve.ray import build

    model, codec = tiny_dirs()
    with pytest.raises(InputError, match="unknown settings: --replicas"):
        build({"model": str(model), "codec": str(codec), "voices_dir": str(tmp_path), "replicas": 2})


def test_kubernetes_grace_period_covers_the_prestop_sleep_and_the_drain():
    """Kubernetes kills the pod at terminationGracePeriodSeconds: the preStop sleep, the server's drain and its
    final wait must fit in it, or a rolling update cuts the requests the drain was finishing."""
    from moss_npu.serve.cli import FINAL_WAIT_S, build_parser

    spec = _documents(REPO / "deploy" / "kubernetes" / "moss-npu.yaml")["Deployment"]["spec"]["template"]["spec"]
    container = spec["containers"][0]
    grace = build_parser().parse_args(container["args"]).shutdown_grace
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and grace is not None
    assert spec["terminationGracePeriodSeconds"] >= float(command[1]) + grace + FINAL_WAIT_S
