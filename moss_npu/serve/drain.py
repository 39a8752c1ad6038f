"""The server's stop: a drain, so a rolling update loses no request (docs/serving.md#operations).

The first signal starts it: ``/health`` turns 503, new requests get 503 ``shutting_down``, sessions end after the
sentences they hold, and requests in flight finish within ``grace_s``, after which they too get 503.
"""

from __future__ import annotations

import asyncio
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from moss_npu.serve.errors import ApiError

RETRY_AFTER_S = 2  # another replica can take the request at once; this one is going away
POLL_S = 0.05


class Drain:
    """Whether the server is draining, what is still in flight, and who must be told (see the module docstring)."""

    def __init__(self, grace_s: float = 300.0) -> None:
        self.grace_s = grace_s
        self.started_at: Optional[float] = None  # time.monotonic() of the first signal
        self.active = 0  # HTTP requests and WebSocket sessions in flight
        self._listeners: set[Callable[[], None]] = set()

    @property
    def draining(self) -> bool:
        return self.started_at is not None

    def expired(self) -> bool:
        """Whether the grace is over: whatever still runs is stopped."""
        return self.started_at is not None and time.monotonic() - self.started_at >= self.grace_s

    def remaining_s(self) -> float:
        """Seconds of grace left (unbounded before the drain starts)."""
        if self.started_at is None:
            return math.inf
        return max(0.0, self.grace_s - (time.monotonic() - self.started_at))

    def start(self) -> None:
        """Begin draining (on the event loop): tell every listener once."""
        if self.started_at is not None:
            return
        self.started_at = time.monotonic()
        for listener in list(self._listeners):
            listener()

    @contextmanager
    def tracked(self) -> Iterator[None]:
        """Count a request or session as in flight while the block runs."""
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1

    @contextmanager
    def listening(self, listener: Callable[[], None]) -> Iterator[None]:
        """Call ``listener`` when the drain starts (at once if it has), while the block runs."""
        self._listeners.add(listener)
        try:
            if self.draining:
                listener()
            yield
        finally:
            self._listeners.discard(listener)

    async def settled(self) -> None:
        """Wait until nothing is in flight or the grace is over."""
        while self.active > 0 and not self.expired():
            await asyncio.sleep(POLL_S)


def shutting_down() -> ApiError:
    """The answer to a request that arrives, or is still running, while the server stops."""
    return ApiError(503, "the server is shutting down; retry the request (another replica will take it)",
                    code="shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})


@dataclass(frozen=True)
class Deadline:
    """When a request (or a session's sentence) must be done: its own timeout (then 504), or the end of the
    server's drain (then 503)."""

    at: float  # the event loop's time
    drain: Drain

    async def next_event(self, ticket: Any) -> tuple:
        """The ticket's next event (``moss_npu.serve.pool.Ticket``) before the deadline, else its answer."""
        loop = asyncio.get_running_loop()
        while (remaining := min(self.at - loop.time(), self.drain.remaining_s())) > 0:
            try:  # in steps, so a drain that starts meanwhile shortens the wait
                return await ticket.next(min(remaining, 1.0))
            except asyncio.TimeoutError:
                pass
        if self.drain.expired():
            raise shutting_down()
        raise ApiError(504, "the request took longer than the server's timeout; shorten the text or raise "
                       "--request-timeout", code="timeout")
