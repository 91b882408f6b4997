"""What the TGI, vLLM and Triton routes share: one request from admission to the last byte.

Each family (mindie/api/tgi.py, vllm_generate.py, triton.py) says how to read its body
(``parse``: a ``Job``, or ``ApiError`` with MindIE's message), how to write the whole answer
(``reply``) and how to write a stream (``events``). This class does the rest exactly as the
native route does it (mindie/api/infer.py): admission before the body is read (503 past
maxLinkNum), the ``req-id`` header (the name stopInfer uses, echoed back), the /stopService
flag (503), MindIE's metrics, one request-log line, a non-stream client that hangs up is
cancelled on its worker, and a stream's slot is released when the stream ends.

The generation itself is ``mindie.generation.Generation`` (stop strings held back and matched
across tokens, deadlines as mindie.md §4.2).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import falcon
import falcon.asgi
import msgspec

from mindie.admission import Slot
from mindie.api.infer import (TICK, Raw, Route, end_stream, finish_ok, read_request, serve_admitted, start_stream,
                              watch_disconnect)
from mindie.contract import wire as P
from mindie.contract.errors import FINISH_EOS, FINISH_STOP, FINISH_STOP_TOKEN, error_type
from mindie.errors import ApiError, validation_error
from mindie.generation import Deadline, Generation, GenerationError, Piece
from mindie.request_log import RequestRecord
from mindie.validation import MAX_TOKENS_NUM, PARSE_ERROR, Limits, check_json_text

log = logging.getLogger("mindie.api")

_decoder = msgspec.json.Decoder()


def decode_json(body: bytes, message: str = PARSE_ERROR) -> Any:
    """The body as JSON (MindIE rejects invalid UTF-8 and, here, nesting past 100 levels)."""
    check_json_text(body, message)
    try:
        return _decoder.decode(body)
    except (msgspec.DecodeError, RecursionError):
        raise validation_error(message) from None


def finish_name(reason: str) -> str:
    """The internal finish reasons as MindIE/TGI name them: a stop string ends with
    ``stop_sequence``, a stop token id with ``eos_token``."""
    if reason == FINISH_STOP:
        return "stop_sequence"
    if reason == FINISH_STOP_TOKEN:
        return FINISH_EOS
    return reason


@dataclass
class Job:
    """A validated request of any family."""

    input_ids: list[int]
    params: P.SamplingParams
    stream: bool = False
    stops: Sequence[str] = ()
    include_stop: bool = False
    priority: int = 5
    timeout: float | None = None
    user_id: str | None = None  # the name stopInfer uses, when the body gives one (Triton "id")
    extra: Any = None  # the family's parsed request
    prompt: str = ""


@dataclass
class Result:
    """A finished non-stream generation."""

    ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str = ""
    prompt_logprobs: list[float] = field(default_factory=list)
    prefill_ms: float = 0.0


class GenerateBase(Route):
    """One family's POST route(s). Subclasses set ``endpoint`` and implement ``parse``,
    ``reply`` and ``events``."""

    def __init__(self, fe) -> None:
        super().__init__(fe.client, fe.tokenizer, fe.limits, fe.metrics, fe.admission, fe.state)
        self.model_name = fe.model_name
        self.full_text = fe.full_text

    # -- what a family provides ------------------------------------------------------------
    def precheck(self, req: falcon.asgi.Request, kw: dict) -> None:
        """Checks before the body is read (Triton: the model in the path)."""

    def parse(self, req: falcon.asgi.Request, body: bytes, kw: dict, rec: RequestRecord) -> Job:
        raise NotImplementedError

    def reply(self, job: Job, res: Result, rec: RequestRecord) -> bytes:
        raise NotImplementedError

    def events(self, job: Job, gen: Generation, rec: RequestRecord) -> AsyncIterator[bytes | None]:
        raise NotImplementedError

    def content_type(self, job: Job) -> str:
        """The content type of a stream."""
        return "text/event-stream"

    def stream_error(self, job: Job, status: int, message: str, etype: str) -> bytes:
        """An error inside an open stream (default: an SSE event in MindIE's error shape)."""
        return b"data:" + msgspec.json.encode({"error": message, "error_type": etype}) + b"\n\n"

    # -- the request -----------------------------------------------------------------------
    async def serve(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, **kw) -> None:
        self.metrics.received()
        rec = RequestRecord("-", req.path)
        await serve_admitted(req, resp, rec, self.admission, self.metrics,
                             lambda slot: self._serve(req, resp, slot, rec, kw))

    async def _serve(self, req, resp, slot: Slot | None, rec: RequestRecord, kw: dict) -> None:
        try:
            self.precheck(req, kw)
            job = await read_request(req, self.limits, self.state, lambda body: self.parse(req, body, kw, rec))
            rec.input_tokens = len(job.input_ids)
            rec.stream = job.stream
            deadline = Deadline(job.timeout, self.limits.token_timeout, self.limits.e2e_timeout, job.stream)
            try:
                gen = Generation(self.client, self.tokenizer, job.input_ids, job.params, deadline,
                                 priority=job.priority, user_id=job.user_id or rec.request_id, stops=job.stops,
                                 include_stop=job.include_stop)
            except GenerationError as e:
                raise ApiError(e.status, e.message, e.error_type) from None
        except ApiError as e:
            self.metrics.failed()
            rec.done(e.status, error=e.message)
            raise
        self.metrics.prompt_tokens(len(job.input_ids))
        if job.stream:
            start_stream(resp, self._stream(job, gen, slot, rec), self.content_type(job))
            return
        try:
            res = await self._collect(req, gen, rec)
        except GenerationError as e:
            self.metrics.failed()
            rec.done(e.status, error=e.message)
            raise ApiError(e.status, e.message, e.error_type) from None
        if res is None:
            resp.status = 499  # the client hung up; nobody reads this
            resp.data = b""
            rec.done(499, error="client disconnected")
            return
        resp.content_type = falcon.MEDIA_JSON
        resp.data = self.reply(job, res, rec)
        self.succeeded(rec, res.finish_reason)

    def succeeded(self, rec: RequestRecord, finish: str) -> None:
        finish_ok(self.metrics, rec, finish_name(finish))

    async def _collect(self, req: falcon.asgi.Request, gen: Generation, rec: RequestRecord) -> Result | None:
        """Every piece; None when the client hung up (the request is cancelled on its worker)."""
        res = Result()
        gone = asyncio.Event()
        watcher = asyncio.create_task(watch_disconnect(req, gone, gen.stream))
        try:
            async with contextlib.aclosing(gen.pieces(tick=True)) as pieces:
                async for p in pieces:
                    if gone.is_set():
                        self.metrics.failed()
                        return None
                    if p is None:
                        continue
                    add_piece(res, p)
                    rec.token(len(p.token_ids))
        finally:
            watcher.cancel()
            if not gen.stream.finished:
                self.client.cancel(gen.stream)
        res.text = gen.text
        return res

    async def _stream(self, job: Job, gen: Generation, slot: Slot | None, rec: RequestRecord) -> AsyncIterator[object]:
        try:
            async with contextlib.aclosing(self.events(job, gen, rec)) as events:
                async for item in events:
                    yield TICK if item is None else Raw(item)
        except GenerationError as e:
            self.metrics.failed()
            rec.done(e.status, error=e.message)
            yield Raw(self.stream_error(job, e.status, e.message, e.error_type))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never leave a truncated body without a reason
            log.exception("stream of request %s failed", gen.request_id)
            self.metrics.failed()
            rec.done(500, error=f"Internal error: {e}")
            yield Raw(self.stream_error(job, 500, f"Internal error: {e}", error_type(500)))
        finally:
            end_stream(self.client, gen.stream, rec, slot)


async def render_pieces(gen: Generation, rec: RequestRecord,
                        render: Callable[[Piece], Iterable[bytes]]) -> AsyncIterator[bytes | None]:
    """A family's stream: what ``render`` makes of each piece (counted in ``rec`` first), and
    None while the generation waits (an idle tick)."""
    async with contextlib.aclosing(gen.pieces(tick=True)) as pieces:
        async for p in pieces:
            if p is None:
                yield None
                continue
            rec.token(len(p.token_ids))
            for item in render(p):
                yield item


def add_piece(res: Result, p: Piece) -> None:
    res.ids += p.token_ids
    res.logprobs += p.logprobs
    res.top_logprobs += p.top_logprobs
    res.prefill_ms = res.prefill_ms or p.prefill_ms
    res.prompt_logprobs = res.prompt_logprobs or p.prompt_logprobs
    if p.finish_reason:
        res.finish_reason = p.finish_reason


# -- checks the families share (MindIE's messages, infer_param.cpp) ---------------------------

def u16len(text: str) -> int:
    if text.isascii():
        return len(text)
    return len(text.encode("utf-16-le", "surrogatepass")) >> 1


MAX_STOP_STRING_LEN = 1024
MAX_STOP_STRING_NUM = 1024
MAX_TOTAL_STOP = 32 * 1024


def check_stop(p: dict, limit_count: bool, single_max: int) -> list[str]:
    """``stop`` as MindIE's AssignStopStrings: a string or a list of strings."""
    v = p.get("stop")
    if v is None:
        return []
    if type(v) is str:
        n = u16len(v)
        if n < 1 or n > single_max:
            raise validation_error(f"Input validation error: length of `stop` must be in [1, {single_max}], "
                                   f"but got {n}")
        return [v]
    if type(v) is not list:
        raise validation_error("Input validation error: param stop must be string or list[string]")
    total = 0
    ok = True
    for s in v:
        if type(s) is not str or not 1 <= u16len(s) <= MAX_STOP_STRING_LEN:
            ok = False
            break
        total += u16len(s)
    if not ok or total > MAX_TOTAL_STOP or (limit_count and len(v) > MAX_STOP_STRING_NUM):
        raise validation_error(f"Input validation error: `stop` must be list[string] if list, and item length in "
                               f"[1, {MAX_STOP_STRING_LEN}] with total <= {MAX_TOTAL_STOP}")
    return list(v)


def check_text_input(v: Any, limits: Limits, missing: str, empty: str, abnormal: str, length: str) -> str:
    """A family's prompt text (TGI ``inputs``, vLLM ``prompt``, Triton ``text_input``) as MindIE
    checks it, with the family's messages: missing (absent or null), an empty list, any other
    list (multimodal), not a string, a length outside (0, max_text_len] UTF-16 units (``length``
    is formatted with ``limit`` and ``n``)."""
    if v is None:
        raise validation_error(missing)
    if type(v) is list:
        if not v:
            raise validation_error(empty)
        raise validation_error("Multimodal inputs are not supported by this model.")
    if type(v) is not str:
        raise validation_error(abnormal)
    n = u16len(v)
    if n == 0 or n > limits.max_text_len:
        raise validation_error(length.format(limit=limits.max_text_len, n=n))
    return v


def encode_text_input(text: str, encode: Callable[[str], list[int]], message: str) -> list[int]:
    """The prompt's token ids; 422 unless their count is in (0, MAX_TOKENS_NUM] (``message`` is
    formatted with ``limit`` and ``n``)."""
    ids = encode(text)
    if not 0 < len(ids) <= MAX_TOKENS_NUM:
        raise validation_error(message.format(limit=MAX_TOKENS_NUM, n=len(ids)))
    return ids


def check_params_object(container: dict, key: str = "parameters") -> dict:
    v = container.get(key)
    if v is None:
        return {}
    if type(v) is not dict:
        raise validation_error(f"{key} must be object type.")
    return v


def check_string(p: dict, key: str) -> str | None:
    v = p.get(key)
    if v is None:
        return None
    if type(v) is not str:
        raise validation_error(f"{key} must be string type.")
    return v


def check_model_name(name: str | None, served: str) -> None:
    """A LoRA name (TGI ``adapter_id``, vLLM ``model``): this server has only its base model."""
    if name is not None and name not in (served, "None"):
        raise ApiError(404, f"Model {name} not found.")


def json_bytes(obj: Any) -> bytes:
    return msgspec.json.encode(obj)
