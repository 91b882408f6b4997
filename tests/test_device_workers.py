"""Device side end to end: real supervisor, real worker processes, real ZeroMQ, the
protocol client. Two CPU device workers stand in for two NPUs."""
from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from mindie.contract import wire as P
from mindie.device_client import DeviceClient, RequestStream
from tests.harness import ROOT, alive, children_of, free_port, short_run_dir, write_config, write_plan

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, demo_model):
    tmp = tmp_path_factory.mktemp("cluster")
    run_dir = short_run_dir()
    cfg_path = write_config(tmp / "config.json", port=free_port(), run_dir=run_dir, model_path=demo_model,
                            schedule={"maxBatchSize": 64})
    log = open(tmp / "supervisor.log", "wb")
    path, dep = write_plan(cfg_path)
    proc = subprocess.Popen([sys.executable, "-m", "workers.supervisor", "--deployment", path],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    yield proc, dep, tmp / "supervisor.log"
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    log.close()


async def _client(dep, timeout=60.0) -> DeviceClient:
    c = DeviceClient(dep.workers)
    await c.start()
    t0 = time.monotonic()
    while len(c.ready_links()) < len(c.links):
        assert time.monotonic() - t0 < timeout, "device workers not ready"
        await asyncio.sleep(0.05)
    return c


@contextlib.asynccontextmanager
async def _connected(dep, timeout=60.0):
    """A client with every worker of ``dep`` ready; closed on exit."""
    c = await _client(dep, timeout)
    try:
        yield c
    finally:
        await c.close()


async def _collect(stream: RequestStream, timeout: float = 60.0) -> tuple[list[int], str, P.RequestError | None]:
    ids: list[int] = []
    deadline = time.monotonic() + timeout
    while True:
        frames = await stream.get(max(0.01, deadline - time.monotonic()))
        assert frames or time.monotonic() < deadline, "request timed out"
        for f in frames:
            ids.extend(f.token_ids)
            if f.error is not None:
                return ids, f.finish_reason, f.error
            if f.finish_reason:
                return ids, f.finish_reason, None


async def _wait_all_free(c: DeviceClient, timeout: float, what: str) -> None:
    """Wait until every worker's heartbeat reports no request and every KV block free."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await asyncio.sleep(0.3)
        hbs = [lk.heartbeat for lk in c.links.values()]
        if all(hb and hb.running == 0 and hb.waiting == 0 and hb.free_blocks == hb.total_blocks for hb in hbs):
            return
    raise AssertionError(f"{what}: {hbs}")


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 32000) for _ in range(rng.randrange(3, 80))] for _ in range(n)]


def test_concurrent_greedy_equals_alone_and_no_frame_lost(cluster):
    _, config, _ = cluster

    async def main():
        async with _connected(config) as c:
            prompts = _prompts(16)
            alone = []
            for p in prompts:
                ids, reason, err = await _collect(c.submit(p, P.SamplingParams(max_new_tokens=24)))
                assert err is None and reason == "length" and len(ids) == 24
                alone.append(ids)
            streams = [c.submit(p, P.SamplingParams(max_new_tokens=24)) for p in prompts]
            together = await asyncio.gather(*(_collect(s) for s in streams))
            assert [t[0] for t in together] == alone
            assert c.gaps == 0
            # Both workers took part.
            assert len({s.link.ep.worker_id for s in streams}) == 2

    asyncio.run(main())


def test_length_cap_and_max_seq_len(cluster):
    _, config, _ = cluster

    async def main():
        async with _connected(config) as c:
            ids, reason, err = await _collect(c.submit([5, 6, 7], P.SamplingParams(max_new_tokens=1)))
            assert (len(ids), reason, err) == (1, "length", None)
            # The front end caps max_new_tokens (tests/test_validation.py); a request beyond
            # maxSeqLen that reaches a worker anyway is refused with an error, not run or hung.
            ids, reason, err = await _collect(c.submit([5, 6, 7], P.SamplingParams(max_new_tokens=100000)))
            assert ids == [] and err is not None and err.status == 500 and "refused" in err.message
            ids, reason, err = await _collect(c.submit([5] * 2550, P.SamplingParams(max_new_tokens=10)), 120)
            assert (len(ids), reason) == (10, "length")  # exactly maxSeqLen tokens in all

    asyncio.run(main())


def test_refuses_unvalidated_input_and_lives_on(cluster):
    """The front end validates (MindIE's 422/424 messages); a worker only asserts its
    invariants: ids beyond the vocabulary or an input of maxSeqLen get an error frame, and the
    worker keeps serving."""
    _, config, _ = cluster

    async def main():
        async with _connected(config) as c:
            for bad in ([5, 32000], [5, -1], [5] * 2560):
                _, reason, err = await _collect(c.submit(bad, P.SamplingParams()))
                assert err is not None and err.status == 500 and "refused by the device worker" in err.message
            ids, reason, err = await _collect(c.submit([5, 6], P.SamplingParams(max_new_tokens=3)))
            assert (len(ids), reason, err) == (3, "length", None)

    asyncio.run(main())


def test_cancel_frees_request(cluster):
    _, config, _ = cluster

    async def main():
        async with _connected(config) as c:
            streams = [c.submit(p, P.SamplingParams(max_new_tokens=400)) for p in _prompts(6, seed=3)]
            await asyncio.sleep(0.5)
            for s in streams:
                c.cancel(s)
            # The workers report nothing running and every KV block free.
            await _wait_all_free(c, 10, "requests not freed")

    asyncio.run(main())


def test_frontend_death_cancels_its_requests(cluster):
    _, config, _ = cluster

    async def main():
        c = await _client(config)
        watcher = await _client(config)
        try:
            for p in _prompts(4, seed=5):
                c.submit(p, P.SamplingParams(max_new_tokens=2000))
            # The front end vanishes without a word: no Cancel, its Hellos stop.
            for t in c.tasks:
                t.cancel()
            await _wait_all_free(watcher, P.FRONTEND_TIMEOUT_S + 10, "orphaned requests not cancelled")
        finally:
            await c.close()
            await watcher.close()

    asyncio.run(main())


def test_kill_worker_is_detected_and_restarted(cluster):
    proc, config, log_path = cluster

    async def main():
        async with _connected(config) as c:
            streams = [c.submit(p, P.SamplingParams(max_new_tokens=2000)) for p in _prompts(4, seed=9)]
            await asyncio.sleep(0.5)
            victim_id = streams[0].link.ep.worker_id
            workers = children_of(proc.pid)
            assert len(workers) == 2, workers
            # Find the victim's pid from its heartbeat.
            pid = c.links[victim_id].heartbeat.pid
            assert pid in workers
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            victims = [s for s in streams if s.link.ep.worker_id == victim_id]
            results = await asyncio.gather(*(_collect(s, 15) for s in victims))
            seen = time.monotonic() - t0
            assert all(err is not None and err.status == 500 for _, _, err in results), results
            assert seen < P.WORKER_TIMEOUT_S + 3, (seen, results)
            # The supervisor restarts it and the client handshakes again.
            deadline = time.monotonic() + 60
            link = c.links[victim_id]
            # Welcome and the first heartbeat of the new instance may come in either order.
            while not (link.welcomed and link.heartbeat and link.heartbeat.instance == link.instance):
                assert time.monotonic() < deadline, "worker not restarted"
                await asyncio.sleep(0.1)
            assert c.links[victim_id].heartbeat.pid != pid
            for s in streams:
                c.cancel(s)
            ids, reason, err = await _collect(c.submit([1, 2, 3], P.SamplingParams(max_new_tokens=4)))
            assert err is None and len(ids) == 4

    asyncio.run(main())
    assert "killed by SIGKILL" in log_path.read_text()


def test_supervisor_stop_leaves_no_process(tmp_path, demo_model):
    cfg_path = write_config(tmp_path / "config.json", port=free_port(), run_dir=short_run_dir(),
                            model_path=demo_model)
    proc = subprocess.Popen([sys.executable, "-m", "workers.supervisor", "--deployment", write_plan(cfg_path)[0]],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while len(children_of(proc.pid)) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    kids = children_of(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    time.sleep(0.2)
    assert not any(alive(k) for k in kids)


@pytest.fixture
def null_supervisor(tmp_path, demo_model):
    """Start a one-worker supervisor on the null model with ``step_ms`` per step."""
    procs = []

    def start(step_ms: float, **schedule):
        cfg_path = write_config(tmp_path / "config.json", port=free_port(), run_dir=short_run_dir(),
                                model_path=demo_model, workers=1, schedule=schedule or None)
        path, dep = write_plan(cfg_path, null_model=True, null_step_ms=step_ms)
        procs.append(subprocess.Popen([sys.executable, "-m", "workers.supervisor", "--deployment", path], cwd=ROOT,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return dep

    yield start
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_frontend_reaped_while_silent_learns_it_at_once(null_supervisor):
    """A front end whose Hellos stop (a stalled loop) has its requests cancelled by the worker;
    when it speaks again the worker's fresh Welcome makes it fail them at once, not hang."""
    config = null_supervisor(20, maxIterTimes=2500)  # 2500 steps of 20 ms: still running when reaped

    async def main():
        async with _connected(config) as c:
            s = c.submit([5, 6, 7], P.SamplingParams(max_new_tokens=2500))
            c.tasks[1].cancel()  # the hello loop
            await asyncio.sleep(P.FRONTEND_TIMEOUT_S + 1.5)
            c.tasks[1] = asyncio.create_task(c._hello_loop())
            ids, reason, err = await _collect(s, 10)
            assert err is not None and err.status == 500 and "dropped" in err.message, (reason, err)
            # The link is usable again afterwards.
            deadline = time.monotonic() + 10
            while not all(lk.welcomed for lk in c.links.values()):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            ids, reason, err = await _collect(c.submit([1, 2, 3], P.SamplingParams(max_new_tokens=3)))
            assert err is None and len(ids) == 3

    asyncio.run(main())


def test_long_step_does_not_look_like_a_dead_worker(null_supervisor):
    """Heartbeats come from their own thread: a step longer than the liveness timeout (here the
    null model sleeping 4.5 s per step) must not fail the requests."""
    config = null_supervisor((P.WORKER_TIMEOUT_S + 1.5) * 1000)

    async def main():
        async with _connected(config) as c:
            ids, reason, err = await _collect(c.submit([5, 6], P.SamplingParams(max_new_tokens=2)), 60)
            assert err is None and reason == "length" and len(ids) == 2

    asyncio.run(main())


def test_a_stopping_worker_ends_its_requests_with_503_at_once(null_supervisor):
    """A worker told to stop (SIGTERM: its supervisor's or its instance's end) ends every request
    it holds with a 503 frame and says so in a last heartbeat, so a front end answers (and a
    coordinator retries elsewhere) at once instead of after the heartbeat timeout."""
    config = null_supervisor(20, maxIterTimes=2500)

    async def main():
        async with _connected(config) as c:
            s = c.submit([5, 6, 7], P.SamplingParams(max_new_tokens=2500))
            await asyncio.sleep(0.5)
            link = s.link
            old, pid = link.instance, link.heartbeat.pid
            t0 = time.monotonic()
            os.kill(pid, signal.SIGTERM)
            ids, reason, err = await _collect(s, 10)
            took = time.monotonic() - t0
            assert err is not None and err.status == 503 and "stopped (signal SIGTERM)" in err.message, (reason, err)
            assert took < P.WORKER_TIMEOUT_S / 2, took
            deadline = time.monotonic() + 1
            while link.welcomed and link.instance == old:  # the last heartbeat unready the link
                assert time.monotonic() < deadline, "link still counted ready after the worker's last heartbeat"
                await asyncio.sleep(0.01)

    asyncio.run(main())
