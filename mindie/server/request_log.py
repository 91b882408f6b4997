"""One log line per inference request (logger ``mindie.request``, INFO).

Fields: request id (the ``req-id`` header or the generated one), endpoint, the model, input and output
tokens, time to first token, duration, speculative decoding's proposed and accepted tokens (when
any were proposed), and how it ended (finish reason, or the HTTP status and
error text). The same fields ride on the record as ``record.request`` (a dict), which the JSON
log format writes as keys of their own (mindie/runtime/log_setup.py).
"""
from __future__ import annotations

import logging
import time

log = logging.getLogger("mindie.request")


class RequestRecord:
    """What one request did, logged once by ``done``."""

    __slots__ = ("request_id", "endpoint", "stream", "t0", "input_tokens", "output_tokens", "ttft_s",
                 "finish_reason", "status", "error", "_logged", "draft_tokens", "accepted_tokens", "model")

    def __init__(self, request_id: str, endpoint: str, model: str = ""):
        self.request_id = request_id
        self.endpoint = endpoint
        self.model = model  # the served model's name (several models: which one served it)
        self.stream = False
        self.t0 = time.monotonic()
        self.input_tokens = 0
        self.output_tokens = 0
        self.ttft_s: float | None = None
        self.finish_reason = ""
        self.status = 200
        self.error = ""
        self._logged = False
        self.draft_tokens = 0  # speculative decoding: tokens proposed for this request
        self.accepted_tokens = 0  # and accepted

    def token(self, n: int = 1) -> None:
        if self.ttft_s is None and n:
            self.ttft_s = time.monotonic() - self.t0
        self.output_tokens += n

    def piece(self, p) -> None:
        """A step's output (mindie.text.generation.Piece): its tokens, and its speculation counts."""
        self.token(len(p.token_ids))
        if p.spec[0]:
            self.draft_tokens += p.spec[0]
            self.accepted_tokens += p.spec[1]

    @property
    def duration_s(self) -> float:
        return time.monotonic() - self.t0

    def done(self, status: int = 200, finish_reason: str = "", error: str = "") -> None:
        if self._logged:
            return
        self._logged = True
        self.status, self.finish_reason, self.error = status, finish_reason, error
        if not log.isEnabledFor(logging.INFO):
            return
        fields = {"request_id": self.request_id, "endpoint": self.endpoint, "stream": self.stream,
                  "status": status, "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                  "ttft_ms": round(self.ttft_s * 1000, 2) if self.ttft_s is not None else None,
                  "duration_ms": round(self.duration_s * 1000, 2)}
        if self.model:
            fields["model"] = self.model
        if self.draft_tokens:
            fields["spec_draft_tokens"] = self.draft_tokens
            fields["spec_accepted_tokens"] = self.accepted_tokens
        if finish_reason:
            fields["finish_reason"] = finish_reason
        if error:
            fields["error"] = error
        ttft = f"{fields['ttft_ms']:.1f}ms" if fields["ttft_ms"] is not None else "-"
        end = f"finish={finish_reason}" if finish_reason else f"error={error!r}"
        if self.draft_tokens:  # speculative decoding: accepted/proposed tokens
            end += f" spec={self.accepted_tokens}/{self.draft_tokens}"
        if self.model:
            end += f" model={self.model}"
        log.info("request %s %s status=%d in=%d out=%d ttft=%s duration=%.1fms %s", self.request_id,
                 self.endpoint, status, self.input_tokens, self.output_tokens, ttft, fields["duration_ms"], end,
                 extra={"request": fields})
