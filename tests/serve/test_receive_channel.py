"""One reader of a request's ASGI receive channel at a time: while a streamed answer goes out, Starlette's
response listens for the client's disconnect, so the server's own watcher (which stops the request when the
client leaves before the first audio) has stopped reading by then. Two readers of one channel race for the one
``http.disconnect`` message. In process, against a stand-in worker pool."""

from __future__ import annotations

import asyncio
import json

import numpy as np

from tests.serve.conftest import serve_module

serve_module("fastapi")

from moss_npu.serve.app import ServerConfig, create_app  # noqa: E402
from moss_npu.serve.metrics import Metrics  # noqa: E402


class _Ticket:
    def __init__(self) -> None:
        self.events: asyncio.Queue = asyncio.Queue()
        self.events.put_nowait(("chunk", np.zeros((2, 3840), np.float32), False))  # then nothing until it ends

    async def next(self, timeout):
        return await asyncio.wait_for(self.events.get(), timeout)

    def gone(self) -> None:
        self.events.put_nowait(("gone",))

    def abandon(self) -> None:
        self.events.put_nowait(("gone",))


class _Pool:
    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def audio_format(self) -> tuple[int, int]:
        return 48000, 2

    def submit(self, job: dict) -> _Ticket:
        return _Ticket()


def test_a_streamed_answer_has_one_reader_of_the_receive_channel(tmp_path):
    app = create_app(ServerConfig(voices_dir=tmp_path), _Pool(), Metrics())
    body = json.dumps({"model": "moss-tts-nano", "input": "Hello.", "response_format": "pcm"}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/audio/speech", "raw_path": b"/v1/audio/speech",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000),
             "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    readers = {"now": 0, "most": 0}
    sent: list[dict] = []

    async def run() -> None:
        left = asyncio.Event()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            if messages:
                return messages.pop(0)
            readers["now"] += 1
            readers["most"] = max(readers["most"], readers["now"])
            try:
                await left.wait()
            finally:
                readers["now"] -= 1
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and message.get("body"):
                for _ in range(20):  # let every reader of the channel reach it
                    await asyncio.sleep(0)
                left.set()  # the client leaves after its first audio

        await asyncio.wait_for(app(scope, receive, send), 30)

    asyncio.run(run())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert readers["most"] == 1
