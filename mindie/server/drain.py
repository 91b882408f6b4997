"""A front end's side of a stop: cut what still runs when the drain ends.

The stop order (mindie/server/service_state.py) says when: a graceful stop lets the requests in progress
run until ``ServerConfig.drainTimeoutS`` after it was given, a Force stop ends them at once. A
front end told to stop directly (SIGTERM from its gunicorn master, without an order: the launcher
died, or gunicorn replaces it) keeps the same bound from that moment. Requests cut here end with
a 503 error in their API's shape (a final event of a stream, an error answer otherwise) and the
request log says the stop cut them; their workers are told to cancel them. New requests are
refused by the pipeline as soon as the order exists (MindIE's 503 "The service has been stopped.").
"""
from __future__ import annotations

import asyncio
import logging
import time

from mindie.device_client import DeviceClient
from mindie.server.service_state import FORCE, GRACEFUL, STOPPING, ServiceState, cut_message

log = logging.getLogger("mindie.drain")

POLL_S = 0.2  # how often the order file is looked at (one stat)


class DrainWatch:
    """Runs in each front end's event loop (FrontEnd's lifespan) until it shuts down."""

    def __init__(self, client: DeviceClient, state: ServiceState, drain_s: float):
        self.client = client
        self.state = state
        self.drain_s = drain_s
        self._signalled_at: float | None = None

    def deadline(self) -> tuple[float, str] | None:
        """(epoch deadline, mode) of the stop this front end follows, or None while serving."""
        order = self.state.order()
        if order is not None:
            return order.deadline, order.mode
        if STOPPING.is_set():
            if self._signalled_at is None:
                self._signalled_at = time.time()
            return self._signalled_at + self.drain_s, GRACEFUL
        return None

    def cut_due(self, now: float | None = None) -> int:
        """Cut every request in flight when the deadline has passed; returns how many."""
        stop = self.deadline()
        if stop is None or (now or time.time()) < stop[0] or not self.client.in_flight():
            return 0
        deadline, mode = stop
        n = self.client.cut_all(503, cut_message(self.drain_s, mode))
        if n:
            log.warning("stop%s: cut %d request(s) still in progress%s", " (Force)" if mode == FORCE else "", n,
                        "" if mode == FORCE else f" at the end of the drain ({self.drain_s:g} s)")
        return n

    async def run(self) -> None:
        while True:
            try:
                self.cut_due()
            except Exception:  # noqa: BLE001 - the watch must outlive a bad read
                log.exception("stop watch")
            await asyncio.sleep(POLL_S)
