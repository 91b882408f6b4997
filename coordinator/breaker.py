"""A circuit breaker per instance: failures take an instance out, a probe puts it back.

States: closed (routable) -> open after ``exception_config.breakerFailures`` failures in a row
(refused connection, timeout before the first token, 5xx from the instance, a stream cut by
the instance). While open the instance gets no requests. ``breakerOpenMs`` after it opened the
breaker is half-open: the poller's next health check of the instance is the probe (the
management plane's ``/health`` answering 200 and ``/v2/status`` answering); success closes it,
failure opens it again for twice as long (at most 16x ``breakerOpenMs``). A half-open instance
also takes one user request as a trial; its success closes the breaker, its failure re-opens it.
"""
from __future__ import annotations

import time
from typing import Optional

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
MAX_BACKOFF = 16


class Breaker:
    def __init__(self, failures: int, open_s: float) -> None:
        self.threshold = failures
        self.open_s = open_s
        self.failures = 0  # in a row
        self.opened_at: Optional[float] = None
        self.backoff = 1
        self.trial_out = False  # a half-open trial request is in flight
        self.trips = 0  # times opened (a metric)

    def state(self, now: Optional[float] = None) -> str:
        if self.opened_at is None:
            return CLOSED
        now = time.monotonic() if now is None else now
        return HALF_OPEN if now - self.opened_at >= self.open_s * self.backoff else OPEN

    def allows(self, now: Optional[float] = None) -> bool:
        """May a user request go to this instance now?"""
        st = self.state(now)
        return st == CLOSED or (st == HALF_OPEN and not self.trial_out)

    def on_dispatch(self) -> None:
        if self.opened_at is not None:
            self.trial_out = True

    def success(self) -> None:
        self.failures = 0
        self.opened_at = None
        self.backoff = 1
        self.trial_out = False

    def failure(self, now: Optional[float] = None) -> bool:
        """Count a failure; True when this one opened (or re-opened) the breaker."""
        now = time.monotonic() if now is None else now
        self.trial_out = False
        if self.opened_at is not None:
            if self.state(now) == HALF_OPEN:  # the probe failed: open again, longer
                self.backoff = min(self.backoff * 2, MAX_BACKOFF)
                self.opened_at = now
                self.trips += 1
                return True
            return False
        self.failures += 1
        if self.failures >= self.threshold:
            self.opened_at = now
            self.trips += 1
            return True
        return False

    def probe_due(self, now: Optional[float] = None) -> bool:
        return self.state(now) == HALF_OPEN
