"""The coordinator over instances that serve different models (issue 56, item 5): two real
instances (scripts/launch.sh) serving the demo model as ``alpha`` and as ``beta``, behind a real
coordinator (``python -m coordinator``). A request naming a model goes only to an instance that
serves it (the coordinator's request log and the instances' own counters say which); a model no
instance serves is the instance's 404 in its API's shape; ``GET /v1/models`` lists the fleet's
models once each, with how many instances serve them."""
from __future__ import annotations

import re

import httpx
import openai
import pytest

from tests.coord_harness import Coordinator, start_instances

NAMES = ("alpha", "beta")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("coord_models")
    servers = start_instances(tmp, 2, per_instance=[{"model": {"modelName": n}} for n in NAMES])
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
    assert models == {0: ["alpha"], 1: ["beta"]}, models


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
    assert [m.id for m in listed.data] == list(NAMES)
    raw = httpx.get(coord.url + "/v1/models", timeout=10).json()
    assert [(m["id"], m["instances"]) for m in raw["data"]] == [("alpha", 1), ("beta", 1)], raw
    # GET /v1/models/{m} reaches an instance serving m
    assert client(coord.url).models.retrieve("beta").id == "beta"
