"""How the server's processes live and die: each one dies with the process it depends on, and
they share one run directory that a start claims and a stop leaves clean.

Dependencies (docs/design.md, "Liveness"): the launcher (scripts/launch.sh) starts the
supervisor and the gunicorn master; the supervisor starts the device workers; the master forks
the front ends. A child asks the kernel to signal it when its parent dies
(``die_with_parent``), so a ``kill -9`` anywhere leaves no orphan behind.

The run directory (``ServerConfig.runDir``, private, mode 0700) holds only what the server
makes (``ENTRIES``; nothing else in it is ever touched):

    server.lock                 flock held for the server's life: taken by the launcher, inherited
                                by the supervisor, the gunicorn master and the front ends; its
                                text names the launcher (pid and start time)
    deployment.json[.<pid>.tmp] the launch plan (spec.py)
    w<i>-jobs.ipc, w<i>-frames.ipc, and their .lock files (flocked by the worker that binds them)
    cores.busy                  CPU core-sharing flags (workers/backends/core_share.py)
    admission.slots             server-wide admission (mindie/server/admission.py; fcntl locks)
    prometheus/                 PROMETHEUS_MULTIPROC_DIR (made by scripts/launch.sh)
    listeners.json[.<pid>.tmp]  the HTTP listeners (mindie/server/listeners.py)
    lora_adapters.json[.<pid>.tmp] the LoRA adapters loaded at run time (mindie/lora_adapters.py), for
                                device workers that restart
    service.stopped[.<pid>.tmp] the stop order (/stopService, or a stop signal to the launcher): every
                                front end refuses new inference and cuts what still runs at its
                                deadline (mindie/server/service_state.py, mindie/server/drain.py)
    ready.announced             made by the front end that logged the ready line (mindie/server/ready_line.py)

A module that adds a file to the run directory adds its name to ``ENTRIES``; except
``responses/`` (the Responses API's stored responses, mindie/server/response_store.py), left out
on purpose: a restart keeps them.

A server is live while any of these files is locked by a process. ``claim`` (at start, by
``python -m mindie.ops.launch_plan``) refuses a live run directory and removes what a dead server left;
``hold`` (the launcher, on the descriptor it keeps open) makes the claim last for the server's
life; ``release`` (the launcher, after every process stopped) removes it all; ``request_stop``
asks the launcher to stop (what a ``/stopService`` handler calls).

    python -m mindie.ops.run_dir hold|release RUN_DIR FD     (scripts/launch.sh)
    python -m mindie.ops.run_dir stop RUN_DIR                (stop the server using RUN_DIR)
"""
from __future__ import annotations

import ctypes
import fcntl
import fnmatch
import os
import shutil
import signal
import stat
import struct

__all__ = ["ENTRIES", "SERVER_LOCK", "RunDirBusy", "die_with_parent", "expected_parent", "launcher_pid", "lock_file", "claim",
           "hold", "release", "request_stop", "owner_of", "leftovers"]

SERVER_LOCK = "server.lock"
ENTRIES = (SERVER_LOCK, "deployment.json", "deployment.json.*.tmp", "w*-jobs.ipc", "w*-frames.ipc", "w*.ipc.lock",
           "cores.busy", "admission.slots", "prometheus", "listeners.json", "listeners.json.*.tmp",
           "service.stopped", "service.stopped.*.tmp", "ready.announced", "lora_adapters.json",
           "lora_adapters.json.*.tmp")
LAUNCHER_ENV = "MINDIE_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1


# -- dying with the parent ------------------------------------------------------------------------
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded now: a preexec_fn should not dlopen
except (OSError, AttributeError):
    _prctl = None


def die_with_parent(sig: int, parent: int | None = None) -> bool:
    """Have the kernel send ``sig`` to this process when its parent dies (PR_SET_PDEATHSIG).

    Call it in the child after the fork (it is not inherited; it survives exec). It fires when
    the parent *thread* that forked us exits, so the parent must fork from a thread that lives
    as long as it does (the main thread in every process here). ``parent`` is the pid the
    caller expects as its parent: if that parent died before the call, the signal is raised at
    once, so there is no window in which the death goes unnoticed. Returns False where the
    kernel cannot do it (not Linux): the caller's parent watch is then the only guard."""
    ok = _prctl is not None and _prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return ok


def launcher_pid() -> int:
    """The pid of the launcher that started this server ($MINDIE_LAUNCHER_PID), else our parent."""
    return int(os.environ.get(LAUNCHER_ENV) or 0) or os.getppid()


def expected_parent() -> int:
    """The parent a process started by scripts/launch.sh must have: the launcher
    ($MINDIE_LAUNCHER_PID), even if it already died (our parent is then init or a subreaper).
    A process started some other way (no such variable, or one passed on by the launcher's
    environment to a process it did not start itself) expects its current parent."""
    ppid = os.getppid()
    launcher = int(os.environ.get(LAUNCHER_ENV) or 0)
    if not launcher or launcher == ppid or _start_time(launcher) is not None:
        return ppid
    return launcher


# -- locks ----------------------------------------------------------------------------------------
class RunDirBusy(RuntimeError):
    """The run directory belongs to a live server (or to one being started)."""


def lock_file(path: str) -> int | None:
    """An open descriptor holding an exclusive flock on ``path`` (created mode 0600), or None when
    another open file holds the lock. The lock lasts until every descriptor of that open file is
    closed, and it is always the lock of the file that ``path`` names now (a file unlinked by a
    stopping owner between our open and our flock is not mistaken for the current one)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # unlinked or replaced meanwhile: lock the file that is there now


def _locked_by_another(path: str) -> bool:
    """Whether a process holds a flock or an fcntl (POSIX / open-file-description) lock on ``path``.
    The flock probe takes the lock for a moment; only called when no live server should exist."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False  # gone, a socket, a link: nothing to lock
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        # F_GETLK over the whole file sees POSIX and OFD locks of any process (we hold none).
        probe = struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        try:
            kind = struct.unpack("hhqqi", fcntl.fcntl(fd, fcntl.F_GETLK, probe))[0]
        except OSError:
            return False
        return kind != fcntl.F_UNLCK
    finally:
        os.close(fd)


# -- the owner record -----------------------------------------------------------------------------
def _start_time(pid: int) -> int | None:
    """The start time of a live (not zombie) process, from /proc; None when there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b") ", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


def _read_owner(fd: int) -> tuple[int, int] | None:
    try:
        pid, start = os.pread(fd, 64, 0).split()[:2]
        return int(pid), int(start)
    except ValueError:
        return None


def _alive(owner: tuple[int, int] | None) -> bool:
    return owner is not None and _start_time(owner[0]) == owner[1]


def owner_of(run_dir: str) -> int | None:
    """The pid of the launcher recorded in the run directory, if that process still lives."""
    try:
        fd = os.open(os.path.join(run_dir, SERVER_LOCK), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        owner = _read_owner(fd)
    finally:
        os.close(fd)
    return owner[0] if _alive(owner) else None


# -- the run directory ----------------------------------------------------------------------------
def _entries(run_dir: str) -> list[str]:
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if any(fnmatch.fnmatchcase(n, p) for p in ENTRIES))


def leftovers(run_dir: str) -> list[str]:
    """The server's entries present in ``run_dir`` (empty after a clean stop)."""
    return _entries(run_dir)


def _remove(run_dir: str, names: list[str]) -> list[str]:
    removed = []
    for name in names:
        path = os.path.join(run_dir, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def claim(run_dir: str, owner: int | None = None) -> list[str]:
    """Claim ``run_dir`` for a server that launcher ``owner`` is starting (default: this process's
    parent): refuse (RunDirBusy) when a live server uses it or another launcher is claiming it,
    else remove what a dead server left and record ``owner``. Returns the names removed.

    The lock is held only while this runs; the launcher takes it over with ``hold`` and keeps
    it (a start racing into that gap sees the recorded launcher alive and refuses)."""
    owner = owner or os.getppid()
    start = _start_time(owner)
    if start is None:
        raise RunDirBusy(f"launcher pid {owner} is not running")
    path = os.path.join(run_dir, SERVER_LOCK)
    fd = lock_file(path)
    if fd is None:
        pid = owner_of(run_dir)
        raise RunDirBusy(f"{run_dir} is in use by a running server" + (f" (launcher pid {pid})" if pid else "")
                         + ": stop it first, or give this one another ServerConfig.port or runDir")
    try:
        prev = _read_owner(fd)
        if prev and prev[0] != owner and _alive(prev):
            raise RunDirBusy(f"another launcher (pid {prev[0]}) is starting a server in {run_dir}")
        names = [n for n in _entries(run_dir) if n != SERVER_LOCK]
        busy = [n for n in names if _locked_by_another(os.path.join(run_dir, n))]
        if busy:
            raise RunDirBusy(f"{run_dir}: {', '.join(busy)} locked by a live process (a device worker or front "
                             "end of a server whose launcher died?): stop it first")
        removed = _remove(run_dir, names)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{owner} {start}\n".encode(), 0)
        return removed
    finally:
        os.close(fd)


def hold(run_dir: str, fd: int, owner: int | None = None) -> None:
    """Lock ``run_dir``'s server.lock through ``fd``, a descriptor the launcher opened and keeps for
    the server's life (every process it starts inherits it: the lock lasts while any of them
    lives). The claim must be ``owner``'s (default: this process's parent)."""
    owner = owner or os.getppid()
    path = os.path.join(run_dir, SERVER_LOCK)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunDirBusy(f"{run_dir} was taken by another server while this one started") from None
    try:
        same = os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        same = False
    rec = _read_owner(fd)
    if not same or rec is None or rec[0] != owner:
        fcntl.flock(fd, fcntl.LOCK_UN)
        raise RunDirBusy(f"{run_dir} was claimed by another start while this one started")


def release(run_dir: str, fd: int | None = None) -> tuple[list[str], list[str]]:
    """Remove the server's entries from ``run_dir`` after its processes stopped; ``fd``: the
    launcher's descriptor holding server.lock (None: the lock must be free). Files still locked
    by a live process are left with the rest of the state. Returns (removed, left)."""
    path = os.path.join(run_dir, SERVER_LOCK)
    own = None
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            own = fd
        except BlockingIOError:
            pass
    else:
        own = lock_file(path) if os.path.exists(path) else None
    if own is None and os.path.exists(path):
        return [], _entries(run_dir)
    try:
        names = [n for n in _entries(run_dir) if n != SERVER_LOCK]
        busy = [n for n in names if _locked_by_another(os.path.join(run_dir, n))]
        if busy:  # a process of this server outlived the stop: leave its state to the next start
            return [], _entries(run_dir)
        removed = _remove(run_dir, names)
        # The lock file last: a start that creates a new one now finds nothing else of ours.
        if own is not None and os.path.exists(path) and os.stat(path).st_ino == os.fstat(own).st_ino:
            removed += _remove(run_dir, [SERVER_LOCK])
        return removed, _entries(run_dir)
    finally:
        if own is not None and own != fd:
            os.close(own)


def request_stop(run_dir: str, sig: int = signal.SIGTERM) -> int:
    """Ask the launcher that owns ``run_dir`` to stop the server (what ``/stopService`` calls):
    it stops every process, then ``release``s the run directory. Returns the launcher's pid;
    raises ProcessLookupError when no live server owns ``run_dir``."""
    path = os.path.join(run_dir, SERVER_LOCK)
    pid = owner_of(run_dir)
    fd = lock_file(path) if pid is not None and os.path.exists(path) else None
    if fd is not None:  # lock free: the recorded launcher is not (or no longer) serving here
        os.close(fd)
        pid = None
    if pid is None:
        raise ProcessLookupError(f"no running server owns {run_dir}")
    os.kill(pid, sig)
    return pid
