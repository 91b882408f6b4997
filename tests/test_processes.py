"""No orphans, whatever dies, and clean exits (docs/reliability.md, "Process deaths" and "Clean
exits"): the real launcher, each kind of process killed with SIGKILL in turn; the run directory
after a stop, after a crash and with two servers on it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mindie.runtime import lifecycle
from tests.harness import (ROOT, Server, alive, free_port, process_roles, short_run_dir, wait_gone,
                           write_config)

pytestmark = pytest.mark.timeout(120)

# What each kill -9 must lead to: the launcher's exit status (None: the launcher is the victim),
# the message it prints, and whether the run directory ends clean (the launcher cleans it when it
# survives; otherwise the next start does).
SUP_KILLED = "the device-worker supervisor (pid {supervisor}) was killed by SIGKILL"
MASTER_KILLED = "the gunicorn master (pid {master}) was killed by SIGKILL"
KILLS = {
    "supervisor": (137, [SUP_KILLED]),
    "master": (137, [MASTER_KILLED]),
    "supervisor+master": (137, [SUP_KILLED, MASTER_KILLED]),  # the drill
    # "launcher" alone: test_start_after_a_crash_cleans_up_and_stop_leaves_nothing (its crash is that
    # test's first half, and the next start on the run dir it leaves its second)
    "launcher+master": (None, []),  # the front ends must stop on their own: nobody else is left
}


def _start(tmp: Path, demo_model: str, run_dir: str | None = None, port: int | None = None,
           frontends: int = 2) -> tuple[Server, str]:
    tmp.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    run_dir = run_dir or short_run_dir()
    cfg = write_config(tmp / "config.json", port=port, run_dir=run_dir, model_path=demo_model, workers=1)
    return Server(cfg, port, frontends=frontends), run_dir


def _serves(srv: Server) -> bool:
    r = httpx.post(srv.url + "/infer_token", json={"input_id": [1, 2], "parameters": {"max_new_tokens": 2}},
                   timeout=30)
    return r.status_code == 200


# -- the lifecycle primitives ---------------------------------------------------------------------
def test_die_with_parent_fires_and_closes_the_fork_race(tmp_path):
    # The parent "died" before the child set the signal (wrong expected parent): killed at once.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                             preexec_fn=lambda: lifecycle.die_with_parent(signal.SIGKILL, 1))
    assert child.wait(5) == -signal.SIGKILL
    # A real parent killed by SIGKILL: its child gets the signal.
    code = ("import signal, subprocess, sys, time\n"
            "from mindie.runtime.lifecycle import die_with_parent\n"
            "import functools, os\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
            " preexec_fn=functools.partial(die_with_parent, signal.SIGTERM, os.getpid()))\n"
            "print(p.pid, flush=True); time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    grandchild = int(parent.stdout.readline())
    assert alive(grandchild)
    parent.kill()
    parent.wait()
    assert wait_gone([grandchild], 5) is not None


def test_claim_refuses_a_live_run_dir_and_cleans_a_dead_one(tmp_path):
    run_dir = short_run_dir()
    for name in ("w0-jobs.ipc", "w0-jobs.ipc.lock", "deployment.json", "deployment.json.77.tmp", "cores.busy",
                 "admission.slots", "server.lock"):
        Path(run_dir, name).write_text("stale")
    os.mkdir(os.path.join(run_dir, "prometheus"))
    Path(run_dir, "prometheus", "counter_1.db").write_text("x")
    Path(run_dir, "notes.txt").write_text("not the server's")  # never touched
    me = os.getpid()

    # A live process holds a worker's endpoint lock: refused, nothing removed.
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDWR)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True); time.sleep(60)\n"), os.path.join(run_dir, "w0-jobs.ipc.lock")],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    try:
        with pytest.raises(lifecycle.RunDirBusy, match="w0-jobs.ipc.lock"):
            lifecycle.claim(run_dir, me)
        assert len(os.listdir(run_dir)) == 9
    finally:
        holder.kill()
        holder.wait()

    # The holder died: everything of the server's goes, the stranger's file stays.
    removed = lifecycle.claim(run_dir, me)
    assert sorted(removed) == ["admission.slots", "cores.busy", "deployment.json", "deployment.json.77.tmp",
                               "prometheus", "w0-jobs.ipc", "w0-jobs.ipc.lock"]
    assert sorted(os.listdir(run_dir)) == ["notes.txt", "server.lock"]
    assert lifecycle.owner_of(run_dir) == me

    # Claimed by a launcher that is alive (a start between its claim and its hold): refused.
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(lifecycle.RunDirBusy, match=f"another launcher \\(pid {me}\\)"):
            lifecycle.claim(run_dir, other.pid)
        # The claimant itself holds the lock through its own descriptor, for good.
        fd = os.open(os.path.join(run_dir, "server.lock"), os.O_RDWR)
        lifecycle.hold(run_dir, fd, me)
        with pytest.raises(lifecycle.RunDirBusy, match="in use by a running server"):
            lifecycle.claim(run_dir, other.pid)
        assert lifecycle.release(run_dir, fd) == (["server.lock"], [])
        os.close(fd)
    finally:
        other.kill()
        other.wait()
    assert os.listdir(run_dir) == ["notes.txt"]


def test_lock_file_never_locks_an_unlinked_file(tmp_path):
    path = str(tmp_path / "x.lock")
    fd = lifecycle.lock_file(path)
    assert fd is not None and lifecycle.lock_file(path) is None
    os.unlink(path)  # the owner's clean stop removes the file, then closes
    fd2 = lifecycle.lock_file(path)
    assert fd2 is not None and os.stat(path).st_ino == os.fstat(fd2).st_ino
    os.close(fd)
    os.close(fd2)


# -- kill -9 of each process of a real server -------------------------------------------------------
def _kill_9(srv: Server, victims: str) -> tuple[int, dict[str, int]]:
    """kill -9 of ``victims`` ("+"-joined roles) of a ready server with two front ends and one
    worker: every process of it is gone within a few seconds. Returns the launcher's status and
    the pid of each role."""
    srv.wait_ready()
    roles = process_roles(srv.proc.pid)
    assert sorted(roles.values()) == ["frontend", "frontend", "master", "supervisor", "worker"], roles
    pid_of = {r: p for p, r in roles.items()}
    pid_of["launcher"] = srv.proc.pid
    everything = [srv.proc.pid, *roles]
    for role in victims.split("+"):
        os.kill(pid_of[role], signal.SIGKILL)
    elapsed = wait_gone(everything, 20)
    left = {p: roles.get(p, "launcher") for p in everything if alive(p)}
    assert elapsed is not None, f"still running: {left}\n{srv.tail()}"
    # "Within a few seconds": the launcher drains the front ends first, which end their requests
    # (none here) and stop at once.
    assert elapsed < 8, elapsed
    return srv.proc.wait(5), pid_of


@pytest.mark.parametrize("victims", list(KILLS))
def test_kill_9_leaves_no_process(tmp_path, demo_model, victims):
    srv, run_dir = _start(tmp_path, demo_model)
    try:
        status, pid_of = _kill_9(srv, victims)
        code, messages = KILLS[victims]
    finally:
        srv.stop()
    log = srv.log_path.read_text()
    if code is None:
        assert status == -signal.SIGKILL
        # Nobody was left to clean up: the next start does (see the test below).
        assert "server.lock" in lifecycle.leftovers(run_dir)
    else:
        assert status == code, log
        for message in messages:
            assert message.format(**pid_of) in log, log
        assert "launch.sh: server stopped because" in log
        assert lifecycle.leftovers(run_dir) == [], log


def test_kill_9_of_a_front_end_and_a_worker_replaces_them_and_stop_leaves_nothing(tmp_path, demo_model):
    srv, run_dir = _start(tmp_path, demo_model)
    try:
        srv.wait_ready()
        roles = process_roles(srv.proc.pid)
        victims = [next(p for p, r in roles.items() if r == "frontend"),
                   next(p for p, r in roles.items() if r == "worker")]
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        assert wait_gone(victims, 5) is not None
        deadline = time.monotonic() + 60
        while True:  # gunicorn respawns the front end, the supervisor the worker
            now = process_roles(srv.proc.pid)
            if sorted(now.values()) == sorted(roles.values()) and not set(victims) & set(now):
                try:
                    if _serves(srv):
                        break
                except httpx.HTTPError:
                    pass
            assert time.monotonic() < deadline, srv.tail()
            time.sleep(0.2)
        assert srv.proc.poll() is None
        everything = [srv.proc.pid, *now]
    finally:
        code = srv.stop()
    assert code == 0, srv.tail()
    assert wait_gone(everything, 5) is not None
    log = srv.log_path.read_text()
    assert f"Worker (pid:{victims[0]}) was sent SIGKILL!" in log
    assert "worker w0 killed by SIGKILL" in log
    assert lifecycle.leftovers(run_dir) == [], log


def test_start_after_a_crash_cleans_up_and_stop_leaves_nothing(tmp_path, demo_model):
    """kill -9 of the launcher leaves no process but its run directory as it was (nobody is left
    to clean it); the next start on that run directory removes the stale state and serves; while
    it runs, a second server on its run directory or its port is refused and changes nothing of
    it; /stopService's stop then leaves the run directory empty. (One crash and one restart for
    what were three tests of a start each: test_kill_9_leaves_no_process[launcher] and
    test_a_second_server_on_the_same_run_dir_or_port_is_refused are its first and middle parts.)"""
    srv, run_dir = _start(tmp_path / "a", demo_model)
    try:
        status, _ = _kill_9(srv, "launcher")
    finally:
        srv.stop()
    assert status == -signal.SIGKILL, srv.tail()
    stale = lifecycle.leftovers(run_dir)
    # Nobody was left to clean up: the next start does.
    assert "server.lock" in stale and "deployment.json" in stale, stale

    # Same run dir: the stale state is removed (and said so), the server serves.
    srv2, _ = _start(tmp_path / "b", demo_model, run_dir=run_dir, frontends=1)
    try:
        srv2.wait_ready()
        assert _serves(srv2)
        assert "removed what a server that stopped uncleanly left in" in srv2.tail(200)
        _second_server_is_refused(tmp_path, demo_model, srv2, run_dir)
        everything = [srv2.proc.pid, *process_roles(srv2.proc.pid)]
        # What /stopService calls: the launcher stops everything and cleans the run dir.
        assert lifecycle.request_stop(run_dir) == srv2.proc.pid
        assert srv2.proc.wait(30) == 0, srv2.tail()
    finally:
        srv2.stop()
    assert wait_gone(everything, 5) is not None
    assert lifecycle.leftovers(run_dir) == [], srv2.tail()
    assert "launch.sh: stopped on request" in srv2.log_path.read_text()
    with pytest.raises(ProcessLookupError):
        lifecycle.request_stop(run_dir)


def _second_server_is_refused(tmp_path: Path, demo_model: str, srv: Server, run_dir: str) -> None:
    """A second server on ``srv``'s run directory, then on its port: each refused, the first
    server's files (inode by inode) and plan unchanged, and it still serves."""
    deadline = time.monotonic() + 30  # the ready line's file comes just after /health says 200
    while not os.path.exists(os.path.join(run_dir, "ready.announced")) and time.monotonic() < deadline:
        time.sleep(0.05)
    state = {n: os.stat(os.path.join(run_dir, n)).st_ino for n in os.listdir(run_dir)}
    plan = Path(run_dir, "deployment.json").read_bytes()
    # Same run dir (the default run dir is per port, so also "same port, default run dir").
    same_dir, _ = _start(tmp_path / "c", demo_model, run_dir=run_dir, port=srv.port)
    assert same_dir.proc.wait(30) == 2, same_dir.tail()
    same_dir.stop()
    assert f"{run_dir} is in use by a running server (launcher pid {srv.proc.pid})" in \
        same_dir.log_path.read_text(), "second server on the same run dir: not refused as in use"
    # Same port, another run dir: gunicorn refuses the port (reuse_port would share it).
    same_port, other_dir = _start(tmp_path / "d", demo_model, port=srv.port)
    assert same_port.proc.wait(60) == 1, same_port.tail()
    same_port.stop()
    assert "is already in use (another server?)" in same_port.log_path.read_text(), \
        "second server on the same port: not refused as in use"
    assert lifecycle.leftovers(other_dir) == []
    # The first server's state is untouched and it still serves.
    assert {n: os.stat(os.path.join(run_dir, n)).st_ino for n in os.listdir(run_dir)} == state, \
        "a refused second server changed the first one's run dir"
    assert Path(run_dir, "deployment.json").read_bytes() == plan
    assert _serves(srv), "the first server stopped serving after a second one was refused"
