"""Reading a request body under ServerConfig.maxRequestLength."""
from __future__ import annotations

import falcon.asgi

from mindie.errors import ApiError, request_too_large


async def read_body(req: falcon.asgi.Request, max_mb: int) -> bytes:
    """The request body, refusing more than ``max_mb`` MB (413) without reading it all.

    A body shorter than its Content-Length (the client hung up, and Falcon's stream just ends;
    or httptools stopped at an Upgrade header) is refused with 400 rather than parsed: its
    prefix may be valid JSON.
    """
    limit = max_mb * 1024 * 1024
    expected = req.content_length
    if expected is not None and expected > limit:
        raise request_too_large(max_mb)
    chunks = []
    size = 0
    async for chunk in req.stream:
        size += len(chunk)
        if size > limit:
            raise request_too_large(max_mb)
        chunks.append(chunk)
    if expected is not None and size < expected:
        raise ApiError(400, f"The request body ended after {size} of its {expected} bytes.")
    return b"".join(chunks)
