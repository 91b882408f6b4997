"""Work-conserving core sharing between the CPU device workers of one host.

Each CPU worker owns ``cores / workers`` threads. When another worker has nothing to do, its
cores would sit idle, so a busy worker borrows them for its next step. The workers share one
small file (``<runDir>/cores.busy``) with two things per worker index ``i``:

- byte ``i`` of the file, mapped: the worker's *intent*, 1 while it has work (``set_busy``);
- an ``fcntl.lockf`` lock on byte ``i``: *ownership* of worker ``i``'s cores.

Before each step (``apply``) a worker takes its own lock, waiting for it if a sibling borrowed
its cores for the step that sibling is computing; then, for each sibling whose intent is 0, it
tries that sibling's lock without waiting, checks the intent again once it holds it, and counts
the sibling's share as borrowed. torch's thread pool is sized to its own share plus the
borrowed ones. After the step (``release``) the borrowed locks are let go; the own lock is kept
while the worker is busy. So two workers never run a step on the same cores: a worker that
wakes up while a sibling uses its cores waits at most for the end of that sibling's step. (The
earlier design, flags only, let two workers waking at once both borrow: their OpenMP pools
oversubscribed the cores and spun against each other, 15x slower with Intel's long spin-waits;
docs/performance.md, "Several CPU workers".)

The kernel releases the locks of a process that dies, so a killed worker's cores are never lost.
POSIX record locks belong to the process and are all dropped when it closes *any* descriptor of
the file: the file is opened once per process and that descriptor is kept open.
"""
from __future__ import annotations

import fcntl
import logging
import mmap
import os
import threading
import time

log = logging.getLogger("workers.backends")

POLL_S = 0.0002  # own lock: one non-blocking attempt every 0.2 ms ...
WAIT_CAP_S = 2.0  # ... for at most this long, then the step runs anyway (warned once)


def _set_threads(n: int) -> None:
    import torch
    torch.set_num_threads(n)


class CoreShare:
    def __init__(self, path: str, index: int, count: int, base_threads: int, set_threads=_set_threads):
        self.index = index
        self.count = count
        self.base = base_threads
        self._set_threads = set_threads
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(self.fd).st_size < count:
                os.ftruncate(self.fd, count)
            self.map = mmap.mmap(self.fd, count)
        except BaseException:
            os.close(self.fd)
            raise
        self.guard = threading.Lock()
        self.busy = False
        self.owned = False  # our own byte locked
        self.borrowed: list[int] = []  # siblings' bytes locked for the current step
        self.threads = 0
        self.warned = False
        self.waited_s = 0.0  # time spent waiting for our own cores (tests, diagnostics)
        self.could_borrow = False  # the last apply() saw an idle sibling
        self.map[index] = 0

    # -- locks ------------------------------------------------------------------------------
    def _try_lock(self, i: int) -> bool:
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, i, os.SEEK_SET)
            return True
        except OSError:  # EAGAIN / EACCES: another process holds it
            return False

    def _unlock(self, i: int) -> None:
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, i, os.SEEK_SET)
        except (OSError, ValueError):
            pass

    def _take_own(self) -> None:
        t0 = time.monotonic()
        deadline = t0 + WAIT_CAP_S
        while not self._try_lock(self.index):
            if time.monotonic() >= deadline:
                if not self.warned:
                    self.warned = True
                    log.warning("core sharing: worker %d waited %.1f s for its cores (a sibling holds them);"
                                " stepping anyway, oversubscribed (warned once)", self.index, WAIT_CAP_S)
                self.waited_s += time.monotonic() - t0
                return
            time.sleep(POLL_S)
        self.owned = True
        self.waited_s += time.monotonic() - t0

    def _release_borrowed(self) -> None:
        for i in self.borrowed:
            self._unlock(i)
        self.borrowed = []

    # -- worker interface -------------------------------------------------------------------
    def set_busy(self, busy: bool) -> None:
        with self.guard:
            if busy != self.busy:
                self.map[self.index] = 1 if busy else 0
                self.busy = busy
            if not busy:
                self._release_borrowed()
                if self.owned:
                    self._unlock(self.index)
                    self.owned = False

    def apply(self, borrow: bool = True) -> int:
        """Before a step: own cores (waiting for a borrower's step to end), borrow idle siblings'
        cores (unless ``borrow`` is False: then only note in ``could_borrow`` whether one is idle),
        size torch's thread pool; returns the thread count."""
        with self.guard:
            self._release_borrowed()  # a step launched without release() (its launch failed)
            if not self.owned:
                self._take_own()
            self.could_borrow = False
            for i in range(self.count):
                if i == self.index or self.map[i] != 0:
                    continue
                self.could_borrow = True
                if not borrow or not self._try_lock(i):
                    continue
                if self.map[i] != 0:  # woke up between the look and the lock: its cores are its own
                    self._unlock(i)
                    continue
                self.borrowed.append(i)
            n = self.base * (1 + len(self.borrowed))
            if n != self.threads:
                self._set_threads(n)
                self.threads = n
            return n

    def release(self) -> None:
        """After a step: hand borrowed cores back (our own stay ours while busy)."""
        with self.guard:
            self._release_borrowed()

    def close(self) -> None:
        with self.guard:
            try:
                self.map[self.index] = 0
                self.map.close()
            except (ValueError, OSError):
                pass
            self.borrowed = []
            self.owned = False
            if self.fd >= 0:
                try:
                    os.close(self.fd)  # drops every lock this process holds on the file
                except OSError:
                    pass
                self.fd = -1
