"""The drain's bookkeeping without a server (``moss_npu.serve.drain``); the real stop: test_shutdown.py."""

import asyncio
import math

from tests.serve.conftest import serve_module

serve_module("fastapi")
from moss_npu.serve.drain import Drain  # noqa: E402


def test_no_grace_bounds_a_request_before_the_drain_starts():
    drain = Drain(grace_s=0)
    assert drain.remaining_s() == math.inf and not drain.expired() and not drain.draining
    drain.start()
    assert drain.draining and drain.expired() and drain.remaining_s() == 0


def test_listeners_are_told_once_and_late_ones_at_once():
    drain, told = Drain(), []
    with drain.listening(lambda: told.append("early")):
        drain.start()
        drain.start()
        with drain.listening(lambda: told.append("late")):
            pass
    assert told == ["early", "late"]


def test_settled_waits_for_what_is_in_flight():
    async def scenario() -> list:
        drain, order = Drain(grace_s=30), []

        async def request() -> None:
            with drain.tracked():
                await asyncio.sleep(0.2)
                order.append("request done")

        task = asyncio.ensure_future(request())
        await asyncio.sleep(0)
        drain.start()
        await drain.settled()
        order.append("settled")
        await task
        return order

    assert asyncio.run(scenario()) == ["request done", "settled"]
