"""Connection hygiene for uvicorn: a header-read timeout, lingering closes, the keep-alive timeout and a cap.

uvicorn bounds an idle kept-alive connection but not one whose headers never finish (slowloris):
``HeaderTimeout`` closes it. A close while the client still sends becomes a reset that can overtake the answer
(a 413), so closes linger as nginx's do. ``HeaderTimeout`` extends uvicorn's ``H11Protocol``, whose internals
may change between releases: setup.py pins the uvicorn range the tests ran on.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from uvicorn.protocols.http.h11_impl import H11Protocol

from moss_npu.serve.errors import ApiError


@dataclass(frozen=True)
class ConnectionLimits:
    """The uvicorn settings of one server (``uvicorn_options``)."""

    header_timeout_s: float = 10.0
    keep_alive_s: int = 5
    max_connections: int = 1000  # past it, uvicorn answers 503 at once

    def raise_file_limit(self) -> None:
        """Raise this process's open-file limit (within its hard limit) so the cap, not the limit, is met first:
        past the file limit, accepting a connection fails, which the cap exists to prevent."""
        try:
            import resource
        except ImportError:  # not on POSIX
            return
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = self.max_connections + 256  # the workers' pipes, model files, logs
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted if hard == resource.RLIM_INFINITY
                                                        else min(wanted, hard), hard))

    def uvicorn_options(self) -> dict[str, Any]:
        """Keyword arguments for ``uvicorn.Config``."""
        protocol = type("Protocol", (HeaderTimeout,), {"header_timeout_s": self.header_timeout_s})
        return {"http": protocol, "timeout_keep_alive": self.keep_alive_s, "limit_concurrency": self.max_connections,
                "h11_max_incomplete_event_size": 16 * 1024, "ws_ping_interval": WS_PING_S, "ws_ping_timeout": WS_PING_S}


LINGER_S = 2.0
WS_PING_S = 20.0  # a WebSocket is pinged this often and closed when a pong takes longer: a dead peer is found


class LingeringTransport:
    """A transport whose ``close`` first half-closes (the answer and a FIN reach the client), then closes after
    ``LINGER_S``; everything else is the wrapped transport's."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop, self._closing = transport, loop, False

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        transport = self._transport
        if transport.is_closing() or not transport.can_write_eof():
            transport.close()
            return
        try:
            transport.pause_reading()
            transport.write_eof()
        except (OSError, RuntimeError):
            transport.close()
            return
        self._loop.call_later(LINGER_S, transport.close)

    def is_closing(self) -> bool:
        return self._closing or self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


_FOLDED = re.compile(rb"\r?\n[ \t]")  # a header line continued on the next (obs-fold)
_HEAD_END = b"\r\n\r\n"


class HeaderTimeout(H11Protocol):
    """uvicorn's h11 protocol, closing connections whose request headers take longer than ``header_timeout_s``,
    with lingering closes; a request whose header lines are folded, or that h11 finds malformed, is answered
    400 in the OpenAI error shape and its connection closed."""

    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(LingeringTransport(transport, self.loop))  # type: ignore[arg-type]
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        self._arm_header_timer()  # before super(): it may start a pipelined request's cycle at once
        super().on_response_complete()

    def data_received(self, data: bytes) -> None:
        """Refuse folded header lines before h11 sees them: h11 joins them into one value, so a front proxy
        that reads them otherwise would see a different request (the header-smuggling trick)."""
        if self._head_tail is not None:
            window = self._head_tail + data
            end = window.find(_HEAD_END)
            if _FOLDED.search(window if end < 0 else window[:end + 2]):
                self._refuse("a header line is folded onto the next (obs-fold); send each header on one line")
                return
            self._head_tail = window[-3:] if end < 0 else None
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 refuses (e.g. conflicting Content-Length), in the OpenAI shape."""
        self._refuse("the request's headers are malformed or conflict (e.g. two different Content-Lengths)")

    def _refuse(self, message: str) -> None:
        """Answer 400 and close, below h11 (whose state may not allow a response yet)."""
        body = json.dumps(ApiError(400, message, code="invalid_http").body()).encode()
        self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()

    def _arm_header_timer(self) -> None:
        self._head_tail: Optional[bytes] = b""  # a request's head is due: its bytes are checked for folds
        self._cancel_header_timer()
        waiting_for = self.cycle  # a new request replaces the cycle once its headers are complete
        self._header_timer: Optional[asyncio.TimerHandle] = self.loop.call_later(
            self.header_timeout_s, self._headers_overdue, waiting_for)

    def _cancel_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _headers_overdue(self, waiting_for: Any) -> None:
        self._header_timer = None
        if self.cycle is waiting_for and not self.transport.is_closing():
            self.transport.close()

    def handle_websocket_upgrade(self, event: Any) -> None:
        """The connection becomes a WebSocket: its headers are complete, and from now on the WebSocket's pings
        and the session's idle timeout (``moss_npu.serve.live``) bound it."""
        self._cancel_header_timer()
        super().handle_websocket_upgrade(event)

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)
