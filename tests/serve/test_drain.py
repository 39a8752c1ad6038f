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


def test_a_sentence_still_speaking_when_the_grace_ends_is_told_shutting_down_not_timed_out():
    from types import SimpleNamespace

    from moss_npu.serve.errors import ApiError
    from moss_npu.serve.live import Session
    from moss_npu.serve.schema import speech_body

    class SilentTicket:  # a worker that never answers
        async def next(self, timeout):
            await asyncio.sleep(timeout)
            raise asyncio.TimeoutError

    drain = Drain(grace_s=0)
    drain.start()
    pool = SimpleNamespace(audio_format=lambda: (48000, 2))
    session = Session(SimpleNamespace(send_json=lambda m: asyncio.sleep(0)), pool, make_job=None,
                      config=SimpleNamespace(request_timeout_s=2.0), drain=drain)
    body = speech_body({"model": "moss-tts-nano", "input": "Still speaking.", "response_format": "pcm"})
    try:
        asyncio.run(session._sentence(0, "Still speaking.", SilentTicket(), body, None))
    except ApiError as exc:
        assert exc.status == 503 and exc.code == "shutting_down"
    else:
        raise AssertionError("the sentence outlived the drain")
