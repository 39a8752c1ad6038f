"""The Ray application's HTTP entry: a gateway that forwards each request to a speech replica's own app.

The gateway reads the body through the server's edge (``moss_npu.serve.edge``), sends the request over a
``DeploymentHandle`` to a replica, which runs it through its app (``run_app``) and streams back the ASGI
messages, so every route, error and streaming format is the server's own. The gateway answers only for a
replica lost mid-request, and relays WebSocket sessions through an ``Inbox`` actor (docs/scaling.md#failures).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

import ray
from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from starlette.requests import ClientDisconnect, Request

from moss_npu.serve.edge import SAFE_METHODS, Edge, answer
from moss_npu.serve.errors import ApiError
from moss_npu.serve.metrics import Metrics

log = logging.getLogger("moss_npu.serve.ray")

SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "query_string", "root_path",
              "headers", "client", "server", "subprotocols")  # what crosses to the replica (plain values)
REPEATABLE_PATHS = ("/v1/audio/speech",)  # POSTs without side effects: sent again when their replica is lost
LOST = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)
SENT_AHEAD = 16  # ASGI messages a replica's app may send before the gateway has taken them (then it waits)
STOP_S = 5.0  # how long a replica's app has to end a request whose call was stopped


def replica_lost(exc: BaseException) -> bool:
    """Whether a handle call failed because its replica is gone (killed, its node lost, stopped mid-request)."""
    return isinstance(exc, LOST) or isinstance(getattr(exc, "cause", None), LOST)


class StreamCut(Exception):
    """A replica was lost after the answer's status line: the gateway ends the connection mid-body."""


class Gateway:
    """The ingress deployment: the edge's checks, then each request forwarded to a speech replica."""

    def __init__(self, speech, config) -> None:
        """``speech``: the speech deployment's handle; ``config``: the server's ``ServerConfig`` (for the edge)."""
        logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
        self.config = config
        self.http_calls = speech.options(stream=True, method_name="http")
        self.session_calls = speech.options(stream=True, method_name="websocket")
        self.inbox = ray.remote(num_cpus=0)(Inbox).remote()  # lives and dies with this replica

    def __serve_build_asgi_app__(self):
        return Edge(self._asgi, policy=self.config, metrics=Metrics())

    async def _asgi(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
        elif scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
        else:
            await self._http(scope, receive, send)

    async def _http(self, scope, receive, send) -> None:
        """Forward one request; send it again once if its replica is lost before answering and that is harmless."""
        try:
            body = await Request(scope, receive).body()
        except ClientDisconnect:
            return  # the client left, or the edge refused the body (and answers)
        tries = 2 if scope["method"] in SAFE_METHODS or scope["path"] in REPEATABLE_PATHS else 1
        for attempt in range(1, tries + 1):
            sent: list[str] = []
            try:
                await _pipe(self.http_calls.remote(_plain(scope), body), send, sent)
                return
            except Exception as exc:  # noqa: BLE001 - every failure is answered or ends the stream
                if sent:
                    raise StreamCut(f"{scope['method']} {scope['path']}: the replica was lost mid-answer; "
                                    "the connection ends without the final chunk") from exc
                if not replica_lost(exc):
                    log.error("%s %s failed in the replica: %s", scope["method"], scope["path"], exc)
                    failed = ApiError(500, "internal error; see the server log", code="internal_error")
                    await answer(failed)(scope, receive, send)
                    return
                log.warning("%s %s: the replica was lost before answering (try %d of %d)", scope["method"],
                            scope["path"], attempt, tries)
        lost = ApiError(503, "the replica serving this request stopped before it answered; send the request again",
                        code="replica_unavailable", headers={"Retry-After": "1"})
        await answer(lost)(scope, receive, send)

    async def _websocket(self, scope, receive, send) -> None:
        """Relay one session: the client's messages through the inbox, the replica's straight back."""
        key = uuid.uuid4().hex
        pump = asyncio.ensure_future(self._pump(receive, key))
        sent: list[str] = []
        try:
            await _pipe(self.session_calls.remote(_plain(scope), self.inbox, key), send, sent)
        except Exception as exc:
            if not replica_lost(exc):
                raise
            log.warning("WebSocket %s: the replica was lost mid-session", scope["path"])
            if "websocket.close" not in sent:
                await send({"type": "websocket.close", "code": 1011})
        finally:
            pump.cancel()
            self.inbox.drop.remote(key)

    async def _pump(self, receive, key: str) -> None:
        """The client's messages into the inbox, in order, until it disconnects."""
        while True:
            message = await receive()
            await self.inbox.put.remote(key, message)
            if message["type"] == "websocket.disconnect":
                return


class Inbox:
    """A Ray actor holding the messages WebSocket clients sent a gateway, by session, until the replica serving
    the session takes them (a handle call carries its arguments one way only)."""

    def __init__(self) -> None:
        self.sessions: dict[str, asyncio.Queue] = {}

    async def put(self, key: str, message: dict) -> None:
        self._queue(key).put_nowait(message)

    async def get(self, key: str) -> dict:
        return await self._queue(key).get()

    async def drop(self, key: str) -> None:
        """Forget a session (a replica still waiting on it reads a disconnect)."""
        queue = self.sessions.pop(key, None)
        if queue is not None:
            queue.put_nowait({"type": "websocket.disconnect", "code": 1006})

    def _queue(self, key: str) -> asyncio.Queue:
        return self.sessions.setdefault(key, asyncio.Queue())


async def _pipe(stream, send, sent: list[str]) -> None:
    """Send on what a replica's app sends, in order (``sent`` records the message types); stop the replica's
    call when this one is stopped (the client left)."""
    try:
        async for message in stream:
            await send(message)
            sent.append(message["type"])
    except BaseException:
        stream.cancel()
        raise


async def _lifespan(receive, send) -> None:
    """Nothing to start or stop here: the replicas own the workers."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def _plain(scope: dict) -> dict:
    return {k: scope[k] for k in SCOPE_KEYS if k in scope}


def body_receive(body: bytes) -> Callable[[], Awaitable[dict]]:
    """The replica's ``receive`` for a forwarded request: its body, then nothing until the call is stopped."""
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop()
        return await asyncio.get_running_loop().create_future()  # only a stopped call (a disconnect) ends this

    return receive


async def run_app(app, scope: dict, receive: Callable[[], Awaitable[Any]]) -> AsyncIterator[dict]:
    """Run one request or session through ``app`` in this replica and yield what it sends: the replica's half.

    When the call is stopped (the client left) the app's next ``receive`` says the client disconnected, so it
    frees its slot as it does for any client that leaves, and it gets ``STOP_S`` to end before it is cancelled.
    """
    queue: asyncio.Queue = asyncio.Queue(SENT_AHEAD)
    gone = asyncio.Event()
    disconnect = ({"type": "websocket.disconnect", "code": 1006} if scope["type"] == "websocket"
                  else {"type": "http.disconnect"})

    async def receive_or_gone() -> dict:
        if gone.is_set():
            return disconnect
        message, stopped = asyncio.ensure_future(receive()), asyncio.ensure_future(gone.wait())
        await asyncio.wait({message, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if message.done():
            return message.result()
        message.cancel()
        return disconnect

    finished: list[bool] = []

    async def send(message: dict) -> None:
        if gone.is_set():
            return
        if message["type"] == "websocket.close" or (message["type"] == "http.response.body"
                                                    and not message.get("more_body", False)):
            finished.append(True)
        await queue.put(message)

    task = asyncio.ensure_future(app(scope, receive_or_gone, send))
    try:
        while True:
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                break
            yield getter.result()
        while not queue.empty():
            yield queue.get_nowait()
        if task.exception() is not None and finished:  # the app failed after its answer (it logged why)
            log.warning("%s %s failed after answering: %s", scope.get("method", "WS"), scope["path"],
                        task.exception())
        else:
            task.result()  # the app's own failure mid-answer: the gateway ends the connection
    finally:
        if not task.done():
            gone.set()
            while not queue.empty():
                queue.get_nowait()  # a send waiting for room goes through; later ones are dropped
            await asyncio.wait({task}, timeout=STOP_S)
            task.cancel()
