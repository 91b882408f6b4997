"""Server-wide service state shared by the front ends: the /stopService flag.

``/stopService`` may land on any front end, and every front end must refuse new inference from
then on, so the flag is a file in the private run directory (``service.stopped``), created
exclusively by the first call (a second call sees it exists: MindIE answers that one with 500).
Front ends check it once per request (one ``stat``) until they see it; then it stays set.
"""
from __future__ import annotations

import os
import threading
import time

# Set when this process is asked to stop (SIGTERM/SIGINT, mindie/gunicorn_worker.py): a front end
# still waiting for its first worker stops waiting at once instead of holding the shutdown.
STOPPING = threading.Event()

STOPPED_FILE = "service.stopped"
STOPPED_MESSAGE = "The service has been stopped."


class ServiceState:
    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, STOPPED_FILE)
        self._stopped = False

    def stopped(self) -> bool:
        """True once any front end of this server took /stopService."""
        if not self._stopped and os.path.exists(self.path):
            self._stopped = True
        return self._stopped

    def stop(self, mode: str) -> bool:
        """Set the flag; False when it was already set (the second /stopService)."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            self._stopped = True
            return False
        try:
            os.write(fd, f"{os.getpid()} {time.time():.3f} {mode}\n".encode())
        finally:
            os.close(fd)
        self._stopped = True
        return True
