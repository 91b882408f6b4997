"""deploy_mode pd_separate through the real coordinator (issue 32, items 3 and 5, coordinator
side): a prefill instance (pdRole prefill), a decode instance (pdRole decode) and a hybrid one
(flex), each started by scripts/launch.sh with the demo model, all on loopback.

- greedy answers through prefill -> KV transfer -> decode equal the hybrid instance's, for
  /infer_token, OpenAI chat and TGI, stream and not, with a stop string and logprobs, and a
  prompt spanning many KV blocks; the request line shows the handoff (the prefill instance's
  transfer: blocks > 0);
- coordinator_info lists each instance with its role (reported by the instances themselves);
- the decode instance taken offline: requests go whole to the hybrid instance;
- a client that hangs up mid-stream: the decode instance stops the request;
- kill -9 of the decode instance mid-stream: the stream ends with an error frame (no hang), and
  the next request goes to the hybrid instance."""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

from tests.coord_harness import Coordinator, kill9, start_instances
from tests.harness import Server, free_ports
from tests.test_coordinator import normal

pytestmark = pytest.mark.timeout(400)

PROMPT = "The quick brown fox jumps over the lazy dog and then"
LONG = " ".join(f"word{i}" for i in range(150))  # many 16-token blocks and a partial one
ROLES = ("prefill", "decode", "flex")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    servers = []
    try:
        # speculation as configured by default (exactness through PD with it on); the streams held
        # open here are long enough either way
        servers = start_instances(tmp, 3, schedule={"speculativeDecoding": True},
                                  per_instance=[{"server": {"pdRole": role, "kvLoadFailurePolicy": "fail"}}
                                                for role in ROLES])
        # no static roles: the coordinator learns them from the instances' /v2/status
        coord = Coordinator(tmp, servers, name="pd",
                            config={"digs_scheduler_config": {"deploy_mode": "pd_separate"},
                                    "exception_config": {"max_retry": 2, "first_token_timeout": 30,
                                                         "infer_timeout": 120}})
        coord.wait_ready_line()
        coord.wait_ready()
        yield tmp, servers, coord
        coord.stop()
    finally:
        for s in servers:
            s.stop()


def close(a, b, path: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ: everything exactly (token ids, text, counts, finish reasons)
    but floats (logprobs) within 1e-4: the decode instance computes the prompt's tail after the
    transferred blocks as a prefix-cache hit does, the cold hybrid instance the whole prompt at once,
    so float rounding may differ in the last digits (docs/design.md, "Logprobs"; bit for bit
    against a prefix hit: tests/test_pd_tcp.py)."""
    if isinstance(a, float) and isinstance(b, float):
        return [] if abs(a - b) <= 1e-4 else [f"{path}: {a} != {b}"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(a)} != {sorted(b)}"]
        return [d for k in a for d in close(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in close(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def _pd(server: Server) -> dict:
    return httpx.get(server.url + "/v2/status", timeout=10).json()["pd"]


def _lines_after(coord, n: int, timeout: float = 10) -> list[str]:
    return coord.wait_request_lines(n + 1, timeout)[n:]


def test_coordinator_info_lists_roles(fleet):
    _, servers, coord = fleet
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10:
        info = coord.info()
        roles = {i["business_port"]: i["role"] for i in info["instances"]}
        if list(roles.values()) == list(ROLES):
            break
        time.sleep(0.2)
    assert [roles[s.port] for s in servers] == list(ROLES), info
    assert info["deploy_mode"] == "pd_separate" and info["ready"] is True
    dec = next(i for i in info["instances"] if i["role"] == "decode")
    assert dec["kv_endpoints"] and all(e.startswith(("ipc://", "tcp://")) for e in dec["kv_endpoints"]), dec


CASES = [
    ("/infer_token", {"input_id": [5, 9, 13, 22, 31, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
                      "stream": False, "parameters": {"max_new_tokens": 12, "details": True}}),
    ("/infer_token", {"input_id": [5, 9, 13, 22, 31], "stream": True, "parameters": {"max_new_tokens": 8}}),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": PROMPT}],
                              "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 2,
                              "stop": ["ing"]}),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": LONG}],
                              "max_tokens": 12, "temperature": 0, "logprobs": True, "stream": True,
                              "stop": ["ing"]}),
    ("/generate", {"inputs": LONG, "parameters": {"max_new_tokens": 12, "details": True, "decoder_input_details": False,
                                                  "stop": ["e"], "top_n_tokens": 2}}),
    ("/generate_stream", {"inputs": PROMPT, "parameters": {"max_new_tokens": 12, "details": True, "stop": ["e"]}}),
]


@pytest.mark.parametrize("path,body", CASES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(CASES)])
def test_greedy_equal_to_the_hybrid_instance(fleet, path, body):
    _, servers, coord = fleet
    hybrid = servers[2]
    direct = normal(httpx.post(hybrid.url + path, json=body, timeout=120))
    n = len(coord.settled_request_lines())  # no earlier request's line still to come
    computed = _pd(servers[1])["computedPromptTokens"]
    via = httpx.post(coord.url + path, json=body, timeout=120)
    assert direct[0] == 200, direct
    assert not close(normal(via), direct), (close(normal(via), direct), via.text[:800])
    (line,) = _lines_after(coord, n)
    # the handoff happened: prefill on instance 0, decode on 1 at the first attempt ...
    assert re.search(r"-> instance 1\(127\.0\.0\.1:\d+\) prefill 0\(\S+\) status 200 pd_load attempts 1 ", line), line
    m = re.search(r" pd transfer \S+ prefill_ms [\d.]+ prompt_tokens (\d+)", line)
    assert m and int(m.group(1)) > 1, line
    # ... and the prompt's KV came from the prefill instance: the decode instance computed only
    # the tail after its last whole 16-token block (the blocks moved are whole ones); with
    # kvLoadFailurePolicy fail a lost transfer would have been a 503 and a retry
    prompt = int(m.group(1))
    t0 = time.monotonic()
    while _pd(servers[1])["computedPromptTokens"] == computed and time.monotonic() - t0 < 10:
        time.sleep(0.1)  # the figure comes with the workers' heartbeats (later on a loaded machine)
    assert _pd(servers[1])["computedPromptTokens"] - computed == (prompt % 16 or 16), (_pd(servers[1]), prompt)


def test_prefill_refusal_is_the_answer(fleet):
    """A request the server refuses (422) comes back as the hybrid instance answers it."""
    _, servers, coord = fleet
    body = {"inputs": PROMPT, "parameters": {"top_p": 1.5}}
    direct = normal(httpx.post(servers[2].url + "/infer", json=body, timeout=60))
    via = httpx.post(coord.url + "/infer", json=body, timeout=60)
    assert direct[0] == 422 and normal(via) == direct


def test_hybrid_fallback_when_the_decode_instance_is_offline(fleet):
    _, servers, coord = fleet
    body = {"input_id": [5, 9, 13, 22, 31], "stream": False, "parameters": {"max_new_tokens": 6}}
    direct = normal(httpx.post(servers[2].url + "/infer_token", json=body, timeout=60))
    assert httpx.post(coord.manage + "/v1/instances/offline", json={"ids": [1]}, timeout=10).status_code == 200
    try:
        n = len(coord.settled_request_lines())  # no earlier request's line still to come
        via = httpx.post(coord.url + "/infer_token", json=body, timeout=60)
        assert normal(via) == direct
        (line,) = _lines_after(coord, n)
        assert re.search(r"-> instance 2\(\S+\) status 200 hybrid_load ", line), line
    finally:
        httpx.post(coord.manage + "/v1/instances/online", json={"ids": [1]}, timeout=10)
    coord.wait_state(1, "ready")


def _running(server: Server) -> int:
    return httpx.get(server.url + "/v2/status", timeout=10).json()["resource"]["runningRequestNum"]


def test_client_disconnect_cancels_on_the_decode_instance(fleet):
    _, servers, coord = fleet
    body = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 2000, "ignore_eos": True}}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", coord.url + "/infer", json=body) as r:
            it = r.iter_lines()
            next(it)
            t1 = time.monotonic()
            for _ in range(20):  # about 10 events
                next(it)
            step = (time.monotonic() - t1) / 10  # the time an event takes here now
            assert _running(servers[1]) == 1
    # the 2000 tokens would take hundreds of events: 5 s, or 150 events' time on a loaded machine
    bound = max(5.0, 150 * step)
    t0 = time.monotonic()
    while _running(servers[1]) and time.monotonic() - t0 < bound:
        time.sleep(0.05)
    assert _running(servers[1]) == 0, f"the decode instance still runs the request {bound:.1f} s after the client left"


def test_stalled_prefill_instance_is_retried_within_first_token_timeout(fleet):
    """SIGSTOP of every process of the prefill instance (a stalled link/box): a request handed to it
    is given up after first_token_timeout (its decode half cancelled) and served by the hybrid
    instance; nothing waits longer."""
    import os
    import signal

    from tests.harness import descendants
    tmp, servers, coord = fleet
    quick = Coordinator(tmp, servers, name="pd-quick",
                        config={"digs_scheduler_config": {"deploy_mode": "pd_separate"},
                                "http_config": {"pollIntervalMs": 5000},  # the request finds P ready
                                "exception_config": {"max_retry": 2, "first_token_timeout": 4, "infer_timeout": 60}})
    pids = [servers[0].proc.pid, *descendants(servers[0].proc.pid)]
    try:
        quick.wait_ready()
        t0 = time.monotonic()
        while [i["role"] for i in quick.info()["instances"]] != list(ROLES):
            assert time.monotonic() - t0 < 20, quick.info()
            time.sleep(0.2)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        body = {"input_id": [5, 9, 13, 22, 31], "stream": False, "parameters": {"max_new_tokens": 6}}
        t0 = time.monotonic()
        r = httpx.post(quick.url + "/infer_token", json=body, timeout=60)
        took = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert normal(r) == normal(httpx.post(servers[2].url + "/infer_token", json=body, timeout=60))
        assert 4 <= took < 15, took
        line = quick.wait_request_lines(1)[-1]
        assert "-> instance 2(" in line and "retries 0:prefill_timeout" in line, line
    finally:
        for pid in pids:
            with __import__("contextlib").suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        quick.stop()
    coord.wait_state(0, "ready", timeout=60)


def test_kill9_of_the_decode_instance_mid_stream(fleet):
    """Last: it kills the decode instance."""
    _, servers, coord = fleet
    body = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 2000, "ignore_eos": True}}
    got = bytearray()
    frames = threading.Event()
    done = threading.Event()

    def run():
        with httpx.stream("POST", coord.url + "/infer", json=body, timeout=60) as r:
            assert r.status_code == 200
            for chunk in r.iter_raw():
                got.extend(chunk)
                if got.count(b"data:") >= 3:
                    frames.set()
        done.set()
    t = threading.Thread(target=run)
    t.start()
    assert frames.wait(30), bytes(got)
    t_kill = time.monotonic()
    kill9(servers[1])
    t.join(60)
    assert done.is_set() and time.monotonic() - t_kill < 30
    last = json.loads([ln[5:] for ln in got.decode().split("\n") if ln.startswith("data:")][-1])
    assert last == {"error": last["error"], "error_type": "Incomplete Generation"}, last
    # no decode instance now: the next request is served whole by the hybrid instance
    coord.wait_state(1, "unreachable", timeout=30)
    n = len(coord.settled_request_lines())  # no earlier request's line still to come
    r = httpx.post(coord.url + "/infer_token", json={"input_id": [5, 9, 13], "parameters": {"max_new_tokens": 4}},
                   timeout=60)
    assert r.status_code == 200, r.text
    (line,) = _lines_after(coord, n)
    assert "-> instance 2(" in line and "hybrid_" in line, line


def _check_own_cores(fleet, plan: dict) -> None:
    """Each instance's processes, its device workers included, run on its planned cores only, and
    the instances' sets are disjoint (when the host has a core per instance)."""
    from tests.harness import descendants
    sets = [i["cpu_cores"] for i in plan["instances"]]
    if len(os.sched_getaffinity(0)) < len(sets):
        assert all(s == [] for s in sets), sets
        return
    assert all(sets) and not set(sets[0]) & set(sets[1]), sets
    for k, cores in enumerate(sets):
        (pid,) = re.findall(rf"instance i{k}: launch.sh pid (\d+)", fleet.out())
        procs = [int(pid), *descendants(int(pid))]
        workers = 0
        for p in procs:
            try:
                with open(f"/proc/{p}/status") as f:
                    allowed = next(ln.split()[1] for ln in f if ln.startswith("Cpus_allowed_list:"))
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    workers += b"workers" in f.read()
            except (OSError, StopIteration):
                continue  # a short-lived helper that is gone
            assert sorted(_cpus(allowed)) == cores, (k, p, allowed, cores)
        assert workers, f"instance i{k}: no worker process among {procs}"


def _cpus(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += range(int(a), int(b or a) + 1)
    return out


def test_motor_sh_starts_a_pd_fleet(tmp_path):
    """scripts/motor.sh with MindIE's PD user_config.json: 1 prefill + 1 decode instance behind the
    coordinator on predict_port; coordinator_info lists each with its role; a request through it
    goes prefill -> decode and equals the decode instance's own plain answer (greedy)."""
    from tests.coord_harness import MotorFleet, consecutive_free_ports
    from tests.test_pd_coordinator_deploy import pd_user_config
    from workers.models.demo import ensure_demo_model

    predict, manage = free_ports(2)
    base = consecutive_free_ports(4, avoid=(predict, manage))
    cfg = pd_user_config(tmp_path / "u.json", predict=predict, manage=manage, model=str(ensure_demo_model()))
    doc = json.loads(cfg.read_text())
    for k in ("mindie_server_prefill_config", "mindie_server_decode_config"):
        doc[k]["ServerConfig"]["port"] = base
    cfg.write_text(json.dumps(doc))
    fleet = MotorFleet(tmp_path, cfg, ready_timeout=240)
    try:
        ready = fleet.wait_ready(260)
        assert "i0 prefill http://" in ready and "i1 decode http://" in ready, ready
        info = httpx.get(f"http://127.0.0.1:{manage}/v1/coordinator_info", timeout=10).json()
        assert [(i["id"], i["role"], i["state"]) for i in info["instances"]] == [(0, "prefill", "ready"),
                                                                                (1, "decode", "ready")], info
        plan = fleet.plan()
        body = {"input_id": list(range(5, 45)), "stream": False, "parameters": {"max_new_tokens": 8}}
        r = httpx.post(f"http://127.0.0.1:{predict}/infer_token", json=body, timeout=120)
        direct = httpx.post(f"http://127.0.0.1:{plan['instances'][1]['business_port']}/infer_token", json=body,
                            timeout=120)
        assert r.status_code == 200 and r.json() == direct.json(), (r.text, direct.text)
        coord_log = open(plan["coordinator_log"], encoding="utf-8", errors="replace").read()
        line = [ln for ln in coord_log.splitlines() if "coordinator.request:" in ln][-1]
        assert re.search(r"-> instance 1\(\S+\) prefill 0\(\S+\) status 200 pd_", line), line
        _check_own_cores(fleet, plan)
        # decode instance loss (issue 52, finding 6): served whole by the prefill instance at once,
        # while motor.sh restarts the decode instance; readiness 200 and true
        (d_pid,) = re.findall(r"instance i1: launch.sh pid (\d+)", fleet.out())
        os.killpg(int(d_pid), signal.SIGKILL)
        t0 = time.monotonic()
        r = httpx.post(f"http://127.0.0.1:{predict}/infer_token", json=body, timeout=15)
        assert r.status_code == 200 and r.json() == direct.json() and time.monotonic() - t0 < 10, r.text
        assert httpx.get(f"http://127.0.0.1:{manage}/v1/readiness", timeout=5).status_code == 200
    finally:
        fleet.cleanup(grace=90)
