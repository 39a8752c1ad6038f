"""Command line of the speech server on Ray Serve (``python -m moss_npu.serve.ray``).

    python -m moss_npu.serve.ray --model DIR --codec DIR --device cpu --min-replicas 1 --max-replicas 2
    MOSS_NPU_API_KEY=KEY python -m moss_npu.serve.ray --address auto --device cuda --max-replicas 8 --host 0.0.0.0
    serve run moss_npu/serve/ray.yaml     # the same, from the config file the package ships

The server's own flags (``python -m moss_npu.serve --help``) mean the same here, except that ``--device`` names
the kind of device each replica owns (cpu, cuda or npu: one device per replica) and ``--host``/``--port`` are
Ray's HTTP proxy's. Connections (``--header-timeout``, ``--keep-alive``, ``--max-connections``) belong to Ray's
proxy and are refused here. Without ``--address`` a local Ray cluster is started (``--num-cpus`` cores).
Model folders and ``--voices-dir`` must be at the same path on every node (the voices folder shared by all).
Exit codes as the server's: 0, 1 runtime failure, 2 bad input, 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
import threading
from dataclasses import replace
from typing import Optional, Union

from moss_npu.cli import run_cli
from moss_npu.device import parse_device, replica_device
from moss_npu.errors import DeviceError, InputError, MissingDependency
from moss_npu.serve import cli as server_cli
from moss_npu.serve.ray_app import APP_NAME, ReplicaSettings, Scaling, application

PROXY_OWNED = {"header_timeout": 10.0, "keep_alive": 5, "max_connections": 1000}  # flag -> the server's default


def build_parser() -> argparse.ArgumentParser:
    """The server's parser plus Ray's flags."""
    p = server_cli.build_parser()
    p.prog = "python -m moss_npu.serve.ray"
    p.description = __doc__
    p.set_defaults(device="cpu")
    ray = p.add_argument_group("Ray Serve")
    ray.add_argument("--address", help="a running Ray cluster (auto, or ray://host:10001); default: start one here")
    ray.add_argument("--num-cpus", type=int, help="cores of the local cluster (default: all of them)")
    ray.add_argument("--min-replicas", type=int, default=1, help="replicas kept running")
    ray.add_argument("--max-replicas", type=int, default=1, help="replicas at most (one device each)")
    ray.add_argument("--target-ongoing-requests", type=float, default=2.0,
                     help="queued + generating requests per replica Ray scales towards")
    ray.add_argument("--cpus-per-replica", type=float, default=1.0, help="cores a CPU replica reserves")
    ray.add_argument("--upscale-delay", type=float, default=5.0, help="seconds of high load before a replica is added")
    ray.add_argument("--downscale-delay", type=float, default=30.0,
                     help="seconds of low load before a replica is removed")
    ray.add_argument("--look-back", type=float, default=30.0, help="seconds of load Ray averages to decide")
    return p


def settings_from_args(args: Union[argparse.Namespace, dict]):
    """Check the flags (a namespace, or a config file's ``args`` by flag name) and return
    ``(ReplicaSettings, Scaling)``; raise ``InputError`` naming the bad one."""
    args = _parse_config_args(args) if isinstance(args, dict) else argparse.Namespace(**vars(args))  # _check edits it
    for name, default in PROXY_OWNED.items():
        if getattr(args, name) != default:
            raise InputError(f"--{name.replace('_', '-')}: under Ray, connections belong to Ray's HTTP proxy; "
                             "leave the flag out")
    one_kind = InputError(f"--device {args.device}: name one kind (cpu, cuda or npu); Ray gives each replica one "
                          "device of it")
    if "," in args.device:
        raise one_kind
    try:
        kind, index = parse_device(args.device)
        device, _ = replica_device(kind, args.cpus_per_replica)
    except DeviceError as exc:
        raise InputError(str(exc)) from None
    if index is not None:
        raise one_kind
    if not 1 <= args.min_replicas <= args.max_replicas <= 1024:
        raise InputError(f"--min-replicas {args.min_replicas} --max-replicas {args.max_replicas}: use "
                         "1 <= min <= max <= 1024")
    for name, value in (("--target-ongoing-requests", args.target_ongoing_requests),
                        ("--cpus-per-replica", args.cpus_per_replica), ("--look-back", args.look_back)):
        if not value > 0:
            raise InputError(f"{name} {value}: use a positive number")
    for name, value in (("--upscale-delay", args.upscale_delay), ("--downscale-delay", args.downscale_delay)):
        if not value >= 0:
            raise InputError(f"{name} {value}: use 0 or more seconds")
    if args.num_cpus is not None and args.address is not None:
        raise InputError("--num-cpus sizes a local cluster; a running one (--address) has its own")
    server_cli._check(args)  # the server's own checks: ranges, key, hosts, voices folder, model folders
    threads = args.num_threads or max(1, int(args.cpus_per_replica))
    settings = ReplicaSettings(config=server_cli.server_config(args), max_queue=args.max_queue,
                               spec=replace(server_cli.worker_spec(args, device), num_threads=threads))
    scaling = Scaling(device_kind=kind, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                      target_ongoing_requests=args.target_ongoing_requests, cpus_per_replica=args.cpus_per_replica,
                      upscale_delay_s=args.upscale_delay, downscale_delay_s=args.downscale_delay,
                      look_back_s=args.look_back)
    return settings, scaling


def _parse_config_args(values: dict) -> argparse.Namespace:
    """A config file's ``args`` (flag names with ``_`` or ``-``) through the same parser: unknown ones are refused."""
    argv: list[str] = []
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        argv += [flag, str(value)]
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
    except SystemExit:
        raise InputError(f"the config file's args are not valid flags: {values}") from None
    if unknown:
        raise InputError(f"the config file's args name unknown settings: {' '.join(unknown)}")
    return args


def build(args: dict):
    """Application builder for ``serve run`` / a Serve config file (``ray.yaml``): ``args`` are the CLI's flags by
    name."""
    return application(*settings_from_args(args))


def main(argv: Optional[list[str]] = None) -> int:
    """Check the flags, start (or join) the cluster, deploy, and serve until Ctrl-C."""
    return run_cli(lambda: serve(build_parser().parse_args(argv)))


def serve(args: argparse.Namespace) -> int:
    """Deploy the application and block; return 0 when the application ends."""
    settings, scaling = settings_from_args(args)
    try:
        import ray
        from ray import serve as ray_serve
    except ImportError as exc:
        raise MissingDependency(f"Ray Serve is not installed ({exc.name} is missing); "
                                "run pip install -e '.[ray]'") from None
    ray.init(address=args.address, num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=True)
    try:
        ray_serve.start(http_options={"host": args.host, "port": args.port})
        ray_serve.run(application(settings, scaling), name=APP_NAME, route_prefix="/")
        print(f"serving on http://{args.host}:{args.port} ({scaling.min_replicas}..{scaling.max_replicas} "
              f"{scaling.device_kind} replicas)", file=sys.stderr, flush=True)
        threading.Event().wait()  # until Ctrl-C (run_cli turns it into exit 130)
    finally:
        if args.address is None:
            ray_serve.shutdown()
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
