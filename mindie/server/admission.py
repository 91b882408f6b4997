"""Server-wide admission: at most ``ServerConfig.maxLinkNum`` inference requests in progress
across every front end of one server, shared through a small file in the private run directory.

The file ``<runDir>/admission.slots`` is an array of int64 mapped into every front end::

    [0] magic   [1] high-water mark of owner records   [2 + r] slots held by owner r
    [2 + MAX_OWNERS + r] pid of owner r (diagnostics only)

Each front end claims one owner record ``r`` for its lifetime by holding an exclusive lock on
byte ``OWNER_LOCK_BASE + r`` of the file; the kernel drops the lock when the process dies,
however it dies (SIGKILL included). Only the owner writes its own record while it lives, so
the number in use server-wide is the sum of the records.

* acquire: take the global lock (byte 0), sum the records; below the limit, add one to the own
  record; at the limit, first reclaim the records of dead owners (an owner whose lock can be
  taken is dead: its count is zeroed), then decide. Two fcntl calls when there is room.
* release: store the own (process-local) count into the own record. No lock: a reader that
  sees the old value sees one slot too many, never too few, so the limit holds.
* a process that dies keeps nothing: its slots are reclaimed by the first acquire that finds
  the server full (and by the next process that claims its record), so the whole limit is
  available again at once, without waiting for a timeout or a restart.

The locks are open-file-description locks (``F_OFD_SETLK``, Linux >= 3.15): they belong to the
open file, not to the process, so closing some other descriptor of the file does not drop
them (the classic POSIX-lock trap) and two ``Admission`` objects in one process are separate
owners (which the tests use). Where OFD locks are missing, classic POSIX locks are used
(per process: one ``Admission`` per process then).

The file is opened after gunicorn forks (in each front end), close-on-exec, mode 0600 inside
the 0700 run directory.
"""
from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import mmap
import os
import struct

log = logging.getLogger("mindie.admission")

__all__ = ["Admission", "Slot", "SLOTS_FILE", "MAX_OWNERS", "snapshot", "in_progress"]

SLOTS_FILE = "admission.slots"
MAGIC = 0x4D49_4E44_4945_4101  # "MINDIEA" + format 1
MAX_OWNERS = 1024  # front-end processes alive at once (a SIGHUP reload briefly doubles them)
_HEADER = 2
_PIDS = _HEADER + MAX_OWNERS
_WORDS = _PIDS + MAX_OWNERS
_SIZE = _WORDS * 8
GLOBAL_LOCK = 0
OWNER_LOCK_BASE = 1 << 30  # lock bytes of the owners, far past the end of the data

_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", None)
_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", None)
_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", None)
_FLOCK = "hhqqi"  # struct flock: l_type, l_whence, l_start, l_len, l_pid (native alignment)


class _Locks:
    """Exclusive one-byte locks on a file: OFD locks where the kernel has them."""

    def __init__(self, fd: int):
        self.fd = fd
        self.ofd = _OFD_SETLK is not None
        if self.ofd:
            try:
                self._fcntl(_OFD_SETLK, fcntl.F_UNLCK, GLOBAL_LOCK)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.ofd = False  # kernel without OFD locks
        if self.ofd:
            self._set, self._setw = _OFD_SETLK, _OFD_SETLKW
        else:
            self._set, self._setw = fcntl.F_SETLK, fcntl.F_SETLKW

    def _fcntl(self, cmd: int, kind: int, offset: int) -> None:
        fcntl.fcntl(self.fd, cmd, struct.pack(_FLOCK, kind, os.SEEK_SET, offset, 1, 0))

    def lock(self, offset: int) -> None:
        """Wait for the lock (only the global lock is waited for, and it is held for µs)."""
        self._fcntl(self._setw, fcntl.F_WRLCK, offset)

    def try_lock(self, offset: int) -> bool:
        try:
            self._fcntl(self._set, fcntl.F_WRLCK, offset)
            return True
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise

    def unlock(self, offset: int) -> None:
        self._fcntl(self._set, fcntl.F_UNLCK, offset)

    def held_elsewhere(self, offset: int) -> bool:
        """Whether another open file (another live front end) holds the lock; takes nothing."""
        get = _OFD_GETLK if self.ofd else fcntl.F_GETLK
        probe = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0)
        return struct.unpack(_FLOCK, fcntl.fcntl(self.fd, get, probe))[0] != fcntl.F_UNLCK


class Slot:
    """One admitted request. ``release()`` gives the slot back; calling it again does nothing.
    A slot dropped without a release (a code path that forgot it) is given back when it is
    garbage-collected, with a warning, so a bug cannot leak capacity for good."""

    __slots__ = ("_adm",)

    def __init__(self, adm: "Admission"):
        self._adm = adm

    def release(self) -> None:
        adm, self._adm = self._adm, None
        if adm is not None:
            adm._release_one()

    @property
    def released(self) -> bool:
        return self._adm is None

    def __del__(self) -> None:
        adm, self._adm = self._adm, None
        if adm is None:
            return
        log.warning("an admission slot was dropped without release; giving it back")
        # Not from inside a finalizer, which may run in the middle of an acquire: next loop turn.
        try:
            asyncio.get_running_loop().call_soon(adm._release_one)
        except RuntimeError:  # no loop running (tools, tests): nothing can be interleaved
            adm._release_one()


class Admission:
    """The admission of one front-end process (open it after fork)."""

    def __init__(self, run_dir: str, limit: int):
        if limit < 1:
            raise ValueError(f"admission limit must be >= 1, got {limit}")
        self.limit = limit
        self.path = os.path.join(run_dir, SLOTS_FILE)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._locks = _Locks(self._fd)
        self._locks.lock(GLOBAL_LOCK)
        try:
            if os.fstat(self._fd).st_size < _SIZE:
                os.ftruncate(self._fd, _SIZE)
            self._map = mmap.mmap(self._fd, _SIZE)
            self._w = memoryview(self._map).cast("q")
            if self._w[0] != MAGIC:  # new file (or an unknown format left by another version)
                self._w[1:_WORDS] = memoryview(bytes(8 * (_WORDS - 1))).cast("q")
                self._w[0] = MAGIC
        finally:
            self._locks.unlock(GLOBAL_LOCK)
        self._held = 0  # the truth for this process; the shared record mirrors it
        self.record = -1
        self.record = self._claim()

    # -- owner record --------------------------------------------------------------------------
    def _claim(self) -> int:
        for r in range(MAX_OWNERS):
            if self._locks.try_lock(OWNER_LOCK_BASE + r):
                break
        else:
            raise RuntimeError(f"{self.path}: all {MAX_OWNERS} owner records are held by live processes")
        w = self._w
        self._locks.lock(GLOBAL_LOCK)
        try:
            w[_HEADER + r] = 0  # whatever a dead former owner left
            w[_PIDS + r] = os.getpid()
            if w[1] <= r:
                w[1] = r + 1
            self._reclaim()
        finally:
            self._locks.unlock(GLOBAL_LOCK)
        return r

    def _reclaim(self) -> int:
        """Zero the records of dead owners (global lock held); returns the slots recovered."""
        w, got = self._w, 0
        for r in range(w[1]):
            n = w[_HEADER + r]
            if n and r != self.record and self._locks.try_lock(OWNER_LOCK_BASE + r):
                self._locks.unlock(OWNER_LOCK_BASE + r)
                log.warning("reclaimed %d admission slot(s) of a front end that died (pid %d)", n, w[_PIDS + r])
                w[_HEADER + r] = 0
                got += n
        return got

    # -- the hot path --------------------------------------------------------------------------
    def try_acquire(self) -> Slot | None:
        """A slot when fewer than ``limit`` requests are in progress server-wide, else None."""
        w, locks = self._w, self._locks
        locks.lock(GLOBAL_LOCK)
        try:
            hw = w[1]
            used = sum(w[_HEADER:_HEADER + hw])
            if used >= self.limit:
                used -= self._reclaim()
                if used >= self.limit:
                    return None
            self._held += 1
            w[_HEADER + self.record] = self._held
        finally:
            locks.unlock(GLOBAL_LOCK)
        return Slot(self)

    def _release_one(self) -> None:
        if self._fd < 0:  # closed: the record is gone already
            return
        if self._held <= 0:  # cannot happen: a Slot releases once
            log.error("admission release without a slot held")
            return
        self._held -= 1
        self._w[_HEADER + self.record] = self._held

    # -- inspection ----------------------------------------------------------------------------
    @property
    def held(self) -> int:
        """Slots held by this front end."""
        return self._held

    def in_use(self) -> int:
        """Slots held server-wide (a consistent sum, under the global lock)."""
        self._locks.lock(GLOBAL_LOCK)
        try:
            return sum(self._w[_HEADER:_HEADER + self._w[1]])
        finally:
            self._locks.unlock(GLOBAL_LOCK)

    def close(self) -> None:
        """Give up the owner record (and any slots still held). For tests and tools."""
        if self._fd < 0:
            return
        self._w[_HEADER + self.record] = 0
        self._w.release()
        self._map.close()
        os.close(self._fd)  # drops the locks
        self._fd = -1


def snapshot(run_dir: str) -> dict[int, int]:
    """{pid: slots held} of the owner records in use, read without locking (for tests and
    diagnostics: a dead owner's count stays until it is reclaimed)."""
    with open(os.path.join(run_dir, SLOTS_FILE), "rb") as f:
        data = f.read(_SIZE)
    words = struct.unpack(f"{len(data) // 8}q", data[:len(data) // 8 * 8])
    if len(words) < _WORDS or words[0] != MAGIC:
        return {}
    out: dict[int, int] = {}
    for r in range(words[1]):
        if words[_HEADER + r]:
            out[words[_PIDS + r]] = out.get(words[_PIDS + r], 0) + words[_HEADER + r]
    return out


def in_progress(run_dir: str) -> int:
    """Requests admitted server-wide by live front ends (a dead one's count is not counted), read
    without claiming an owner record or taking a lock: what a stop waits for (mindie/ops/launcher_drain.py).
    0 when there is no admission file (no front end ever started)."""
    try:
        fd = os.open(os.path.join(run_dir, SLOTS_FILE), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return 0
    try:
        data = os.pread(fd, _SIZE, 0)
        if len(data) < _SIZE:
            return 0
        words = struct.unpack(f"{_WORDS}q", data)
        if words[0] != MAGIC:
            return 0
        locks = _Locks(fd)
        return sum(n for r in range(words[1]) if (n := words[_HEADER + r])
                   and locks.held_elsewhere(OWNER_LOCK_BASE + r))
    finally:
        os.close(fd)
