"""Faults under the coordinator, on real processes (two instances started by scripts/launch.sh,
the coordinator process, loopback): an instance that hangs before its first token
(first_token_timeout: retried elsewhere), an instance whose front end dies mid-stream (the stream
ends with an error frame in its API's shape), an instance killed with SIGKILL (requests retried,
the circuit breaker isolates it, and takes it back after it restarts)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

from tests.coord_harness import Coordinator, kill9, start_instances
from tests.harness import Server, process_roles

PROMPT = "The quick brown fox jumps over the lazy dog and then"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    servers = start_instances(tmp, 2)
    try:
        yield tmp, servers
    finally:
        for s in servers:
            s.stop()


def frontend_pid(server: Server) -> int:
    return next(p for p, r in process_roles(server.launcher_pid()).items() if r == "frontend")


def serving(coord: Coordinator, timeout: float = 10) -> int:
    """The id of the instance with a request of this coordinator in flight."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        busy = [i["id"] for i in coord.info()["instances"] if i["inflight"]]
        if busy:
            return busy[0]
        time.sleep(0.02)
    raise TimeoutError("no request in flight")


def wait_health(server: Server, timeout: float = 60) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(server.tail())


STREAMS = {
    "native": ("/infer", {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 400, "ignore_eos": True}}),
    "openai": ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": PROMPT}],
                                        "max_tokens": 400, "ignore_eos": True, "stream": True}),
    "tgi": ("/generate_stream", {"inputs": PROMPT, "parameters": {"max_new_tokens": 400}}),
    "vllm": ("/generate", {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}),
    "triton": ("/v2/models/demo/generate_stream", {"id": "x", "text_input": PROMPT,
                                                   "parameters": {"max_new_tokens": 400}}),
}


def last_frame(family: str, raw: bytes):
    if family == "vllm":
        return json.loads([f for f in raw.split(b"\0") if f.strip()][-1])
    events = [ln[5:].strip() for ln in raw.decode().split("\n") if ln.startswith("data:")]
    if family == "openai":
        assert events[-1] == "[DONE]"
        return json.loads(events[-2])
    return json.loads(events[-1])


@pytest.mark.parametrize("family", list(STREAMS))
def test_error_frame_when_the_instance_dies_mid_stream(fleet, family):
    tmp, servers = fleet
    coord = Coordinator(tmp, servers, name=f"mid-{family}")
    try:
        coord.wait_ready()
        path, body = STREAMS[family]
        got = bytearray()
        frames = threading.Event()

        def run():
            with httpx.stream("POST", coord.url + path, json=body, timeout=60) as r:
                assert r.status_code == 200
                for chunk in r.iter_raw():
                    got.extend(chunk)
                    if got.count(b"data:") >= 3 or got.count(b"\0") >= 3:
                        frames.set()
        t = threading.Thread(target=run)
        t.start()
        assert frames.wait(30), bytes(got)
        victim = servers[serving(coord)]
        os.kill(frontend_pid(victim), signal.SIGKILL)  # the front end holding the stream dies
        t.join(60)
        assert not t.is_alive()
        last = last_frame(family, bytes(got))
        if family == "native":
            assert last == {"error": last["error"], "error_type": "Incomplete Generation"}, last
        elif family == "openai":
            assert last["error"]["code"] == 500 and last["error"]["type"] == "InternalServerError", last
        else:
            assert last["error_type"] == "Incomplete Generation" and "first token" in last["error"], last
        text = httpx.get(coord.manage + "/metrics", timeout=10).text
        assert re.search(r"^coordinator_streams_cut_total 1", text, re.M)
        line = coord.wait_request_lines(1)[-1]
        assert "instance failed mid-stream" in line, line
    finally:
        coord.stop()
        for s in servers:
            wait_health(s)  # gunicorn replaced the front end


def test_first_token_timeout_retries_elsewhere(fleet):
    """A stopped instance accepts the connection and never answers: after first_token_timeout
    the request goes to the other instance, and the client gets its answer."""
    tmp, servers = fleet
    coord = Coordinator(tmp, servers, name="ftt", config={
        "http_config": {"pollIntervalMs": 60000}, "exception_config": {"first_token_timeout": 2}})
    body = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 4}}
    stopped = None
    try:
        coord.wait_ready()
        # The instance that took a probe is stopped: the router picks it again next (the last poll's
        # load favours it) or, on a tie, the other one and then it (least recently picked).
        assert httpx.post(coord.url + "/infer", json=body, timeout=30).status_code == 200
        k = int(re.search(r"-> instance (\d+)\(", coord.wait_request_lines(1)[-1]).group(1))
        stopped = frontend_pid(servers[k])
        os.kill(stopped, signal.SIGSTOP)
        for _ in range(2):
            r = httpx.post(coord.url + "/infer", json=body, timeout=30)
            assert r.status_code == 200 and r.text.count("data:") == 4, r.text
        lines = [ln for ln in coord.wait_request_lines(3) if "retries" in ln]
        assert lines, coord.request_lines()
        for ln in lines:
            assert f"retries {k}:first_token_timeout" in ln and f"-> instance {1 - k}(" in ln, ln
            assert float(re.search(r"duration_ms (\S+)", ln).group(1)) >= 2000
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        coord.stop()


def test_kill9_instance_retry_breaker_and_probe_back(fleet):
    """SIGKILL of a whole instance: every request still succeeds (retried on the other one), the
    circuit breaker isolates the dead instance, and after it is started again a half-open trial
    puts it back. (Polling is slowed so the breaker, not the poller, is what acts.)"""
    tmp, servers = fleet
    coord = Coordinator(tmp, servers, name="k9i", config={
        "http_config": {"pollIntervalMs": 60000},
        "exception_config": {"max_retry": 1, "breakerFailures": 2, "breakerOpenMs": 8000}})
    try:
        coord.wait_ready()
        kill9(servers[0])
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}
        for i in range(3):  # well within breakerOpenMs: the open breaker keeps them off instance 0
            r = httpx.post(coord.url + "/infer", json=body, timeout=30)
            assert r.status_code == 200, (i, r.text)
            r = httpx.post(coord.url + "/v1/chat/completions", json={
                "model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True},
                timeout=30)
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
        lines = coord.wait_request_lines(6)
        assert all("-> instance 1(" in ln and " status 200 " in ln for ln in lines), lines
        assert sum("retries 0:connect" in ln for ln in lines) == 2, lines  # then the breaker opened
        assert [i["state"] for i in coord.info()["instances"]][0] == "isolated"
        text = httpx.get(coord.manage + "/metrics", timeout=10).text
        assert re.search(r'^coordinator_breaker_trips_total\{instance="0"\} 1', text, re.M)
        assert re.search(r'^coordinator_retries_total\{reason="connect"\} 2', text, re.M)
        # the instance comes back on its port: the half-open trial request closes the breaker
        servers[0] = Server(servers[0].log_path.parent / "config.json", servers[0].port)
        servers[0].wait_ready(180)
        coord.wait_state(0, "probing", timeout=15)
        for _ in range(2):
            assert httpx.post(coord.url + "/infer", json=body, timeout=30).status_code == 200
        coord.wait_state(0, "ready", timeout=10)
        assert "-> instance 0(" in " ".join(coord.wait_request_lines(8)[-2:])
    finally:
        coord.stop()


def test_stop_service_drains_the_fleet(fleet):
    """GET /stopService on the coordinator's manage port: new requests get 503 at once, the stream
    in flight finishes, every instance drains and stops, then the coordinator exits 0. (Last in
    this module: it stops the instances.)"""
    tmp, servers = fleet
    coord = Coordinator(tmp, servers, name="stop")
    try:
        coord.wait_ready()
        got = bytearray()
        started = threading.Event()

        def run():
            body = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 300, "ignore_eos": True}}
            with httpx.stream("POST", coord.url + "/infer", json=body, timeout=60) as r:
                for chunk in r.iter_raw():
                    got.extend(chunk)
                    started.set()
        t = threading.Thread(target=run)
        t.start()
        assert started.wait(30)
        out = {}
        stopper = threading.Thread(target=lambda: out.setdefault("r", httpx.get(coord.manage + "/stopService", timeout=90)))
        stopper.start()
        # once /stopService has arrived (readiness says so; later than a guessed 0.3 s on a loaded
        # machine) new requests are refused while the stream runs on
        t0 = time.monotonic()
        while httpx.get(coord.manage + "/v1/readiness", timeout=10).status_code != 503:
            assert time.monotonic() - t0 < 20, "readiness still 200 after /stopService"
            time.sleep(0.02)
        r = httpx.post(coord.url + "/infer", json={"inputs": "a"}, timeout=10)
        assert r.status_code == 503 and r.json()["error"] == "The service has been stopped.", r.text
        stopper.join(90)
        t.join(60)
        assert out["r"].status_code == 200
        assert got.count(b"data:") == 300 and b'"generated_text"' in got  # the stream ended whole
        assert coord.proc.wait(30) == 0
        for s in servers:
            s.proc.wait(60)  # its exit status is the server's business (tests/test_stop.py)
            assert "/stopService: asked the launcher" in s.tail(400), s.tail(15)
    finally:
        coord.stop()
