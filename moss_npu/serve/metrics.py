"""Prometheus metrics of one server, in a registry the server owns (``GET /metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_TTFA_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0)
_RTF_BUCKETS = (0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


class Metrics:
    """Requests by status, load (in flight, active slots, queue), time to first audio, RTF, frames."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("moss_npu_requests", "HTTP requests answered, by route and status",
                                ("route", "status"), registry=r)
        self.in_flight = Gauge("moss_npu_in_flight_requests", "speech requests admitted and not finished",
                               registry=r)
        self.active_slots = Gauge("moss_npu_active_slots", "engine slots generating now (all workers)", registry=r)
        self.queue_depth = Gauge("moss_npu_queue_depth", "requests waiting for an engine slot (all workers)",
                                 registry=r)
        self.workers_ready = Gauge("moss_npu_workers_ready", "workers that are warmed up and serving", registry=r)
        self.worker_restarts = Counter("moss_npu_worker_restarts", "workers started again after dying", registry=r)
        self.ttfa = Histogram("moss_npu_time_to_first_audio_seconds", "request arrival to first audio sent",
                              buckets=_TTFA_BUCKETS, registry=r)
        self.rtf = Histogram("moss_npu_real_time_factor", "wall time of a request / seconds of audio it made",
                             buckets=_RTF_BUCKETS, registry=r)
        self.frames = Counter("moss_npu_frames", "codec frames generated (rate() gives frames/s)", registry=r)
        self.audio_seconds = Counter("moss_npu_audio_seconds", "seconds of audio generated", registry=r)

    def set_load(self, active: int, queued: int) -> None:
        self.active_slots.set(active)
        self.queue_depth.set(queued)

    def set_in_flight(self, count: int) -> None:
        self.in_flight.set(count)

    def render(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)
