"""The worker's command loop (``moss_npu.serve.worker.WorkerLoop``) against a stand-in engine and pipe: a cancel
that meets its request's pump finishing at the same moment neither raises nor stops the worker."""

from __future__ import annotations

from moss_npu.serve.worker import WorkerLoop


class _Pipe:
    def __init__(self, messages: list) -> None:
        self.messages, self.sent = list(messages), []

    def recv(self):
        if not self.messages:
            raise EOFError
        return self.messages.pop(0)


class _Channel:
    def __init__(self, messages: list) -> None:
        self.conn, self.sent = _Pipe(messages), []

    def send(self, *message) -> None:
        self.sent.append(message)


class _Engine:
    active_slots = queued = 0
    closed = False

    def close(self) -> None:
        self.closed = True


class _Stream:
    cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class _PumpFinishesAfterTheCheck(dict):
    """The request's pump thread removes its stream right after the loop has looked it up by ``in``."""

    def __contains__(self, rid) -> bool:
        found = super().__contains__(rid)
        self.pop(rid, None)
        return found


def test_a_cancel_racing_the_end_of_its_request_keeps_the_worker_serving():
    engine = _Engine()
    loop = WorkerLoop(None, engine, _Channel([("cancel", 7), ("cancel", 8), ("stop",)]))
    loop.streams = _PumpFinishesAfterTheCheck({7: _Stream()})
    running = _Stream()
    loop.streams[8] = running
    loop.run()  # on 96bcbaf: KeyError from streams[7] after `7 in streams`, which ended the worker
    assert engine.closed and running.cancelled
