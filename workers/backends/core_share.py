"""Work-conserving core sharing between the CPU device workers of one host.

Each CPU worker owns ``cores / workers`` threads. When another worker has nothing to do, its
cores would sit idle, so a busy worker borrows them for its next step: the workers publish
"busy" flags in a small shared file (one byte each) and a worker sizes torch's thread pool,
before each step, to its own share plus the shares of the workers that are idle right now.
A race (two workers waking at once) costs one oversubscribed step; the next step corrects it.
"""
from __future__ import annotations

import mmap
import os

import torch


class CoreShare:
    def __init__(self, path: str, index: int, count: int, base_threads: int):
        self.index = index
        self.count = count
        self.base = base_threads
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < count:
                os.ftruncate(fd, count)
            self.map = mmap.mmap(fd, count)
        finally:
            os.close(fd)
        self.busy = False
        self.threads = 0
        self.map[index] = 0

    def set_busy(self, busy: bool) -> None:
        if busy != self.busy:
            self.map[self.index] = 1 if busy else 0
            self.busy = busy

    def apply(self) -> int:
        """Size torch's thread pool for the next step; returns the thread count."""
        idle = sum(1 for i in range(self.count) if i != self.index and self.map[i] == 0)
        n = self.base * (1 + idle)
        if n != self.threads:
            torch.set_num_threads(n)
            self.threads = n
        return n

    def close(self) -> None:
        try:
            self.map[self.index] = 0
            self.map.close()
        except (ValueError, OSError):
            pass
