"""Reading a request body under ServerConfig.maxRequestLength."""
from __future__ import annotations

import falcon.asgi

from mindie.errors import request_too_large


async def read_body(req: falcon.asgi.Request, max_mb: int) -> bytes:
    """The request body, refusing more than ``max_mb`` MB (413) without reading it all."""
    limit = max_mb * 1024 * 1024
    if req.content_length is not None and req.content_length > limit:
        raise request_too_large(max_mb)
    chunks = []
    size = 0
    async for chunk in req.stream:
        size += len(chunk)
        if size > limit:
            raise request_too_large(max_mb)
        chunks.append(chunk)
    return b"".join(chunks)
