"""Prefill/decode KV transfer over tcp with CURVE (issue 32, item 2: "tcp with the existing CURVE keys
across hosts"), forced onto loopback: three real servers started by scripts/launch.sh on the demo model,

- P: prefill, ``inferMode dmi`` + ``interCommPort``: binds its KV endpoint on tcp (CURVE, key dir A)
  beside the ipc one;
- D: decode, the same key dir A, ``kvTransferTcpOnly`` (no ipc KV endpoint at all: every block it
  receives came over tcp), ``kvLoadFailurePolicy fail``;
- H: a hybrid (flex) instance, the reference answers, with *another* key dir B: as a prefill
  instance it holds the wrong key;

and the X-Mindie-PD protocol driven by hand, then through the real coordinator (pd_separate). Plus
the config rules of the tcp endpoint (no server needed)."""
from __future__ import annotations

import concurrent.futures
import json
import os
import time
import uuid
from pathlib import Path

import httpx
import pytest

from mindie.config import ConfigError, load_config
from mindie.ops.curve_keys import create_key_dir
from mindie.topology import build_deployment
from tests.coord_harness import Coordinator, consecutive_free_ports
from tests.harness import Server, free_port, short_run_dir, write_config

pytestmark = pytest.mark.timeout(600)

BLOCK = 16


def _kv_port(n: int = 1) -> int:
    """A port P with P .. P + n - 1 free on 127.0.0.1 now (interCommPort of an n-worker instance)."""
    return consecutive_free_ports(n)


def _keys(tmp: Path, name: str) -> Path:
    create_key_dir(str(tmp / name))
    return tmp / name


def _config(path: Path, port: int, server: dict, key_dir: Path | None, model_path: str | None = None,
            schedule: dict | None = None) -> Path:
    write_config(path, port=port, run_dir=short_run_dir(), workers=1, model_path=model_path,
                 server=server, schedule=schedule)
    if key_dir is not None:
        cfg = json.loads(path.read_text())
        cfg["BackendConfig"]["workerCurveKeyDir"] = str(key_dir)
        path.write_text(json.dumps(cfg, indent=2))
    return path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, demo_model):
    tmp = tmp_path_factory.mktemp("pdtcp")
    a, b = _keys(tmp, "keys-a"), _keys(tmp, "keys-b")
    common = {"inferMode": "dmi", "kvTransferLeaseMs": 3000, "kvTransferTimeoutMs": 3000}
    specs = {"P": ({"pdRole": "prefill"}, a), "D": ({"pdRole": "decode", "kvTransferTcpOnly": True,
                                                     "kvLoadFailurePolicy": "fail"}, a),
             "H": ({"pdRole": "flex"}, b)}
    servers = {}
    try:
        for name, (extra, keys) in specs.items():
            port = free_port()
            cfg = _config(tmp / f"{name}.json", port, {**common, **extra, "interCommPort": _kv_port()}, keys,
                          model_path=demo_model)
            servers[name] = Server(cfg, port)
        for s in servers.values():
            s.wait_ready(240)
        for s in servers.values():
            s.pd = httpx.get(s.url + "/v2/status", timeout=10).json()["pd"]
        servers["keys"] = (a, b)
        servers["tmp"] = tmp
        yield servers
    finally:
        for s in servers.values():
            if isinstance(s, Server):
                s.stop()


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 131 + i * 17) % 200 + 5 for i in range(n)]


def _ids(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["details"]["generated_token_ids"]


def _handoff(fleet, body: dict, prefill: str = "P", key: str | None = None, stream: bool = False,
             path: str = "/infer_token") -> tuple[httpx.Response, httpx.Response, float]:
    """Prefill on ``prefill`` (its KV pushed to D's tcp endpoint), decode on D, at once; the
    prefill answer's wall time."""
    d = fleet["D"]
    ep = d.pd["kvEndpoints"][0]
    tid = uuid.uuid4().hex
    order = {"op": "prefill", "transferId": tid, "kvEndpoint": ep}
    key = d.pd.get("kvCurvePublicKey", "") if key is None else key
    if key:
        order["kvCurvePublicKey"] = key
    hp = {"X-Mindie-PD": json.dumps(order)}
    hd = {"X-Mindie-PD": json.dumps({"op": "decode", "transferId": tid, "kvEndpoint": ep})}

    def pre():
        t0 = time.monotonic()
        r = httpx.post(fleet[prefill].url + path, json=body, headers=hp, timeout=60)
        return r, time.monotonic() - t0

    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(pre)
        if stream:
            with httpx.stream("POST", d.url + path, json=body, headers=hd, timeout=60) as r:
                r.read()
        else:
            r = httpx.post(d.url + path, json=body, headers=hd, timeout=60)
        pr, took = fut.result()
    return pr, r, took


def test_tcp_endpoints_advertised(fleet):
    a, b = fleet["keys"]
    pub = lambda d: (d / "worker.key").read_text().split('public-key = "')[1][:40]  # noqa: E731
    d, p = fleet["D"].pd, fleet["P"].pd
    # D: tcp only (kvTransferTcpOnly), its CURVE public key beside it
    assert len(d["kvEndpoints"]) == 1 and d["kvEndpoints"][0].startswith("tcp://127.0.0.1:"), d
    assert d["kvCurvePublicKey"] == pub(a)
    # P: the ipc endpoint first (peers on this host), then the tcp one
    assert [e.split(":")[0] for e in p["kvEndpoints"]] == ["ipc", "tcp"], p
    assert fleet["H"].pd["kvCurvePublicKey"] == pub(b)


@pytest.mark.parametrize("n", [BLOCK + 1, 12 * BLOCK + 5])
def test_greedy_over_tcp_curve_equals_hybrid(fleet, n):
    body = {"input_id": _prompt(n, n), "parameters": {"max_new_tokens": 12, "details": True, "ignore_eos": True}}
    want = _ids(httpx.post(fleet["H"].url + "/infer_token", json=body, timeout=60))
    pr, r, _ = _handoff(fleet, body)
    assert pr.status_code == 200, pr.text
    assert pr.json()["promptTokens"] == n
    assert _ids(r) == want


def test_stream_over_tcp_curve_equals_hybrid(fleet):
    body = {"prompt": " ".join(f"w{i}" for i in range(60)), "max_tokens": 10, "temperature": 0,
            "model": "demo", "stream": True}
    want = httpx.post(fleet["H"].url + "/v1/completions", json=body, timeout=60)
    pr, r, _ = _handoff(fleet, body, stream=True, path="/v1/completions")
    assert pr.status_code == 200, pr.text

    def text(resp) -> str:
        out = []
        for line in resp.text.splitlines():
            if line.startswith("data: {"):
                out += [c.get("text", "") for c in json.loads(line[6:])["choices"]]
        return "".join(out)

    assert r.status_code == 200 and text(r) == text(want) and text(want)


def _logprobs(r: httpx.Response) -> list:
    assert r.status_code == 200, r.text
    return [(c["text"], c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"]) for c in r.json()["choices"]]


def test_logprobs_equal_a_prefix_cache_hit_exactly(fleet):
    """Through P -> D the logprobs are bit for bit those of a hybrid instance that holds the prompt's
    full blocks in its prefix cache (the decode side computes the tail after them, as a prefix hit
    does); against a cold hybrid prefill they may differ in the last float digits (the tail's KV is
    computed with attention over cached blocks instead of in one prefill: another summation order)."""
    body = {"model": "demo", "prompt": " ".join(f"word{i}" for i in range(90)), "max_tokens": 10,
            "temperature": 0, "logprobs": 2}
    h = fleet["H"].url + "/v1/completions"
    cold = _logprobs(httpx.post(h, json=body, timeout=60))
    warm = _logprobs(httpx.post(h, json=body, timeout=60))  # its full blocks now a prefix-cache hit
    pr, r, _ = _handoff(fleet, body, path="/v1/completions")
    assert pr.status_code == 200, pr.text
    got = _logprobs(r)
    assert got == warm
    assert [t for t, _, _ in got] == [t for t, _, _ in cold]
    assert max(abs(a - b) for (_, x, _), (_, y, _) in zip(got, cold) for a, b in zip(x, y)) < 1e-4


def test_n_choices_through_pd(fleet):
    """n > 1: the first choice decodes on the transferred blocks, the others compute the prompt on D
    (the decode order names one request); every choice as the hybrid instance's, seeded."""
    body = {"model": "demo", "prompt": " ".join(f"w{i}" for i in range(50)), "max_tokens": 8, "n": 3,
            "temperature": 0.8, "seed": 11}
    want = httpx.post(fleet["H"].url + "/v1/completions", json=body, timeout=60)
    pr, r, _ = _handoff(fleet, body, path="/v1/completions")
    assert pr.status_code == 200 and pr.json()["promptTokens"] > 16, pr.text
    assert r.status_code == 200, r.text
    texts = lambda resp: sorted((c["index"], c["text"]) for c in resp.json()["choices"])  # noqa: E731
    assert len(texts(r)) == 3 and texts(r) == texts(want)


def test_wrong_client_key_refused_loudly(fleet):
    """H holds key dir B: D's ZAP refuses its key. H's prefill answers 503 at once saying so (not
    after the lease); D's decode request follows kvLoadFailurePolicy fail within its timeout."""
    body = {"input_id": _prompt(5 * BLOCK, 3), "parameters": {"max_new_tokens": 4, "details": True}}
    pr, r, took = _handoff(fleet, body, prefill="H")
    assert pr.status_code == 503, pr.text
    assert "refused this worker's CURVE key" in pr.text and "workerCurveKeyDir/clients/" in pr.text, pr.text
    assert took < 2.5, took  # the handshake's refusal, not kvTransferLeaseMs (3 s) after the prompt
    assert r.status_code == 503 and "ServerConfig.kvLoadFailurePolicy is fail" in r.text, r.text
    assert "kvTransferTimeoutMs" in r.text
    assert "handshake failed" in fleet["D"].tail(400)


def test_wrong_server_key_refused_loudly(fleet):
    """P told a wrong public key for D (H's): the handshake fails on P's side, at once."""
    body = {"input_id": _prompt(3 * BLOCK, 5), "parameters": {"max_new_tokens": 4, "details": True}}
    pr, r, took = _handoff(fleet, body, key=fleet["H"].pd["kvCurvePublicKey"])
    assert pr.status_code == 503 and "CURVE handshake with tcp://" in pr.text, pr.text
    assert took < 2.5, took
    assert r.status_code == 503, r.text
    # a malformed key is the client's error
    tid = uuid.uuid4().hex
    bad = httpx.post(fleet["P"].url + "/infer_token", json=body, timeout=30, headers={"X-Mindie-PD": json.dumps(
        {"op": "prefill", "transferId": tid, "kvEndpoint": fleet["D"].pd["kvEndpoints"][0],
         "kvCurvePublicKey": "short"})})
    assert bad.status_code == 400 and "kvCurvePublicKey" in bad.text, bad.text
    # the link recovers: the next transfer with the right key goes through
    body = {"input_id": _prompt(3 * BLOCK, 6), "parameters": {"max_new_tokens": 6, "details": True,
                                                              "ignore_eos": True}}
    want = _ids(httpx.post(fleet["H"].url + "/infer_token", json=body, timeout=60))
    pr, r, _ = _handoff(fleet, body)
    assert pr.status_code == 200 and _ids(r) == want


def test_through_the_coordinator_over_tcp(fleet):
    """pd_separate over P and D: the coordinator picks D's tcp endpoint (the only one it reports)
    and hands P D's public key; answers equal the hybrid instance's."""
    tmp = fleet["tmp"]
    coord = Coordinator(tmp, [fleet["P"], fleet["D"]], name="pdtcp",
                        config={"digs_scheduler_config": {"deploy_mode": "pd_separate"}})
    try:
        coord.wait_ready_line()
        coord.wait_ready()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 20:  # both roles and D's KV endpoint polled in
            insts = coord.info()["instances"]
            if sorted(i["role"] for i in insts) == ["decode", "prefill"] and all(
                    i["kv_endpoints"] for i in insts if i["role"] == "decode"):
                break
            time.sleep(0.2)
        body = {"input_id": _prompt(7 * BLOCK + 3, 9), "parameters": {"max_new_tokens": 10, "details": True,
                                                                      "ignore_eos": True}}
        want = _ids(httpx.post(fleet["H"].url + "/infer_token", json=body, timeout=60))
        assert _ids(httpx.post(coord.url + "/infer_token", json=body, timeout=60)) == want
        chat = {"model": "demo", "messages": [{"role": "user", "content": "tell me about tcp and curve"}],
                "max_tokens": 8, "temperature": 0}
        got = httpx.post(coord.url + "/v1/chat/completions", json=chat, timeout=60)
        ref = httpx.post(fleet["H"].url + "/v1/chat/completions", json=chat, timeout=60)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["message"] == ref.json()["choices"][0]["message"]
        line = coord.wait_request_lines(2)[-1]
        assert "transfer" in line, line
    finally:
        coord.stop()


# -- config rules (no server) ------------------------------------------------------------------------
def _cfg(tmp_path: Path, server: dict, key_dir: Path | None = None, **backend) -> Path:
    path = _config(tmp_path / "c.json", free_port(), server, key_dir, model_path="/m")
    cfg = json.loads(path.read_text())
    cfg["BackendConfig"].update(backend)
    path.write_text(json.dumps(cfg))
    return path


def _refused(path: Path, env: dict | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(str(path), env=env or {})
    return str(e.value)


def test_config_tcp_kv_endpoint(tmp_path):
    keys = _keys(tmp_path, "k")
    dmi = {"inferMode": "dmi", "interCommPort": 31000}
    # endpoints: ipc + tcp on interCommPort + i; tcp only drops the ipc one
    path = _cfg(tmp_path, dmi, keys, npuDeviceIds=[[0], [1]])
    ws = build_deployment(load_config(str(path), env={}).config).workers
    assert [w.kv_tcp_endpoint for w in ws] == ["tcp://127.0.0.1:31000", "tcp://127.0.0.1:31001"]
    assert all(w.kv_endpoint.startswith("ipc://") and w.kv_curve_key_dir == str(keys) for w in ws)
    (w,) = build_deployment(load_config(str(_cfg(tmp_path, {**dmi, "kvTransferTcpOnly": True}, keys)),
                                        env={}).config).workers
    assert (w.kv_endpoint, w.kv_tcp_endpoint) == ("", "tcp://127.0.0.1:31000")
    # MindIE's stock file sets interCommPort with inferMode standard: no tcp endpoint, nothing needed
    (w,) = build_deployment(load_config(str(_cfg(tmp_path, {"interCommPort": 1121})), env={}).config).workers
    assert w.kv_tcp_endpoint == "" and w.kv_endpoint.startswith("ipc://")
    # tcp without keys: refused naming the key, unless plain tcp is allowed
    msg = _refused(_cfg(tmp_path, dmi))
    assert msg.startswith("BackendConfig.workerCurveKeyDir:") and "interCommPort 0 for ipc only" in msg, msg
    (w,) = build_deployment(load_config(str(_cfg(tmp_path, dmi, workerInsecureTcp=True)), env={}).config).workers
    assert w.kv_tcp_endpoint == "tcp://127.0.0.1:31000"
    # a key dir whose clients/ lacks the workers' own key (made before KV transfers used it)
    os.unlink(keys / "clients" / "worker.key")
    msg = _refused(_cfg(tmp_path, dmi, keys))
    assert msg.startswith("BackendConfig.workerCurveKeyDir:") and "workers' public key" in msg, msg
    # every 0.0.0.0 pod needs the address peers connect to: kvTransferHost (or its env var)
    zero = {**dmi, "ipAddress": "0.0.0.0", "allowAllZeroIpListening": True}
    msg = _refused(_cfg(tmp_path, zero, workerInsecureTcp=True))
    assert msg.startswith("ServerConfig.kvTransferHost:") and "status.podIP" in msg, msg
    path = _cfg(tmp_path, zero, workerInsecureTcp=True)
    (w,) = build_deployment(load_config(str(path), env={"MINDIE_KV_TRANSFER_HOST": "10.1.2.3"}).config).workers
    assert w.kv_tcp_endpoint == "tcp://10.1.2.3:31000"
    (w,) = build_deployment(load_config(str(_cfg(tmp_path, {**dmi, "kvTransferHost": "::1"}, workerInsecureTcp=True)),
                                        env={}).config).workers
    assert w.kv_tcp_endpoint == "tcp://[::1]:31000"
    # ranges and the keys that need the tcp endpoint
    assert _refused(_cfg(tmp_path, {**dmi, "interCommPort": 80}, workerInsecureTcp=True)).startswith(
        "ServerConfig.interCommPort:")
    assert _refused(_cfg(tmp_path, {"kvTransferTcpOnly": True})).startswith("ServerConfig.kvTransferTcpOnly:")
    assert _refused(_cfg(tmp_path, {"interCommPort": 31000, "kvTransferHost": "10.0.0.1"})).startswith(
        "ServerConfig.kvTransferHost:")
