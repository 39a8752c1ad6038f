"""The speech server as a Ray Serve application: one replica per device, autoscaled on requests in flight.

Each speech replica is the single-host server's app (``create_app``) around a pool of one worker on the device
Ray reserved for it; a gateway deployment (``moss_npu.serve.ray_gateway``) forwards requests to the replicas.
How it scales, shares voices and survives a lost replica: docs/scaling.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moss_npu.device import replica_device

if TYPE_CHECKING:
    from moss_npu.serve.app import ServerConfig
    from moss_npu.serve.spec import WorkerSpec

log = logging.getLogger("moss_npu.serve.ray")

APP_NAME = "moss-npu"
DEPLOYMENT = "speech"
GATEWAY = "gateway"
READY_TIMEOUT_S = 600.0  # a replica loading and warming up on a loaded machine
FAILED_STATES = ("failed", "crash_loop")


@dataclass(frozen=True)
class ReplicaSettings:
    """What every replica builds its server from: the server's config, its one worker's spec, its queue."""

    config: ServerConfig
    spec: WorkerSpec  # device inside the replica: cpu, cuda:0 or npu:0 (Ray makes its device index 0)
    max_queue: int = 32

    @property
    def max_ongoing(self) -> int:
        """Requests a replica admits: its slots plus its queue (Ray queues the rest at its router)."""
        return self.spec.max_batch + self.max_queue


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
            "autoscaling_config": self._autoscaling(self.min_replicas, self.target_ongoing_requests),
            "health_check_period_s": 5.0,
            "health_check_timeout_s": 30.0,
            "graceful_shutdown_timeout_s": 10.0,
        }

    def gateway_options(self, max_ongoing: int) -> dict:
        """``serve.deployment`` options of the gateway: no device and no core reserved (it relays bytes), room
        for every replica's requests in one gateway, one more gateway per replica's worth of requests."""
        return {
            "ray_actor_options": {"num_cpus": 0},
            "max_ongoing_requests": max_ongoing * self.max_replicas,
            "autoscaling_config": self._autoscaling(1, max_ongoing),
        }

    def _autoscaling(self, low: int, target: float) -> dict:
        """Ray's autoscaling config: ``low`` to ``max_replicas`` replicas, aiming at ``target`` requests each."""
        return {"min_replicas": low, "max_replicas": self.max_replicas, "initial_replicas": low,
                "target_ongoing_requests": target, "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s, "look_back_period_s": self.look_back_s}


class SpeechReplica:
    """One replica: a worker pool of one worker on this replica's device, and the server app around it, which
    runs the requests the gateway forwards (``moss_npu.serve.ray_gateway``)."""

    async def __init__(self, settings: ReplicaSettings) -> None:
        from ray import serve

        from moss_npu.serve.app import create_app
        from moss_npu.serve.metrics import Metrics
        from moss_npu.serve.pool import WorkerPool

        logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.metrics = Metrics()
        self.fatal: list[str] = []
        self.pool = WorkerPool([settings.spec], max_queue=settings.max_queue, metrics=self.metrics,
                               on_fatal=lambda message, _user_fault: self.fatal.append(message))
        self.pool.start()  # here, not in the app's lifespan: Ray routes to a replica once __init__ returns
        await self._until_ready(settings.spec.device)
        self.app = create_app(settings.config, self.pool, self.metrics, health_extra=self._deployment_health)

    async def http(self, scope: dict, body: bytes):
        """One forwarded HTTP request through the app: the ASGI messages it sends, the answer naming this replica
        (``X-Moss-Replica``)."""
        from moss_npu.serve.ray_gateway import body_receive, run_app

        async for message in run_app(self.app, scope, body_receive(body)):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-moss-replica", self.replica_id.encode("ascii", "replace"))]}
            yield message

    async def websocket(self, scope: dict, inbox, key: str):
        """One forwarded WebSocket session through the app, the client's messages read from the gateway's inbox."""
        from moss_npu.serve.ray_gateway import run_app

        async for message in run_app(self.app, scope, lambda: inbox.get.remote(key)):
            yield message

    def __del__(self) -> None:
        """Ray's graceful stop of the replica: stop its worker."""
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.close()

    async def _until_ready(self, device: str) -> None:
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
        log.info("replica %s ready on %s", self.replica_id, device)

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


def application(settings: ReplicaSettings, scaling: Scaling):
    """The bound Serve application (the gateway, bound to the speech deployment): ``serve.run(application(...))``
    or the ``build`` of a config file. ``ray`` is imported only here, when it is used."""
    from ray import serve

    from moss_npu.serve.ray_gateway import Gateway

    speech = serve.deployment(name=DEPLOYMENT, **scaling.deployment_options(settings.max_ongoing))(SpeechReplica)
    gateway = serve.deployment(name=GATEWAY, **scaling.gateway_options(settings.max_ongoing))(serve.ingress()(Gateway))
    return gateway.bind(speech.bind(settings), settings.config)
