"""Many concurrent short ``/infer`` streams over kept-alive connections, on the real server
(scripts/launch.sh, demo model): every answer ends with its full output, and the request log
says so; none is an HTTP 200 with an empty body (``status=200 out=0 error=''``).

The defect this guards against: a stream's frames that landed just as its wait for them timed
out (the idle tick, mindie/sse.py) were dropped, and the request ended as an empty success
(mindie/device_client.py ``RequestStream.get``). With the default 1 s tick that took a loaded server (a
thousand streams through the coordinator lost 1-6 %); a 2 ms tick (``MINDIE_SSE_IDLE_TICK_S``)
makes nearly every wait time out, and over half of these streams came back empty before the fix.
"""
from __future__ import annotations

import asyncio
import json
import re

import httpx

from harness import demo_server

STREAMS = 240
CONNECTIONS = 60  # kept-alive, each reused by several streams in turn


async def _one(client: httpx.AsyncClient, url: str, i: int, tokens: int) -> tuple[int, bytes]:
    body = {"input_id": [9 + i % 50, 6], "stream": True,
            "parameters": {"max_new_tokens": tokens, "ignore_eos": True}}
    r = await client.post(url + "/infer", json=body)
    return r.status_code, r.content


async def _run(url: str) -> list[tuple[int, int, bytes]]:
    limits = httpx.Limits(max_connections=CONNECTIONS, max_keepalive_connections=CONNECTIONS)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        jobs = [(i, 1 + i % 2) for i in range(STREAMS)]  # 1 and 2 tokens: the whole answer in one or two frames
        answers = await asyncio.gather(*(_one(client, url, i, n) for i, n in jobs))
    return [(n, status, content) for (_, n), (status, content) in zip(jobs, answers)]


def test_short_streams_on_kept_alive_connections_end_in_full(tmp_path) -> None:
    with demo_server(tmp_path, None, env={"MINDIE_SSE_IDLE_TICK_S": "0.002"}) as srv:
        results = asyncio.run(asyncio.wait_for(_run(srv.url), 240))
        log = srv.tail(100000)
    bad = []
    for tokens, status, content in results:
        events = [json.loads(e[len(b"data:"):]) for e in content.split(b"\n\n") if e.startswith(b"data:")]
        full = (status == 200 and len(events) == tokens and "generated_text" in events[-1]
                and "error" not in events[-1])
        if not full:
            bad.append((tokens, status, content[:200]))
    assert not bad, f"{len(bad)} of {len(results)} streams did not end in full, e.g. {bad[:3]}"
    lines = re.findall(r"mindie\.request: request \S+ /infer .*", log)
    assert len(lines) == STREAMS, f"{len(lines)} request-log lines for {STREAMS} requests"
    wrong = [ln for ln in lines if "status=200" not in ln or " out=0 " in ln or "finish=length" not in ln]
    assert not wrong, wrong[:3]
