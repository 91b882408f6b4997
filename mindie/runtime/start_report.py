"""A child process tells its parent how its start ended: one line on a pipe, ``ready`` or
``failed: <reason>``.

The supervisor (workers/supervisor.py) makes a pipe per device-worker process (``StartWatch``)
and passes the write end to the child (``pass_fds``, its number on the command line); the worker
(workers/worker.py, and each tensor-parallel rank) reports through ``StartReport`` once it serves,
or with the reason it cannot start (the exception's message: ``unsupported model type ...``,
``cannot bind tcp://...: address already in use ...``). A child that dies before either
(a signal, a crash in native code) reports nothing: its exit status is then the reason. The
supervisor tells a start failure from a crash while serving this way, and after a few start
failures in a row stops instead of restarting a worker that can never start.

A pipe, not a file in the run directory: nothing is left behind whatever dies, and the end of
the pipe's data is the end of the child. Standard library only (the supervisor is torch-free).
"""
from __future__ import annotations

import contextlib
import os

__all__ = ["StartReport", "StartWatch", "reason_of"]

READY = "ready"
FAILED = "failed: "
# One write below PIPE_BUF (4096 on Linux) is atomic: a report is never interleaved or cut.
MAX_REASON = 2000


def reason_of(exc: BaseException) -> str:
    """An exception as one line: a SystemExit's message as it is, anything else with its type."""
    if isinstance(exc, SystemExit):
        text = "exited" if exc.code is None else str(exc.code)
    else:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    text = " ".join(text.split())  # one line: the pipe carries one report per line
    return text if len(text) <= MAX_REASON else text[:MAX_REASON - 3] + "..."


class StartReport:
    """The child's end: ``ready()`` or ``failed(reason)``, the first call only (later ones and a
    parent gone meanwhile are ignored). ``fd`` None: nobody asked (started by hand)."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd

    def ready(self) -> None:
        self._send(READY)

    def failed(self, reason: str | BaseException) -> None:
        self._send(FAILED + (reason_of(reason) if isinstance(reason, BaseException) else " ".join(reason.split())))

    def _send(self, line: str) -> None:
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            os.write(fd, (line[:MAX_REASON + len(FAILED)] + "\n").encode(errors="replace"))
        except OSError:  # the parent is gone (EPIPE): nobody to tell
            pass
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)


class StartWatch:
    """The parent's end of one child's report. Pass ``child_fd`` to the child (``pass_fds`` and its
    command line), call ``started()`` once it is spawned, then ``poll()`` as often as convenient:
    ``ready`` and ``reason`` say what the child reported so far."""

    def __init__(self) -> None:
        self._r, self.child_fd = os.pipe()
        os.set_blocking(self._r, False)
        self._buf = b""
        self.ready = False
        self.reason: str | None = None  # the child's "failed: ..." text

    def started(self) -> None:
        """The child holds its copy of the write end now: close ours, so that the read end sees the
        end of data when the child is gone."""
        if self.child_fd >= 0:
            os.close(self.child_fd)
            self.child_fd = -1

    def poll(self) -> None:
        """Read what the child wrote (never blocks)."""
        while self._r >= 0:
            try:
                data = os.read(self._r, 4096)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # end of data: the child (and whatever it passed the pipe to) is gone
                self.close()
                return
            self._buf += data
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text == READY:
                    self.ready = True
                elif text.startswith(FAILED):
                    self.reason = text[len(FAILED):]

    def close(self) -> None:
        for attr in ("_r", "child_fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, attr, -1)
