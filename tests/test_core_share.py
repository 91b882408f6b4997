"""Core sharing between CPU workers (workers/backends/core_share.py; issue 16, item 0), with real
processes on one share file: idle siblings' cores are borrowed, busy ones' are not, a worker
that wakes up while a sibling uses its cores waits for the end of that sibling's step, and the
kernel hands a killed worker's locks back."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

TIMEOUT_S = 20.0


def _no_threads(n: int) -> None:  # torch is not needed to test the protocol
    pass


def _serve(path: str, index: int, count: int, conn) -> None:
    """A worker stand-in: runs CoreShare calls sent over ``conn``, answers each."""
    from workers.backends.core_share import CoreShare
    share = CoreShare(path, index, count, 1, set_threads=_no_threads)
    conn.send("ready")
    while True:
        if not conn.poll(60):
            return
        cmd, *args = conn.recv()
        if cmd == "busy":
            share.set_busy(args[0])
            conn.send(None)
        elif cmd == "apply":
            before = share.waited_s
            n = share.apply()
            conn.send((n, share.waited_s - before, share.owned, list(share.borrowed)))
        elif cmd == "release":
            share.release()
            conn.send(None)
        elif cmd == "trylock":
            got = share._try_lock(args[0])
            conn.send(got)
        elif cmd == "exit":
            share.close()
            conn.send(None)
            return


class Proc:
    def __init__(self, ctx, path: str, index: int, count: int):
        self.conn, child = ctx.Pipe()
        self.p = ctx.Process(target=_serve, args=(path, index, count, child), daemon=True)
        self.p.start()
        assert self.recv() == "ready"

    def recv(self, timeout: float = TIMEOUT_S):
        assert self.conn.poll(timeout), "no answer in time"
        return self.conn.recv()

    def call(self, *cmd, timeout: float = TIMEOUT_S):
        self.conn.send(cmd)
        return self.recv(timeout)

    def stop(self) -> None:
        if self.p.is_alive():
            try:
                self.call("exit", timeout=5)
            except (AssertionError, OSError, EOFError):
                pass
        self.p.join(5)
        if self.p.is_alive():
            self.p.kill()
            self.p.join(5)


@pytest.fixture
def procs(tmp_path):
    ctx = mp.get_context("spawn")
    path = str(tmp_path / "cores.busy")
    started: list[Proc] = []

    def start(count: int) -> list[Proc]:
        for i in range(count):
            started.append(Proc(ctx, path, i, count))
        return started

    yield start
    for p in started:
        p.stop()


def test_idle_siblings_lent_busy_ones_not(procs):
    a, b, c = procs(3)
    assert a.call("busy", True) is None
    n, _, owned, borrowed = a.call("apply")
    assert (n, owned, borrowed) == (3, True, [1, 2])  # both siblings idle: their cores lent
    a.call("release")
    b.call("busy", True)
    n, waited, owned, borrowed = b.call("apply")
    assert (n, owned, borrowed) == (2, True, [2])  # a is busy: only c's cores
    assert waited < 1.0
    n, _, _, borrowed = a.call("apply")
    assert (n, borrowed) == (1, [])  # b busy (and holding its cores), c lent to b until b's release
    b.call("release")
    n, _, _, borrowed = a.call("apply")
    assert (n, borrowed) == (2, [2])
    a.call("release")
    b.call("busy", False)  # idle again: its own cores can be borrowed at once
    n, _, _, borrowed = a.call("apply")
    assert (n, borrowed) == (3, [1, 2])


def test_waking_worker_waits_for_borrowers_step(procs):
    a, b = procs(2)
    a.call("busy", True)
    assert a.call("apply")[0] == 2  # b idle: a computes on both shares
    b.call("busy", True)
    b.conn.send(("apply",))
    hold = 0.6
    assert not b.conn.poll(hold), "b stepped on cores a still uses"
    assert a.call("release") is None  # a's step ends: b's cores go back
    n, waited, owned, borrowed = b.recv(timeout=5)
    assert (n, owned, borrowed) == (1, True, [])  # a is busy: b gets its own share only
    assert hold * 0.9 <= waited < 1.9
    # and now a, busy, cannot borrow b's cores
    assert a.call("apply")[0] == 1


def test_killed_worker_locks_released(procs):
    a, b = procs(2)
    a.call("busy", True)
    assert a.call("apply")[0] == 2  # a holds both locks
    assert b.call("trylock", 0) is False and b.call("trylock", 1) is False
    os.kill(a.p.pid, signal.SIGKILL)
    a.p.join(TIMEOUT_S)
    assert not a.p.is_alive()
    b.call("busy", True)
    t0 = time.monotonic()
    n, waited, owned, _ = b.call("apply")
    assert owned and waited < 1.0 and time.monotonic() - t0 < 5
    assert n == 1  # a's intent byte still says busy: not borrowed, but its lock is free
    assert b.call("trylock", 0) is True


def test_wait_is_capped(procs):
    """A sibling that never releases costs one capped wait, then the step runs anyway."""
    from workers.backends import core_share
    a, b = procs(2)
    a.call("busy", True)
    assert a.call("apply")[0] == 2
    b.call("busy", True)
    t0 = time.monotonic()
    n, waited, owned, _ = b.call("apply", timeout=core_share.WAIT_CAP_S + 10)
    assert not owned and n == 1
    assert core_share.WAIT_CAP_S * 0.95 <= waited <= time.monotonic() - t0 < core_share.WAIT_CAP_S + 5


def test_thread_count_set_only_on_change(tmp_path):
    from workers.backends.core_share import CoreShare
    calls: list[int] = []
    share = CoreShare(str(tmp_path / "cores.busy"), 0, 2, 3, set_threads=calls.append)
    try:
        share.set_busy(True)
        assert share.apply() == 6 and share.apply() == 6
        share.release()
        assert calls == [6]
        share.map[1] = 1  # sibling busy
        assert share.apply() == 3
        assert calls == [6, 3]
    finally:
        share.close()


def _files(**contents):
    return lambda path: contents.get(path)


def test_usable_cores_affinity_and_cgroup_quota():
    from mindie.topology import CGROUP_V1_QUOTA, CGROUP_V2_CPU_MAX, usable_cores
    eight = set(range(8))
    assert usable_cores(_files(), eight) == 8  # no cgroup files: the affinity mask
    assert usable_cores(_files(), {2, 5}) == 2
    assert usable_cores(_files(**{CGROUP_V2_CPU_MAX: "max 100000\n"}), eight) == 8  # v2, unlimited
    assert usable_cores(_files(**{CGROUP_V2_CPU_MAX: "300000 100000\n"}), eight) == 3
    assert usable_cores(_files(**{CGROUP_V2_CPU_MAX: "250000 100000\n"}), eight) == 2  # 2.5 rounds down
    assert usable_cores(_files(**{CGROUP_V2_CPU_MAX: "50000 100000\n"}), eight) == 1  # at least one
    assert usable_cores(_files(**{CGROUP_V2_CPU_MAX: "1600000 100000\n"}), {0, 1, 2, 3}) == 4  # min of both
    v1q, v1p = CGROUP_V1_QUOTA[0], CGROUP_V1_QUOTA[0].replace("quota", "period")
    assert usable_cores(_files(**{v1q: "-1\n", v1p: "100000\n"}), eight) == 8  # v1, unlimited
    assert usable_cores(_files(**{v1q: "400000\n", v1p: "100000\n"}), eight) == 4
    assert usable_cores(_files(**{v1q: "200000\n", v1p: "50000\n"}), {0, 1}) == 2
    assert usable_cores(_files(**{CGROUP_V2_CPU_MAX: "garbage"}), eight) == 8
    assert usable_cores(_files(), set()) >= 1


def test_prepare_warns_when_threads_exceed_cores(monkeypatch, caplog):
    from mindie.ops import launch_plan as prepare
    from mindie.contract.spec import WorkerSpec

    def spec(threads):
        return WorkerSpec(worker_id="w", job_endpoint="", pub_endpoint="", device_type="cpu", threads=threads)

    class Dep:
        workers = [spec(4), spec(4)]

    monkeypatch.setattr(prepare, "usable_cores", lambda: 8)
    with caplog.at_level("WARNING", logger="mindie.ops.prepare"):
        prepare.check_cpu_threads(Dep)
    assert not caplog.records
    monkeypatch.setattr(prepare, "usable_cores", lambda: 6)
    with caplog.at_level("WARNING", logger="mindie.ops.prepare"):
        prepare.check_cpu_threads(Dep)
    assert len(caplog.records) == 1 and "8 threads on 6 usable cores" in caplog.text
