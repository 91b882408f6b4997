"""Issue 12 on the real launch script: MindIE's management plane (health, status, config,
stopService), the business plane's model queries, tokenizer and stopInfer, with the planes split
(three ports) and merged; bodies and statuses as mindie.md §2, §5, §6 give them."""
from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest

from mindie.text.detokenizer import load_tokenizer
from tests.harness import Server, alive, descendants, free_port, free_ports, short_run_dir, write_config

pytestmark = pytest.mark.timeout(600)

MAX_BATCH = 8
BLOCK = 16


@pytest.fixture(scope="module")
def split(tmp_path_factory, demo_model):
    """Three planes on three ports, two front ends, two CPU workers."""
    tmp = tmp_path_factory.mktemp("split")
    ports = free_ports(3)
    cfg = write_config(tmp / "config.json", port=ports[0], run_dir=short_run_dir(), model_path=demo_model,
                       server={"managementIpAddress": "127.0.0.1", "managementPort": ports[1],
                               "metricsPort": ports[2]},
                       schedule={"maxBatchSize": MAX_BATCH, "maxPrefillBatchSize": MAX_BATCH,
                                 "maxIterTimes": 2000})
    srv = Server(cfg, ports[0], frontends=2, health_url=f"http://127.0.0.1:{ports[1]}/health")
    try:
        srv.wait_ready(120)
        srv.biz = f"http://127.0.0.1:{ports[0]}"
        srv.mgmt = f"http://127.0.0.1:{ports[1]}"
        srv.metrics = f"http://127.0.0.1:{ports[2]}"
        # /health is ready once a front end has one worker, and each front end meets each worker on
        # its own: until both front ends count both workers, status figures depend on which answers.
        wait_for(lambda: all(httpx.get(srv.mgmt + "/v1/status", timeout=10).json()["resource"]["availSlotsNum"]
                             == 2 * MAX_BATCH for _ in range(20)), 60, "both front ends to count both workers")
        yield srv
    finally:
        srv.stop()


def infer_body(n_new: int, stream: bool = False, prompt=(5, 6, 7)) -> dict:
    return {"input_id": list(prompt), "stream": stream,
            "parameters": {"max_new_tokens": n_new, "ignore_eos": True, "details": True}}


def _wait_status(split, idle: dict, timeout: float = 10) -> None:
    """Until /v1/status is the idle one again: its figures come with the workers' heartbeats,
    a little after the answer."""
    wait_for(lambda: httpx.get(split.mgmt + "/v1/status", timeout=10).json()["resource"] == idle, timeout,
             f"/v1/status to be idle again: {idle}")


def wait_for(pred, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# -- planes ---------------------------------------------------------------------------------------
BUSINESS = [("POST", "/infer"), ("POST", "/infer_token"), ("GET", "/v1/models"), ("GET", "/v1/models/demo"),
            ("POST", "/v1/tokenizer"), ("GET", "/v2"), ("GET", "/v2/models/demo"), ("GET", "/v2/models/demo/config"),
            ("POST", "/v2/models/demo/stopInfer")]
# /info is on the management plane (MindIE) and also on the business plane (TGI clients ask it
# there): tests/test_tgi.py.
MANAGEMENT = [("GET", "/health"), ("GET", "/v2/health/live"), ("GET", "/v2/health/ready"),
              ("GET", "/v2/models/demo/ready"), ("GET", "/health/timed-3"), ("GET", "/v1/config"),
              ("GET", "/v1/status"), ("GET", "/v2/status"), ("GET", "/v2/models/demo/getSlotCount"),
              ("GET", "/metrics-json")]
METRICS = [("GET", "/metrics")]


def test_each_route_only_on_its_plane(split):
    planes = {"business": (split.biz, BUSINESS), "management": (split.mgmt, MANAGEMENT),
              "metrics": (split.metrics, METRICS)}
    for name, (url, routes) in planes.items():
        for other, (other_url, _) in planes.items():
            for method, path in routes:
                r = httpx.request(method, other_url + path, json={}, timeout=30)
                if other == name:
                    assert r.status_code != 404 or path.endswith("stopInfer"), (name, path, r.status_code, r.text)
                else:
                    assert r.status_code == 404, (name, other, path, r.status_code, r.text)
                    assert r.json()["error_type"] == "NotFoundError"


def test_a_probe_on_the_business_port_says_where_the_probes_live(split):
    """Issue 52 finding 9: /health and the other probes on the business port are 404s in MindIE's
    shape that name the management plane's address; so is a common probe name no plane serves."""
    mgmt = split.mgmt
    for path in ("/health", "/v2/health/ready", "/v2/health/live", "/v2/models/demo/ready", "/health/timed-3",
                 "/v1/status"):
        for method in ("GET", "HEAD", "POST"):
            r = httpx.request(method, split.biz + path, timeout=10)
            assert r.status_code == 404, (method, path, r.status_code)
            if method != "HEAD":
                body = r.json()
                assert body["error_type"] == "NotFoundError" and set(body) == {"error", "error_type"}
                assert f"{mgmt}{path}" in body["error"] and "managementPort" in body["error"], body
    r = httpx.get(split.biz + "/v1/health", timeout=10)
    assert r.status_code == 404 and mgmt in r.json()["error"] and "/v2/health/ready" in r.json()["error"], r.text
    # the other way round: the business routes named on the management port, /metrics on both
    r = httpx.post(mgmt + "/infer_token", json={"input_id": [5]}, timeout=10)
    assert r.status_code == 404 and f"{split.biz}/infer_token" in r.json()["error"], r.text
    r = httpx.get(split.biz + "/metrics", timeout=10)
    assert r.status_code == 404 and f"{split.metrics}/metrics" in r.json()["error"], r.text
    # an unknown path stays a plain 404
    r = httpx.get(split.biz + "/nothing-here", timeout=10)
    assert r.status_code == 404 and "plane" not in r.json()["error"], r.text


# -- health ---------------------------------------------------------------------------------------
def test_health_routes_when_healthy(split):
    for path in ("/health", "/v2/health/live", "/v2/health/ready", "/v2/models/demo/ready"):
        r = httpx.get(split.mgmt + path, timeout=10)
        assert (r.status_code, r.content) == (200, b""), (path, r.text)
    r = httpx.get(split.mgmt + "/v2/models/nope/ready", timeout=10)
    assert r.status_code == 404
    assert r.json() == {"error": "Model nope not found.", "error_type": "NotFoundError"}


def test_timed_health_runs_a_real_inference(split):
    for path in ("/health/timed-3", "/health/timed", "/health/timed-600", "/health/timed-1"):
        r = httpx.get(split.mgmt + path, timeout=20)
        assert (r.status_code, r.json()) == (200, {"status": "healthy"}), (path, r.text)
    range_msg = "Wait time should be in range of [1, 600], input is not valid"
    for n, msg in (("0", range_msg), ("601", range_msg), ("abc", range_msg), ("-5", range_msg), ("1.5", range_msg),
                   ("1000", "Max wait time is 600, input is invalid or too long"),
                   ("0003", "Max wait time is 600, input is invalid or too long")):
        r = httpx.get(f"{split.mgmt}/health/timed-{n}", timeout=10)
        assert r.status_code == 404, (n, r.text)
        assert r.json() == {"error": msg, "error_type": "NotFoundError"}, n


# -- status and config ----------------------------------------------------------------------------
def test_status_routes_idle(split):
    st = httpx.get(split.mgmt + "/v1/status", timeout=10).json()
    assert list(st) == ["service", "resource", "linkStatus", "pd"]  # pd: project extension (mindie/api/pd_role.py)
    assert st["service"] == {"roleStatus": "RoleReady", "currentRole": "flex"}
    res = st["resource"]
    assert list(res) == ["availSlotsNum", "availBlockNum", "waitingRequestNum", "runningRequestNum",
                         "swappedRequestNum", "freeNpuBlockNums", "freeCpuBlockNums", "totalNpuBlockNums",
                         "totalCpuBlockNums"]
    assert res["availSlotsNum"] == 2 * MAX_BATCH  # two workers
    assert res["runningRequestNum"] == res["waitingRequestNum"] == res["swappedRequestNum"] == 0
    assert res["totalNpuBlockNums"] > 0 and res["freeNpuBlockNums"] == res["totalNpuBlockNums"] == res["availBlockNum"]
    v2 = httpx.get(split.mgmt + "/v2/status", timeout=10).json()["resource"]
    assert sorted(v2["dpInstMap"]) == ["0", "1"]
    assert sum(v2["dpInstMap"].values()) == v2["totalAvailNpuBlockNum"] == res["totalNpuBlockNums"]
    assert v2["maxAvailNpuBlockNum"] == max(v2["dpInstMap"].values())
    slots = httpx.get(split.mgmt + "/v2/models/demo/getSlotCount", timeout=10).json()
    assert slots == {"total_slots": 2 * MAX_BATCH, "free_slots": 2 * MAX_BATCH,
                     "available_tokens_length": res["totalNpuBlockNums"] * BLOCK}
    assert httpx.get(split.mgmt + "/v2/models/x/getSlotCount", timeout=10).status_code == 404
    cfg = httpx.get(split.mgmt + "/v1/config", timeout=10).json()
    engine = cfg.pop("engine")  # project extension: the plan's engine settings, as settled
    workers = cfg.pop("workers")  # project extension: each worker's device and the CPU kernels it chose
    assert [w["workerId"] for w in workers] == sorted(w["workerId"] for w in workers) and len(workers) == 2, workers
    assert all(w["device"].startswith("cpu (") and "kernels: isa=" in w["device"] and "decode attention=" in w["device"]
               for w in workers), workers
    assert cfg == {"modelName": "demo", "maxSeqLen": 2560, "npuMemSize": -1, "cpuMemSize": 1, "worldSize": 0,
                   "maxOutputLen": 2000, "cacheBlockSize": BLOCK,
                   # prefill/decode role (mindie/api/pd_role.py): MindIE's inferMode, then project extensions
                   "inferMode": "standard", "pdRole": "flex", "currentRole": "flex"}
    assert engine["block_size"] == BLOCK and engine["max_batch_size"] == MAX_BATCH
    assert None not in (engine["overlap"], engine["prefill_chunk_tokens"], engine["decode_hold_ms"],
                        engine["cpu"]["native_bf16"], engine["cpu"]["fused_decode_rows"])
    assert engine["cpu"]["kernels"] is True and engine["gc_freeze"] is True and engine["tp_collective_timeout_s"] == 30
    info = httpx.get(split.mgmt + "/info", timeout=10).json()
    assert info["max_concurrent_requests"] == MAX_BATCH and info["max_input_length"] == 2048
    assert info["models"][0]["model_id"] == "demo" and info["models"][0]["max_total_tokens"] == 2560
    assert info["models"][0]["model_device_type"] == "cpu" and info["version"] == "1.0.0"


def test_status_follows_a_running_request(split):
    """Filled from the workers' live state: a long stream shows as running with blocks taken,
    and everything is back within a step of its end."""
    idle = httpx.get(split.mgmt + "/v1/status", timeout=10).json()["resource"]
    assert idle["availSlotsNum"] == 2 * MAX_BATCH
    stop, ended = threading.Event(), threading.Event()

    def run():
        # Long enough to outlast the checks on a fast CPU (the demo model makes 300 tokens in 0.2 s);
        # left early once they are done.
        with httpx.stream("POST", split.biz + "/infer", json=infer_body(1900, stream=True), timeout=60) as r:
            for _ in r.iter_bytes():
                if stop.is_set():
                    break
        ended.set()

    t = threading.Thread(target=run)
    t.start()
    try:
        res = wait_for(lambda: (lambda r: r if r["runningRequestNum"] == 1 else None)(
            httpx.get(split.mgmt + "/v1/status", timeout=10).json()["resource"]), 20, "a running request")
        assert res["freeNpuBlockNums"] < idle["freeNpuBlockNums"] and res["availSlotsNum"] == 2 * MAX_BATCH - 1
        slots = httpx.get(split.mgmt + "/v2/models/demo/getSlotCount", timeout=10).json()
        assert slots["free_slots"] == 2 * MAX_BATCH - 1
    finally:
        stop.set()
        t.join(60)
    assert ended.is_set()
    _wait_status(split, idle, timeout=30)


def test_business_model_queries(split):
    assert httpx.get(split.biz + "/v2", timeout=10).json() == {
        "name": "MindIE Server", "version": "1.0.0",
        "extensions": {"max_iter_times": 2000, "prefill_policy_type": 0, "decode_policy_type": 0,
                       "max_prefill_batch_size": MAX_BATCH, "max_prefill_tokens": 4096}}
    assert httpx.get(split.biz + "/v2/models/demo", timeout=10).json() == {
        "name": "demo", "platform": "MindIE Server", "inputs": [{"name": "input0", "shape": [-1], "datatype": "UINT32"}],
        "outputs": [{"name": "output0", "shape": [-1], "datatype": "UINT32"}]}
    c = httpx.get(split.biz + "/v2/models/demo/config", timeout=10).json()
    assert list(c) == ["model_name", "input_datatype", "output_datatype", "max_seq_len", "npu_mem_size",
                       "cpu_mem_size", "world_size", "model_weight_path", "model_instance_type"]
    assert c["model_name"] == "demo" and c["max_seq_len"] == 2560 and "/" not in c["model_weight_path"]
    for path in ("/v2/models/other", "/v2/models/other/config"):
        r = httpx.get(split.biz + path, timeout=10)
        assert r.status_code == 404 and r.json() == {"error": "Model other not found.", "error_type": "NotFoundError"}


def test_tokenizer_counts_tokens(split, demo_model):
    tok = load_tokenizer(demo_model)
    text = "What is deep learning? 深度学习是什么"
    r = httpx.post(split.biz + "/v1/tokenizer", json={"inputs": text}, timeout=10)
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tok.encode(text)
    assert body["token_number"] == len(ids)  # what /infer is given for this text, BOS included
    # every token listed (the BOS as its text), except the bytes of one character merged into it
    # (MindIE: the only reason for fewer tokens than token_number)
    assert "".join(body["tokens"]) == tok.tokenizer.decode(ids, skip_special_tokens=False)
    assert body["tokens"][0] == "<s>" and ids[0] in tok.special_ids
    assert len(body["tokens"]) < len(ids)  # the CJK characters take several tokens each
    # the case: "Hello world" is three tokens (BOS, two words), all three listed
    ascii_ids = tok.encode("Hello world")
    r = httpx.post(split.biz + "/v1/tokenizer", json={"inputs": "Hello world"}, timeout=10)
    assert r.json() == {"token_number": len(ascii_ids), "tokens": ["<s>", "Hello", " world"]}
    assert len(ascii_ids) == 3
    # the count is what a generation is given: TGI's details.prompt_tokens for the same text
    g = httpx.post(split.biz + "/generate", json={"inputs": "Hello world", "parameters": {"max_new_tokens": 1,
                                                                                         "details": True}},
                   timeout=30)
    assert g.json()["details"]["prompt_tokens"] == r.json()["token_number"]
    r = httpx.post(split.biz + "/v1/tokenizer", json={"inputs": text, "do_decode": False}, timeout=10)
    assert r.json() == {"token_number": len(ids), "tokens": ids}
    for bad, msg in ((b"{", "Req body converts to json fail."), (b"{}", "Inputs in request body is invalid."),
                     (b'{"inputs": 5}', "Inputs in request body is invalid."),
                     (b'{"inputs": ""}', "Inputs in request body is invalid.")):
        r = httpx.post(split.biz + "/v1/tokenizer", content=bad, timeout=10)
        assert r.status_code == 422 and r.json() == {"error": msg, "error_type": "Input Validation Error"}, bad


# -- stopInfer -----------------------------------------------------------------------------------
def test_stop_infer_ends_a_long_stream_at_once(split):
    """A stream named by its req-id header is ended by stopInfer (sent to the business plane, on
    whichever front end): its final frame comes at once, and its blocks are free again."""
    idle = httpx.get(split.mgmt + "/v1/status", timeout=10).json()["resource"]
    frames: list[bytes] = []
    headers: dict = {}
    t_end: list[float] = []

    def run():
        with httpx.stream("POST", split.biz + "/infer", json=infer_body(1900, stream=True),
                          headers={"req-id": "long-stream_1"}, timeout=120) as r:
            headers.update(r.headers)
            for chunk in r.iter_bytes():
                frames.append(chunk)
        t_end.append(time.monotonic())

    t = threading.Thread(target=run)
    t.start()
    wait_for(lambda: frames, 30, "a frame")
    t1 = time.monotonic()
    wait_for(lambda: len(b"".join(frames).split(b"data:")) > 20, 30, "20 frames")
    step = (time.monotonic() - t1) / 20  # a frame's time here now
    for _ in range(2):  # from both front ends (connections are spread by the kernel)
        r = httpx.post(split.biz + "/v2/models/demo/stopInfer", json={"id": "other-id"}, timeout=10)
        assert r.status_code == 404
        assert r.json() == {"error": "RequestId is other-id not found.", "error_type": "NotFoundError"}
    t0 = time.monotonic()
    body = b'{"id": "long-stream_1"}'
    r = httpx.post(split.biz + "/v2/models/demo/stopInfer", content=body, timeout=10)
    assert r.status_code == 200 and r.content == body, r.text  # MindIE echoes the body
    t.join(30)
    # the rest would take well over 1000 frames (hundreds with speculation): 2 s, or 100 frames'
    # time where a loaded machine makes frames slow
    assert t_end and t_end[0] - t0 < max(2.0, 100 * step), ("the stream did not end at once", t_end[0] - t0, step)
    assert headers.get("req-id") == "long-stream_1"
    data = b"".join(frames)
    last = json.loads(data.strip().split(b"data: ")[-1])
    assert last["details"]["finish_reason"] == "stop_sequence"
    assert last["details"]["generated_tokens"] < 1900
    _wait_status(split, idle)  # blocks freed
    # Gone now: a second stop finds nothing.
    r = httpx.post(split.biz + "/v2/models/demo/stopInfer", content=body, timeout=10)
    assert r.status_code == 404


def test_stop_infer_generated_id_and_errors(split):
    """Without a req-id header the server makes one and returns it in the response header (a
    stream has it before its first frame); stopInfer takes that id. Bad bodies get MindIE's
    messages."""
    ended: list = []

    with httpx.stream("POST", split.biz + "/infer", json=infer_body(1900, stream=True), timeout=120) as r:
        rid = r.headers["req-id"]
        assert len(rid) >= 8
        it = r.iter_bytes()
        next(it)
        stop = httpx.post(split.biz + "/v2/models/demo/stopInfer", json={"id": rid}, timeout=10)
        assert stop.status_code == 200, stop.text
        rest = b"".join(it)
        ended.append(json.loads(rest.strip().split(b"data: ")[-1]))
    assert ended[0]["details"]["finish_reason"] == "stop_sequence"
    ok = httpx.post(split.biz + "/infer", json=infer_body(1), timeout=30)
    assert ok.status_code == 200 and len(ok.headers["req-id"]) >= 8 and ok.headers["req-id"] != rid
    id_msg = ("The id can contain only digits, letters, underscores(_), hyphens(-) and no more than 256 words "
              "in length.")
    for body, msg in ((b'{"x": 1}', "Not found id."), (b'{"id": null}', "Not found id."), (b'{"id": "a b"}', id_msg),
                      (('{"id": "%s"}' % ("a" * 257)).encode(), id_msg), (b'{"id": 5}', id_msg),
                      (b"{", "Failed to parse request context to json")):
        r = httpx.post(split.biz + "/v2/models/demo/stopInfer", content=body, timeout=10)
        assert (r.status_code, r.json()) == (422, {"error": msg, "error_type": "Input Validation Error"}), body
    r = httpx.post(split.biz + "/v2/models/nope/stopInfer", json={"id": "x"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"] == "Model nope not found."
    bad = httpx.post(split.biz + "/infer", json=infer_body(1), headers={"req-id": "bad id!"}, timeout=10)
    assert bad.status_code == 422 and bad.json()["error_type"] == "Input Validation Error"


def test_timed_health_fails_when_workers_stall(split):
    """Last on this server: the workers are stopped (SIGSTOP) so /health/timed-2 cannot finish
    its inference: 500 within the wait; they resume and it is healthy again."""
    import signal
    workers = split.workers()
    assert len(workers) == 2
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = httpx.get(split.mgmt + "/health/timed-2", timeout=10)
        took = time.monotonic() - t0
        assert r.status_code == 500, r.text
        assert r.json()["error_type"] == "Incomplete Generation"
        assert took < 5.0  # the 2 s wait and the answer; a hang would run into the 10 s timeout
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
    wait_for(lambda: httpx.get(split.mgmt + "/health/timed-3", timeout=10).status_code == 200, 30, "healthy again")


# -- BUSY and /stopService, planes merged ------------------------------------------------------
def test_busy_then_stop_service_drains_16_streams(tmp_path, demo_model):
    port = free_port()
    cfg = write_config(tmp_path / "config.json", port=port, run_dir=short_run_dir(), model_path=demo_model,
                       workers=1, schedule={"maxBatchSize": 4, "maxPrefillBatchSize": 4},
                       server={"drainTimeoutS": 300})  # every stream must finish, however slow the machine
    srv = Server(cfg, port, frontends=2)
    try:
        srv.wait_ready(120)
        pids = descendants(srv.proc.pid)
        url = srv.url
        n_new = 300
        results: list = [None] * 16

        def run(i):
            with httpx.stream("POST", url + "/infer", json=infer_body(n_new, stream=True, prompt=(5, 6, 7 + i)),
                              timeout=120) as r:
                results[i] = (r.status_code, b"".join(r.iter_bytes()))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        # BUSY: the one worker's 4 slots are taken and 12 requests wait.
        r = wait_for(lambda: (lambda r: r if r.status_code == 503 else None)(
            httpx.get(url + "/v2/health/ready", timeout=10)), 30, "readiness to say BUSY")
        assert r.json() == {"message": "Service is alive but busy. Consider reducing request frequency"}
        live = httpx.get(url + "/v2/health/live", timeout=10)
        assert (live.status_code, live.json()) == (200, {"message": "Service is alive but busy"})
        assert httpx.get(url + "/health/timed-3", timeout=10).json() == {"status": "healthy"}
        assert httpx.get(url + "/health", timeout=10).status_code == 200

        stop: dict = {}

        def call_stop():
            stop["r"] = httpx.get(url + "/stopService", timeout=120)
            stop["t"] = time.monotonic()

        st = threading.Thread(target=call_stop)
        st.start()
        stopped = {"error": "The service has been stopped.", "error_type": "Service Unavailable"}
        # /health says so as soon as the flag is set (an inference sent before that would queue
        # behind the 16 streams); from then on every front end refuses new inference.
        r = wait_for(lambda: (lambda r: r if r.status_code == 503 else None)(
            httpx.get(url + "/health", timeout=10)), 10, "/health to say stopped")
        assert r.json() == stopped
        for _ in range(4):
            r = httpx.post(url + "/infer", json=infer_body(2), timeout=10)
            assert (r.status_code, r.json()) == (503, stopped)
        assert httpx.get(url + "/v2/health/ready", timeout=10).status_code == 503
        assert httpx.get(url + "/health/timed-3", timeout=10).json() == {"status": "healthy"}
        second = httpx.get(url + "/stopService", timeout=10)
        assert (second.status_code, second.content) == (500, b"")
        assert st.is_alive(), "stopService returned before the streams finished"
        for t in threads:
            t.join(120)
        st.join(60)
        t_streams_done = time.monotonic()
        assert stop["r"].status_code == 200
        assert stop["t"] <= t_streams_done
        for status, data in results:
            assert status == 200
            last = json.loads(data.strip().split(b"data: ")[-1])
            assert last["details"]["generated_tokens"] == n_new and last["details"]["finish_reason"] == "length"
        # Then every process of the server exits, the launcher with status 0.
        srv.proc.wait(60)
        assert srv.proc.returncode == 0, srv.tail()
        assert len(pids) >= 5 and not [p for p in pids if alive(p)]
    finally:
        srv.stop()
