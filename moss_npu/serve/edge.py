"""The server's front edge: ASGI middleware deciding from the headers alone, before a body byte is read.

In order: ambiguous framing (``Content-Length`` with ``Transfer-Encoding``; the rest is refused below, in
``connections``), the ``Host`` (against DNS rebinding), the ``Origin`` of a browser write (keyless servers), the
API key, then the body's size and arrival time (413, 408: the rest is never read). A draining server answers 503
to all but ``/health`` and ``/metrics``. Refusals use the OpenAI error shape (docs/serving.md#operations).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
from dataclasses import dataclass
from typing import Optional

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from moss_npu.serve.drain import Drain, shutting_down
from moss_npu.serve.errors import ApiError, shown
from moss_npu.serve.metrics import Metrics

ROUTES = ("/health", "/metrics", "/v1/models", "/v1/audio/speech", "/v1/audio/voices", "/", "/page", "/static")
PUBLIC_ROUTES = ("/health", "/", "/page", "/static")  # the page loads without the key, then asks for it
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
STAY_OPEN_ROUTES = ("/health", "/metrics")  # answered while the server drains
CLOSING_STATUSES = (400, 503)  # ambiguous framing (the rest of the stream cannot be trusted); a server stopping


@dataclass(frozen=True, kw_only=True)
class EdgePolicy:
    """What the edge lets through: key, hosts, origins, body limits."""

    api_key: Optional[str] = None
    max_upload_bytes: int = 10 * 2**20
    body_timeout_s: float = 60.0
    bind_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()  # extra Host names; "*" allows any
    cors_origins: tuple[str, ...] = ()  # origins allowed to write from a browser; "*" allows any

    @property
    def max_body_bytes(self) -> int:
        """Largest request body: an upload in base64 plus room for the other fields."""
        return self.max_upload_bytes * 4 // 3 + 2**16

    def checks_host(self) -> bool:
        """Hosts are checked on keyless servers, and whenever an allow-list was given."""
        return (self.api_key is None or bool(self.allowed_hosts)) and "*" not in self.allowed_hosts

    def host_allowed(self, host: str) -> bool:
        """Whether a ``Host`` header value (name or address, with or without port) names this server."""
        name = _host_name(host)
        allowed = {"localhost", *(h.lower() for h in self.allowed_hosts)}
        if self.bind_host not in ("", "0.0.0.0", "::", "[::]"):  # a wildcard bind names no host
            allowed.add(self.bind_host.lower().strip("[]"))
        return name is not None and (name in allowed or _is_loopback(name))

    def origin_allowed(self, origin: str, host: str) -> bool:
        """Whether a browser ``Origin`` may write: the same origin as ``Host``, or one listed in ``cors_origins``."""
        if "*" in self.cors_origins or origin in self.cors_origins:
            return True
        scheme, _, rest = origin.partition("://")
        return scheme in ("http", "https", "ws", "wss") and rest.lower() == host.lower()


def _host_name(host: str) -> Optional[str]:
    """The name part of a Host header (lower case, IPv6 without brackets), or None when it is malformed."""
    host = host.strip().lower()
    if not host:
        return None
    if host.startswith("["):
        end = host.find("]")
        return host[1:end] if end > 0 else None
    name, _, port = host.partition(":")
    if port and not port.isdigit():
        return None
    return name or None


def _is_loopback(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def route_of(path: str) -> str:
    """The metrics label of a path: one of ``ROUTES`` or ``other``."""
    return next((r for r in ROUTES if path == r or path.startswith(r + "/")), "other")


class Edge:
    """ASGI middleware applying an ``EdgePolicy`` (see the module docstring) and counting answers."""

    def __init__(self, app, policy: EdgePolicy, metrics: Metrics, drain: Optional[Drain] = None) -> None:
        self.app, self.policy, self.metrics, self.drain = app, policy, metrics, drain or Drain()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "websocket":
            return await self._websocket(scope, receive, send)
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [0]

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is None and self.drain.draining and route_of(scope["path"]) not in STAY_OPEN_ROUTES:
                refusal = shutting_down()
            if refusal is not None:
                await answer(refusal, close=refusal.status in CLOSING_STATUSES)(scope, receive, counted)
                return
            with self.drain.tracked():
                await self._serve(scope, receive, counted, status)
        finally:
            self.metrics.requests.labels(route=route_of(scope["path"]), status=str(status[0] or 500)).inc()

    async def _websocket(self, scope, receive, send) -> None:
        """A WebSocket handshake gets the same host, origin and key checks (opening one counts as a write);
        a refused one is closed before it is accepted (the client sees 403)."""
        if self._refusal(scope, write=True, body=False) is not None:
            await send({"type": "websocket.close", "code": 1008})
            return
        with self.drain.tracked():  # a session begun during a drain is told so (moss_npu.serve.live)
            await self.app(scope, receive, send)

    def _refusal(self, scope, *, write: Optional[bool] = None, body: bool = True) -> Optional[ApiError]:
        """The answer for a request its headers already rule out, or None."""
        policy = self.policy
        headers = Headers(scope=scope)
        if "transfer-encoding" in headers and "content-length" in headers:
            return ApiError(400, "Content-Length and Transfer-Encoding together make the body's end ambiguous; "
                            "send one of them", code="invalid_http")
        host = headers.get("host", "")
        if policy.checks_host() and not policy.host_allowed(host):
            return ApiError(403, f"host {shown(host)} is not this server; a server without an API key answers only to "
                            "its own address (start it with --allowed-hosts NAME to add one)", code="host_not_allowed")
        origin = headers.get("origin")
        write = scope.get("method") not in SAFE_METHODS if write is None else write
        if policy.api_key is None and origin is not None and write and not policy.origin_allowed(origin, host):
            return ApiError(403, f"cross-origin write from {shown(origin)} refused; a server without an API key takes "
                            "writes only from its own pages (start it with --cors-origins ORIGIN to allow one)",
                            code="cross_origin")
        if (policy.api_key is not None and route_of(scope["path"]) not in PUBLIC_ROUTES
                and scope.get("method") != "OPTIONS"):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), policy.api_key.encode()):
                return ApiError(401, "invalid or missing API key; send the header 'Authorization: Bearer <key>'",
                                code="invalid_api_key")
        length = headers.get("content-length")
        if body and length is not None and (not length.strip().isdigit() or int(length) > policy.max_body_bytes):
            return _too_large(policy.max_body_bytes)
        return None

    async def _serve(self, scope, receive, send, status: list) -> None:
        """Run the app with a receive that enforces the body limits and a send that yields to a refusal."""
        policy = self.policy
        loop = asyncio.get_running_loop()
        deadline = loop.time() + policy.body_timeout_s
        state = {"read": 0, "done": False, "refused": None}

        async def limited() -> dict:
            if state["refused"] is not None:
                return {"type": "http.disconnect"}
            if state["done"]:
                return await receive()  # after the body: only a disconnect can come
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return refuse(ApiError(408, f"the request body did not arrive within {policy.body_timeout_s:g} s",
                                       code="body_timeout"))
            if message["type"] == "http.request":
                state["read"] += len(message.get("body", b""))
                if state["read"] > policy.max_body_bytes:
                    return refuse(_too_large(policy.max_body_bytes))
                state["done"] = not message.get("more_body", False)
            return message

        def refuse(error: ApiError) -> dict:
            state["refused"] = error
            return {"type": "http.disconnect"}  # the app stops reading; its answer is replaced by ours

        async def guarded_send(message) -> None:
            if state["refused"] is None:
                await send(message)

        try:
            await self.app(scope, limited, guarded_send)
        except Exception:
            if state["refused"] is None:
                raise
        if state["refused"] is not None and status[0] == 0:
            await answer(state["refused"], close=True)(scope, receive, send)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than {limit} bytes", code="request_too_large")


def answer(error: ApiError, close: bool = False) -> JSONResponse:
    """``error`` as a whole JSON response, an ASGI app (``close``: the unread body ends the connection)."""
    return JSONResponse(error.body(), error.status, {**error.headers, **({"connection": "close"} if close else {})})
