"""Checks the model-family tests run against a real server (tests/harness.py ``demo_server``):
/infer_token's greedy ids, a metric's value, and the OpenAI chat route against a reference's
greedy continuation of the same conversation."""
from __future__ import annotations

import re
from typing import Any, Callable

import httpx


def infer_ids(url: str, prompt: list[int], n: int, model: str | None = None) -> list[int]:
    """The ids /infer_token generates for ``prompt`` (``n`` tokens, greedy, eos ignored); ``model``:
    the body's model name (a server of several models routes by it)."""
    r = httpx.post(url + "/infer_token", json={"input_id": prompt, **({"model": model} if model else {}), "parameters": {
        "max_new_tokens": n, "ignore_eos": True, "details": True}}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["details"]["generated_token_ids"]


def metric(url: str, name: str) -> float:
    """The value of metric ``name`` on /metrics (its first sample)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)", text, re.M)
    assert m, text[-2000:]
    return float(m.group(1))


def assert_chat_equals(url: str, tok: Any, greedy: Callable[[list[int], int], list[int]], content: str,
                       n: int = 12, model: str | None = None) -> None:
    """The chat route's greedy answer to one user message equals ``greedy`` (the reference's
    continuation) of the prompt ``tok``'s chat template renders, decoded; ``model``: the model named."""
    msgs = [{"role": "user", "content": content}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    ref = greedy(list(ids), n)
    r = httpx.post(url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": n, "ignore_eos": True,
                                                       "temperature": 0, **({"model": model} if model else {})},
                   timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["choices"][0]["message"]["content"] == tok.decode(ref, skip_special_tokens=True)
