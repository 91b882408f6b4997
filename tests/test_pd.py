"""Prefill/decode disaggregation, instance to instance without a coordinator (mindie/contract/pd.py,
mindie/api/pd_role.py, workers/pd_transfer.py): three real servers started by scripts/launch.sh on
the demo model — a hybrid reference H, a prefill instance P and a decode instance D — and the
X-Mindie-PD protocol driven by hand as the coordinator would (docs/design.md "Disaggregated
prefill/decode")."""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import time
import uuid
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from tests.harness import Server, free_port, plain_decode, short_run_dir, write_config

BLOCK = 16  # cacheBlockSize of every instance here
LEASE_MS = 1500


def _start(tmp, name: str, role: str, policy: str = "recompute", schedule: dict | None = None,
           model: dict | None = None):
    port = free_port()
    cfg = write_config(tmp / f"{name}.json", port=port, run_dir=short_run_dir(), workers=1,
                       model_path=_start.model, schedule=schedule, model=model,
                       server={"inferMode": "dmi", "pdRole": role, "kvTransferLeaseMs": LEASE_MS,
                               "kvTransferTimeoutMs": 3000, "kvLoadFailurePolicy": policy})
    return Server(cfg, port)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, demo_model):
    tmp = tmp_path_factory.mktemp("pd")
    _start.model = demo_model
    servers = {"H": _start(tmp, "h", "flex"),
               # the prefill instance, whose prompts take many steps beside other work (16-token
               # chunks): the last test kills its worker mid-transfer, with a request served whole
               # (the coordinator's fallback) decoding beside it one token a step (plain_decode), so
               # the chunks keep the transfer spread over ~120 steps. (It was a flex instance K of its
               # own: one server start less. Handoffs prefilled in chunks still equal the hybrid
               # answer, as D's tail computed after the transferred blocks does.)
               "P": _start(tmp, "p", "prefill", schedule=plain_decode({"prefillChunkTokens": 16})),
               "D": _start(tmp, "d", "decode"),
               "F": _start(tmp, "f", "decode", policy="fail"),
               # a decode instance whose KV cache (cpuMemSize 0.0012 GiB: ~19 blocks at 4 KiB a token)
               # is too small for two of the requests of the preemption test at once; one token a
               # step (plain_decode), so that each request runs its 160 steps long enough for the
               # others' handoffs to arrive beside it (speculation finished the demo model's
               # repetitive text in a few steps, and the handoffs then ran one after another)
               "S": _start(tmp, "s", "decode", schedule=plain_decode(), model={"cpuMemSize": 0.0012})}
    try:
        for s in servers.values():
            s.wait_ready(180)
        for s in servers.values():
            s.kv = httpx.get(s.url + "/v2/status", timeout=10).json()["pd"]["kvEndpoints"][0]
        yield servers
    finally:
        for s in servers.values():
            s.stop()


def _pd(fleet, path: str, body: dict, stream: bool = False, decode: str = "D", prefill: str = "P",
        tid: str | None = None) -> tuple[httpx.Response, dict]:
    """The coordinator's two calls: prefill (P) and decode (D) at the same time, as recommended."""
    p, d = fleet[prefill], fleet[decode]
    tid = tid or uuid.uuid4().hex
    hp = {"X-Mindie-PD": json.dumps({"op": "prefill", "transferId": tid, "kvEndpoint": d.kv})}
    hd = {"X-Mindie-PD": json.dumps({"op": "decode", "transferId": tid, "kvEndpoint": d.kv})}
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(httpx.post, p.url + path, json=body, headers=hp, timeout=120)
        if stream:
            with httpx.stream("POST", d.url + path, json=body, headers=hd, timeout=120) as r:
                r.read()
        else:
            r = httpx.post(d.url + path, json=body, headers=hd, timeout=120)
        pr = fut.result()
    assert pr.status_code == 200, pr.text
    return r, pr.json()


def _ids(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["details"]["generated_token_ids"]


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 131 + i * 17) % 200 + 5 for i in range(n)]


@pytest.mark.parametrize("n", [3, BLOCK, BLOCK + 1, 5 * BLOCK + 7, 12 * BLOCK])
def test_infer_token_greedy_equals_hybrid(fleet, n):
    body = {"input_id": _prompt(n, n), "parameters": {"max_new_tokens": 12, "details": True, "ignore_eos": True}}
    want = _ids(httpx.post(fleet["H"].url + "/infer_token", json=body, timeout=120))
    before = _computed(fleet["D"])
    r, pre = _pd(fleet, "/infer_token", body)
    assert _ids(r) == want
    assert pre["promptTokens"] == n
    # D computed only what was not transferred: the tail after the last full block before the last token.
    tail = n - ((n - 1) // BLOCK) * BLOCK
    deadline = time.monotonic() + 5
    while _computed(fleet["D"]) - before < tail and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _computed(fleet["D"]) - before == tail


def _computed(s) -> int:
    return httpx.get(s.url + "/v2/status", timeout=10).json()["pd"]["computedPromptTokens"]


def test_seeded_sampling_equals_hybrid(fleet):
    body = {"input_id": _prompt(70, 7), "parameters": {"max_new_tokens": 10, "details": True, "do_sample": True,
                                                       "temperature": 0.9, "top_k": 20, "seed": 1234,
                                                       "ignore_eos": True}}
    want = _ids(httpx.post(fleet["H"].url + "/infer_token", json=body, timeout=120))
    r, _ = _pd(fleet, "/infer_token", body)
    assert _ids(r) == want


def test_prefix_cache_hits_on_both_sides(fleet):
    """The same prompt twice through P -> D: the second time both sides hold its blocks in their prefix
    caches (P computes less, D drops the payload and reuses its own); the output is unchanged. Then a
    longer prompt sharing that prefix."""
    base = _prompt(4 * BLOCK + 3, 11)
    body = {"input_id": base, "parameters": {"max_new_tokens": 8, "details": True, "ignore_eos": True}}
    want = _ids(httpx.post(fleet["H"].url + "/infer_token", json=body, timeout=120))
    assert _ids(_pd(fleet, "/infer_token", body)[0]) == want
    assert _ids(_pd(fleet, "/infer_token", body)[0]) == want
    longer = {"input_id": base + _prompt(2 * BLOCK, 12), "parameters": body["parameters"]}
    want2 = _ids(httpx.post(fleet["H"].url + "/infer_token", json=longer, timeout=120))
    assert _ids(_pd(fleet, "/infer_token", longer)[0]) == want2


def _sse_text(r: httpx.Response, key) -> str:
    out = []
    for line in r.text.splitlines():
        if line.startswith("data:") and line[5:].strip() not in ("[DONE]", ""):
            out.append(key(json.loads(line[5:])))
    return "".join(x for x in out if x)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat(fleet, stream):
    body = {"model": "demo", "messages": [{"role": "user", "content": "tell me about blocks " * 9}],
            "max_tokens": 16, "temperature": 0, "stream": stream, "ignore_eos": True}
    h = httpx.post(fleet["H"].url + "/v1/chat/completions", json=body, timeout=120)
    r, _ = _pd(fleet, "/v1/chat/completions", body, stream=stream)
    assert h.status_code == r.status_code == 200, r.text
    if stream:
        key = lambda c: c["choices"][0]["delta"].get("content") if c.get("choices") else None
        assert _sse_text(r, key) == _sse_text(h, key) and _sse_text(h, key)
    else:
        assert r.json()["choices"][0]["message"] == h.json()["choices"][0]["message"]
        assert r.json()["usage"] == h.json()["usage"]


@pytest.mark.parametrize("stream", [False, True])
def test_openai_completions(fleet, stream):
    body = {"model": "demo", "prompt": "once upon a time in a land of paged caches " * 6, "max_tokens": 12,
            "temperature": 0, "stream": stream}
    h = httpx.post(fleet["H"].url + "/v1/completions", json=body, timeout=120)
    r, _ = _pd(fleet, "/v1/completions", body, stream=stream)
    assert h.status_code == r.status_code == 200, r.text
    if stream:
        key = lambda c: c["choices"][0]["text"] if c.get("choices") else None
        assert _sse_text(r, key) == _sse_text(h, key) and _sse_text(h, key)
    else:
        assert r.json()["choices"][0]["text"] == h.json()["choices"][0]["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_tgi(fleet, stream):
    body = {"inputs": "the quick brown fox " * 12, "parameters": {"max_new_tokens": 10, "details": True}}
    path = "/generate_stream" if stream else "/generate"
    h = httpx.post(fleet["H"].url + path, json=body, timeout=120)
    r, _ = _pd(fleet, path, body, stream=stream)
    assert h.status_code == r.status_code == 200, r.text
    if stream:
        key = lambda c: c["token"]["text"]
        assert _sse_text(r, key) == _sse_text(h, key)
    else:
        assert r.json()["generated_text"] == h.json()["generated_text"]


def test_constrained_output_equals_hybrid(fleet):
    """A JSON-schema response through prefill -> decode: the decode side compiles the constraint from
    the body it got, so the tokens (and the object) are the hybrid instance's."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "size": {"type": "integer"}}, "required": ["name", "size"],
              "additionalProperties": False}
    body = {"model": "demo", "messages": [{"role": "user", "content": "describe a block as json " * 5}],
            "max_tokens": 200, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "block", "schema": schema}}}
    h = httpx.post(fleet["H"].url + "/v1/chat/completions", json=body, timeout=120)
    r, _ = _pd(fleet, "/v1/chat/completions", body)
    assert h.status_code == r.status_code == 200, r.text
    got = r.json()["choices"][0]["message"]["content"]
    assert got == h.json()["choices"][0]["message"]["content"]
    if r.json()["choices"][0]["finish_reason"] == "stop":  # not cut by max_tokens (whitespace is free)
        assert set(json.loads(got)) == {"name", "size"}, got


def test_preemption_on_the_decode_side_keeps_the_output(fleet):
    """Four handoffs at once to a decode instance whose KV cache holds one of them whole (53 + 160
    tokens: 14 of its ~19 blocks): it preempts (and recomputes) some, and every answer is still the
    hybrid instance's."""
    bodies = [{"input_id": _prompt(3 * BLOCK + 5, 40 + i),
               "parameters": {"max_new_tokens": 160, "details": True, "ignore_eos": True}} for i in range(4)]
    want = [_ids(httpx.post(fleet["H"].url + "/infer_token", json=b, timeout=120)) for b in bodies]

    def metric() -> float:
        text = httpx.get(fleet["S"].url + "/metrics", timeout=30).text
        m = re.search(r"^num_preemptions_total(?:\{[^}]*\})? (\S+)", text, re.M)
        assert m, text[-2000:]
        return float(m.group(1))

    before = metric()
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda b: _ids(_pd(fleet, "/infer_token", b, decode="S")[0]), bodies))
    assert got == want
    status = httpx.get(fleet["S"].url + "/v1/status", timeout=10).text
    assert metric() > before, status[:1500]


# -- roles ----------------------------------------------------------------------------------------

V1_BODY = {"local": {"id": 0, "host_ip": "127.0.0.1", "server_ip": "127.0.0.1",
                     "device": [{"device_id": "0", "device_ip": "127.0.0.1", "device_logical_id": "0"}]},
           "peers": [{"id": 1, "host_ip": "127.0.0.1", "server_ip": "127.0.0.1", "device": []}]}
V2_BODY = {"local": [{"server_ip": "127.0.0.1", "host_ip": "127.0.0.1",
                      "dp_inst_list": [{"dp_inst_id": 0, "device": []}]}], "peers": []}


def test_roles_reported_and_enforced(fleet):
    p, d, h = fleet["P"], fleet["D"], fleet["H"]
    for s, role in ((p, "prefill"), (d, "decode"), (h, "flex")):
        for path in ("/v1/status", "/v2/status"):
            body = httpx.get(s.url + path, timeout=10).json()
            assert body["service"]["currentRole"] == role and body["service"]["roleStatus"] == "RoleReady"
            assert body["pd"]["kvEndpoints"] == [s.kv]
        cfg = httpx.get(s.url + "/v1/config", timeout=10).json()
        assert cfg["inferMode"] == "dmi" and cfg["currentRole"] == role
    plain = {"input_id": [5, 6, 7], "parameters": {"max_new_tokens": 2}}
    r = httpx.post(p.url + "/infer_token", json=plain, timeout=60)
    assert r.status_code == 503 and "role is prefill" in r.json()["error"], r.text
    # the coordinator's fallback with no decode instance (issue 52): the prefill instance serves whole
    whole = {"X-Mindie-PD": json.dumps({"op": "whole"})}
    r = httpx.post(p.url + "/infer_token", json=plain, headers=whole, timeout=60)
    assert r.status_code == 200 and r.json() == httpx.post(h.url + "/infer_token", json=plain, timeout=60).json()
    assert httpx.post(d.url + "/infer_token", json=plain, timeout=60).status_code == 200  # decode serves plain
    hdr = {"X-Mindie-PD": json.dumps({"op": "prefill", "transferId": "x1", "kvEndpoint": p.kv})}
    r = httpx.post(d.url + "/infer_token", json=plain, headers=hdr, timeout=60)
    assert r.status_code == 503 and "role is decode" in r.json()["error"], r.text
    bad = {"X-Mindie-PD": "{not json"}
    assert httpx.post(h.url + "/infer_token", json=plain, headers=bad, timeout=60).status_code == 400


def test_role_api(fleet):
    h = fleet["H"]
    try:
        # A request running when the role changes is drained, not cut (new plain requests are refused).
        long = {"input_id": [5, 6, 7], "parameters": {"max_new_tokens": 500, "ignore_eos": True, "details": True}}
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            running = ex.submit(httpx.post, h.url + "/infer_token", json=long, timeout=120)
            time.sleep(0.1)
            r = httpx.post(h.url + "/v1/role/prefill", json=V1_BODY, timeout=10)
            assert r.status_code == 200 and r.json() == {"result": "ok"}
            assert not running.done(), "the request ended before the role changed: nothing was drained"
            assert len(_ids(running.result())) == 500
        st = httpx.get(h.url + "/v1/status", timeout=10).json()
        assert st["service"]["currentRole"] == "prefill" and st["linkStatus"]["peers"] == [{"target": 1, "link": "ok"}]
        plain = {"input_id": [5, 6, 7], "parameters": {"max_new_tokens": 2}}
        assert httpx.post(h.url + "/infer_token", json=plain, timeout=60).status_code == 503
        r = httpx.post(h.url + "/v2/role/decode", json=V2_BODY, timeout=10)
        assert r.status_code == 200 and r.json() == {"result": "ok"}
        assert httpx.get(h.url + "/v2/status", timeout=10).json()["service"]["currentRole"] == "decode"
        for path, body in (("/v1/role/flex", {"local": {"id": 0}}), ("/v1/role/flex", [1]),
                           ("/v2/role/flex", V1_BODY), ("/v1/role/decode", {"peers": []})):
            r = httpx.post(h.url + path, json=body, timeout=10)
            assert r.status_code == 422, (path, r.text)
            assert r.json() == {"error": "Req body converts to json fail. Reset to previous node status.",
                                "error_type": "Input validation error"}
        assert httpx.get(h.url + "/v2/status", timeout=10).json()["service"]["currentRole"] == "decode"
        assert httpx.post(h.url + "/v1/role/boss", json=V1_BODY, timeout=10).status_code == 404
    finally:
        assert httpx.post(h.url + "/v1/role/flex", json=V1_BODY, timeout=10).status_code == 200


# -- faults: a fake prefill worker speaks the KV protocol to D's endpoint ------------------------------

def _fake_sender(endpoint: str):
    from workers.pd_transfer import KvBlock, KvDone, crc_of
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock, KvBlock, KvDone, crc_of


def _layout(fleet) -> tuple[int, int]:
    """(frames per block, bytes per frame) of the demo model's cache (float32), from its config."""
    cfg = json.loads((Path(_start.model) / "config.json").read_text())
    return 2 * cfg["num_hidden_layers"], cfg["num_key_value_heads"] * BLOCK * cfg["head_dim"] * 4


def _held(s) -> int:
    return httpx.get(s.url + "/v2/status", timeout=10).json()["pd"]["heldBlocks"]


@pytest.mark.parametrize("fault", ["crc", "gap"])
def test_corrupt_transfer_fails_loudly_or_recomputes(fleet, fault):
    """A corrupted block (checksum) or a sequence gap: with kvLoadFailurePolicy fail the decode request
    gets a 503 naming it; with recompute (D) the answer is the hybrid one."""
    nframes, nbytes = _layout(fleet)
    prompt = _prompt(3 * BLOCK + 2, 40 + len(fault))
    body = {"input_id": prompt, "parameters": {"max_new_tokens": 6, "details": True, "ignore_eos": True}}
    want = _ids(httpx.post(fleet["H"].url + "/infer_token", json=body, timeout=120))
    for name in ("F", "D"):
        s = fleet[name]
        sock, KvBlock, KvDone, crc_of = _fake_sender(s.kv)
        tid = uuid.uuid4().hex
        enc = msgspec.msgpack.Encoder()
        for i in range(3):
            if fault == "gap" and i == 1:
                continue
            payload = [bytes([i + 1]) * nbytes for _ in range(nframes)]
            crc = crc_of(payload) ^ (1 if fault == "crc" and i == 2 else 0)
            sock.send_multipart([enc.encode(KvBlock(tid, i, prompt[i * BLOCK:(i + 1) * BLOCK], crc, nbytes * nframes)),
                                 *payload])
        sock.send(enc.encode(KvDone(tid, 3, len(prompt))))
        hd = {"X-Mindie-PD": json.dumps({"op": "decode", "transferId": tid, "kvEndpoint": s.kv})}
        r = httpx.post(s.url + "/infer_token", json=body, headers=hd, timeout=60)
        if name == "F":
            assert r.status_code == 503, r.text
            msg = r.json()["error"]
            assert ("checksum" in msg if fault == "crc" else "sequence gap" in msg) and "kvLoadFailurePolicy" in msg
        else:
            assert _ids(r) == want  # the garbage never reached the cache: recomputed
        sock.close(0)
        deadline = time.monotonic() + 10
        while _held(s) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _held(s) == 0


def test_a_full_decode_cache_cuts_the_transfer_and_computes_the_rest(fleet):
    """S's KV cache entirely held by another transfer (a fake sender's 40 blocks, kept alive for 4 s):
    a handoff's blocks find no free block. The prefill side still gets its acknowledgement (200, not
    a 503 "out of KV blocks"), and S computes the whole prompt itself once the blocks are freed: the
    hybrid instance's answer."""
    nframes, nbytes = _layout(fleet)
    s = fleet["S"]
    hog = _prompt(40 * BLOCK, 99)
    sock, KvBlock, KvDone, crc_of = _fake_sender(s.kv)
    enc, tid = msgspec.msgpack.Encoder(), uuid.uuid4().hex

    def send(i: int) -> None:
        payload = [bytes([i % 250 + 1]) * nbytes for _ in range(nframes)]
        ids = hog[i * BLOCK:(i + 1) * BLOCK] if i < 40 else hog[:BLOCK]
        sock.send_multipart([enc.encode(KvBlock(tid, i, ids, crc_of(payload), nbytes * nframes)), *payload])

    for i in range(40):
        send(i)
    deadline = time.monotonic() + 30
    while _held(s) < 15 and time.monotonic() < deadline:  # S wrote what fits (~19 blocks) and holds it
        time.sleep(0.1)
    assert _held(s) >= 15
    body = {"input_id": _prompt(3 * BLOCK + 5, 77), "parameters": {"max_new_tokens": 10, "details": True,
                                                                   "ignore_eos": True}}
    want = _ids(httpx.post(fleet["H"].url + "/infer_token", json=body, timeout=120))
    before = _computed(s)
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        handoff = ex.submit(_pd, fleet, "/infer_token", body, decode="S")  # asserts the prefill side's 200
        t0, i = time.monotonic(), 40
        while time.monotonic() - t0 < 4:  # frames after the cut are dropped but keep the hog's lease
            send(i)
            i += 1
            time.sleep(0.2)
        sock.send(enc.encode(KvDone(tid, i, len(hog))))
        r, pre = handoff.result(timeout=120)
    assert _ids(r) == want and pre["promptTokens"] == len(body["input_id"])
    deadline = time.monotonic() + 5  # (the figure comes with S's worker heartbeat)
    while _computed(s) - before < len(body["input_id"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _computed(s) - before == len(body["input_id"])  # no block of it found room: all computed on S
    assert sock.poll(10_000), "no acknowledgement of the hog's transfer"
    ack = msgspec.msgpack.decode(sock.recv(), type=list)  # acknowledged too (its blocks up to the cut)
    assert ack[0] == 4 and ack[1] == tid and ack[2] is True, ack
    sock.close(0)


def test_lost_transfer_times_out(fleet):
    """Step B without step A: F (fail) answers 503 after kvTransferTimeoutMs; D recomputes."""
    body = {"input_id": _prompt(40, 99), "parameters": {"max_new_tokens": 4, "details": True, "ignore_eos": True}}
    want = _ids(httpx.post(fleet["H"].url + "/infer_token", json=body, timeout=120))
    for name in ("F", "D"):
        s = fleet[name]
        hd = {"X-Mindie-PD": json.dumps({"op": "decode", "transferId": uuid.uuid4().hex, "kvEndpoint": s.kv})}
        t0 = time.monotonic()
        r = httpx.post(s.url + "/infer_token", json=body, headers=hd, timeout=60)
        assert time.monotonic() - t0 >= 2.9
        if name == "F":
            assert r.status_code == 503 and "never arrived" in r.json()["error"], r.text
        else:
            assert _ids(r) == want


def test_sender_dies_mid_transfer_blocks_freed_within_lease(fleet):
    """Blocks arrive, then the sender is gone (as after kill -9 of a prefill worker): the decode side
    holds them, then frees them within the lease (kvTransferLeaseMs)."""
    nframes, nbytes = _layout(fleet)
    d = fleet["D"]
    sock, KvBlock, _KvDone, crc_of = _fake_sender(d.kv)
    tid = uuid.uuid4().hex
    prompt = _prompt(6 * BLOCK, 77)
    enc = msgspec.msgpack.Encoder()
    for i in range(4):
        payload = [bytes([7]) * nbytes for _ in range(nframes)]
        sock.send_multipart([enc.encode(KvBlock(tid, i, prompt[i * BLOCK:(i + 1) * BLOCK], crc_of(payload),
                                                nbytes * nframes)), *payload])
    deadline = time.monotonic() + 10
    while _held(d) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _held(d) == 4
    sock.close(0)
    t0 = time.monotonic()
    while _held(d) and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    assert _held(d) == 0
    assert time.monotonic() - t0 < LEASE_MS / 1000 + 3


def test_prefill_to_missing_endpoint_is_503(fleet):
    body = {"input_id": _prompt(40, 5), "parameters": {"max_new_tokens": 4}}
    hp = {"X-Mindie-PD": json.dumps({"op": "prefill", "transferId": "t-missing",
                                     "kvEndpoint": "ipc:///tmp/no-such-kv-endpoint.ipc"})}
    r = httpx.post(fleet["P"].url + "/infer_token", json=body, headers=hp, timeout=60)
    assert r.status_code == 503 and "not found" in r.json()["error"], r.text
    assert _held(fleet["P"]) == 0


def test_kill_9_of_the_prefill_worker_mid_transfer(fleet):
    """kill -9 of P's device worker while its blocks stream to F: F holds what arrived, frees it within
    the lease; the decode request fails with F's policy (fail: 503); P's worker is restarted. (Last in
    the file: the tests before it use P's first worker.)"""
    k, f = fleet["P"], fleet["F"]
    prompt = _prompt(120 * BLOCK, 3)
    body = {"input_id": prompt, "parameters": {"max_new_tokens": 4, "details": True}}
    tid = uuid.uuid4().hex
    hp = {"X-Mindie-PD": json.dumps({"op": "prefill", "transferId": tid, "kvEndpoint": f.kv})}
    hd = {"X-Mindie-PD": json.dumps({"op": "decode", "transferId": tid, "kvEndpoint": f.kv})}
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        # A request served whole (a prefill instance refuses plain ones) decoding on P first: beside
        # it P's prompt steps take 16-token chunks (prefillChunkTokens), so the transfer to F spans
        # ~120 steps.
        ex.submit(httpx.post, k.url + "/infer_token", json={"input_id": [5, 6, 7], "parameters": {
            "max_new_tokens": 2000, "ignore_eos": True}}, headers={"X-Mindie-PD": json.dumps({"op": "whole"})},
            timeout=120)
        deadline = time.monotonic() + 30  # until it runs (not a guessed 0.5 s: later on a loaded machine)
        while httpx.get(k.url + "/v2/status", timeout=10).json()["resource"]["runningRequestNum"] < 1:
            assert time.monotonic() < deadline, "the whole request never ran on P"
            time.sleep(0.02)
        pre = ex.submit(httpx.post, k.url + "/infer_token", json=body, headers=hp, timeout=120)
        dec = ex.submit(httpx.post, f.url + "/infer_token", json=body, headers=hd, timeout=120)
        deadline = time.monotonic() + 30
        while _held(f) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        held = _held(f)
        (worker,) = k.workers()
        os.kill(worker, signal.SIGKILL)
        assert held > 0, "no block arrived before the kill"
        pr, dr = pre.result(), dec.result()
    assert pr.status_code >= 500, pr.text  # the prefill request ends with an error, never hangs
    assert dr.status_code == 503 and "KV transfer" in dr.json()["error"], dr.text
    t0 = time.monotonic()
    while _held(f) and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    assert _held(f) == 0 and time.monotonic() - t0 < LEASE_MS / 1000 + 3
