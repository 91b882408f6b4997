"""scripts/motor.sh heals and drains in order (issue 52, findings 4 and 5), on a real fleet (two
demo-model instances by scripts/launch.sh, the coordinator, loopback):

- an instance killed (every process of it, SIGKILL) is restarted with backoff and the
  coordinator routes to it again;
- a wedged coordinator (SIGSTOP) fails its liveness probe, is killed and restarted;
- SIGTERM to motor.sh drains the coordinator first: a stream still running at its drainTimeoutS
  ends with the coordinator's error frame (not a silent cut, not the instances' drain), and only
  then are the instances stopped."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import httpx
import pytest

from tests.coord_harness import MotorFleet, consecutive_free_ports
from tests.harness import InferStreams, alive, descendants, free_ports
from tests.test_motor import server_config, user_config

pytestmark = pytest.mark.timeout(420)

COORD_DRAIN_S = 2


def pid_of(out: str, prefix: str, field: int) -> int:
    """The pid in motor.sh's last line starting with ``prefix`` (word ``field``)."""
    lines = [ln for ln in out.splitlines() if ln.startswith(prefix)]
    assert lines, (prefix, out[-2000:])
    return int(lines[-1].split()[field].rstrip(","))


def until(cond, timeout: float, what) -> float:
    """Polls ``cond`` until true; the seconds it took. Fails with ``what()`` after ``timeout``."""
    t0 = time.monotonic()
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if cond():
                return time.monotonic() - t0
        assert time.monotonic() - t0 < timeout, what()
        time.sleep(0.1)


def test_instance_kill_heals_wedged_coordinator_restarts_and_sigterm_drains_in_order(tmp_path, demo_model):
    predict, manage = free_ports(2)
    base = consecutive_free_ports(4, avoid=(predict, manage))
    server = server_config(demo_model, base)
    # streams long enough to outlast the coordinator's drain at any speed
    server["BackendConfig"]["ModelDeployConfig"]["maxSeqLen"] = 2048
    server["BackendConfig"]["ScheduleConfig"]["maxIterTimes"] = 2000
    cfg = user_config(tmp_path / "u.json", predict=predict, manage=manage, server=server)
    doc = json.loads(cfg.read_text())
    doc["mindie_ms_coordinator_config"]["http_config"]["drainTimeoutS"] = COORD_DRAIN_S
    cfg.write_text(json.dumps(doc))
    fleet = MotorFleet(tmp_path, cfg, ready_timeout=180)
    out, proc = fleet.out, fleet.proc
    seen: list[int] = []
    body = {"input_id": [5, 6, 7], "stream": False, "parameters": {"max_new_tokens": 3}}

    def state(iid: int) -> str:
        insts = httpx.get(f"http://127.0.0.1:{manage}/v1/coordinator_info", timeout=5).json()["instances"]
        return next(i["state"] for i in insts if i["id"] == iid)

    try:
        fleet.wait_ready(200)
        plan = fleet.plan()
        seen[:] = fleet.pids()
        i0 = plan["instances"][0]
        # 1. every process of instance i0 killed at once (a crashed box): motor.sh restarts it
        # after its backoff, and the coordinator routes to it again.
        launcher = pid_of(out(), f"motor: instance {i0['name']}: launch.sh pid", 5)
        victims = [launcher, *descendants(launcher)]
        t0 = time.monotonic()
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        fleet.wait_for(f"instance {i0['name']} stopped (launch.sh was killed by SIGKILL", 20)
        assert "restarting it in 0.5 s" in out(), out()[-2000:]
        until(lambda: state(0) != "ready", 30, lambda: out()[-2000:])
        until(lambda: state(0) == "ready", 180, lambda: out()[-3000:])
        healed = time.monotonic() - t0
        r = httpx.post(f"http://127.0.0.1:{i0['business_port']}/infer_token", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert pid_of(out(), f"motor: instance {i0['name']}: launch.sh pid", 5) != launcher
        print(f"instance kill -> routed again after {healed:.1f} s")

        # 2. the coordinator wedged (SIGSTOP): liveness misses, SIGKILL, a new one that routes.
        first = pid_of(out(), "motor: coordinator: pid", 3)
        t0 = time.monotonic()
        os.kill(first, signal.SIGSTOP)
        fleet.wait_for("failed its liveness probe 3 times in a row", 40)
        fleet.wait_for("the coordinator was killed by SIGKILL: restarting it", 20)
        until(lambda: httpx.post(f"http://127.0.0.1:{predict}/infer_token", json=body, timeout=30).status_code == 200,
              60, lambda: out()[-2000:])
        back = time.monotonic() - t0
        second = pid_of(out(), "motor: coordinator: pid", 3)
        assert second != first and not alive(first) and alive(second)
        print(f"coordinator SIGSTOP -> serving again through a new one after {back:.1f} s")

        # 3. SIGTERM to motor.sh with a long stream through the coordinator: the coordinator drains
        # first and cuts it with its own error frame at its drainTimeoutS; then the instances.
        seen[:] = sorted(set(seen) | set(fleet.pids()))
        streams = InferStreams(f"http://127.0.0.1:{predict}", 2, 1900)
        streams.wait_started(3, timeout=60)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        streams.join(COORD_DRAIN_S + 30)
        failed, full = streams.outcome()
        assert full == 0 and len(failed) == 2, [len(e) for e in streams.events]
        for ev, end in zip(streams.events, streams.ended):
            assert "http_config.drainTimeoutS" in ev[-1]["error"], ev[-1]  # the coordinator's cut
            assert COORD_DRAIN_S - 0.5 <= end - t0 <= COORD_DRAIN_S + 10, end - t0
        assert proc.wait(90) == 0, out()[-3000:]
        text = out()
        assert text.index("stopping the coordinator") < text.index("draining 2 instance(s)"), text[-2000:]
        coord_log = open(plan["coordinator_log"], errors="replace").read()
        assert coord_log.count("cut by the coordinator's drain") >= 2, coord_log[-2000:]
        print(f"motor.sh SIGTERM -> streams cut with error frames at {max(streams.ended) - t0:.2f} s "
              f"(coordinator drainTimeoutS {COORD_DRAIN_S})")
    finally:
        fleet.cleanup(seen)
