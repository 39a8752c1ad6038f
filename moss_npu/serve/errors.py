"""Errors the server answers with, in the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Optional

from moss_npu.errors import RUNTIME_FAILURE, AudioError, AudioTooLong, ConfigError, InputError, MossNpuError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 408: "timeout_error",
          409: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "server_error", 504: "timeout_error"}


WORKER_LOST = "WorkerLost"  # the worker process died with the request in flight
INTERNAL = "Internal"  # a failure that is not the user's to fix: its message stays in the server log


class ServerError(MossNpuError):
    """The server could not start or a worker could not load (exit 1, or 2 when the cause is the user's input)."""

    def __init__(self, message: str, exit_code: int = RUNTIME_FAILURE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class ApiError(Exception):
    """A request the server refuses or cannot serve: HTTP ``status`` plus the OpenAI error fields."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        """The JSON body of the answer."""
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


SHOWN_CHARS = 64  # how much of a client's value an error message repeats


def shown(value: object) -> str:
    """``repr(value)`` cut to ``SHOWN_CHARS`` characters with an ellipsis: an answer never echoes a hostile value
    whole (a 13 MB ``model`` would come back as a 13 MB error), and only the part shown is ever copied."""
    text = repr(value[: SHOWN_CHARS + 1] if isinstance(value, str) else value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 1] + "…"


def from_engine(kind: str, message: str) -> ApiError:
    """Map a failure reported by a worker (the exception's class name and message) to an answer."""
    if kind == AudioTooLong.__name__:
        return ApiError(413, message, code="audio_too_long")
    if kind in (InputError.__name__, AudioError.__name__, ConfigError.__name__):
        return ApiError(400, message, code="invalid_value")
    if kind == WORKER_LOST:
        return ApiError(503, message, code="worker_unavailable")
    if kind == INTERNAL:
        return ApiError(500, "internal error while synthesizing; see the server log", code="internal_error")
    return ApiError(500, message, code="synthesis_failed")


def kind_of(exc: BaseException) -> str:
    """Name a failure for the trip from a worker: a ``MossNpuError`` by its class, anything else as internal."""
    return type(exc).__name__ if isinstance(exc, MossNpuError) else INTERNAL
