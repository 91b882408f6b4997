"""The gunicorn worker class of the front ends: uvicorn with uvloop + httptools, and a
graceful-shutdown bound so SIGTERM cannot hang on open SSE streams (UvicornWorker does not
forward gunicorn's graceful_timeout)."""
from __future__ import annotations

import os

from uvicorn_worker import UvicornWorker


class FrontEndWorker(UvicornWorker):
    CONFIG_KWARGS = {
        "loop": "uvloop",
        "http": "httptools",
        "lifespan": "on",
        "timeout_graceful_shutdown": int(os.environ.get("MINDIE_GRACEFUL_TIMEOUT", "15")) - 3,
        "limit_concurrency": int(os.environ.get("MINDIE_MAX_CONNECTIONS", "4096")),
    }
