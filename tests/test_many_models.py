"""Several models behind one server (docs/design.md, "Several models"): two tiny random chat
models (different seeds, different chat templates) in one server started by the real launch
script with ``maxLoadedModels`` 1, so every switch between them evicts one and loads the other.

Each model's greedy answers are first taken from a server of its own (served alone), then must
come out the same from the shared server: before and after eviction and reload, and from
concurrent requests over both. Unload is measured on the worker processes (their pids from
/v1/status, their RSS from /proc), keep_alive 0 unloads after the request, unknown names get each
API's 404. The in-process tests cover the pieces (keep_alive parsing, the plan's endpoints).
"""
from __future__ import annotations

import concurrent.futures
import json
import re
import time
from pathlib import Path

import httpx
import pytest

from tests.harness import Server, demo_server, free_port, rss_mib, short_run_dir, wait_gone, write_config
from tests.lazy_modules import LazyModule
from tests.tiny_hf import QWEN3_CHAT_TEMPLATE, save_chat_model

ollama = LazyModule("ollama")  # imported where a test uses it (tests/lazy_modules.py)
openai = LazyModule("openai")  # imported where a test uses it (tests/lazy_modules.py)

PLAIN_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPTS = ["hello there", "count to three", "what is a model"]
TOKENS = 12


def _chat(client: openai.OpenAI, model: str, prompt: str) -> str:
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                       max_tokens=TOKENS, temperature=0)
    return r.choices[0].message.content


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=180, max_retries=0)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("many")
    return {"alpha": save_chat_model(d / "alpha", QWEN3_CHAT_TEMPLATE, seed=1),
            "beta": save_chat_model(d / "beta", PLAIN_TEMPLATE, seed=2)}


@pytest.fixture(scope="module")
def alone(models, tmp_path_factory) -> dict[str, list[str]]:
    """Each model's greedy answers to PROMPTS, served alone (one server each, stopped after)."""
    out = {}
    for name, path in models.items():
        with demo_server(tmp_path_factory.mktemp(f"alone-{name}"), str(path), model={"modelName": name}) as s:
            out[name] = [_chat(_client(s), name, p) for p in PROMPTS]
    assert out["alpha"] != out["beta"]  # two different models, or the test proves nothing
    return out


def _two_models(models, d: Path, max_loaded: int, deploy: dict | None = None, more: list | None = None) -> Server:
    port = free_port()
    cfg = write_config(d / "config.json", port=port, run_dir=short_run_dir(), workers=1,
                       model_path=str(models["alpha"]), model={"modelName": "alpha"},
                       deploy={"maxLoadedModels": max_loaded, **(deploy or {})},
                       more_models=[{"modelName": "beta", "modelWeightPath": str(models["beta"])}, *(more or [])])
    return Server(cfg, port)


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    # a third model, "huge", whose KV budget alone is more than maxLoadedMemSize: listed, never loaded
    s = _two_models(models, tmp_path_factory.mktemp("shared"), 1, deploy={"maxLoadedMemSize": 8},
                    more=[{"modelName": "huge", "cpuMemSize": 16}])
    try:
        s.wait_ready(180)
        yield s
    finally:
        s.stop()


def _states(server: Server) -> dict:
    return httpx.get(server.url + "/v1/status", timeout=10).json()["models"]


def _wait_state(server: Server, name: str, state: str, timeout: float = 30) -> dict:
    end = time.monotonic() + timeout
    while True:
        st = _states(server)[name]
        if st["state"] == state:
            return st
        assert time.monotonic() < end, f"{name} is {st['state']}, not {state}"
        time.sleep(0.1)


def test_every_model_listed_with_whether_loaded(server) -> None:
    data = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in data] == ["alpha", "beta", "huge"]
    loaded = {m["id"]: m["loaded"] for m in data}
    states = _states(server)
    assert loaded == {n: states[n]["state"] == "loaded" for n in ("alpha", "beta", "huge")}
    assert sum(loaded.values()) <= 1  # maxLoadedModels 1
    assert httpx.get(server.url + "/v1/models/beta", timeout=10).json()["id"] == "beta"  # its own app answers
    tags = ollama.Client(host=server.url, timeout=30).list()
    assert sorted(m.model for m in tags.models) == ["alpha", "beta", "huge"]
    status = httpx.get(server.url + "/v1/status", timeout=10).json()
    assert status["maxLoadedModels"] == 1 and status["models"]["beta"]["threads"] >= 1
    assert status["models"]["beta"]["kv_gb"] == 1.0
    assert status["maxLoadedMemSize"] == 8 and 1.0 < status["models"]["beta"]["mem_gb"] < 1.05
    assert status["models"]["huge"]["refused"] and not status["models"]["beta"]["refused"]


def test_a_model_alone_over_the_memory_bound_is_refused(server) -> None:
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:
        _chat(_client(server), "huge", PROMPTS[0])
    assert e.value.status_code == 503 and "maxLoadedMemSize" in str(e.value) and "huge" in str(e.value)
    assert time.monotonic() - t0 < 10  # at once, not after the request's timeout
    r = httpx.post(server.url + "/models/load", json={"model": "huge"}, timeout=60)
    assert r.status_code == 503 and "maxLoadedMemSize" in r.json()["error"]["message"], r.text
    assert _states(server)["huge"]["state"] == "unloaded" and "loading model huge" not in server.tail(2000)


def test_unknown_model_is_each_apis_404(server) -> None:
    with pytest.raises(openai.NotFoundError):
        _client(server).chat.completions.create(model="gamma", messages=[{"role": "user", "content": "x"}],
                                                max_tokens=2)
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=server.url, timeout=30).chat(model="gamma", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 404 and "gamma" in e.value.error
    r = httpx.post(server.url + "/models/load", json={"model": "gamma"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = httpx.post(server.url + "/v2/models/gamma/generate", json={"text_input": "x"}, timeout=10)
    assert r.status_code == 404


def test_answers_as_alone_before_and_after_reload(server, alone) -> None:
    client = _client(server)
    # each switch evicts the other model: alpha (loaded first), beta (loaded, alpha evicted),
    # alpha again (reloaded after its eviction, beta evicted). Beta's own reload after an eviction
    # is the next test's (its requests over both models load beta again after alpha), so a fourth
    # round, a model load more, would prove nothing new
    for name in ("alpha", "beta", "alpha"):
        assert [_chat(client, name, p) for p in PROMPTS] == alone[name]
        assert _states(server)[name]["state"] in ("loaded", "draining")
    log = server.tail(400)
    assert "evicting model alpha" in log and "evicting model beta" in log


def test_concurrent_requests_over_both_models_complete(server, alone) -> None:
    client = _client(server)
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in ("alpha", "beta")] * 2
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: _chat(client, job[0], PROMPTS[job[1]]), jobs))
    assert answers == [alone[name][i] for name, i in jobs]
    # metrics and the request log name the model that served each request
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    for name in ("alpha", "beta"):
        assert f'request_success_total{{model_name="{name}"}}' in metrics
        assert f"/v1/chat/completions status=200" in server.tail(400) and f"model={name}" in server.tail(400)


def test_unload_frees_the_workers_memory(server) -> None:
    r = httpx.post(server.url + "/models/load", json={"model": "beta"}, timeout=120)
    assert r.status_code == 200, r.text
    st = _wait_state(server, "beta", "loaded")
    pids = st["pids"]
    assert pids and set(pids) <= set(server.workers())
    held = rss_mib(pids)
    assert held > 50  # a worker process (torch, weights, KV pages touched)
    r = httpx.post(server.url + "/models/unload", json={"model": "beta"}, timeout=120)
    assert r.status_code == 200, r.text
    assert wait_gone(pids, 15) is not None
    assert rss_mib(pids) == 0 and not set(pids) & set(server.workers())
    assert _states(server)["beta"]["state"] == "unloaded"
    assert "beta" not in [m.model for m in ollama.Client(host=server.url, timeout=30).ps().models]


def test_ollama_keep_alive_zero_unloads_after_the_request(server, alone) -> None:
    ol = ollama.Client(host=server.url, timeout=180)
    r = ol.chat(model="alpha", messages=[{"role": "user", "content": PROMPTS[0]}],
                options={"temperature": 0, "num_predict": TOKENS}, keep_alive=0)
    assert r.message.content == alone["alpha"][0]
    _wait_state(server, "alpha", "unloaded", 15)
    # the next request without keep_alive loads it again, and it stays (the default: for good)
    assert _chat(_client(server), "alpha", PROMPTS[1]) == alone["alpha"][1]
    time.sleep(1.0)
    assert _states(server)["alpha"]["state"] == "loaded"
    assert [m.model for m in ol.ps().models] == ["alpha"]


def test_sleep_frees_every_worker_and_wake_restores_the_answers(server, alone) -> None:
    client = _client(server)
    assert _chat(client, "beta", PROMPTS[0]) == alone["beta"][0]
    pids = server.workers()
    assert pids and _states(server)["beta"]["state"] == "loaded"
    assert httpx.post(server.url + "/sleep?level=3", timeout=10).status_code == 400
    r = httpx.post(server.url + "/sleep?level=1", timeout=120)
    assert r.status_code == 200, r.text
    assert httpx.get(server.url + "/is_sleeping", timeout=10).json() == {"is_sleeping": True}
    assert wait_gone(pids, 15) is not None and server.workers() == []
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # asleep, not broken
    with pytest.raises(openai.APIStatusError) as e:
        _chat(client, "alpha", PROMPTS[0])
    assert e.value.status_code == 503 and "sleeping" in str(e.value)
    r = httpx.post(server.url + "/wake_up", timeout=120)
    assert r.status_code == 200, r.text
    assert httpx.get(server.url + "/is_sleeping", timeout=10).json() == {"is_sleeping": False}
    assert _states(server)["beta"]["state"] == "loaded"  # what was loaded before the sleep
    assert [_chat(client, "beta", p) for p in PROMPTS] == alone["beta"]


def test_a_load_does_not_stall_the_other_models_requests(models, alone, tmp_path) -> None:
    """Both resident (maxLoadedModels 2): while beta loads again, alpha's requests keep being
    answered, each well within beta's load time."""
    s = _two_models(models, tmp_path, 2)
    try:
        s.wait_ready(180)
        _wait_state(s, "beta", "loaded", 120)
        assert httpx.post(s.url + "/models/unload", json={"model": "beta"}, timeout=60).status_code == 200
        client = _client(s)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            loading = pool.submit(_chat, client, "beta", PROMPTS[0])
            _wait_state(s, "beta", "loading", 10)
            times = []
            while _states(s)["beta"]["state"] == "loading":
                t0 = time.monotonic()
                assert _chat(client, "alpha", PROMPTS[2]) == alone["alpha"][2]
                times.append(time.monotonic() - t0)
            assert loading.result(120) == alone["beta"][0]
        load_s = _states(s)["beta"]["load_s"]
        assert times and max(times) < load_s / 2, (times, load_s)
        # the workers' figures of every model on /metrics (the first model's route adds beta's)
        assert _chat(client, "beta", PROMPTS[1]) == alone["beta"][1]
        text = httpx.get(s.url + "/metrics", timeout=10).text
        for name in ("alpha", "beta"):
            assert f'num_requests_running{{model_name="{name}"}}' in text
        assert text.count("# TYPE num_requests_running gauge") == 1  # one family, a sample per model
        gen = re.search(r'^avg_generation_throughput_toks_per_s\{model_name="beta"\} (\S+)$', text, re.M)
        assert gen and float(gen.group(1)) > 0, text
    finally:
        s.stop()


# -- in process -------------------------------------------------------------------------------------
@pytest.mark.parametrize("value,seconds", [(0, 0.0), (30, 30.0), ("5m", 300.0), ("1h30m", 5400.0), ("-1", -1.0),
                                           (-5, -1.0), ("10s", 10.0), ("soon", None), (None, None), (True, None)])
def test_keep_alive_as_ollama_reads_it(value, seconds) -> None:
    from mindie.server.model_router import keep_alive_seconds
    assert keep_alive_seconds(value) == seconds


def test_plan_gives_each_model_its_own_workers(tmp_path: Path, models) -> None:
    from mindie.config import load_config
    from mindie.model_plan import build_many

    port = free_port()
    cfg = write_config(tmp_path / "c.json", port=port, run_dir=short_run_dir(), workers=2,
                       model_path=str(models["alpha"]), model={"modelName": "alpha"}, deploy={"maxLoadedModels": 1})
    c = json.loads(cfg.read_text())
    c["BackendConfig"]["ModelDeployConfig"]["ModelConfig"].append(
        {"modelName": "beta", "modelWeightPath": str(models["beta"]), "cpuMemSize": 0.5, "dtype": "bfloat16"})
    cfg.write_text(json.dumps(c))
    dep = build_many(load_config(str(cfg), env={}).config)
    assert [[w.model_name for w in g] for g in dep.groups] == [["alpha", "alpha"], ["beta", "beta"]]
    endpoints = [w.job_endpoint for g in dep.groups for w in g] + [w.pub_endpoint for g in dep.groups for w in g]
    assert len(set(endpoints)) == 8
    assert len({w.worker_id for g in dep.groups for w in g}) == 4
    beta = dep.models[0][0]
    assert (beta.dtype, beta.cpu_mem_gb, beta.model_path) == ("bfloat16", 0.5, str(models["beta"]))
    assert dep.max_loaded_models == 1 and dep.models_endpoint.endswith("models.ipc")


def test_sleep_mode_serves_one_model_through_the_host(tmp_path: Path, models) -> None:
    """enableSleepMode: one model, planned for the model host (sleep, wake_up, load, unload);
    without it a single model's plan is as it always was."""
    from mindie.config import load_config
    from mindie.model_plan import build_many

    cfg = write_config(tmp_path / "c.json", port=free_port(), run_dir=short_run_dir(), workers=1,
                       model_path=str(models["alpha"]), deploy={"enableSleepMode": True})
    dep = build_many(load_config(str(cfg), env={}).config)
    assert dep.models_endpoint and dep.models == [] and len(dep.groups) == 1
    cfg = write_config(tmp_path / "d.json", port=free_port(), run_dir=short_run_dir(), workers=1,
                       model_path=str(models["alpha"]))
    assert build_many(load_config(str(cfg), env={}).config).models_endpoint == ""


def test_weight_estimate_is_the_models_parameters(models) -> None:
    """workers/model_memory.py reads the safetensors headers: the bytes of the model's own
    parameters at the served dtype (fp32 as stored, bf16 half of it)."""
    import torch
    from transformers import AutoModelForCausalLM
    from workers.model_memory import weight_bytes

    model = AutoModelForCausalLM.from_pretrained(models["alpha"], dtype=torch.float32)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes(str(models["alpha"]), "float32") == weight_bytes(str(models["alpha"]), "auto") == params
    assert weight_bytes(str(models["alpha"]), "bfloat16") == params // 2


class _FakeGroup:
    """A worker group that is ready once started and gone once stopped (the host's policy only)."""

    def __init__(self, specs, parent, run_dir) -> None:
        from types import SimpleNamespace
        self.children = [SimpleNamespace(ready=False, procs=[])]
        self.exit_status, self.failure = 0, ""

    def start(self) -> None:
        self.children[0].ready = True

    def poll_once(self) -> None:
        pass

    def stop(self) -> None:
        self.children[0].ready = False


def test_memory_bound_evicts_idle_models_and_refuses_one_too_big(models, monkeypatch) -> None:
    """maxLoadedMemSize on the real ModelHost policy: the models loaded at start are those that
    fit; a load past the bound evicts the least recently used idle model (not the busy one); a
    model that alone exceeds it is never loaded, its load order and its requests refused naming
    the key."""
    import asyncio

    from mindie.contract import model_wire as W
    from mindie.contract.spec import WorkerSpec
    from mindie.model_link import ModelLink, ModelUnavailable
    from workers import model_host
    from workers.model_memory import GIB

    monkeypatch.setattr(model_host, "MIN_RESIDENT_S", 0.0)
    kv = {"a": 1.0, "b": 1.0, "c": 1.4, "d": 3.0}
    groups = [[WorkerSpec(worker_id=n, job_endpoint="", pub_endpoint="", model_name=n, dtype="float32",
                          model_path=str(models["alpha"]), cpu_mem_gb=g)] for n, g in kv.items()]
    host = model_host.ModelHost(groups, 3, -1, "inproc://unused", 0, "/tmp", _FakeGroup, max_mem_gb=2.5)
    sent: list = []
    monkeypatch.setattr(host, "_send", lambda ident, msg: sent.append(msg))

    def settle(use: W.ModelUse | None = None) -> dict:
        for _ in range(40):
            if use is not None:
                host.frontends[b"fe"] = (time.monotonic(), use)
            host.tick()
            time.sleep(0.005)
        return {n: m.state for n, m in host.models.items()}

    weights = host.models["a"].mem - GIB
    assert 0 < weights < 0.05 * GIB  # a tiny model: the KV budget dominates
    host.load_at_start()  # the first three (maxLoadedModels 3), of which a and b fit
    assert settle() == {"a": "loaded", "b": "loaded", "c": "unloaded", "d": "unloaded"}
    assert host.fits(host.models["c"]) is False  # 1 + 1 + 1.4 GiB > 2.5
    # c is wanted while a runs a request: b (idle) goes, a stays; 1 + 1.4 GiB fit
    states = settle(W.ModelUse("fe", {"a": 1}, {"c": 1}))
    assert states == {"a": "loaded", "b": "unloaded", "c": "loaded", "d": "unloaded"}
    # d alone (3 GiB + weights) is more than the bound: never loaded
    states = settle(W.ModelUse("fe", {}, {"d": 1}))
    assert states["d"] == "unloaded" and states["a"] == states["c"] == "loaded"
    report = {n: m for n, m in host.models.items()}
    assert report["d"].refused and "maxLoadedMemSize 2.5 GiB" in report["d"].refused
    host._order(b"fe", W.ModelOrder("fe", "t1", "load", "d"))
    assert sent and sent[-1].status == 503 and "maxLoadedMemSize" in sent[-1].message
    # a front end's request for it fails at once with that reason
    link = ModelLink("inproc://unused", "fe", lambda name: True)
    link.states = {"d": W.ModelState(refused=True, error=report["d"].refused, mem_gb=round(report["d"].mem / GIB, 3))}
    t0 = time.monotonic()
    with pytest.raises(ModelUnavailable, match="maxLoadedMemSize"):
        asyncio.run(link.acquire("d", 30.0))
    assert time.monotonic() - t0 < 1.0
    link.ctx.destroy(linger=0)
    host.sock.close(0)
    host.ctx.term()
