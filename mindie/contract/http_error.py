"""The one HTTP error type of the server and the coordinator (MindIE ``WrapperJson``, mindie.md §3).

Every error body is ``{"error": "<message>", "error_type": "<type>"}`` (key order as MindIE,
compact JSON, non-ASCII kept as UTF-8 like nlohmann's ``dump``). ``error_type`` is the MindIE
name of the status (``mindie.contract.errors.ERROR_TYPES``, shared with the device workers).
``ApiError`` is the one exception type of a failed request, on every route, in every API family
and on both processes that answer HTTP: the server's routes, parsers and generation loop (a
worker's error frame, a deadline) raise it, and its request pipeline (mindie/pipeline.py) logs and
counts it once; the coordinator (coordinator/) raises it for what it refuses itself. Each writes it
in the shape of the request's API family (mindie/contract/families.py): MindIE's shape by default,
OpenAI's ``{"error": {...}}`` on the OpenAI routes; inside an open stream as its family's error
frame.

Decision (413): MindIE itself answers an over-long body with ``{"message": "Request body too
large. Maximum allowed size is 40MB."}`` (cpp-httplib's error handler, mindie.md §1). We keep
its message text verbatim but use the uniform ``{"error", "error_type"}`` shape with
``error_type`` "Request Entity Too Large", so clients need one error parser for every route.
"""
from __future__ import annotations

import msgspec

from mindie.contract.errors import error_type as _error_type

__all__ = ["ApiError", "not_found", "validation_error", "generation_error", "service_unavailable",
           "request_too_large"]

_encode = msgspec.json.encode


class ApiError(Exception):
    """An error answer: HTTP ``status``, MindIE ``error_type`` and the ``message`` text."""

    __slots__ = ("status", "error_type", "message", "param", "timeout")

    def __init__(self, status: int, message: str, error_type: str | None = None, *, param: str | None = None,
                 timeout: bool = False) -> None:
        """``param``: the request field at fault (OpenAI's ``error.param``). ``timeout``: a
        deadline expired (MindIE's native stream writes that one as raw text)."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type if error_type is not None else _error_type(status)
        self.param = param
        self.timeout = timeout

    def body(self) -> bytes:
        """``{"error": message, "error_type": type}`` as compact UTF-8 JSON."""
        # A dict literal keeps insertion order, which msgspec preserves when encoding.
        return _encode({"error": self.message, "error_type": self.error_type})

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.message!r}, {self.error_type!r})"


def not_found(message: str) -> ApiError:
    """404 "NotFoundError" (e.g. ``Model X not found.``)."""
    return ApiError(404, message)


def validation_error(message: str) -> ApiError:
    """422 "Input Validation Error": request parsing and parameter checks."""
    return ApiError(422, message)


def generation_error(message: str) -> ApiError:
    """424 "Generation Error": engine enqueue rejections (``Failed to enqueue inferRequest. ...``)."""
    return ApiError(424, message)


# MindIE's 503 once a stop was ordered (/stopService, a stop signal): the server's words, and the
# coordinator's when it drains.
STOPPED_MESSAGE = "The service has been stopped."


def service_unavailable(message: str = "The service has been stopped") -> ApiError:
    """503 "Service Unavailable" (after /stopService, no live worker, ...)."""
    return ApiError(503, message)


def request_too_large(max_mb: int) -> ApiError:
    """413 for a body over ``ServerConfig.maxRequestLength`` MB (MindIE's message text)."""
    return ApiError(413, f"Request body too large. Maximum allowed size is {max_mb}MB.")
