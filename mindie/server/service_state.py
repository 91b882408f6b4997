"""Server-wide service state shared by the front ends: the stop order.

A stop (``/stopService``, SIGTERM or SIGINT to the launcher) is one order that every front end
must follow: refuse new inference with MindIE's 503 from then on, let the requests in progress
run until the order's deadline, then cut what still runs with a final error in its API's shape
(docs/operations.md, "Stop"). ``/stopService`` may land on any front end, so the order is a file
in the private run directory (``service.stopped``), created exclusively by the first stop (a
second ``/stopService`` sees it exists: MindIE answers that one with 500). Its one line:

    <pid> <created, epoch s> <mode: graceful|Force> <deadline, epoch s>

``Force`` (``/stopService?mode=Force``, or a second stop signal) has its deadline now: requests are
cut at once. Escalating rewrites the file (atomically); front ends re-read it when it changes.
Front ends check for it once per request (one ``stat``) and from a watch task.
"""
from __future__ import annotations

import os
import threading
import time
from typing import NamedTuple

from mindie.contract.http_error import STOPPED_MESSAGE

# Set when this process is asked to stop (SIGTERM/SIGINT, mindie/server/gunicorn_worker.py): a front end
# still waiting for its first worker stops waiting at once instead of holding the shutdown, and
# the requests in progress are cut at the drain bound even without a stop order.
STOPPING = threading.Event()

STOPPED_FILE = "service.stopped"
GRACEFUL, FORCE = "graceful", "Force"


def cut_message(drain_s: float, mode: str) -> str:
    """The error of a request the stop cut (its final frame, and the request log's line)."""
    if mode == FORCE:
        return f"{STOPPED_MESSAGE} The request was cut by a forced stop before it finished."
    return (f"{STOPPED_MESSAGE} The request was still running at the end of the drain "
            f"(ServerConfig.drainTimeoutS = {drain_s:g} s) and was cut.")


class StopOrder(NamedTuple):
    pid: int
    created: float
    mode: str  # GRACEFUL or FORCE
    deadline: float  # epoch seconds: requests still running then are cut

    def line(self) -> str:
        return f"{self.pid} {self.created:.3f} {self.mode} {self.deadline:.3f}\n"

    @classmethod
    def parse(cls, text: str) -> "StopOrder | None":
        parts = text.split()
        try:
            pid, created, mode = int(parts[0]), float(parts[1]), parts[2]
            deadline = float(parts[3]) if len(parts) > 3 else created
        except (IndexError, ValueError):
            return None
        return cls(pid, created, mode if mode in (GRACEFUL, FORCE) else GRACEFUL, deadline)


class ServiceState:
    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, STOPPED_FILE)
        self._stopped = False
        self._order: StopOrder | None = None
        self._stat: tuple[int, int] | None = None  # (inode, mtime ns) of the file last read

    def stopped(self) -> bool:
        """True once any front end of this server took /stopService, or the launcher a signal."""
        if not self._stopped and os.path.exists(self.path):
            self._stopped = True
        return self._stopped

    def stop(self, mode: str, drain_s: float) -> bool:
        """Give the stop order (deadline ``drain_s`` from now; now for Force); False when an order
        exists already (the second /stopService)."""
        now = time.time()
        order = StopOrder(os.getpid(), now, mode, now if mode == FORCE else now + drain_s)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            self._stopped = True
            return False
        try:
            os.write(fd, order.line().encode())
        finally:
            os.close(fd)
        self._stopped = True
        self._order = order
        return True

    def force(self) -> StopOrder:
        """Turn the order (given or not) into a Force one: the deadline is now."""
        now = time.time()
        old = self.order()
        order = StopOrder(os.getpid(), old.created if old else now, FORCE, now)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, order.line().encode())
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        self._stopped = True
        return order

    def order(self) -> StopOrder | None:
        """The stop order, or None; re-read only when the file changed (a ``stat`` otherwise)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        key = (st.st_ino, st.st_mtime_ns)
        if key != self._stat:
            try:
                with open(self.path) as f:
                    order = StopOrder.parse(f.read())
            except FileNotFoundError:
                return None
            if order is None:  # being written: keep the last one read
                return self._order
            self._stat, self._order = key, order
            self._stopped = True
        return self._order
