"""Error types and finish reasons, spelled as MindIE reports them (mindie.md §3, §4.5).

The device side sends ``wire.RequestError(status, error_type, message)``; the front end turns
it into ``{"error": message, "error_type": error_type}`` with that status. Both take the type
from ``ERROR_TYPES``.
"""
from __future__ import annotations

# MindIE's g_exceptionInfo plus the name of our 413 (see mindie/contract/http_error.py).
ERROR_TYPES: dict[int, str] = {
    400: "Bad Request",
    404: "NotFoundError",
    413: "Request Entity Too Large",
    422: "Input Validation Error",
    424: "Generation Error",
    500: "Incomplete Generation",
    503: "Service Unavailable",
}

# Finish reasons (mindie.md §4.5).
FINISH_EOS = "eos_token"
FINISH_LENGTH = "length"
FINISH_ABORT = "stop_sequence"
FINISH_STOP_TOKEN = "stop_token"  # internal: a SamplingParams.stop_token_ids hit (APIs map it)
FINISH_STOP = "stop"  # internal: a stop string matched in the front end (APIs map it)
FINISH_POOLED = "pooled"  # internal: a pooling request's prompt computed and pooled (no token sampled)
FINISH_ERROR = "error"  # internal: the frame carries an error, the front end reports it


class UnknownAdapterError(LookupError):
    """A request names a LoRA adapter that is not served (never loaded, or being unloaded): the
    one exception for it on both sides (device worker, front end), MindIE's 404 words."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"Model {name} not found.")


def error_type(status: int) -> str:
    """MindIE's ``error_type`` of an HTTP status ("Error" for one MindIE does not name)."""
    return ERROR_TYPES.get(status, "Error")
