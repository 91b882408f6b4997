"""The coordinator over instances that serve different models (issue 56, item 5): two real
instances (scripts/launch.sh) serving the demo model as ``alpha`` and ``shared``, and as ``beta``
and ``shared``, each with ``maxLoadedModels`` 1 (its first model loaded at start), behind a real
coordinator (``python -m coordinator``). A request naming a model goes only to an instance that
serves it (the coordinator's request log and the instances' own counters say which), and to one
where it is loaded when there is one (``shared``: loaded by the first request on demand, then
every later request goes there); a model no instance serves is the instance's 404 in its API's
shape; ``GET /v1/models`` and Ollama's ``/api/tags`` list the fleet's models once each,
``/api/ps`` those loaded somewhere."""
from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.coord_harness import Coordinator, start_instances
from tests.lazy_modules import LazyModule

openai = LazyModule("openai")  # imported where a test uses it (tests/lazy_modules.py)
ollama = LazyModule("ollama")  # imported where a test uses it (tests/lazy_modules.py)

NAMES = ("alpha", "beta")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("coord_models")
    servers = start_instances(tmp, 2, deploy={"maxLoadedModels": 1},
                              per_instance=[{"model": {"modelName": n}, "more_models": [{"modelName": "shared"}]}
                                            for n in NAMES])
    coord = None
    try:
        coord = Coordinator(tmp, servers, config={"digs_scheduler_config": {"algorithm_type": "cache_affinity"}})
        coord.wait_ready()
        for iid in (0, 1):
            coord.wait_state(iid, "ready")
        yield servers, coord
    finally:
        if coord is not None:
            coord.stop()
        for s in servers:
            s.stop()


def received(server) -> float:
    """The instance's own count of the requests it received (its /metrics, every label summed)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^request_received_total(?:\{[^}]*\})? (\S+)$", text, re.M))


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60)


def test_instances_learn_their_models(fleet):
    _, coord = fleet
    models = {i["id"]: i["models"] for i in coord.info()["instances"]}
    assert models == {0: ["alpha", "shared"], 1: ["beta", "shared"]}, models


def test_requests_go_to_the_instance_serving_their_model(fleet):
    servers, coord = fleet
    for k, name in enumerate(NAMES):
        before = [received(s) for s in servers]
        n_lines = len(coord.settled_request_lines())
        for turn in range(3):  # different conversations: affinity and load could pick either instance
            msgs = [{"role": "user", "content": f"Say {turn} about {name}"}]
            via = client(coord.url).chat.completions.create(model=name, messages=msgs, max_tokens=6, temperature=0)
            direct = client(servers[k].url).chat.completions.create(model=name, messages=msgs, max_tokens=6,
                                                                    temperature=0)
            assert via.model == name
            assert via.choices[0].message.content == direct.choices[0].message.content
        # Triton's generate names the model in its path
        r = httpx.post(f"{coord.url}/v2/models/{name}/generate",
                       json={"text_input": "Hello", "parameters": {"max_tokens": 4}}, timeout=60)
        assert r.status_code == 200, r.text
        lines = coord.settled_request_lines()[n_lines:]
        assert len(lines) == 4 and all(f"-> instance {k}(" in ln for ln in lines), lines
        after = [received(s) for s in servers]
        # 3 relayed + 3 direct chat requests and the generate request on the serving instance, none on the other
        assert after[k] - before[k] == 7, (name, before, after)
        assert after[1 - k] == before[1 - k], (name, before, after)


def test_request_without_a_model_goes_to_any_instance(fleet):
    servers, coord = fleet
    before = sum(received(s) for s in servers)
    r = httpx.post(coord.url + "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}}, timeout=60)
    assert r.status_code == 200, r.text
    assert sum(received(s) for s in servers) == before + 1


def test_unknown_model_is_the_apis_404(fleet):
    servers, coord = fleet
    with pytest.raises(openai.NotFoundError) as via:
        client(coord.url).chat.completions.create(model="gamma", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=3)
    with pytest.raises(openai.NotFoundError) as direct:
        client(servers[0].url).chat.completions.create(model="gamma", messages=[{"role": "user", "content": "hi"}],
                                                       max_tokens=3)
    assert via.value.status_code == 404
    assert via.value.body == direct.value.body and "The model `gamma` does not exist." in str(via.value.body)
    # Ollama's shape for Ollama's route, Triton's for a model in the path: the instance's own answer
    for path, body in (("/api/chat", {"model": "gamma", "messages": [{"role": "user", "content": "hi"}],
                                      "stream": False}),
                       ("/v2/models/gamma/generate", {"text_input": "hi"})):
        r = httpx.post(coord.url + path, json=body, timeout=30)
        d = httpx.post(servers[1].url + path, json=body, timeout=30)
        assert r.status_code == d.status_code == 404 and r.json() == d.json(), (path, r.text, d.text)
        assert "gamma" in r.text

def test_models_lists_the_fleet(fleet):
    _, coord = fleet
    listed = client(coord.url).models.list()
    assert [m.id for m in listed.data] == ["alpha", "shared", "beta"]
    raw = httpx.get(coord.url + "/v1/models", timeout=10).json()
    assert [(m["id"], m["instances"]) for m in raw["data"]] == [("alpha", 1), ("shared", 2), ("beta", 1)], raw
    # GET /v1/models/{m} reaches an instance serving m
    assert client(coord.url).models.retrieve("beta").id == "beta"


def _loaded(coord) -> dict:
    return {i["id"]: i["loaded"] for i in coord.info()["instances"]}


def _wait_loaded(coord, want: dict, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while (got := _loaded(coord)) != want:
        assert time.monotonic() < end, got
        time.sleep(0.2)


def test_requests_go_where_their_model_is_loaded(fleet):
    """``shared`` is on both instances, loaded on neither: its first request loads it on one of
    them (evicting that one's first model: maxLoadedModels 1), and every later request, each a new
    conversation (no affinity), goes there too, not to the other to load it a second time."""
    servers, coord = fleet
    _wait_loaded(coord, {0: ["alpha"], 1: ["beta"]})  # what their /v2/status says: the first models
    n_lines = len(coord.settled_request_lines())
    for turn in range(4):
        msgs = [{"role": "user", "content": f"Tell {turn} things about sharing"}]
        r = client(coord.url).chat.completions.create(model="shared", messages=msgs, max_tokens=4, temperature=0)
        assert r.model == "shared"
    lines = coord.settled_request_lines()[n_lines:]
    where = {int(re.search(r"-> instance (\d)\(", ln).group(1)) for ln in lines}
    assert len(lines) == 4 and len(where) == 1, lines
    k = where.pop()
    _wait_loaded(coord, {k: ["shared"], 1 - k: [NAMES[1 - k]]})
    assert "loading model shared" in servers[k].tail(400)
    assert "loading model shared" not in servers[1 - k].tail(400)
    # Ollama's model lists of the fleet: every model once; those loaded somewhere
    ol = ollama.Client(host=coord.url, timeout=30)
    assert [m.model for m in ol.list().models] == ["alpha", "shared", "beta"]
    assert sorted(m.model for m in ol.ps().models) == sorted(["shared", NAMES[1 - k]])


def test_model_scope_rules_in_process():
    """The routing rules on the real Registry and Router (no processes): a name scopes routing
    only when an instance lists it (Ollama's ``:latest`` dropped), affinity never crosses models,
    a removed instance's models leave the index, and the fleet's list counts instances."""
    import msgspec
    from coordinator.config import CoordinatorConfig
    from coordinator.model_index import aggregate, model_of
    from coordinator.registry import Instance, Registry
    from coordinator.router import Router

    cfg = msgspec.convert({"digs_scheduler_config": {"algorithm_type": "cache_affinity"}}, CoordinatorConfig)
    reg = Registry(3, 5.0, False, False, 100)
    lists = [{"alpha": {"id": "alpha"}, "beta": {"id": "beta"}}, {"beta": {"id": "beta"}}]
    for i, models in enumerate(lists):
        inst = reg.add(Instance(id=i, ip="127.0.0.1", business_port=3000 + i, mgmt_port=3000 + i), quiet=True)
        reg.set_models(inst, models)
        inst.polled_ok = inst.seen = True
        inst.total_slots = inst.avail_slots = 8
    router = Router(cfg, reg, None)
    assert model_of("/api/show", {"name": "alpha"}) == "alpha" and model_of("/v2/models/beta/infer", {}) == "beta"
    msgs = [{"role": "user", "content": "hello"}]
    for name, scope in (("alpha", "alpha"), ("alpha:latest", "alpha"), ("gamma", ""), ("tgi", ""), ("", "")):
        assert router.info("/v1/chat/completions", {"model": name, "messages": msgs}).scope == scope, name
    for _ in range(4):  # alpha lives on instance 0 only
        inst, _ = router.pick(router.info("/v1/chat/completions", {"model": "alpha", "messages": msgs}), set())
        assert inst.id == 0
    # the same conversation for beta, whose affine instance is free to differ: beta's keys are its own
    a = router.info("/v1/chat/completions", {"model": "alpha", "messages": msgs}).keys
    b = router.info("/v1/chat/completions", {"model": "beta", "messages": msgs}).keys
    assert a and b and not set(a) & set(b)
    picks = {router.pick(router.info("/v1/completions", {"model": "beta", "prompt": f"p{k}"}), set())[0].id
             for k in range(4)}
    assert picks == {0, 1}  # beta is on both: load spreads it
    # beta loaded on neither (as their polls say): the first request loads it on one, and the next
    # ones, new prompts, follow it there
    reg.instances[0].loaded, reg.instances[1].loaded = frozenset({"alpha"}), frozenset()
    chat = router.info("/v1/chat/completions", {"model": "beta", "messages": [{"role": "user", "content": "x"}]})
    first, _ = router.pick(chat, set())
    assert {router.pick(router.info("/v1/completions", {"model": "beta", "prompt": f"q{k}"}), set())[0].id
            for k in range(4)} == {first.id}
    # a poll says beta is loaded on the other one only: the conversation's affine instance is cold
    other = reg.instances[1 - first.id]
    first.loaded, other.loaded = frozenset(), frozenset({"beta"})
    assert router.pick(chat, set()) == (other, "affinity_cold")
    first.loaded = other.loaded = None  # one-model servers: every model they list is loaded
    assert [(m["id"], m["instances"]) for m in aggregate(reg.ready())["data"]] == [("alpha", 1), ("beta", 2)]
    # the list does not depend on which instance was admitted (or became ready) first
    assert aggregate(reversed(reg.ready())) == aggregate(reg.ready())
    reg.remove(0, quiet=True)
    assert router.info("/v1/completions", {"model": "alpha"}).scope == "" and dict(reg.models.count) == {"beta": 1}
