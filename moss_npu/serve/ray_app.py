"""The speech server as a Ray Serve application: one replica per device, autoscaled on requests in flight.

Each replica is the single-host server's own FastAPI app (``create_app``, through ``serve.ingress``) around a
``WorkerPool`` of one worker on the one device Ray reserved for the replica, so every route, error shape and
streaming format is the same; Ray's HTTP proxy routes requests to replicas and streams their answers. Ray
scales the replicas between ``min_replicas`` and ``max_replicas`` on ongoing requests per replica (what a
replica has queued plus generating), and a replica takes traffic only once its worker has loaded and warmed up.

Voices live in one folder every replica shares (``--voices-dir``, a network file system across machines): the
folder is the truth, each replica's index refreshes when the folder changes and on a miss, and name claims are
exclusive file creations, so a voice uploaded through one replica is usable through every other at once and
deleted everywhere (``moss_npu.serve.voices``).

Answers carry ``X-Moss-Replica`` (the replica's id) and ``/health`` adds the deployment's replica counts as
Ray reports them, so a restarting replica shows there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from moss_npu.device import replica_device

log = logging.getLogger("moss_npu.serve.ray")

APP_NAME = "moss-npu"
DEPLOYMENT = "speech"
READY_TIMEOUT_S = 600.0  # a replica loading and warming up on a loaded machine
FAILED_STATES = ("failed", "crash_loop")


@dataclass(frozen=True)
class ReplicaSettings:
    """What every replica builds its server from (plain values: Ray ships them to the replicas)."""

    model: str
    codec: str
    device: str  # inside the replica: cpu, cuda:0 or npu:0 (Ray makes its device index 0)
    voices_dir: str
    dtype: Optional[str] = None
    max_batch: int = 8
    max_queue: int = 32
    num_threads: int = 1
    max_new_frames: int = 375
    model_name: str = "moss-tts-nano"
    api_key: Optional[str] = None
    max_input_chars: int = 4096
    request_timeout_s: float = 300.0
    max_upload_bytes: int = 10 * 2**20
    max_voice_seconds: float = 30.0
    body_timeout_s: float = 60.0
    bind_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()


@dataclass(frozen=True)
class Scaling:
    """How many replicas, what each reserves, and when Ray adds or removes one."""

    device_kind: str = "cpu"
    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing_requests: float = 2.0
    cpus_per_replica: float = 1.0
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 30.0
    look_back_s: float = 30.0

    def deployment_options(self, max_ongoing: int) -> dict:
        """``serve.deployment`` options: the replica's device reservation and the autoscaling config."""
        _, actor_options = replica_device(self.device_kind, self.cpus_per_replica)
        return {
            "ray_actor_options": actor_options,
            "max_ongoing_requests": max_ongoing,
            "autoscaling_config": {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                                   "initial_replicas": self.min_replicas,
                                   "target_ongoing_requests": self.target_ongoing_requests,
                                   "upscale_delay_s": self.upscale_delay_s,
                                   "downscale_delay_s": self.downscale_delay_s,
                                   "look_back_period_s": self.look_back_s},
            "health_check_period_s": 5.0,
            "health_check_timeout_s": 30.0,
            "graceful_shutdown_timeout_s": 10.0,
        }


class ReplicaHeader:
    """ASGI middleware: every HTTP answer names the replica that gave it (``X-Moss-Replica``)."""

    def __init__(self, app, replica: str) -> None:
        self.app, self.replica = app, replica.encode("ascii", "replace")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def tagged(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-moss-replica", self.replica)]}
            await send(message)

        await self.app(scope, receive, tagged)


class SpeechReplica:
    """One replica: a worker pool of one worker on this replica's device, and the server app around it."""

    async def __init__(self, settings: dict) -> None:
        from ray import serve

        from moss_npu.serve.app import ServerConfig
        from moss_npu.serve.metrics import Metrics
        from moss_npu.serve.pool import WorkerPool
        from moss_npu.serve.spec import WorkerSpec

        logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
        s = ReplicaSettings(**settings)
        self.settings = s
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.metrics = Metrics()
        self.fatal: list[str] = []
        spec = WorkerSpec(model=s.model, codec=s.codec, device=s.device, dtype=s.dtype, max_batch=s.max_batch,
                          num_threads=s.num_threads, max_new_frames=s.max_new_frames)
        self.pool = WorkerPool([spec], max_queue=s.max_queue, metrics=self.metrics,
                               on_fatal=lambda message, _user_fault: self.fatal.append(message))
        self.config = ServerConfig(
            voices_dir=Path(s.voices_dir), model_names=(s.model_name,), api_key=s.api_key,
            max_input_chars=s.max_input_chars, max_new_frames=s.max_new_frames,
            request_timeout_s=s.request_timeout_s, max_upload_bytes=s.max_upload_bytes,
            max_voice_seconds=s.max_voice_seconds, body_timeout_s=s.body_timeout_s, bind_host=s.bind_host,
            allowed_hosts=tuple(s.allowed_hosts), cors_origins=tuple(s.cors_origins))
        self.pool.start()  # here, not in the app's lifespan: Ray routes to a replica once __init__ returns
        await self._until_ready()

    async def _until_ready(self) -> None:
        """Wait for the worker to load and warm up; raise (Ray then starts the replica again) if it cannot."""
        end = time.monotonic() + READY_TIMEOUT_S
        while not self.pool.ready:
            if self.fatal:
                self.pool.close()
                raise RuntimeError(f"replica {self.replica_id}: {self.fatal[0]}")
            if time.monotonic() > end:
                self.pool.close()
                raise RuntimeError(f"replica {self.replica_id}: the worker was not ready after {READY_TIMEOUT_S:g} s")
            await asyncio.sleep(0.2)
        log.info("replica %s ready on %s", self.replica_id, self.settings.device)

    def __serve_build_asgi_app__(self):
        from moss_npu.serve.app import create_app

        app = create_app(self.config, self.pool, self.metrics, health_extra=self._deployment_health)
        return ReplicaHeader(app, self.replica_id)

    def _deployment_health(self) -> dict:
        """This replica's id and the deployment's replicas by state (Ray's view), for ``/health``."""
        extra: dict[str, Any] = {"replica": self.replica_id}
        try:
            from ray import serve

            deployment = serve.status().applications[APP_NAME].deployments[DEPLOYMENT]
            extra["deployment"] = {"status": str(deployment.status.value),
                                   "replicas": {str(getattr(k, "value", k)): v
                                                for k, v in deployment.replica_states.items()}}
        except Exception as exc:  # noqa: BLE001 - the controller is unreachable: health still answers
            extra["deployment"] = {"status": "unknown", "reason": type(exc).__name__}
        return extra

    def check_health(self) -> None:
        """Ray's periodic health check: a replica whose worker is down for good is replaced."""
        for w in self.pool.workers:
            if w.state in FAILED_STATES:
                raise RuntimeError(f"worker {w.index} is {w.state}: {w.cause}")


def deployment(scaling: Scaling, max_ongoing: int):
    """The Serve deployment class of the speech server (built here so ``ray`` is imported only when used)."""
    from ray import serve

    ingress = serve.ingress()(SpeechReplica)
    return serve.deployment(name=DEPLOYMENT, **scaling.deployment_options(max_ongoing))(ingress)


def application(settings: ReplicaSettings, scaling: Scaling):
    """The bound Serve application: ``serve.run(application(...))`` or the ``build`` of a config file."""
    return deployment(scaling, settings.max_batch + settings.max_queue).bind(asdict(settings))


def build(args: dict):
    """Application builder for ``serve run`` / a Serve config file: ``args`` are the CLI's flags by name."""
    from moss_npu.serve.ray import settings_from_args

    settings, scaling = settings_from_args(args)
    return application(settings, scaling)
