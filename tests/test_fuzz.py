"""Hostile input (issue 13, item 1: "no input makes a 5xx"; docs/reliability.md "Hostile input").

Unit part: the JSON nesting limit checked before decoding (mindie.text.validation._too_deep) against
a reference depth on random trees.

Server part: one real server (scripts/launch.sh, one front end, one CPU worker, generations of
at most 4 tokens, 5 s server timeouts) receives thousands of hostile requests, all over raw
sockets so that nothing is normalised on the way: random JSON trees (deep, wide, huge numbers,
NaN-like literals, unicode, invalid UTF-8), valid MindIE bodies with parameters swapped for
wrong types and out-of-range values, random methods, paths, headers and bodies against every
route the app registers, and broken framing (HTTP versions, Content-Length lies, broken chunks,
stray CR/LF/NUL, random bytes), and clients that stall (idle connections, blank lines, heads and
bodies sent slowly or cut off at random points without closing: the receive timeouts, 408), a
1 MiB header flood (its 431 read by a client still sending). Every answer must have a documented status (DOCUMENTED) and,
unless it is a 2xx, MindIE's {"error", "error_type"} JSON body; every exchange ends within
REQUEST_BOUND_S; after each test every server process is alive (same pids: nothing died and was
respawned), the log holds no traceback, and at the end /health is 200 and a normal request works.

Examples are derandomized (the same requests on every run). MINDIE_FUZZ_EXAMPLES=N runs N
examples per hypothesis test instead of the defaults (about 2,500 requests in all), e.g.
    MINDIE_FUZZ_EXAMPLES=5000 pytest tests/test_fuzz.py
"""
from __future__ import annotations

import ast
import asyncio
import collections
import contextlib
import json
import os
import random
import re
import socket
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mindie.pipeline import read_body
from mindie.contract.http_error import ApiError
from mindie.api.infer_schema import parse_infer_request
from mindie.text.validation import MAX_JSON_DEPTH, Limits, _too_deep
from tests.harness import ROOT, Server, alive, descendants, free_port, short_run_dir, write_config

pytestmark = pytest.mark.timeout(900)

REQUEST_BOUND_S = 20.0  # e2eTimeout (5 s) + generous slack on a busy 2-core box
HEAD_TIMEOUT_S = 2.0  # the server's ServerConfig.headTimeoutS
BODY_TIMEOUT_S = 3.0  # and bodyTimeoutS
TIMEOUT_SLACK_S = 2.5  # a timeout acts within this of its due time on a busy 2-core box
MAX_NEW = 4  # ScheduleConfig.maxIterTimes: every generation is short

# The statuses a client may see (docs/reliability.md). 500 only as a timeout
# ("Engine callback timeout: ...") or a worker lost mid-request; 503 only without a ready
# worker (never during this test: the worker must stay alive).
DOCUMENTED = {200, 400, 404, 405, 408, 413, 422, 424, 431, 500, 505}
BODY_STATUSES = {200, 413, 422, 424, 500}  # what a well-framed POST /infer[_token] may get
DOCUMENTED_500 = re.compile(r"Engine callback timeout: |Device worker \d+ (stopped responding|restarted|dropped)")
# What must never appear in the server log while hostile input arrives.
LOG_ALARMS = re.compile(r"Traceback|Exception in ASGI application|unhandled error|WORKER TIMEOUT|"
                        r"Worker \(pid:\d+\) (was sent|exited)|Device step failed|Request refused")

ROUTES = ["/infer", "/infer_token", "/health", "/v2/health/live", "/v2/health/ready", "/v1/models",
          "/v1/models/{model}", "/metrics", "/v1/tokenizer", "/v2", "/v2/models/{model}", "/v2/models/{model}/config",
          "/v2/models/{model}/stopInfer", "/v2/models/{model}/ready", "/health/timed", "/health/timed-{n}", "/info",
          "/v1/config", "/v1/status", "/v2/status", "/v2/models/{model}/getSlotCount", "/metrics-json",
          "/generate", "/generate_stream", "/", "/v2/models/{model}/infer", "/v2/models/{model}/generate",
          "/v2/models/{model}/generate_stream", "/v1/completions", "/v1/chat/completions",
          "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/messages", "/v1/messages/count_tokens",
          "/api/chat", "/api/generate", "/api/tags", "/api/ps", "/api/version", "/api/show", "/api/embed",
          "/v1/responses", "/v1/responses/{response_id}", "/v1/embeddings",
          "/rerank", "/v1/rerank", "/v2/rerank", "/score", "/v1/score"]
POST_ROUTES = {"/infer", "/infer_token", "/v1/tokenizer", "/v2/models/{model}/stopInfer", "/generate",
               "/generate_stream", "/", "/v2/models/{model}/infer", "/v2/models/{model}/generate",
               "/v2/models/{model}/generate_stream",
               "/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
               "/v1/messages", "/v1/messages/count_tokens", "/api/chat", "/api/generate", "/api/show", "/api/embed",
               "/v1/responses", "/v1/embeddings", "/rerank", "/v1/rerank", "/v2/rerank", "/score", "/v1/score"}
# Routes that answer both GET and POST (TGI's POST /, Ollama's GET / "Ollama is running").
GET_AND_POST = {"/"}
# Routes that answer GET and DELETE (a stored response of OpenAI's Responses API).
GET_AND_DELETE = {"/v1/responses/{response_id}"}
# Registered but not fuzzed: it stops the server (tests/test_management.py drives it).
# /stopService stops the server; the role routes would turn it into a prefill or decode instance
# that refuses plain requests (tests/test_pd.py covers them).
NOT_FUZZED = {"/stopService", "/v1/role/{role}", "/v2/role/{role}"}


def _path(route: str) -> bytes:
    return route.replace("{model}", "demo").replace("{n}", "3").replace("{response_id}", "resp_none").encode()
PARAM_KEYS = ["temperature", "top_k", "top_p", "typical_p", "do_sample", "seed", "repetition_penalty",
              "watermark", "priority", "max_new_tokens", "timeout", "details"]


def _n(default: int) -> int:
    return int(os.environ.get("MINDIE_FUZZ_EXAMPLES") or default)


def fuzz_settings(default: int):
    return settings(max_examples=_n(default), deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=False)


def weighted(*choices):
    """One of the strategies, drawn with the given weights (``one_of`` does not draw its
    branches evenly)."""
    table = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.integers(0, len(table) - 1).flatmap(table.__getitem__)


# --------------------------------------------------------------------------------------------
# JSON with hostile literals
# --------------------------------------------------------------------------------------------


class Raw(bytes):
    """Bytes written into a JSON document as they are (literals JSON does not allow, invalid UTF-8)."""


def dump(v) -> bytes:
    if isinstance(v, Raw):
        return bytes(v)
    if isinstance(v, dict):
        return b"{" + b",".join(dump(k) + b":" + dump(x) for k, x in v.items()) + b"}"
    if isinstance(v, list):
        return b"[" + b",".join(dump(x) for x in v) + b"]"
    return json.dumps(v, ensure_ascii=False).encode("utf-8", "surrogatepass")


EDGE_NUMBERS = [0, 1, -1, 2, 5, 6, 20, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
                -(2**63), -(2**63) - 1, 10**30, 1048576, 1048577, 65535, 65536, 0.0, -0.0, 0.5, 1.0, 1.5, 5.0,
                1e-7, 1e308, -1e308, 3.4028234663852886e38, 3.5e38, 5e-324, 0.999999999]
RAW_LITERALS = [b"NaN", b"-NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"9" * 400, b"-" + b"9" * 400,
                b"0." + b"0" * 400 + b"1", b"1e-999", b"-0", b"0x10", b"01", b"1.", b".5", b"+1", b"1e", b"tru",
                b"nul", b"undefined", b"'a'", b'"\\ud800"', b'"\\udfff\\ud800"', b'"\xff"', b'"\xc3"',
                b'"\xed\xa0\x80"', b'"\xf4\x90\x80\x80"', b'"\x00"', b'"a\nb"', b'"\\u0000"', b'"\\x41"', b"[1,]",
                b'{"a":1,}', b"{,}", b"[", b"}", b"", b"/*c*/1", b"1 2"]
EDGE_TEXT = ["", " ", "a", "\u00e9\u4e2d\U0001f600", "\u202e\ufeff", "\x00", "a" * 5000, "[" * 200, "{" * 200,
             '\\"]]]]', "\ud7ff\ue000\uffff"]

raw_literals = st.sampled_from(RAW_LITERALS).map(Raw)
leaves = weighted(
    (1, st.none() | st.booleans()), (2, st.integers(-(2**70), 2**70)),
    (1, st.floats(allow_nan=False, allow_infinity=False)), (2, st.text(max_size=24)),
    (2, st.sampled_from(EDGE_NUMBERS)), (1, st.sampled_from(EDGE_TEXT)),
)
trees = st.recursive(leaves, lambda c: st.lists(c, max_size=6) | st.dictionaries(st.text(max_size=8), c, max_size=6),
                     max_leaves=40)


@st.composite
def deep(draw):
    """A value nested ``depth`` levels: around the limit, around Python's recursion limit, or far past it."""
    depth = draw(st.sampled_from([MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 990, 1000, 1010, 100_000])
                 | st.integers(1, 3000))
    kind = draw(st.sampled_from(["[", "{", "mixed", "wide"]))
    inner = dump(draw(leaves | raw_literals))
    if kind == "[":
        return Raw(b"[" * depth + inner + b"]" * depth)
    if kind == "{":
        return Raw(b'{"a":' * depth + inner + b"}" * depth)
    if kind == "wide":  # depth 2, many brackets: the scan path without a rejection
        return Raw(b"[" + b",".join([b"[" + inner + b"]"] * min(depth, 2000)) + b"]")
    opens = [b"[" if i % 2 else b'{"k":' for i in range(depth)]
    return Raw(b"".join(opens) + inner + b"".join(b"]" if i % 2 else b"}" for i in reversed(range(depth))))


values = weighted((4, trees), (2, deep()), (1, raw_literals))


@st.composite
def corrupt(draw, body: bytes) -> bytes:
    """Invalid UTF-8, a NUL, truncation or a stray bracket at a random place, or nothing."""
    how = draw(st.sampled_from(["none", "none", "none", "none", "byte", "truncate", "bracket"]))
    if how == "none" or not body:
        return body
    i = draw(st.integers(0, len(body)))
    if how == "truncate":
        return body[:i]
    if how == "bracket":
        return body[:i] + draw(st.sampled_from([b"[", b"]", b"{", b"}", b'"', b"\\"])) + body[i:]
    return body[:i] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"\x80"])) + body[i:]


# --------------------------------------------------------------------------------------------
# Unit: the depth limit before decoding
# --------------------------------------------------------------------------------------------


def depth_of(v) -> int:
    if isinstance(v, dict):
        return 1 + max(map(depth_of, v.values()), default=0)
    if isinstance(v, list):
        return 1 + max(map(depth_of, v), default=0)
    return 0


tricky_text = st.text(alphabet='[]{}"\\ a\u00e9\n', max_size=12)
plain_trees = st.recursive(st.none() | st.integers() | tricky_text,
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(tricky_text, c, max_size=3),
                           max_leaves=12)


@st.composite
def nested_trees(draw):
    v = draw(plain_trees)
    kinds = draw(st.binary(min_size=MAX_JSON_DEPTH - 12, max_size=MAX_JSON_DEPTH + 4))  # one level each
    siblings = draw(st.lists(plain_trees, min_size=1, max_size=3))
    for i, kind in enumerate(kinds):
        v = {"k": v} if kind % 3 == 0 else [v] if kind % 3 == 1 else [siblings[i % len(siblings)], v]
    return v


@given(tree=nested_trees(), ascii_only=st.booleans())
@settings(max_examples=200, deadline=None, derandomize=True, database=None)
def test_depth_scan_matches_reference(tree, ascii_only):
    body = json.dumps(tree, ensure_ascii=ascii_only).encode()
    assert _too_deep(body) == (depth_of(tree) > MAX_JSON_DEPTH)


DEEP_BODIES = [
    (b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH, "ok"),  # "Not found inputs.", not a parse error
    (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), "422"),
    (b'{"input_id":[1],"x":' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}", "ok"),
    (b'{"input_id":[1],"x":' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}", "422"),
    (b'{"input_id":[1],"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "422"),
    (b'{"input_id":[1],"x":"' + b"[" * 5000 + b'"}', "ok"),  # brackets in a string do not nest
    (b'{"input_id":[1],"x":"\\"' + b"[" * 5000 + b'"}', "ok"),
    (b'{"input_id":[1],"parameters":' + b'{"a":' * 1000 + b"1" + b"}" * 1001, "422"),
]


@pytest.mark.parametrize("i", range(len(DEEP_BODIES)))
def test_deep_bodies_are_422(i):
    body, expect = DEEP_BODIES[i]
    try:
        parse_infer_request(body, Limits(vocab_size=32000), encode=lambda s: [1])
    except ApiError as e:
        parse_error = (e.status, e.message) == (422, "Failed to parse request context to json")
        assert parse_error == (expect == "422"), e
    else:
        assert expect == "ok"


class _Req:
    """What read_body uses of a Falcon request: content_length and an async-iterable stream."""

    def __init__(self, content_length, chunks):
        self.content_length = content_length
        self.chunks = chunks

    @property
    def stream(self):
        async def gen():
            for c in self.chunks:
                yield c
        return gen()


@pytest.mark.parametrize("content_length, chunks, want", [
    (5, [b"ab", b"cde"], b"abcde"),
    (None, [b"x" * 600_000, b"y" * 400_000], 1_000_000),  # chunked: counted while read
    (None, [b"x" * 600_000, b"y" * 600_000], 413),
    (2 * 1024 * 1024, [], 413),  # refused before reading
    (100, [b'{"input_id":[1]}'], 400),  # the client hung up: the stream just ended
])
def test_read_body(content_length, chunks, want):
    try:
        body = asyncio.run(read_body(_Req(content_length, chunks), 1))
    except ApiError as e:
        assert e.status == want, e
        assert json.loads(e.body())["error_type"] in ("Bad Request", "Request Entity Too Large")
    else:
        assert body == want or len(body) == want


def test_routes_match_the_app():
    """ROUTES are the routes mindie/server/app.py registers (a new route is fuzzed too, or this fails)."""
    tree = ast.parse((ROOT / "mindie" / "server" / "app.py").read_text())
    # create_app's route table: ("/path", resource, suffix) tuples per plane.
    found = {n.elts[0].value for n in ast.walk(tree) if isinstance(n, ast.Tuple) and n.elts
             and isinstance(n.elts[0], ast.Constant) and str(n.elts[0].value).startswith("/")}
    assert found == set(ROUTES) | NOT_FUZZED


# --------------------------------------------------------------------------------------------
# The server and a raw HTTP client
# --------------------------------------------------------------------------------------------


class Fuzzed:
    def __init__(self, srv: Server):
        self.srv = srv
        self.port = srv.port
        self.sent = 0
        self.statuses: collections.Counter = collections.Counter()  # (test, status) -> count
        self.log_pos = 0
        # Every Python process of the server (launcher's children and theirs) at the start.
        self.pids = {p: _cmdline(p) for p in descendants(srv.proc.pid) if b"python" in _cmdline(p)}

    def check_alive_and_quiet(self) -> None:
        assert self.srv.proc.poll() is None, f"launch.sh exited:\n{self.srv.tail()}"
        dead = [self.pids[p] for p in self.pids if not alive(p) or _cmdline(p) != self.pids[p]]
        assert not dead, f"server processes died: {dead}\n{self.srv.tail()}"
        self.srv.log.flush()
        with open(self.srv.log_path, "rb") as f:
            f.seek(self.log_pos)
            new = f.read()
        self.log_pos += len(new)
        log = new.decode(errors="replace")
        alarms = [ln for ln in log.splitlines() if LOG_ALARMS.search(ln)]
        assert not alarms, "server log:\n" + "\n".join(alarms[:20]) + "\n" + log[-3000:]


def _cmdline(pid: int) -> bytes:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    return b""


@pytest.fixture(scope="module")
def fz(tmp_path_factory, demo_model):
    tmp = tmp_path_factory.mktemp("fuzz")
    port = free_port()
    cfg = write_config(tmp / "config.json", port=port, run_dir=short_run_dir(), workers=1, model_path=demo_model,
                       server={"maxRequestLength": 1, "tokenTimeout": 5, "e2eTimeout": 5,
                               "headTimeoutS": HEAD_TIMEOUT_S, "bodyTimeoutS": BODY_TIMEOUT_S},
                       schedule={"maxIterTimes": MAX_NEW})
    srv = Server(cfg, port, frontends=1)
    try:
        srv.wait_ready()
        f = Fuzzed(srv)
        assert len(f.pids) >= 4, f.pids  # gunicorn master, front end, supervisor, worker
        yield f
        print(f"\nfuzz: {f.sent} requests; (test, status): count, 0 = connection closed without an answer:")
        for (test, status), n in sorted(f.statuses.items()):
            print(f"  {test:40s} {status:3d}: {n}")
    finally:
        srv.stop()


@pytest.fixture(autouse=True)
def _alive_after_each_test(request):
    yield
    if "fz" in request.fixturenames:
        request.getfixturevalue("fz").check_alive_and_quiet()


class Resp:
    def __init__(self, status: int, headers: dict[bytes, bytes], body: bytes):
        self.status, self.headers, self.body = status, headers, body

    def __repr__(self) -> str:
        return f"Resp({self.status}, {self.body[:300]!r})"


class Truncated(AssertionError):
    pass


def parse_responses(buf: bytes, head: bool) -> list[Resp]:
    """Every response in ``buf``; a truncated one raises ``Truncated`` (fails the test)."""
    out = []
    while buf:
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            raise Truncated(f"truncated response head: {buf[:300]!r}")
        lines = buf[:end].split(b"\r\n")
        m = re.fullmatch(rb"HTTP/1\.1 (\d{3}) [^\r\n]*", lines[0])
        assert m, f"bad status line: {lines[0][:200]!r}"
        status = int(m.group(1))
        headers = {}
        for ln in lines[1:]:
            k, _, v = ln.partition(b":")
            headers[k.strip().lower()] = v.strip()
        buf = buf[end + 4:]
        n = int(headers.get(b"content-length", b"-1"))
        if 100 <= status < 200 or status in (204, 304) or head and len(buf) != n:
            body = b""  # (a HEAD's answer may still carry a body: uvicorn's 400 to a request it could not parse)
        elif headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            body = b""
            while True:
                nl = buf.find(b"\r\n")
                if nl < 0:
                    raise Truncated(f"truncated chunked body: {body[-200:]!r}")
                size = int(buf[:nl].split(b";")[0], 16)
                if len(buf) < nl + 2 + size + 2:
                    raise Truncated(f"truncated chunk: {buf[:200]!r}")
                body += buf[nl + 2:nl + 2 + size]
                buf = buf[nl + 2 + size + 2:]
                if size == 0:
                    break
        elif n >= 0:
            if len(buf) < n:
                raise Truncated(f"truncated body: {len(buf)} of {n} bytes")
            body, buf = buf[:n], buf[n:]
        else:
            body, buf = buf, b""
        if not 100 <= status < 200:
            out.append(Resp(status, headers, body))
    return out


def exchange(fz: Fuzzed, data: bytes, *, expect: int | None = None, half_close: bool = False,
             head: bool = False) -> list[Resp]:
    """Send ``data`` on a new connection; read until ``expect`` whole responses came, or else
    until the server closes the connection (after a half-close when the framing may leave the
    server waiting for more). All within REQUEST_BOUND_S."""
    fz.sent += 1
    t0 = time.monotonic()
    buf = bytearray()
    with socket.create_connection(("127.0.0.1", fz.port), timeout=REQUEST_BOUND_S) as s:
        with contextlib.suppress(OSError):  # the server may answer and close before all is sent
            s.sendall(data)
            if half_close:
                s.shutdown(socket.SHUT_WR)
        while True:
            left = REQUEST_BOUND_S - (time.monotonic() - t0)
            assert left > 0, f"no end after {REQUEST_BOUND_S} s: {data[:300]!r} -> {bytes(buf[:300])!r}"
            s.settimeout(left)
            try:
                chunk = s.recv(1 << 16)
            except ConnectionResetError:
                break
            except socket.timeout:
                continue  # the assert above fails
            if not chunk:
                break
            buf += chunk
            if expect is not None:
                with contextlib.suppress(Truncated):
                    if len(parse_responses(bytes(buf), head)) >= expect:
                        break
    rs = parse_responses(bytes(buf), head)
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[-1].split("[")[0].split(" ")[0]
    fz.statuses.update((test, r.status) for r in rs or [Resp(0, {}, b"")])  # 0: no answer
    if expect is not None:
        assert len(rs) == expect, f"{len(rs)} responses to {data[:300]!r}: {rs}"
    # Here too, so that hypothesis finds the request that did it (a line logged only after the
    # answer is blamed on the next request: hypothesis then reports a flaky failure, still a failure).
    fz.check_alive_and_quiet()
    return rs


OPENAI_PATHS = (b"/v1/completions", b"/v1/chat/completions", b"/v1/embeddings", b"/score", b"/v1/score")
RERANK_PATHS = (b"/rerank", b"/v1/rerank", b"/v2/rerank")  # Cohere's {"message": "..."}


def _responses(bare: bytes) -> bool:
    """Under /v1/responses: OpenAI's error object, named SSE events."""
    return bare == b"/v1/responses" or bare.startswith(b"/v1/responses/")


def check(r: Resp, allowed: set[int] = DOCUMENTED, head: bool = False, path: bytes = b"") -> None:
    """A documented status; JSON or SSE bodies that parse; errors in MindIE's shape (OpenAI's
    {"error": {"message", "type", "param", "code"}} on the OpenAI routes and for a path under /v1/
    that no route serves; Anthropic's {"type": "error", "error": {"type", "message"}} under
    /v1/messages; Ollama's {"error": "..."} under /api/; Cohere's {"message": "..."} on the rerank routes)."""
    assert r.status in allowed, r  # 503 is not: the worker is alive throughout
    ctype = r.headers.get(b"content-type", b"")
    bare = path.split(b"?")[0]
    anthropic = bare == b"/v1/messages" or bare.startswith(b"/v1/messages/")
    ollama = bare.startswith(b"/api/")
    if 200 <= r.status < 300:
        if ctype.startswith(b"application/json") and r.body:
            json.loads(r.body)
        elif ctype.startswith(b"application/x-ndjson"):  # Ollama's streams: one JSON object a line
            assert ollama and r.body.endswith(b"\n"), r
            for line in r.body.split(b"\n")[:-1]:
                assert isinstance(json.loads(line), dict), r
        elif ctype.startswith(b"text/event-stream"):  # SSE frames, or MindIE's raw timeout text last
            for frame in r.body.split(b"\n\n")[:-1]:
                if frame == b"data: [DONE]" and bare in OPENAI_PATHS:
                    continue
                assert not ollama, r  # NDJSON, never SSE
                if anthropic or _responses(bare):  # named events
                    name, data = frame.split(b"\n")
                    assert name.startswith(b"event: ") and data.startswith(b"data: {"), r
                    json.loads(data[6:])
                    continue
                # MindIE's and OpenAI's frames are "data: {", TGI's and Triton's "data:{" (MindIE's own)
                assert frame.startswith((b"data: {", b"data:{")) or frame.startswith(b"Engine callback timeout: "), r
                json.loads(frame[5:]) if frame.startswith(b"data:") else None
        return
    if head and not r.body:
        return
    try:
        err = json.loads(r.body)
    except ValueError:
        raise AssertionError(f"error body is not JSON: {r}") from None
    assert ctype.startswith(b"application/json"), r
    unrouted_v1 = r.status == 404 and bare.startswith(b"/v1/")
    if anthropic and isinstance(err, dict) and err.get("type") == "error":
        e = err["error"]
        assert list(err) == ["type", "error"] and list(e) == ["type", "message"], r
        assert isinstance(e["type"], str) and isinstance(e["message"], str), r
        message = e["message"]
    elif (bare in OPENAI_PATHS or unrouted_v1 or _responses(bare)) and isinstance(err, dict) and isinstance(err.get("error"), dict):
        e = err["error"]
        assert list(err) == ["error"] and list(e) == ["message", "type", "param", "code"], r
        assert isinstance(e["message"], str) and isinstance(e["type"], str) and e["code"] == r.status, r
        message = e["message"]
    elif bare in RERANK_PATHS and isinstance(err, dict) and list(err) == ["message"]:
        assert isinstance(err["message"], str), r
        message = err["message"]
    elif ollama and isinstance(err, dict) and list(err) == ["error"]:  # Ollama's {"error": "..."}
        # (a request the HTTP layer refuses before routing, a bad request line, is MindIE's shape)
        assert isinstance(err["error"], str), r
        message = err["error"]
    else:
        assert isinstance(err, dict) and list(err) == ["error", "error_type"], r
        assert isinstance(err["error"], str) and isinstance(err["error_type"], str), r
        message = err["error"]
    if r.status == 500:
        assert DOCUMENTED_500.match(message), f"undocumented 500: {r}"


def http(method: bytes, path: bytes, body: bytes = b"", headers: list[bytes] | None = None,
         version: bytes = b"HTTP/1.1") -> bytes:
    hs = [b"Host: fuzz", b"Connection: close", *(headers or [])]
    if body or method in (b"POST", b"PUT", b"PATCH"):
        hs.append(b"Content-Length: %d" % len(body))
    return method + b" " + path + b" " + version + b"\r\n" + b"".join(h + b"\r\n" for h in hs) + b"\r\n" + body


# --------------------------------------------------------------------------------------------
# Regression cases of issue 13 and the framing survey (each exact)
# --------------------------------------------------------------------------------------------

VALID = b'{"input_id":[5618,19678,701],"parameters":{"max_new_tokens":2}}'
PT = b"POST /infer_token HTTP/1.1\r\nHost: x\r\n"
CASES = {
    "HTTP/2.0 request line": (b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", [505]),
    "no HTTP version": (b"GET /health\r\n\r\n", [505]),
    "HTTP/0.9": (b"GET /health HTTP/0.9\r\n\r\n", [505]),
    "HTTP/3.0": (b"GET /health HTTP/3.0\r\nHost: x\r\n\r\n", [400]),
    "HTTP/1.1 + junk": (b"GET /health HTTP/1.1x\r\nHost: x\r\n\r\n", [400]),
    "HTTP/2 preface": (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", [400]),
    "TLS hello": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(100), [400]),
    "deep JSON": (http(b"POST", b"/infer_token", b"[" * 1000 + b"]" * 1000), [422]),
    "JSON depth 100 (the limit)": (http(b"POST", b"/infer_token", b'{"input_id":[1],"x":' + b"[" * (MAX_JSON_DEPTH - 1)
                                          + b"]" * (MAX_JSON_DEPTH - 1) + b"}"), [200]),
    "JSON depth 101": (http(b"POST", b"/infer_token", b'{"input_id":[1],"x":' + b"[" * MAX_JSON_DEPTH
                              + b"]" * MAX_JSON_DEPTH + b"}"), [422]),
    "deep JSON under an ignored key": (
        http(b"POST", b"/infer", b'{"inputs":"a","x":' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}"), [422]),
    "bad chunk size": (PT + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n", [400]),
    "chunk longer than its size": (
        PT + b"Transfer-Encoding: chunked\r\n\r\n5\r\nabcdefgh\r\n0\r\n\r\n", [400]),
    "chunked + Content-Length": (
        PT + b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n", [400]),
    "chunked body over the limit": (
        PT + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        + (b"10000\r\n" + b" " * 0x10000 + b"\r\n") * 18 + b"0\r\n\r\n", [413]),  # 1.1 MB in 64 KB chunks
    "Content-Length not a number": (PT + b"Content-Length: abc\r\n\r\n" + VALID, [400]),
    "Content-Length negative": (PT + b"Content-Length: -1\r\n\r\n" + VALID, [400]),
    "Content-Length twice": (PT + b"Content-Length: 3\r\nContent-Length: 5\r\n\r\n", [400]),
    "Content-Length 10^23": (PT + b"Content-Length: " + b"9" * 23 + b"\r\n\r\n", [400]),
    # The rest is a bad request: uvicorn answers it at once and drops the first one's answer.
    "Content-Length short": (PT + b"Content-Length: 5\r\n\r\n" + VALID, [400]),
    "Content-Length over the limit": (
        PT + b"Content-Length: 2000000\r\nConnection: close\r\n\r\n" + VALID, [413]),
    "lone LF": (b"GET /health HTTP/1.1\nHost: x\n\n", [400]),
    "lone CR": (b"GET /health HTTP/1.1\rHost: x\r\r", [400]),
    "NUL in path": (b"GET /he\x00alth HTTP/1.1\r\nHost: x\r\n\r\n", [400]),
    "NUL in header": (b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n", [400]),
    "non-ASCII path": (b"GET /h\xffalth HTTP/1.1\r\nHost: x\r\n\r\n", [400]),
    "invalid method": (b"G@T /health HTTP/1.1\r\nHost: x\r\n\r\n", [400]),
    "unknown method": (b"FOO /health HTTP/1.1\r\nHost: x\r\n\r\n", [400]),
    "known method, no responder": (b"PURGE /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", [400]),
    "DELETE /infer": (b"DELETE /infer HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", [405]),
    "GET /infer_token": (b"GET /infer_token HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", [405]),
    "POST /metrics": (b"POST /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 0\r\n\r\n", [405]),
    "absolute-form target": (b"GET http://example.com/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", [200]),
    "bad absolute-form": (b"GET http://[::1/health HTTP/1.1\r\nHost: x\r\n\r\n", [400]),
    "asterisk-form": (b"OPTIONS * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", [404]),
    "CONNECT": (b"CONNECT example.com:443 HTTP/1.1\r\nHost: x\r\n\r\n", [400]),
    "200 KB header": (b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 200_000 + b"\r\n\r\n", [431]),
    "20,000 headers": (b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: a\r\n" % i for i in range(20000)) + b"\r\n",
                       [431]),
    "60 KB header": (b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-A: " + b"a" * 60_000 + b"\r\n\r\n",
                     [200]),
    # Upgrade is ignored (ws "none"), but httptools delivers no body after an Upgrade header.
    "websocket upgrade on POST": (
        PT + b"Connection: Upgrade, close\r\nUpgrade: websocket\r\n"
        b"Content-Length: %d\r\n\r\n" % len(VALID) + VALID, [400]),
    "h2c upgrade": (b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings, close\r\nUpgrade: h2c\r\n"
                    b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n", [200]),
    "pipelined, then HTTP/2.0": (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 2 + b"GET /health HTTP/2.0\r\n\r\n",
                                 [200, 200, 505]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_framing_cases(fz, name):
    data, want = CASES[name]
    rs = exchange(fz, data)
    assert [r.status for r in rs] == want, rs
    for r in rs:
        check(r)


def test_deep_json_on_every_post_route_is_refused_not_a_500(fz):
    """A body nested past the limit is refused in its family's shape on every POST route (the
    recursive decoder is never reached: a RecursionError would be a 500 and a traceback)."""
    for route in sorted(POST_ROUTES):
        path = _path(route)
        [r] = exchange(fz, http(b"POST", path, b"[" * 3000 + b"]" * 3000), expect=1)
        assert r.status in (400, 404, 422), (path, r)
        check(r, BODY_STATUSES | {400, 404}, path=path)


def test_unknown_methods_on_known_routes_are_json_405(fz):
    for route in ROUTES:
        path = _path(route)
        other = () if route in GET_AND_POST else (b"GET" if route in POST_ROUTES else b"POST",)
        refused = (b"PUT", b"PATCH") if route in GET_AND_DELETE else (b"PUT", b"PATCH", b"DELETE")
        for method in (*refused, *other):
            [r] = exchange(fz, http(method, path, b"{}" if method != b"GET" else b""), expect=1)
            assert r.status == 405, (method, path, r)
            check(r, path=path)
            if path.startswith(b"/api/"):  # Ollama's clients read only {"error": "..."}
                assert list(json.loads(r.body)) == ["error"], (method, path, r)


# --------------------------------------------------------------------------------------------
# Hypothesis: hostile bodies, mutated MindIE bodies, random requests, broken framing
# --------------------------------------------------------------------------------------------

infer_paths = st.sampled_from([b"/infer", b"/infer_token"])


@st.composite
def hostile_bodies(draw) -> bytes:
    shape = draw(st.sampled_from(["any", "object", "object", "deep"]))
    if shape == "any":
        v = draw(values)
    elif shape == "deep":
        where = draw(st.sampled_from(["top", "x", "parameters", "inputs", "input_id", "param"]))
        d = draw(deep())
        v = {"top": d, "x": {"input_id": [1], "x": d}, "parameters": {"input_id": [1], "parameters": d},
             "inputs": {"inputs": d}, "input_id": {"input_id": d},
             "param": {"input_id": [1], "parameters": {draw(st.sampled_from(PARAM_KEYS)): d}}}[where]
    else:
        v = draw(st.dictionaries(st.sampled_from(["inputs", "input_id", "stream", "parameters", "x", ""]), values,
                                 max_size=4))
    return draw(corrupt(dump(v)))


@given(path=infer_paths, body=hostile_bodies())
@fuzz_settings(500)
def test_hostile_json_bodies(fz, path, body):
    [r] = exchange(fz, http(b"POST", path, body), expect=1)
    check(r, BODY_STATUSES)


other_posts = st.sampled_from([_path(r) for r in sorted(POST_ROUTES - {"/infer", "/infer_token"})])
api_keys = st.sampled_from(["inputs", "prompt", "messages", "text_input", "parameters", "max_tokens", "stream",
                            "model", "stop", "n", "logprobs", "id", "x"])


@st.composite
def hostile_api_bodies(draw) -> bytes:
    """Bodies with the keys of the other API families (OpenAI, TGI, vLLM, Triton) and hostile values."""
    v = draw(st.dictionaries(api_keys, values, max_size=5))
    return draw(corrupt(dump(v)))


@given(path=other_posts, body=weighted((2, hostile_api_bodies()), (1, hostile_bodies())))
@fuzz_settings(400)
def test_hostile_bodies_on_the_other_apis(fz, path, body):
    [r] = exchange(fz, http(b"POST", path, body), expect=1)
    check(r, BODY_STATUSES | {400, 404}, path=path)


valid_params = {
    "temperature": st.floats(0.05, 2.0), "top_k": st.integers(1, 50), "top_p": st.floats(0.05, 0.99),
    "typical_p": st.floats(0.05, 1.0), "do_sample": st.booleans(), "seed": st.integers(0, 2**63 - 1),
    "repetition_penalty": st.floats(0.5, 2.0), "watermark": st.booleans(), "priority": st.integers(1, 5),
    "max_new_tokens": st.integers(1, 2**31 - 1), "timeout": st.integers(1, 65535), "details": st.booleans(),
}
hostile_values = weighted((2, st.sampled_from(EDGE_NUMBERS)), (1, raw_literals), (2, leaves), (2, trees), (1, deep()))


@st.composite
def mutated_bodies(draw) -> bytes:
    body: dict = {}
    if draw(st.booleans()):
        body["input_id"] = draw(st.lists(st.integers(0, 31999), min_size=1, max_size=64))
    else:
        body["inputs"] = draw(st.text(min_size=1, max_size=200))
    if draw(st.booleans()):
        body["stream"] = draw(st.booleans())
    params = {k: draw(s) for k, s in valid_params.items() if draw(st.booleans())}
    for key in draw(st.lists(st.sampled_from([*PARAM_KEYS, "stream", "inputs", "input_id", "parameters",
                                              "stop", "n", "best_of"]), max_size=3, unique=True)):
        bad = draw(hostile_values)
        if key in ("stream", "inputs", "input_id", "parameters"):
            body[key] = bad
        else:
            params[key] = bad
    if "input_id" in body and draw(st.integers(0, 9)) == 0:  # ids out of range / vocab, huge lists
        body["input_id"] = draw(st.sampled_from([[32000], [-1], [1048577], [2**64], [1.0], [True], ["1"], [],
                                                 [1] * 3000, [1] * 1048577]))
    if params or "parameters" not in body:
        body.setdefault("parameters", params)
    return dump(body)


@given(path=infer_paths, body=mutated_bodies())
@fuzz_settings(500)
def test_mutated_mindie_bodies(fz, path, body):
    [r] = exchange(fz, http(b"POST", path, body), expect=1)
    check(r, BODY_STATUSES)
    if r.status == 200 and b'"stream":true' in body.replace(b" ", b""):
        assert r.headers.get(b"content-type", b"").startswith(b"text/event-stream"), r


methods = weighted(
    (6, st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"PATCH", b"HEAD", b"OPTIONS"])),
    (1, st.sampled_from([b"TRACE", b"CONNECT", b"PURGE", b"LINK", b"PROPFIND", b"get", b"SEARCH"])),
    (1, st.from_regex(rb"\A[A-Za-z!#$%&'*+.^_`|~-]{1,12}\Z")), (1, st.binary(min_size=1, max_size=8)))
paths = weighted(
    (6, st.sampled_from([_path(r) for r in ROUTES])),
    (2, st.sampled_from([b"/v1/models/", b"/v1/models/demo/x", b"/infer/", b"//infer", b"/infer?stream=1",
                         b"/%2e%2e/", b"/v1/models/%ff%00", b"/v1/models/" + b"a" * 5000, b"/health?" + b"&" * 1000,
                         b"*", b"/\\"])),
    (1, st.text(max_size=30).map(lambda t: b"/" + t.encode().replace(b" ", b"%20").replace(b"\r", b"")
                                 .replace(b"\n", b""))),
    (1, st.binary(max_size=20).map(lambda b: b"/" + b)),
)
plausible_headers = st.sampled_from([
    b"Content-Type: application/json", b"Content-Type: text/plain", b"Content-Type: multipart/form-data; boundary=x",
    b"Accept: text/event-stream", b"Accept: */*;q=0", b"Accept: application/xml", b"Accept-Encoding: gzip, br",
    b"Content-Encoding: gzip", b"Expect: 100-continue", b"Expect: nothing", b"req-id: ffff", b"req-id: " + b"z" * 2000,
    b"Connection: keep-alive", b"Upgrade: websocket", b"Connection: upgrade", b"Range: bytes=0-1",
    b"X-Forwarded-For: ::1", b"Forwarded: for=unknown", b"Host:", b"If-None-Match: *", b"Authorization: Bearer x",
    b"Cookie: " + b"a=b; " * 500, b"User-Agent: \xe2\x98\x83", b"X-Empty:", b"X-A: a\tb"])
hostile_headers = st.sampled_from([b"Content-Type: \xff\xfe", b"Host: a\x7fb", b" folded", b"X-\xffName: v",
                                   b"Content-Length: 0", b"Transfer-Encoding: identity", b"Transfer-Encoding: chunked",
                                   b"Content-Length: 99999", b": novalue", b"NoColon"])
header_lines = st.lists(weighted(
    (6, plausible_headers), (1, hostile_headers),
    (2, st.tuples(st.from_regex(rb"\A[A-Za-z0-9-]{1,20}\Z"), st.from_regex(rb"\A[ -~]{0,40}\Z")).map(b": ".join)),
    (1, st.tuples(st.from_regex(rb"\A[A-Za-z0-9-]{1,20}\Z"), st.binary(max_size=40)).map(b": ".join)),
), max_size=4)


@given(method=methods, path=paths, headers=header_lines,
       body=weighted((1, st.just(b"")), (1, st.binary(max_size=200)), (1, hostile_bodies()), (2, mutated_bodies())))
@fuzz_settings(700)
def test_random_requests(fz, method, path, headers, body):
    head = method == b"HEAD"
    # Headers that frame the body differently may leave the server waiting: half-close then.
    framing = any(h.lower().startswith((b"content-length", b"transfer-encoding")) for h in headers)
    rs = exchange(fz, http(method, path, body, headers), expect=None if framing else 1, half_close=framing,
                  head=head)
    embed = path.split(b"?")[0] == b"/api/embed"  # 501 until the server serves embeddings (as above)
    for r in rs:
        check(r, DOCUMENTED | ({501} if embed else set()), head=head, path=path)


@st.composite
def broken_framing(draw) -> bytes:
    path = draw(st.sampled_from([b"/infer_token", b"/infer", b"/health", b"/v1/models"]))
    method = b"GET" if path in (b"/health", b"/v1/models") else b"POST"
    body = VALID if method == b"POST" else b""
    kind = draw(st.sampled_from(["version", "length", "chunked", "inject", "bytes", "pipeline", "split"]))
    if kind == "version":
        v = draw(st.sampled_from([b"HTTP/2.0", b"HTTP/2", b"HTTP/0.9", b"HTTP/1.0", b"HTTP/1.2", b"HTTP/9.9",
                                  b"HTTP/1.1 ", b"http/1.1", b"HTTP/11", b"", b"HTTP/1.1\x00"])
                 | st.from_regex(rb"\AHTTP/[0-9]\.[0-9]\Z"))
        return http(method, path, body, version=v)
    if kind == "length":
        cl = draw(st.sampled_from([b"0", b"1", b"-1", b"+5", b"0x10", b" 5", b"5 5", b"", b"99999999999999999999",
                                   b"%d" % (len(body) + 10), b"%d" % max(len(body) - 10, 0), b"%d, %d" % (2, 2)])
                  | st.integers(0, 200).map(lambda n: b"%d" % n))
        return (method + b" " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Length: " + cl + b"\r\n\r\n" + body)
    if kind == "chunked":
        pieces = draw(st.lists(st.sampled_from([b"5\r\nabcde\r\n", b"z\r\n", b"5\r\nab\r\n", b"-1\r\n",
                                                b"ffffffffffffffffff\r\n", b"3;ext=\x00\r\nabc\r\n", b"0\r\n\r\n",
                                                b"0\r\nX-Trailer: 1\r\n\r\n", b"3\nabc\n", b"\r\n", b"1\r\n\xff\r\n"]),
                               max_size=5))
        te = draw(st.sampled_from([b"chunked", b"Chunked", b"gzip, chunked", b"chunked, gzip", b"xchunked"]))
        return (b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: " + te + b"\r\n\r\n" + b"".join(pieces))
    if kind == "inject":
        raw = http(method, path, body)
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(0, len(raw)))
            raw = raw[:i] + draw(st.sampled_from([b"\r", b"\n", b"\x00", b"\x7f", b"\xff", b" ", b"\t", b":",
                                                  b"\r\n", b"\r\n\r\n"])) + raw[i:]
        return raw
    if kind == "bytes":
        return draw(st.binary(min_size=1, max_size=300))
    if kind == "pipeline":
        reqs = draw(st.lists(st.sampled_from([http(b"GET", b"/health")[:-2].replace(b"Connection: close\r\n", b"")
                                              + b"\r\n", b"GET /health HTTP/2.0\r\n\r\n", b"\r\n", b"GARBAGE\r\n\r\n",
                                              http(b"POST", b"/infer_token", VALID).replace(b"Connection: close\r\n",
                                                                                            b"")]),
                             min_size=2, max_size=4))
        return b"".join(reqs)
    raw = http(method, path, body)  # "split": a prefix only (the rest never comes)
    return raw[:draw(st.integers(0, len(raw)))]


@given(data=broken_framing())
@fuzz_settings(700)
def test_broken_framing(fz, data):
    for r in exchange(fz, data, half_close=True):
        check(r)


# --------------------------------------------------------------------------------------------
# Clients that stall: the receive timeouts (ServerConfig.headTimeoutS, bodyTimeoutS)
# --------------------------------------------------------------------------------------------


def stall(fz: Fuzzed, first: bytes, trickle: bytes = b"", gap: float = 0.4, then: bytes = b"") -> tuple[bytes, float]:
    """A client that sends ``first`` (and after one answer, when ``then`` is given, ``then``),
    then ``trickle`` every ``gap`` seconds, never finishing and never closing: returns what it
    received and when the server closed (seconds since the last of ``first``/``then`` was sent)."""
    fz.sent += 1
    bound = max(HEAD_TIMEOUT_S, BODY_TIMEOUT_S) + TIMEOUT_SLACK_S + 5
    buf = b""
    with socket.create_connection(("127.0.0.1", fz.port), timeout=bound) as s:
        if first:
            s.sendall(first)
        if then:
            while not buf.endswith(b"\r\n\r\n"):  # a bodyless answer (GET /health)
                buf += s.recv(65536)
            buf = b""
            time.sleep(1.0)  # idle on the kept-alive connection: not counted
            s.sendall(then)
        t0 = next_at = time.monotonic()
        s.setblocking(False)
        while time.monotonic() - t0 < bound:
            if trickle and time.monotonic() >= next_at:
                with contextlib.suppress(OSError):
                    s.send(trickle)
                next_at += gap
            try:
                chunk = s.recv(65536)
            except BlockingIOError:
                time.sleep(0.02)
                continue
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return buf, time.monotonic() - t0
            buf += chunk
        raise AssertionError(f"still open after {bound:.0f} s: {first[:200]!r} -> {buf[:200]!r}")


def timeout_answer(what: str, seconds: float) -> bytes:
    return b'{"error":"The request %s was not received within %g s.","error_type":"Request Timeout"}' % (
        what.encode(), seconds)


POST_CL = b"POST /infer_token HTTP/1.1\r\nHost: x\r\nContent-Length: 200\r\n\r\n"
STALLS = {  # name: (first, trickle, then, expected: "" = closed without an answer, or "head"/"body")
    "idle connection": (b"", b"", b"", ""),
    "blank lines only": (b"", b"\r\n", b"", ""),
    "request line only": (b"GET /health HTTP/1.1\r\n", b"", b"", "head"),
    "slow head (a header line every 0.4 s)": (b"GET /health HTTP/1.1\r\nHost: x\r\n", b"X-A: b\r\n", b"", "head"),
    "slow head, a byte every 0.4 s": (b"GET /health?", b"a", b"", "head"),
    "slow head after a kept-alive request": (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", b"X-A: b\r\n",
                                             b"GET /health HTTP/1.1\r\n", "head"),
    "body never sent": (POST_CL, b"", b"", "body"),
    "slow body (a byte every 0.4 s)": (POST_CL + b'{"input_id":[1,', b"1", b"", "body"),
    "chunked body cut": (b"POST /infer_token HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"5\r\n{\"inp\r\n", b"", b"", "body"),
    "slow body on /v1/chat/completions": (POST_CL.replace(b"/infer_token", b"/v1/chat/completions"), b" ", b"",
                                          "body"),
    "slow body on /v1/tokenizer": (POST_CL.replace(b"/infer_token", b"/v1/tokenizer"), b" ", b"", "body"),
}


def check_stall(got: bytes, took: float, expected: str, name: str) -> None:
    due = {"": HEAD_TIMEOUT_S, "head": HEAD_TIMEOUT_S, "body": BODY_TIMEOUT_S}[expected]
    assert due - 0.3 < took < due + TIMEOUT_SLACK_S, (name, took, got[:300])
    if not expected:
        assert got == b"", (name, got)
        return
    [r] = parse_responses(got, head=False)
    assert r.status == 408 and r.headers[b"connection"] == b"close", (name, r)
    assert r.body == timeout_answer(expected, due), (name, r)
    check(r)


def run_stalls(fz: Fuzzed, cases: dict) -> dict:
    """Every case at once, one thread each (they take seconds each, mostly waiting)."""
    out: dict = {}

    def one(name):
        try:
            first, trickle, then, _ = cases[name]
            out[name] = stall(fz, first, trickle, then=then)
        except BaseException as e:  # noqa: BLE001 - reported below
            out[name] = e

    threads = [threading.Thread(target=one, args=(n,)) for n in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_stalled_clients_are_cut_at_the_receive_timeouts(fz):
    fz.srv.log.flush()
    start = fz.srv.log_path.stat().st_size
    results = run_stalls(fz, STALLS)
    for name, (_, _, _, expected) in STALLS.items():
        got = results.get(name)
        if isinstance(got, BaseException) or got is None:
            raise AssertionError(f"{name}: {got!r}")
        check_stall(*got, expected, name)
    # The 3 bodies that stalled after their first bytes on inference routes were logged as 408 (the
    # app learns why its body ended and gives its admission slot back: tests/test_admission.py),
    # just after the answer. A body never begun never reached the app (Falcon waits for its first
    # bytes before routing): nothing to log.
    pattern = r"/(?:infer_token|v1/chat/completions) status=408 .*The request body was not received"
    deadline = time.monotonic() + 10
    while True:
        fz.srv.log.flush()
        log = fz.srv.log_path.read_bytes()[start:].decode(errors="replace")
        logged = re.findall(pattern, log)
        if len(logged) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    time.sleep(0.5)  # and no more come
    fz.srv.log.flush()
    log = fz.srv.log_path.read_bytes()[start:].decode(errors="replace")
    assert len(re.findall(pattern, log)) == 3, log[-3000:]


CUT_TEMPLATES = [
    http(b"GET", b"/health").replace(b"Connection: close\r\n", b""),
    http(b"POST", b"/infer_token", VALID).replace(b"Connection: close\r\n", b""),
    b"POST /infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"8\r\n{\"inputs\r\n9\r\n\":\"hello\"\r\n1\r\n}\r\n0\r\n\r\n",
    http(b"POST", b"/v1/completions", b'{"model":"demo","prompt":"hi","max_tokens":2}').replace(
        b"Connection: close\r\n", b""),
]


def test_requests_cut_at_random_points_time_out(fz):
    """Requests cut anywhere (seeded), the connection left open: closed without an answer when
    nothing was sent, 408 for the head or the body otherwise, each at its timeout."""
    rng = random.Random(27)
    cases = {}
    for i in range(24):
        req = CUT_TEMPLATES[i % len(CUT_TEMPLATES)]
        cut = 0 if i == 0 else rng.randrange(1, len(req))
        head_end = req.index(b"\r\n\r\n") + 4
        cases[f"{req[:20]!r} cut at {cut}"] = (req[:cut], b"", b"", "" if cut == 0 else "head" if cut < head_end else "body")
    results = run_stalls(fz, cases)
    for name, (_, _, _, expected) in cases.items():
        got = results.get(name)
        if isinstance(got, BaseException) or got is None:
            raise AssertionError(f"{name}: {got!r}")
        check_stall(*got, expected, name)


def test_header_flood_reads_its_431(fz):
    """1 MiB of headers sent in full (the server reads and drops what follows its 431 until the
    client is done: no reset while the client sends), then the answer read."""
    for flood in (b"X-A: " + b"a" * (1 << 20) + b"\r\n",
                  b"".join(b"X-%d: %s\r\n" % (i, b"b" * 40) for i in range((1 << 20) // 48))):
        fz.sent += 1
        with socket.create_connection(("127.0.0.1", fz.port), timeout=REQUEST_BOUND_S) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + flood + b"\r\n")  # a reset fails here
            buf = b""
            while chunk := s.recv(65536):
                buf += chunk
        [r] = parse_responses(buf, head=False)
        assert r.status == 431, r
        check(r)


# --------------------------------------------------------------------------------------------
# Afterwards: everything alive, nothing logged, the server still serves
# --------------------------------------------------------------------------------------------


def test_zz_server_survived(fz):
    fz.check_alive_and_quiet()
    [r] = exchange(fz, http(b"GET", b"/health"), expect=1)
    assert r.status == 200, r
    [r] = exchange(fz, http(b"POST", b"/infer_token",
                            b'{"input_id":[5618,19678,701],"parameters":{"max_new_tokens":3,"details":true}}'),
                   expect=1)
    assert r.status == 200, r
    details = json.loads(r.body)["details"]
    assert details["generated_tokens"] == 3 and details["finish_reason"] == "length", details
