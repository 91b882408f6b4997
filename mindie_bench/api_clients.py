"""One streaming adapter per API, on a small asyncio HTTP/1.1 client.

Why not httpx: the load generator shares a 2-core machine with the server, and at 256
concurrent streams httpx's per-chunk cost (async generators, stream wrappers, h11) is
several times that of parsing the bytes straight in ``Protocol.data_received``. This
client does only what the benchmark needs: keep-alive POST/GET over HTTP/1.1 (TLS
optional), ``Content-Length``, chunked or read-until-close bodies, and SSE ``data:``
lines. Arrival times are taken when the bytes are read from the socket, so the event
loop's scheduling of coroutines does not add to TTFT or ITL.

The response parser is ``httptools`` (llhttp; installed with ``uvicorn[standard]``), not a
hand-written one: it passes the same tests, is 3-13x faster per SSE event and its _Conn is
65 lines shorter (mindie_bench/lab/http_parser.py).

Token counting per API:

* native ``/infer_token``: every frame's ``token.id`` list (the last frame, whose
  ``token.text`` is null, carries the last token);
* OpenAI ``/v1/completions``: ``token_ids`` in a chunk when the server sends them, else
  one token per chunk with text; the total is replaced by ``usage.completion_tokens``
  (``stream_options.include_usage``) when present, since a chunk may hold several tokens;
* OpenAI ``/v1/chat/completions`` (``chat``): one token per chunk whose ``delta`` has content,
  replaced by ``usage.completion_tokens`` like ``/v1/completions``;
* TGI ``/generate_stream``: one token per event (``token.id``, int or list).
"""
from __future__ import annotations

import asyncio
import json
import ssl as ssl_mod
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

import httptools

from mindie_bench.workload import RequestSpec, text_of

try:  # msgspec is a server dependency and decodes small JSON frames ~3x faster
    import msgspec

    _loads: Callable[[bytes], Any] = msgspec.json.decode
except ImportError:  # pragma: no cover
    _loads = json.loads

APIS = ("native", "openai", "chat", "tgi")
MAX_HEAD = 64 * 1024
MAX_ERROR_BODY = 2048


# ----------------------------------------------------------------------------- results


@dataclass
class RequestResult:
    """What one request measured. Times are ``time.perf_counter()`` seconds."""

    index: int
    expected_output_tokens: int
    prompt_tokens: int
    start: float = 0.0
    end: float = 0.0  # arrival of the last token frame (or of the failure)
    ok: bool = False
    error: Optional[str] = None
    chunk_times: list[float] = field(default_factory=list)  # frames with >= 1 token
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each such frame
    output_tokens: int = 0

    @property
    def ttft(self) -> Optional[float]:
        """Seconds from sending to the first token frame."""
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float:
        """Seconds from sending to the last token frame."""
        return self.end - self.start


# ----------------------------------------------------------------------------- SSE parsing


class SSEParser:
    """Splits a byte stream into SSE ``data`` payloads and hands them to ``on_event``.

    Accepts ``\\n`` or ``\\r\\n`` line ends and ``data:`` with or without the space;
    comments (keep-alives ``:``) and other fields are skipped.
    """

    __slots__ = ("_buf", "_data", "on_event")

    def __init__(self, on_event: Callable[[bytes, float], None]) -> None:
        self._buf = b""
        self._data: Optional[bytes] = None
        self.on_event = on_event

    def feed(self, chunk: bytes, t: float) -> None:
        buf = self._buf + chunk if self._buf else chunk
        lines = buf.split(b"\n")
        self._buf = lines.pop()
        for line in lines:
            if line[-1:] == b"\r":
                line = line[:-1]
            if not line:
                if self._data is not None:
                    data, self._data = self._data, None
                    self.on_event(data, t)
            elif line[:5] == b"data:":
                v = line[6:] if line[5:6] == b" " else line[5:]
                self._data = v if self._data is None else self._data + b"\n" + v

    def close(self, t: float) -> None:
        """End of body: a complete ``data`` line not followed by a blank line still counts
        (lenient to servers that omit the last blank line); a partial line does not."""
        if self._data is not None:
            data, self._data = self._data, None
            self.on_event(data, t)


class StreamHandler:
    """Base of the per-API stream parsers; fills a ``RequestResult``."""

    def __init__(self, result: RequestResult) -> None:
        self.result = result
        self.done = False  # the API's final frame was seen

    def tokens(self, n: int, t: float) -> None:
        r = self.result
        r.chunk_times.append(t)
        r.chunk_tokens.append(n)
        r.output_tokens += n
        r.end = t

    def fail(self, msg: str) -> None:
        if self.result.error is None:
            self.result.error = msg

    def on_event(self, data: bytes, t: float) -> None:
        raise NotImplementedError


def _id_count(tok: Any) -> int:
    if not isinstance(tok, dict):
        return 0
    ids = tok.get("id")
    if ids is None:
        return 0
    return len(ids) if isinstance(ids, list) else 1


def _error_text(obj: dict[str, Any]) -> str:
    err = obj.get("error")
    if isinstance(err, dict):  # OpenAI style {"error": {"message": ...}}
        err = err.get("message", err)
    kind = obj.get("error_type")
    return f"{err} ({kind})" if kind else str(err)


class NativeHandler(StreamHandler):
    """``/infer_token`` frames: ``{"prefill_time","decode_time","token":{"id":[..],"text"}}``;
    the last adds ``generated_text`` and ``details``. No ``[DONE]``."""

    def on_event(self, data: bytes, t: float) -> None:
        try:
            obj = _loads(data)
        except Exception:
            self.fail(f"bad JSON frame: {data[:200]!r}")
            return
        if not isinstance(obj, dict):
            self.fail(f"unexpected frame: {data[:200]!r}")
            return
        if "error" in obj:
            self.fail(_error_text(obj))
            self.done = True
            return
        n = _id_count(obj.get("token"))
        if n:
            self.tokens(n, t)
        if obj.get("generated_text") is not None or obj.get("details") is not None:
            self.done = True


class TGIHandler(NativeHandler):
    """``/generate_stream`` events: ``{"index","token":{"id","text",..},"generated_text",
    "details"}``; the last has non-null ``generated_text``; errors are
    ``{"error","error_type"}`` events under HTTP 200. Same parsing as native."""

    def on_event(self, data: bytes, t: float) -> None:
        super().on_event(data, t)
        if self.done and self.result.error is None:
            try:
                details = _loads(data).get("details") or {}
                if details.get("input_length"):  # server's own prompt token count
                    self.result.prompt_tokens = int(details["input_length"])
            except Exception:
                pass


class OpenAIHandler(StreamHandler):
    """``/v1/completions`` chunks ending with ``data: [DONE]``; usage in the last chunk."""

    def __init__(self, result: RequestResult) -> None:
        super().__init__(result)
        self.usage: Optional[dict[str, Any]] = None

    def on_event(self, data: bytes, t: float) -> None:
        if data.strip() == b"[DONE]":
            self.done = True
            if self.usage and self.result.error is None:
                # A chunk may carry several tokens; the server's count is the truth.
                ct = self.usage.get("completion_tokens")
                if ct is not None:
                    self.result.output_tokens = int(ct)
                pt = self.usage.get("prompt_tokens")
                if pt:
                    self.result.prompt_tokens = int(pt)
            return
        try:
            obj = _loads(data)
        except Exception:
            self.fail(f"bad JSON chunk: {data[:200]!r}")
            return
        if not isinstance(obj, dict):
            self.fail(f"unexpected chunk: {data[:200]!r}")
            return
        if "error" in obj:
            self.fail(_error_text(obj))
            return
        for ch in obj.get("choices") or ():
            if not isinstance(ch, dict):
                continue
            ids = ch.get("token_ids")  # when the server sends them, the exact count
            if n := len(ids) if ids else self.choice_tokens(ch):
                self.tokens(n, t)
        if obj.get("usage"):
            self.usage = obj["usage"]

    def choice_tokens(self, ch: dict[str, Any]) -> int:
        """Tokens in one choice of a chunk without ``token_ids``: one per text chunk."""
        text = ch.get("text")
        # An empty text is still a token (incomplete UTF-8) unless the chunk only
        # announces the finish reason.
        return 1 if text or (text == "" and ch.get("finish_reason") is None) else 0


class ChatHandler(OpenAIHandler):
    """``/v1/chat/completions`` chunks (this server, vLLM, llama.cpp's llama-server): one token
    per chunk whose ``delta`` carries content (answer, reasoning or a tool call). Chunks without
    any (the role announcement, empty deltas, the finish chunk, llama-server's ``timings``, the
    usage chunk) are not token frames, so TTFT is the first content's arrival; the total is the
    server's ``usage.completion_tokens`` when it sends usage."""

    def choice_tokens(self, ch: dict[str, Any]) -> int:
        d = ch.get("delta")
        if not isinstance(d, dict):
            return 0
        return 1 if d.get("content") or d.get("reasoning_content") or d.get("reasoning") or d.get("tool_calls") \
            else 0


# ----------------------------------------------------------------------------- HTTP client


class _Exchange:
    """One request/response: collects the head, streams or buffers the body."""

    __slots__ = ("fut", "status", "headers", "body", "sink", "on_head", "got_bytes")

    def __init__(self, fut: asyncio.Future[bool],
                 on_head: Callable[[int, dict[str, str]], Optional[Callable[[bytes, float], None]]]):
        self.fut = fut  # result: True if the connection may be reused
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.sink: Optional[Callable[[bytes, float], None]] = None
        self.on_head = on_head
        self.got_bytes = False


class _Conn(asyncio.Protocol):
    """An HTTP/1.1 connection running one exchange at a time; httptools parses the response
    in ``data_received`` and calls the ``on_*`` methods below."""

    def __init__(self) -> None:
        self.transport: Optional[asyncio.Transport] = None
        self.closed = False
        self.ex: Optional[_Exchange] = None
        self.parser: Optional[httptools.HttpResponseParser] = None
        self.headers: dict[str, str] = {}
        self.head_size = 0
        self.in_body = False  # the final (non-1xx) head has been parsed
        self.until_close = False  # the body ends when the server closes the connection
        self.keep_alive = True
        self.t = 0.0  # arrival time of the bytes being parsed

    # asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.closed = True
        ex = self.ex
        if ex is None or ex.fut.done():
            return
        if self.until_close:
            self._complete(False)
        else:
            where = "mid-body" if self.in_body else "before the response head"
            ex.fut.set_exception(ConnectionError(f"connection closed {where}" + (f": {exc}" if exc else "")))

    def data_received(self, data: bytes) -> None:
        self.t = time.perf_counter()
        ex = self.ex
        if ex is None or ex.fut.done():
            return
        ex.got_bytes = True
        try:
            self.parser.feed_data(data)  # type: ignore[union-attr]
        except Exception as e:  # malformed response: fail this exchange, drop the connection
            if not ex.fut.done():  # an error raised in a callback below arrives wrapped
                ex.fut.set_exception(e.__context__ if isinstance(e, httptools.HttpParserCallbackError)
                                     and isinstance(e.__context__, Exception) else e)
            self.close()

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_size += len(name) + len(value) + 4
        if self.head_size > MAX_HEAD:
            raise ValueError("response head too large")
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        parser, headers, ex = self.parser, self.headers, self.ex
        assert parser is not None and ex is not None
        status = parser.get_status_code()
        self.headers, self.head_size = {}, 0
        if status < 200:  # interim response: the real head follows
            return
        ex.status, ex.headers, self.in_body = status, headers, True
        self.keep_alive = parser.should_keep_alive()
        self.until_close = not ("chunked" in headers.get("transfer-encoding", "").lower()
                                or "content-length" in headers or status in (204, 304))
        ex.sink = ex.on_head(status, headers)

    def on_body(self, data: bytes) -> None:
        ex = self.ex
        assert ex is not None
        if ex.sink is not None:
            ex.sink(data, self.t)
        elif len(ex.body) < MAX_ERROR_BODY * 32:
            ex.body += data

    def on_message_complete(self) -> None:
        if self.in_body:  # not the end of a 1xx head
            self._complete(True)

    def _complete(self, reusable: bool) -> None:
        ex, self.ex = self.ex, None
        if ex is not None and not ex.fut.done():
            ex.fut.set_result(reusable and self.keep_alive and not self.until_close and not self.closed)

    # API for the client
    def start(self, ex: _Exchange, request: bytes) -> None:
        self.ex, self.headers, self.head_size, self.in_body, self.until_close = ex, {}, 0, False, False
        self.parser = httptools.HttpResponseParser(self)
        assert self.transport is not None
        self.transport.write(request)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class HttpClient:
    """Keep-alive connection pool over ``_Conn``; one pool per (scheme, host, port)."""

    def __init__(self, *, insecure: bool = False) -> None:
        self._idle: dict[tuple[str, str, int], list[_Conn]] = {}
        self._all: set[_Conn] = set()
        self._ssl: Optional[ssl_mod.SSLContext] = None
        self._insecure = insecure

    def _ssl_ctx(self) -> ssl_mod.SSLContext:
        if self._ssl is None:
            ctx = ssl_mod.create_default_context()
            if self._insecure:
                ctx.check_hostname = False
                ctx.verify_mode = ssl_mod.CERT_NONE
            self._ssl = ctx
        return self._ssl

    async def _connect(self, key: tuple[str, str, int]) -> _Conn:
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(
            _Conn, host, port, ssl=self._ssl_ctx() if scheme == "https" else None)
        self._all.add(conn)
        return conn

    async def request(self, method: str, url: str, body: bytes = b"", *,
                      on_head: Optional[Callable[[int, dict[str, str]],
                                                 Optional[Callable[[bytes, float], None]]]] = None,
                      timeout: Optional[float] = None,
                      headers: Optional[dict[str, str]] = None) -> _Exchange:
        """Send one request; ``on_head(status, headers)`` may return a body sink
        ``(bytes, t)`` to stream the body instead of buffering it. Raises
        ``ConnectionError``/``TimeoutError`` on failure."""
        u = urlsplit(url)
        scheme = u.scheme or "http"
        host = u.hostname or "127.0.0.1"
        port = u.port or (443 if scheme == "https" else 80)
        key = (scheme, host, port)
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        hdrs = {"Host": f"{host}:{port}", "User-Agent": "mindie-bench", "Accept": "*/*",
                "Content-Length": str(len(body))}
        if body:
            hdrs["Content-Type"] = "application/json"
        if headers:
            hdrs.update(headers)
        req = (f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
               + "\r\n").encode("latin-1") + body
        loop = asyncio.get_running_loop()
        for attempt in (0, 1):
            idle = self._idle.get(key)
            reused = False
            conn: Optional[_Conn] = None
            while idle:
                c = idle.pop()
                if not c.closed:
                    conn, reused = c, True
                    break
            if conn is None:
                try:
                    conn = await asyncio.wait_for(self._connect(key), timeout)
                except asyncio.TimeoutError:
                    raise TimeoutError(f"connect timed out after {timeout:g} s") from None
            fut: asyncio.Future[bool] = loop.create_future()
            ex = _Exchange(fut, on_head or (lambda s, h: None))
            conn.start(ex, req)
            timer = loop.call_later(timeout, self._expire, conn, fut, timeout) if timeout else None
            try:
                reusable = await fut
            except ConnectionError:
                conn.close()
                # A pooled connection the server closed while idle: retry once, fresh.
                if reused and not ex.got_bytes and attempt == 0:
                    continue
                raise
            except BaseException:
                conn.close()
                raise
            finally:
                if timer is not None:
                    timer.cancel()
            if reusable:
                self._idle.setdefault(key, []).append(conn)
            else:
                conn.close()
            return ex
        raise AssertionError("unreachable")

    @staticmethod
    def _expire(conn: _Conn, fut: asyncio.Future[bool], timeout: float) -> None:
        if not fut.done():
            fut.set_exception(TimeoutError(f"timed out after {timeout:g} s"))
        conn.close()

    async def get_json(self, url: str, timeout: float = 10.0) -> Any:
        """GET a JSON document; raises on non-2xx."""
        ex = await self.request("GET", url, timeout=timeout)
        if not 200 <= ex.status < 300:
            raise ConnectionError(f"HTTP {ex.status}: {bytes(ex.body[:200])!r}")
        return json.loads(bytes(ex.body))

    async def aclose(self) -> None:
        for c in list(self._all):
            c.close()
        self._all.clear()
        self._idle.clear()


# ----------------------------------------------------------------------------- adapters


class Adapter:
    """Builds request bodies for one API and parses its stream into ``RequestResult``s."""

    api = ""
    path = ""
    handler_cls: type[StreamHandler] = StreamHandler

    def __init__(self, url: str, *, model: Optional[str] = None, ignore_eos: bool = True,
                 extra: Optional[dict[str, Any]] = None, path: Optional[str] = None,
                 tokenizer: Any = None) -> None:
        self.base = url.rstrip("/")
        self.model = model
        self.ignore_eos = ignore_eos
        self.extra = dict(extra or {})
        self.tokenizer = tokenizer
        self.url = self.base + (path or self.path)

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"api": self.api, "url": self.url, "model": self.model, "ignore_eos": self.ignore_eos,
                "extra": self.extra}

    async def send(self, client: HttpClient, spec: RequestSpec, timeout: Optional[float]) -> RequestResult:
        """Run one streaming request; never raises (failures land in ``result.error``)."""
        body = json.dumps(self.body(spec), separators=(",", ":")).encode()
        result = RequestResult(spec.index, spec.output_len, spec.prompt_len)
        handler = self.handler_cls(result)
        sse = SSEParser(handler.on_event)

        def on_head(status: int, headers: dict[str, str]) -> Optional[Callable[[bytes, float], None]]:
            if status == 200 and "text/event-stream" in headers.get("content-type", ""):
                return sse.feed
            return None  # buffer it for the error message

        result.start = time.perf_counter()
        try:
            ex = await client.request("POST", self.url, body, on_head=on_head, timeout=timeout,
                                      headers={"Accept": "text/event-stream"})
        except (ConnectionError, TimeoutError, OSError) as e:
            handler.fail(f"{type(e).__name__}: {e}" + (f" after {result.output_tokens} tokens"
                                                        if result.output_tokens else ""))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # protocol errors from a misbehaving server
            handler.fail(f"{type(e).__name__}: {e}")
        else:
            if ex.status != 200:
                handler.fail(f"HTTP {ex.status}: {bytes(ex.body[:MAX_ERROR_BODY]).decode('utf-8', 'replace').strip()}")
            elif ex.sink is None:
                handler.fail(f"HTTP 200 but content-type {ex.headers.get('content-type')!r}, not an SSE stream")
            else:
                sse.close(time.perf_counter())
                if not handler.done:
                    handler.fail(f"stream ended before the final frame after {result.output_tokens} tokens")
        result.ok = result.error is None
        if not result.chunk_times:
            result.end = time.perf_counter()
        return result


class NativeAdapter(Adapter):
    """MindIE ``POST /infer_token`` with ``input_id`` (or ``inputs`` for text prompts)."""

    api, path, handler_cls = "native", "/infer_token", NativeHandler

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        params: dict[str, Any] = {"max_new_tokens": spec.output_len, "details": True}
        if self.ignore_eos:
            # MindIE ignores unknown parameters, so this is harmless there and exact-length
            # on servers that honour it.
            params["ignore_eos"] = True
        params.update(self.extra)
        body: dict[str, Any] = {"stream": True, "parameters": params}
        if spec.prompt_ids is not None:
            body["input_id"] = spec.prompt_ids
        else:
            body["inputs"] = spec.prompt_text
        return body


class OpenAIAdapter(Adapter):
    """OpenAI/vLLM ``POST /v1/completions``, prompt as a token-id list, greedy."""

    api, path, handler_cls = "openai", "/v1/completions", OpenAIHandler

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": spec.prompt_ids if spec.prompt_ids is not None else spec.prompt_text,
            "max_tokens": spec.output_len,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
            body["min_tokens"] = spec.output_len
        body.update(self.extra)
        return body


class ChatAdapter(Adapter):
    """OpenAI ``POST /v1/chat/completions`` (this server, vLLM, llama-server): the prompt as one
    user message (text: see ``workload.text_of``), greedy, streamed with usage."""

    api, path, handler_cls = "chat", "/v1/chat/completions", ChatHandler

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": text_of(spec, self.tokenizer)}],
            "max_tokens": spec.output_len,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:  # never with the chat workload: its answers end where the model ends them
            body["ignore_eos"] = True
            body["min_tokens"] = spec.output_len
        body.update(self.extra)
        return body


class TGIAdapter(Adapter):
    """TGI ``POST /generate_stream``; text only, see ``workload.text_of`` for how ids
    become text."""

    api, path, handler_cls = "tgi", "/generate_stream", TGIHandler

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        params: dict[str, Any] = {"max_new_tokens": spec.output_len, "details": True}
        if self.ignore_eos:
            params["ignore_eos"] = True  # not a TGI parameter; servers that know it honour it
        params.update(self.extra)
        return {"inputs": text_of(spec, self.tokenizer), "parameters": params}


ADAPTERS: dict[str, type[Adapter]] = {"native": NativeAdapter, "openai": OpenAIAdapter, "chat": ChatAdapter,
                                      "tgi": TGIAdapter}


def make_adapter(api: str, url: str, **kw: Any) -> Adapter:
    """The adapter for ``api`` (one of ``APIS``)."""
    try:
        return ADAPTERS[api](url, **kw)
    except KeyError:
        raise ValueError(f"unknown api {api!r}; choose from {', '.join(APIS)}") from None


async def resolve_model(client: HttpClient, base_url: str, timeout: float = 10.0) -> Optional[str]:
    """The first model id from ``GET /v1/models``, or None if the server has none."""
    try:
        doc = await client.get_json(base_url.rstrip("/") + "/v1/models", timeout)
        return doc["data"][0]["id"]
    except Exception:
        return None
