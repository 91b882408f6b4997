"""The coordinator (coordinator/) in front of two real server instances (scripts/launch.sh,
demo model, loopback): every API family through it gives what the instance gives directly
(stream and not), routing (load_balance, cache_affinity), the manage API (refresh, offline,
online, readiness, coordinator_info, aggregated /metrics), request_limit refusals, and a
kill -9'd coordinator restarted. Faults of instances: tests/test_coordinator_faults.py."""
from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from tests.coord_harness import Coordinator, start_instances

PROMPT = "The quick brown fox jumps over the lazy dog and then"
VOLATILE = {"id", "created", "prefill_time", "decode_time", "system_fingerprint", "queue_time",
            "inference_time", "first_token_time", "time_per_output_token", "seed"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fleet")
    # maxIterTimes above the 2000-token streams the tests hold open (the harness default is 512)
    servers = start_instances(tmp, 2, schedule={"maxIterTimes": 2400})
    coord = Coordinator(tmp, servers, name="lb")
    try:
        coord.wait_ready_line()
        coord.wait_ready()
        yield tmp, servers, coord
    finally:
        coord.stop()
        for s in servers:
            s.stop()


def _strip(x):
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if k not in VOLATILE}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    return x


def normal(r: httpx.Response):
    """The answer without what differs between two runs (ids, timings): parsed JSON, or the list
    of a stream's frames (SSE ``data:`` events or vLLM's NUL-ended JSON)."""
    text = r.text
    ctype = r.headers.get("content-type", "")
    if "event-stream" in ctype or text.startswith("data:"):
        frames = [ln[5:].strip() for ln in text.split("\n") if ln.startswith("data:")]
        return r.status_code, [_strip(json.loads(f)) if f.startswith("{") else f for f in frames]
    if "\0" in text:
        return r.status_code, [_strip(json.loads(f)) for f in text.split("\0") if f.strip()]
    try:
        return r.status_code, _strip(r.json())
    except ValueError:
        return r.status_code, text


def same_answer(a, b) -> bool:
    """Equal answers, embedding vectors within 1e-5: the two inputs of an embeddings request are two
    sequences, in one step or in two depending on when each reaches the worker, and a step's row
    count changes the last bits of its products (docs/design.md: batch invariance)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_answer(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_answer(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-5
    return a == b


CASES = [
    ("/infer", {"inputs": PROMPT, "stream": False, "parameters": {"max_new_tokens": 8, "details": True}}),
    ("/infer", {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 8}}),
    ("/infer_token", {"input_id": [5, 9, 13, 22, 31], "stream": False, "parameters": {"max_new_tokens": 6}}),
    ("/infer_token", {"input_id": [5, 9, 13, 22, 31], "stream": True, "parameters": {"max_new_tokens": 6}}),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": PROMPT}],
                              "max_tokens": 8, "temperature": 0}),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": PROMPT}],
                              "max_tokens": 8, "temperature": 0, "stream": True}),
    ("/v1/completions", {"model": "demo", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}),
    ("/v1/completions", {"model": "demo", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}),
    ("/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 8, "details": True}}),
    ("/generate_stream", {"inputs": PROMPT, "parameters": {"max_new_tokens": 8}}),
    ("/", {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 4}}),
    ("/generate", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}),
    ("/generate", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}),
    ("/v2/models/demo/infer", {"id": "t1", "inputs": [{"name": "input0", "shape": [1, 5], "datatype": "UINT32",
                                                        "data": [5, 9, 13, 22, 31]}],
                               "outputs": [{"name": "output0"}], "parameters": {"max_new_tokens": 6}}),
    ("/v2/models/demo/generate", {"id": "g1", "text_input": PROMPT, "parameters": {"max_new_tokens": 6}}),
    ("/v2/models/demo/generate_stream", {"id": "s1", "text_input": PROMPT, "parameters": {"max_new_tokens": 6}}),
    ("/v1/tokenizer", {"inputs": PROMPT}),
    ("/v1/messages", {"model": "demo", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
                      "temperature": 0}),
    ("/v1/messages", {"model": "demo", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
                      "temperature": 0, "stream": True}),
    ("/v1/messages/count_tokens", {"model": "demo", "messages": [{"role": "user", "content": PROMPT}]}),
    ("/v1/messages", {"model": "nope", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8}),
    ("/infer", {"inputs": PROMPT, "parameters": {"top_p": 1.5}}),  # an instance's 422, passed through
    ("/v1/embeddings", {"model": "demo", "input": [PROMPT, "hi"], "encoding_format": "float"}),  # no PD handoff
    ("/v1/embeddings", {"model": "demo", "input": "x", "dimensions": 8}),  # an instance's 400, in OpenAI's shape
    # the demo model cannot rerank: the instance's 400 (Cohere's shape; /score's OpenAI's), relayed
    ("/v2/rerank", {"model": "demo", "query": PROMPT, "documents": ["a", "b"]}),
    ("/score", {"model": "demo", "text_1": PROMPT, "text_2": ["a"]}),
]


@pytest.mark.parametrize("path,body", CASES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(CASES)])
def test_same_answer_as_the_instance(fleet, path, body):
    _, servers, coord = fleet
    direct = normal(httpx.post(servers[0].url + path, json=body, timeout=60))
    via = httpx.post(coord.url + path, json=body, timeout=60)
    assert same_answer(normal(via), direct), via.text[:500]
    assert via.headers.get("content-type") == httpx.post(servers[1].url + path, json=body,
                                                         timeout=60).headers.get("content-type")
    assert via.headers.get("server") == "MindIE-MS"
    # Date is a singleton field (RFC 9110 6.6.1): the coordinator's, not the instance's as well
    assert len(via.headers.get_list("date")) == 1, via.headers


def test_get_routes_and_unknown_route(fleet):
    _, servers, coord = fleet
    for path in ("/v1/models", "/info", "/v2", "/v2/models/demo", "/v2/models/demo/config"):
        r = httpx.get(coord.url + path, timeout=10)
        assert r.status_code == 200, (path, r.text)
        got = normal(r)
        if path == "/v1/models":  # the fleet's list: the instance's, with how many instances serve each model
            assert [m.pop("instances") for m in got[1]["data"]] == [2], got
        assert got == normal(httpx.get(servers[0].url + path, timeout=10)), path
    r = httpx.post(coord.url + "/no/such/route", json={}, timeout=10)
    assert r.status_code == 404 and r.json()["error_type"] == "NotFoundError"
    # an unknown /v1/... path in OpenAI's shape (what OpenAI clients read), as the server answers it
    r = httpx.post(coord.url + "/v1/no/such/route", json={}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError" and r.json()["error"]["code"] == 404
    r = httpx.get(coord.url + "/infer", timeout=10)
    assert r.status_code == 405 and set(r.json()) == {"error", "error_type"}


def test_responses_through_the_coordinator(fleet):
    """OpenAI's Responses API relayed: the same answer and stream as the instance gives; GET and
    DELETE /v1/responses/{id} reach an instance (its 404 for an id it does not hold, in OpenAI's
    shape, not the coordinator's "not a route")."""
    _, servers, coord = fleet
    body = {"model": "demo", "input": PROMPT, "max_output_tokens": 8, "temperature": 0, "store": False}
    direct = httpx.post(servers[0].url + "/v1/responses", json=body, timeout=60).json()
    via = httpx.post(coord.url + "/v1/responses", json=body, timeout=60)
    assert via.status_code == 200 and via.headers.get("server") == "MindIE-MS", via.text
    assert [o["content"] for o in via.json()["output"]] == [o["content"] for o in direct["output"]]
    assert via.json()["usage"] == direct["usage"]
    stream = httpx.post(coord.url + "/v1/responses", json={**body, "stream": True}, timeout=60)
    names = [ln[7:] for ln in stream.text.split("\n") if ln.startswith("event: ")]
    assert names[0] == "response.created" and names[-1] in ("response.completed", "response.incomplete"), names
    for method in ("GET", "DELETE"):
        r = httpx.request(method, coord.url + "/v1/responses/resp_unknown", timeout=10)
        assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError", r.text
        assert "resp_unknown" in r.json()["error"]["message"], r.text


def test_anthropic_messages_through_the_coordinator(fleet):
    """Item 6 of issue 54: the anthropic package against the coordinator gets what the instance
    gives, its errors in Anthropic's shape (an instance's 404 relayed; the coordinator's own
    refusals of the family in that shape too), and a conversation's turns stay on one instance
    under cache_affinity, as chat conversations do."""
    anthropic = pytest.importorskip("anthropic")
    tmp, servers, _ = fleet
    coord = Coordinator(tmp, servers, name="anthropic", config={
        "digs_scheduler_config": {"algorithm_type": "cache_affinity", "affinityBlockTokens": 16}})
    try:
        coord.wait_ready()
        via, direct = (anthropic.Anthropic(base_url=u, api_key="none", max_retries=0, timeout=60)
                       for u in (coord.url, servers[0].url))
        msgs = [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]
        kw = dict(model="demo", max_tokens=6, system="Be brief.", extra_body={"temperature": 0})
        where = []
        for turn in range(3):
            a = via.messages.create(messages=msgs, **kw)
            assert a.content == direct.messages.create(messages=msgs, **kw).content
            with via.messages.stream(messages=msgs, **kw) as st:
                assert "".join(st.text_stream) == "".join(b.text for b in a.content)
            coord.wait_request_lines(2 * turn + 2, 10)
            where += _instance_of_last(coord, 2)
            msgs += [{"role": "assistant", "content": a.content[0].text if a.content else "."},
                     {"role": "user", "content": f"turn {turn}"}]
        assert len(set(where)) == 1, where  # every turn of the conversation on the instance that has it
        assert via.messages.count_tokens(model="demo", messages=msgs).input_tokens == \
            direct.messages.count_tokens(model="demo", messages=msgs).input_tokens
        with pytest.raises(anthropic.NotFoundError) as e:
            via.messages.create(model="claude-nope", max_tokens=4, messages=msgs)
        assert e.value.body["error"]["type"] == "not_found_error"
    finally:
        coord.stop()


def test_streams_are_relayed_frame_by_frame(fleet):
    """The first event reaches the client while the instance is still generating."""
    _, servers, coord = fleet
    body = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 200, "ignore_eos": True}}
    t0 = time.monotonic()
    times = []
    with httpx.stream("POST", coord.url + "/infer", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                times.append(time.monotonic() - t0)
    assert len(times) == 200
    assert times[0] < times[-1] * 0.5, (times[0], times[-1])


def _instance_of_last(coord, n: int = 1) -> list[int]:
    out = []
    for ln in coord.request_lines()[-n:]:
        m = re.search(r"-> instance (\d+)\(", ln)
        out.append(int(m.group(1)) if m else -1)
    return out


def _wait_idle(coord, servers, timeout: float = 20) -> None:
    """Until the router sees every instance idle, so that their loads tie (then idle instances
    take turns): each instance's own status says idle (its figures come with its workers'
    heartbeats, a little after a request ends; a poll in between reads it still running), then
    the coordinator's last poll does."""
    t0 = time.monotonic()
    for s in servers:
        while (res := httpx.get(s.url + "/v2/status", timeout=10).json()["resource"])["runningRequestNum"] or \
                res["waitingRequestNum"]:
            assert time.monotonic() - t0 < timeout, res
            time.sleep(0.05)
    while True:
        insts = coord.info()["instances"]
        if not any(i["running"] or i["waiting"] or i["inflight"] for i in insts):
            return
        assert time.monotonic() - t0 < timeout, insts
        time.sleep(0.05)


def test_load_balance_spreads_and_follows_load(fleet):
    _, servers, coord = fleet
    # idle instances take turns
    before = len(coord.settled_request_lines())  # not short by the last test's stream's late line
    for _ in range(4):
        _wait_idle(coord, servers)
        assert httpx.post(coord.url + "/infer", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}},
                          timeout=60).status_code == 200
    coord.wait_request_lines(before + 4, 10)
    picks = _instance_of_last(coord, 4)
    assert sorted(picks) == [0, 0, 1, 1], picks
    # a long stream on one instance (held open until the short ones are answered: one that ended
    # on its own first would free its instance): the next short requests go to the other one
    held = _Held(coord.url)
    busy = coord.info()
    busy_id = next(i["id"] for i in busy["instances"] if i["inflight"] == 1)
    before = len(coord.request_lines())
    for _ in range(3):
        httpx.post(coord.url + "/infer", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}, timeout=60)
    coord.wait_request_lines(before + 3, 10)
    assert _instance_of_last(coord, 3) == [1 - busy_id] * 3
    held.release()


def test_request_log_line_names_the_instance(fleet):
    _, servers, coord = fleet
    before = len(coord.settled_request_lines())  # earlier tests' /v1/completions lines do not count
    httpx.post(coord.url + "/v1/completions", json={"model": "demo", "prompt": "hi", "max_tokens": 2}, timeout=60)
    pat = re.compile(r"request \w+ POST /v1/completions -> instance [01]\(127\.0\.0\.1:\d+\) status 200 ")
    (line,) = coord.wait_request_lines(before + 1)[before:]
    assert pat.search(line), line


def test_manage_info_metrics_and_probes(fleet):
    _, servers, coord = fleet
    for path in ("/v1/startup", "/v1/health", "/v2/health/live", "/v1/readiness", "/v2/health/ready"):
        assert httpx.get(coord.manage + path, timeout=10).status_code == 200, path
    info = coord.info()
    assert [s["id"] for s in info["schedule_info"]] == [0, 1]
    assert set(info["schedule_info"][0]) == {"id", "allocated_slots", "allocated_blocks"}
    assert {"request_num", "request_length_info"} <= set(info)
    assert all(i["state"] == "ready" and i["model_name"] == "demo" for i in info["instances"])
    text = httpx.get(coord.manage + "/metrics", timeout=10).text
    # each instance's own metrics, labelled, and the coordinator's counters
    assert re.search(r'^request_received_total\{.*instance="0".*\} \d+', text, re.M), text[:2000]
    assert re.search(r'^request_received_total\{.*instance="1".*\} \d+', text, re.M)
    assert re.search(r"^coordinator_request_received_total \d+", text, re.M)
    assert re.search(r'^coordinator_routing_decisions_total\{decision="load",instance="[01]"\} \d+', text, re.M)
    assert re.search(r'^coordinator_instance_ready\{instance="1"\} 1', text, re.M)


def _counter(coord, pattern: str) -> float:
    m = re.search(pattern + r" (\S+)$", httpx.get(coord.manage + "/metrics", timeout=10).text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_request_is_counted_when_its_answer_has_ended(fleet):
    """Read straight after the answer (no wait): the request is already in the success / failed
    counters and the latency histogram (they are recorded before the last byte goes out)."""
    _, _, coord = fleet
    ok, e2e = r"^coordinator_request_success_total", r"^coordinator_e2e_request_latency_seconds_count"
    bad = r'^coordinator_request_failed_total\{code="404"\}'
    bodies = [{"inputs": PROMPT, "parameters": {"max_new_tokens": 3}},
              {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 3}}]
    for body in bodies * 3:
        n_ok, n_e2e = _counter(coord, ok), _counter(coord, e2e)
        r = httpx.post(coord.url + "/infer", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert (_counter(coord, ok), _counter(coord, e2e)) == (n_ok + 1, n_e2e + 1), body
    for _ in range(3):
        n_bad = _counter(coord, bad)
        assert httpx.post(coord.url + "/no/such/route", json={}, timeout=10).status_code == 404
        assert _counter(coord, bad) == n_bad + 1


def test_offline_online_and_readiness(fleet):
    _, servers, coord = fleet
    m = coord.manage
    assert httpx.post(m + "/v1/instances/offline", json={"ids": [0]}, timeout=10).status_code == 200
    coord.wait_state(0, "offline")
    before = len(coord.settled_request_lines())
    for _ in range(3):
        httpx.post(coord.url + "/infer", json={"inputs": "a", "parameters": {"max_new_tokens": 1}}, timeout=60)
    coord.wait_request_lines(before + 3, 10)
    assert _instance_of_last(coord, 3) == [1, 1, 1]
    assert httpx.post(m + "/v1/instances/offline", json={"ids": [1]}, timeout=10).status_code == 200
    r = httpx.get(m + "/v1/readiness", timeout=10)
    assert r.status_code == 503 and r.content == b""
    assert httpx.get(m + "/v2/health/ready", timeout=10).status_code == 503
    assert httpx.get(m + "/v1/health", timeout=10).status_code == 200
    r = httpx.post(coord.url + "/infer", json={"inputs": "a"}, timeout=10)
    assert r.status_code == 503 and r.json() == {"error": "MindIE-MS Coordinator is not ready",
                                                 "error_type": "Service Unavailable"}
    assert httpx.post(m + "/v1/instances/online", json={"ids": [0, 1]}, timeout=10).status_code == 200
    assert httpx.get(m + "/v1/readiness", timeout=10).status_code == 200
    # bodies MindIE's controller would not send: 400 in MindIE's shape, naming what is wrong
    r = httpx.post(m + "/v1/instances/offline", json={"ids": [7]}, timeout=10)
    assert r.status_code == 400 and "7" in r.json()["error"]
    r = httpx.post(m + "/v1/instances/online", content=b"{not json", timeout=10)
    assert r.status_code == 400 and set(r.json()) == {"error", "error_type"}
    r = httpx.post(m + "/v1/instances/query_tasks", json={"p_id": 0, "d_id": 1}, timeout=10)
    assert r.json() == {"is_end": True}


def test_refresh_sets_the_instances(fleet):
    tmp, servers, coord = fleet
    m = coord.manage
    a, b = servers
    # MindIE's body: the full set; instance 1 is left out, instance 5 (= b under a new id) comes in
    body = {"ids": [0, 5], "instances": [
        {"id": 0, "ip": "127.0.0.1", "port": str(a.port), "metric_port": str(a.port), "model_name": "demo",
         "static_info": {"group_id": 0, "max_seq_len": 2560, "max_output_len": 512, "total_slots_num": 64,
                         "total_block_num": 1024, "block_size": 16, "label": 0, "role": 85},
         "dynamic_info": {"avail_slots_num": 64, "avail_block_num": 1024}},
        {"id": 5, "ip": "127.0.0.1", "port": str(b.port), "metric_port": str(b.port), "model_name": "demo",
         "static_info": {"total_slots_num": 64, "total_block_num": 1024, "block_size": 16, "role": 85},
         "dynamic_info": {"avail_slots_num": 64, "avail_block_num": 1024}}]}
    try:
        r = httpx.post(m + "/v1/instances/refresh", json=body, timeout=30)
        assert r.status_code == 200, r.text
        ids = sorted(i["id"] for i in coord.info()["instances"])
        assert ids == [0, 5]
        coord.wait_state(5, "ready")
        before = len(coord.settled_request_lines())
        for _ in range(4):
            _wait_idle(coord, servers)
            httpx.post(coord.url + "/infer", json={"inputs": "a", "parameters": {"max_new_tokens": 1}}, timeout=60)
        coord.wait_request_lines(before + 4, 10)
        assert sorted(_instance_of_last(coord, 4)) == [0, 0, 5, 5]
        # the newer form: delete one endpoint
        r = httpx.post(m + "/v1/instances/refresh", json={"event": "del", "instances": [{"endpoints": [
            {"id": 5, "ip": "127.0.0.1", "business_port": b.port, "mgmt_port": b.port}]}]}, timeout=30)
        assert r.status_code == 200, r.text
        assert [i["id"] for i in coord.info()["instances"]] == [0]
        # malformed: 400 naming the field
        r = httpx.post(m + "/v1/instances/refresh", json={"ids": [3], "instances": [
            {"id": 3, "ip": "127.0.0.1", "port": "80", "metric_port": "1026"}]}, timeout=10)
        assert r.status_code == 400 and "instances[0].port" in r.json()["error"], r.text
    finally:
        r = httpx.post(m + "/v1/instances/refresh", json={"event": "set", "instances": [{"endpoints": [
            {"id": 0, "ip": "127.0.0.1", "business_port": a.port, "mgmt_port": a.port},
            {"id": 1, "ip": "127.0.0.1", "business_port": b.port, "mgmt_port": b.port}]}]}, timeout=30)
        assert r.status_code == 200, r.text
        coord.wait_state(1, "ready")


def test_cache_affinity_keeps_conversations_on_their_instance(fleet):
    """Multi-turn chats: with cache_affinity every turn of a conversation goes where its first
    turn went (load_balance alternates idle instances); a busy affine instance falls back to load."""
    tmp, servers, _ = fleet
    coord = Coordinator(tmp, servers, name="ca", config={
        "digs_scheduler_config": {"algorithm_type": "cache_affinity", "affinityBlockTokens": 16},
        "request_limit": {"single_node_max_requests": 1}})
    try:
        coord.wait_ready()
        convs = [[{"role": "system", "content": "You are terse."}, {"role": "user", "content": f"topic {c}"}]
                 for c in range(4)]
        where: dict[int, list[int]] = {c: [] for c in range(4)}
        for turn in range(3):
            for c, msgs in enumerate(convs):
                if turn == 0:
                    _wait_idle(coord, servers)  # new conversations go by load: idle ones take turns
                r = httpx.post(coord.url + "/v1/chat/completions", json={"model": "demo", "messages": msgs,
                                                                         "max_tokens": 3, "temperature": 0}, timeout=60)
                assert r.status_code == 200, r.text
                msgs += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"and more on turn {turn}"}]
                coord.wait_request_lines(turn * 4 + c + 1, 10)
                where[c].append(_instance_of_last(coord)[0])
        assert all(len(set(w)) == 1 for w in where.values()), where
        assert {w[0] for w in where.values()} == {0, 1}, where  # new conversations by load: both used
        text = httpx.get(coord.manage + "/metrics", timeout=10).text
        hits = sum(float(v) for v in re.findall(r'^coordinator_routing_decisions_total\{decision="affinity_hit"'
                                                 r',instance="\d"\} (\S+)', text, re.M))
        assert hits == 8, text
        # token prompts: the instance that served a prompt's leading blocks gets the prompts that
        # share them (another tail); a prompt with other leading blocks goes by load
        def tok(ids):
            before = len(coord.request_lines())
            httpx.post(coord.url + "/infer_token", json={"input_id": ids, "parameters": {"max_new_tokens": 1}},
                       timeout=60).raise_for_status()
            coord.wait_request_lines(before + 1, 10)
            return _instance_of_last(coord)[0]
        shared = list(range(100, 164))  # 4 blocks of 16
        first = tok(shared + [7, 8, 9])
        assert [tok(shared + [i, 3]) for i in (1, 2, 3)] == [first] * 3
        assert tok(list(range(500, 564))) == 1 - first  # new prefix: by load, and the other one is idle-er
        # text prompts: blocks of 16 x string_token_rate characters
        text = "lorem ipsum dolor sit amet " * 20
        home_t = None
        for tail in ("alpha", "beta", "gamma"):
            before = len(coord.request_lines())
            httpx.post(coord.url + "/v1/completions", json={"model": "demo", "prompt": text + tail, "max_tokens": 1},
                       timeout=60).raise_for_status()
            coord.wait_request_lines(before + 1, 10)
            home_t = home_t if home_t is not None else _instance_of_last(coord)[0]
            assert _instance_of_last(coord)[0] == home_t
        # the affine instance busy (single_node_max_requests 1, a long stream on it): by load
        conv = convs[0]
        home = where[0][0]
        started, stop = threading.Event(), threading.Event()

        def long():
            # held open until the check is done (closed then: cancelled), so that it cannot end
            # first and free its instance, nor log its line among the checked request's
            body = {"model": "demo", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2000,
                    "ignore_eos": True, "stream": True}
            # send it to the home instance: a conversation whose first turn went there
            with httpx.stream("POST", coord.url + "/v1/chat/completions", json={**body, "messages": conv[:2]},
                              timeout=120) as r:
                for _ in r.iter_lines():
                    started.set()
                    if stop.is_set():
                        return
        n_before = len(coord.settled_request_lines())
        t = threading.Thread(target=long)
        t.start()
        try:
            assert started.wait(30)
            r = httpx.post(coord.url + "/v1/chat/completions", json={"model": "demo", "messages": conv,
                                                                     "max_tokens": 2}, timeout=60)
            assert r.status_code == 200
            # its line is written after the client has the reply: the one line after the turns' so far
            (line,) = coord.wait_request_lines(n_before + 1)[n_before:]
            assert "affinity_busy" in line and f"-> instance {1 - home}(" in line, line
        finally:
            stop.set()
            t.join(120)
    finally:
        coord.stop()


def test_request_limit_refused_at_once(fleet):
    tmp, servers, _ = fleet
    coord = Coordinator(tmp, servers, name="lim", config={"request_limit": {"max_requests": 1,
                                                                            "single_node_max_requests": 1}})
    try:
        coord.wait_ready()
        started = threading.Event()

        def long():
            body = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 300, "ignore_eos": True}}
            with httpx.stream("POST", coord.url + "/infer", json=body, timeout=120) as r:
                for _ in r.iter_lines():
                    started.set()
        t = threading.Thread(target=long)
        t.start()
        assert started.wait(30)
        t0 = time.monotonic()
        r = httpx.post(coord.url + "/infer", json={"inputs": "a"}, timeout=10)
        # at once: a request that waited for room would wait for the 300-token stream's end (then
        # 200) or schedule_timeout (600 s); 5 s leaves room for a loaded machine (load 10-20)
        assert time.monotonic() - t0 < 5.0
        assert r.status_code == 429
        assert r.json() == {"error": "Too many requests", "error_type": "Too Many Requests"}
        r = httpx.post(coord.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}]},
                       timeout=10)
        assert r.status_code == 429 and r.json()["error"]["code"] == 429  # OpenAI's error shape
        t.join(120)
        time.sleep(0.3)  # its request line is written just after the client saw the end
        # body_limit (MB): 413 in MindIE's shape
        r = httpx.post(coord.url + "/infer", content=b"x" * (10 * 2 ** 20 + 1), timeout=30)
        assert r.status_code == 413 and r.json()["error_type"] == "Request Entity Too Large"
    finally:
        coord.stop()


def test_coordinator_kill9_and_restart(fleet):
    """kill -9 of the coordinator: the instances keep serving; a new one rebuilds its view from the
    config and the first poll, and routes at once."""
    tmp, servers, _ = fleet
    coord = Coordinator(tmp, servers, name="k9")
    coord.wait_ready()
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}
    assert httpx.post(coord.url + "/infer", json=body, timeout=60).status_code == 200
    coord.kill9()
    for s in servers:
        assert httpx.post(s.url + "/infer", json=body, timeout=60).status_code == 200
    again = Coordinator(tmp, servers, name="k9", ports=(coord.predict_port, coord.manage_port))
    try:
        line = again.wait_ready_line()
        assert "0 127.0.0.1" in line and "1 127.0.0.1" in line and line.count(" ready") >= 3, line
        r = httpx.post(again.url + "/infer", json=body, timeout=60)
        assert r.status_code == 200
    finally:
        again.stop()


def test_client_disconnect_cancels_on_the_instance(fleet):
    """A client that hangs up mid-stream: the coordinator closes the instance's connection, and the
    instance stops generating (its running count drops long before the 2000 tokens would end)."""
    _, servers, coord = fleet
    body = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 2000, "ignore_eos": True}}
    before = len(coord.settled_request_lines())
    gone0 = _disconnects(coord)
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", coord.url + "/infer", json=body) as r:
            it = r.iter_lines()
            next(it)
            t1 = time.monotonic()
            for _ in range(20):  # about 10 events
                next(it)
            step = (time.monotonic() - t1) / 10  # the time an event takes here now
            iid = next(i["id"] for i in coord.info()["instances"] if i["inflight"])
            status = httpx.get(servers[iid].url + "/v2/status", timeout=10).json()["resource"]
            assert status["runningRequestNum"] == 1
    # 2000 tokens would take 10 s and more (hundreds of events even with speculation); 3 s, or
    # 100 events' time where a loaded machine makes events slow
    bound = max(3.0, 100 * step)
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound:
        if httpx.get(servers[iid].url + "/v2/status", timeout=10).json()["resource"]["runningRequestNum"] == 0:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the instance still runs the request {bound:.1f} s after the client left")
    (line,) = coord.wait_request_lines(before + 1)[before:]  # written after the cancel, not at once
    assert "client disconnected" in line, line
    assert _disconnects(coord) == gone0 + 1  # counted before the line is written


def _disconnects(coord) -> float:
    text = httpx.get(coord.manage + "/metrics", timeout=10).text
    return float(re.search(r"^coordinator_client_disconnects_total (\S+)$", text, re.M).group(1))


class _Held:
    """A long stream through the coordinator, held open until ``release()``."""

    def __init__(self, url: str) -> None:
        self.started, self.stop = threading.Event(), threading.Event()
        self.t = threading.Thread(target=self._run, args=(url,))
        self.t.start()
        assert self.started.wait(30)

    def _run(self, url: str) -> None:
        body = {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 2000, "ignore_eos": True}}
        with httpx.stream("POST", url + "/infer", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                self.started.set()
                if self.stop.is_set():
                    return  # closing the stream: the coordinator and the instance cancel it

    def release(self) -> None:
        self.stop.set()
        self.t.join(30)


def test_schedule_timeout_waits_for_room(fleet):
    """Every instance at single_node_max_requests: a request waits for room up to
    schedule_timeout (then 503), and is served as soon as room frees."""
    tmp, servers, _ = fleet
    coord = Coordinator(tmp, servers, name="sched", config={
        "request_limit": {"single_node_max_requests": 1}, "exception_config": {"schedule_timeout": 2}})
    try:
        coord.wait_ready()
        held = [_Held(coord.url), _Held(coord.url)]
        t0 = time.monotonic()
        r = httpx.post(coord.url + "/infer", json={"inputs": "a", "parameters": {"max_new_tokens": 2}}, timeout=30)
        waited = time.monotonic() - t0
        assert r.status_code == 503 and "Request schedule timeout" in r.json()["error"], r.text
        assert 1.9 <= waited < 5, waited
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("r", httpx.post(
            coord.url + "/infer", json={"inputs": "a", "parameters": {"max_new_tokens": 2}}, timeout=30)))
        t.start()
        time.sleep(0.5)
        assert "r" not in out  # waiting
        held[0].release()
        t.join(30)
        assert out["r"].status_code == 200, out["r"].text
        held[1].release()
    finally:
        coord.stop()


def _ndjson(r: httpx.Response) -> list:
    """An Ollama answer's objects without what differs between two runs (times, durations)."""
    volatile = {"created_at", "total_duration", "load_duration", "prompt_eval_duration", "eval_duration"}
    return [{k: v for k, v in json.loads(ln).items() if k not in volatile} for ln in r.text.splitlines() if ln]


def test_ollama_through_the_coordinator(fleet):
    """Ollama's routes relayed (mindie/contract/families.py OLLAMA): the chat stream (Ollama's
    default, no "stream" key) line by line and the whole answers as the instance gives them, the
    model routes, and an error in Ollama's shape."""
    _, servers, coord = fleet
    name = httpx.get(servers[0].url + "/api/tags", timeout=10).json()["models"][0]["name"]
    via_tags = httpx.get(coord.url + "/api/tags", timeout=10)
    assert via_tags.status_code == 200 and via_tags.json()["models"][0]["name"] == name
    chat = {"model": name, "messages": [{"role": "user", "content": PROMPT}], "options": {"temperature": 0,
                                                                                          "num_predict": 8}}
    for path, body in (("/api/chat", chat), ("/api/chat", {**chat, "stream": False}),
                       ("/api/generate", {"model": name, "prompt": PROMPT, "raw": True, "stream": False,
                                          "options": {"temperature": 0, "num_predict": 8}})):
        direct = httpx.post(servers[0].url + path, json=body, timeout=60)
        via = httpx.post(coord.url + path, json=body, timeout=60)
        assert via.status_code == direct.status_code == 200 and _ndjson(via) == _ndjson(direct), via.text[:300]
        assert via.headers["content-type"] == direct.headers["content-type"]
    assert len(_ndjson(via)) == 1 and _ndjson(via)[0]["eval_count"] == 8
    lines = _ndjson(httpx.post(coord.url + "/api/chat", json=chat, timeout=60))
    assert len(lines) > 2 and lines[-1]["done"] is True and lines[-1]["eval_count"] == 8
    r = httpx.post(coord.url + "/api/chat", json={**chat, "model": "nope"}, timeout=30)
    assert r.status_code == 404 and r.json() == {"error": "model 'nope' not found"}
    r = httpx.post(coord.url + "/api/show", json={"model": name}, timeout=30)
    assert r.status_code == 200 and r.json()["details"]["family"] == "llama"
