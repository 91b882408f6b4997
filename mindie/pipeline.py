"""The request pipeline: one lifecycle for every inference route of every API family.

    admission -> read -> parse -> submit -> pieces -> render -> finish (log, metrics)

``Pipeline.serve`` runs it for one request with the route's ``Codec``: the family's small part,
kept beside its route in ``mindie/api/``. A codec parses its body into a ``Job`` (one or more
``Sub``missions: OpenAI's ``n`` and list prompts give several) and renders what comes back in its
own shape: the whole answer (``reply``), or stream events (``open``, ``render`` per piece,
``close``), and errors (``error`` before the answer starts, ``stream_error`` inside a stream: the
codec's ``family``'s shapes, mindie/contract/families.py, which the coordinator writes too).
Everything else happens here, once, the same way for every family:

- the ``req-id`` header (what stopInfer names; generated when absent, echoed back) and the
  admission slot (maxLinkNum, server-wide; taken before the body is read, so a refusal costs no
  work), released exactly once when the answer is fully sent;
- the body, read under maxRequestLength (413), the /stopService flag (503), a large body parsed
  off the event loop, and so are the checks a codec leaves in ``Job.checks`` (a structured-output
  constraint compiled for the first time);
- one ``Generation`` per submission (mindie/text/generation.py: stop strings, deadlines);
- a non-stream client that hangs up, or a stream whose client is gone, is cancelled on its
  worker, logged 499 and counted failed;
- every failure is one ``ApiError`` (mindie/contract/http_error.py), logged and counted once here; the app's
  error handler asks the codec to write it (mindie/server/app.py);
- MindIE's metrics (received, failed, success with TTFT/TPOT/end to end, prompt tokens) and one
  request-log line (mindie/server/request_log.py);
- the body keys the codec found its family does not read (``Job.ignored``): named in the
  ``X-Ignored-Fields`` header and a rate-limited WARNING (mindie/text/ignored_fields.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import falcon
import falcon.asgi

from mindie.text import ignored_fields
from mindie import sse
from mindie.api import pd_role
from mindie.lora_adapters import Adapters
from mindie.server.admission import Admission, Slot
from mindie.device_client import DeviceClient
from mindie.contract import families, pd
from mindie.contract import wire as P
from mindie.contract.errors import FINISH_EOS, FINISH_STOP, FINISH_STOP_TOKEN
from mindie.text.detokenizer import TextTokenizer
from mindie.contract.http_error import STOPPED_MESSAGE, ApiError, request_too_large
from mindie.text.generation import Deadline, Generation, Piece
from mindie.server.http_conn import RECEIVE_TIMEOUT_KEY
from mindie.server.metrics import Metrics
from mindie.server.request_log import RequestRecord
from mindie.server.service_state import ServiceState
from mindie.text.structured import Checker
from mindie.text.validation import Limits

log = logging.getLogger("mindie.api")

LARGE_BODY = 256 * 1024  # bytes; larger bodies are parsed on a thread
REQ_ID_HEADER = "req-id"
REQ_ID_RE = re.compile(r"^[a-zA-Z0-9_-]{1,256}$")


# -- what a codec parses into, and what comes back ------------------------------------------

@dataclass
class Sub:
    """One submission to a device worker."""

    input_ids: list[int]
    params: P.SamplingParams
    stops: Sequence[str] = ()
    include_stop: bool = False
    priority: int = P.DEFAULT_PRIORITY
    timeout: float | None = None  # the client's timeout (s); None = the server's only
    user_id: str | None = None  # the name stopInfer uses when the body gives one (else req-id)
    prompt: int = 0  # which prompt of the request (OpenAI list prompts: several subs share one)
    adapter: str = ""  # the LoRA adapter the request names ("" = the base model)
    keep_special: frozenset[int] = frozenset()  # special ids the text keeps (tool-call delimiters)
    # A thinking budget (mindie/text/reasoning.py ThinkingBudget): its ``generation(start, ids, params)``
    # runs the submission instead of one Generation.
    budget: Any = None


@dataclass
class Job:
    """A parsed request: its submissions and the family's parsed body (``request``)."""

    subs: list[Sub]
    stream: bool = False
    request: Any = None
    codec: "Codec | None" = None  # who renders it, when not the route's codec (/generate)
    ignored: list[ignored_fields.Found] = field(default_factory=list)  # body keys the family does not read
    # Checks too slow for the event loop (compiling a new structured-output constraint:
    # mindie/text/structured.py), run on a thread before anything is submitted; each raises ApiError.
    checks: list[Callable[[], None]] = field(default_factory=list)
    state: dict = field(default_factory=dict)  # the codec's per-request scratch (Output.state: per output)

    def prompt_tokens(self) -> int:
        """Prompt tokens of the request, each prompt counted once."""
        return sum({s.prompt: len(s.input_ids) for s in self.subs}.values())

    @staticmethod
    def cached_tokens(outs: list[Output]) -> int:
        """Of those, the ones whose KV the prefix cache served: each prompt once, as its first
        output's worker found them."""
        first: dict[int, int] = {}
        for o in outs:
            first.setdefault(o.sub.prompt, o.gen.cached_tokens)
        return sum(first.values())


@dataclass
class Output:
    """What one submission produced so far (``add`` each piece)."""

    index: int
    sub: Sub
    gen: Generation
    text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    finish: str = ""
    stop: str | None = None  # the stop string that ended it
    prefill_ms: float | None = None  # of the first token
    decode_ms: list[float] = field(default_factory=list)  # of each later token
    state: dict = field(default_factory=dict)  # the codec's per-output scratch
    embedding: bytes = b""  # a pooling submission's vector (float32 little-endian)

    def add(self, p: Piece) -> None:
        # Once per token frame of every stream: keep the common case (one id, no log-probs) short.
        if p.text:
            self.text += p.text
        ids = p.token_ids
        if ids:
            n = len(ids)
            if self.prefill_ms is None:
                self.prefill_ms = round(p.prefill_ms, 2)
                if n > 1:
                    self.decode_ms += [round(p.decode_ms / n, 2)] * (n - 1)
            else:
                self.decode_ms += [round(p.decode_ms / n, 2)] * n
            self.ids += ids
        if p.logprobs:
            self.logprobs += p.logprobs
        if p.top_logprobs:
            self.tops += p.top_logprobs
        if p.prompt_logprobs and not self.prompt_logprobs:
            self.prompt_logprobs = list(p.prompt_logprobs)
        if p.finish_reason:
            self.finish = p.finish_reason
            self.stop = p.stop
            if p.embedding:
                self.embedding = p.embedding

    def stop_reason(self) -> Union[str, int, None]:
        """The stop string or stop token id that ended it (vLLM's ``stop_reason``), else None."""
        if self.finish == FINISH_STOP:
            return self.stop
        if self.finish == FINISH_STOP_TOKEN and self.ids:
            return self.ids[-1]
        return None


@dataclass
class Context:
    """One request as its codec sees it: the HTTP request, its log record and the route's
    arguments (``kw``: the responder's mode, path parameters)."""

    req: falcon.asgi.Request
    rec: RequestRecord
    kw: dict

    @property
    def request_id(self) -> str:
        return self.rec.request_id


class Codec:
    """One API family's shapes. Subclasses implement ``parse``, ``reply`` and ``render``."""

    detokenize = True  # whether pieces carry text (False: the codec decodes ids itself)
    content_type = sse.SSE  # of a stream
    family = families.OTHER  # whose error shapes (mindie/contract/families.py; OTHER: MindIE's)

    def precheck(self, ctx: Context) -> None:
        """Checks before the body is read (Triton: the model in the path)."""

    def parse(self, body: bytes, ctx: Context) -> Job:
        raise NotImplementedError

    def refused(self, err: ApiError) -> ApiError:
        """A refusal before any submission, as this family reports it (OpenAI: 422 is 400)."""
        return err

    def reply(self, job: Job, outs: list[Output], ctx: Context) -> bytes:
        """The whole answer of a non-stream request."""
        raise NotImplementedError

    def open(self, job: Job, outs: list[Output], ctx: Context) -> Iterable[bytes]:
        """Events before the first piece."""
        return ()

    def render(self, job: Job, out: Output, piece: Piece, ctx: Context) -> Iterable[bytes]:
        """The events of one piece (``out`` has it added already)."""
        raise NotImplementedError

    def close(self, job: Job, outs: list[Output], ctx: Context) -> Iterable[bytes]:
        """Events after the last piece of every output."""
        return ()

    def error(self, err: ApiError) -> tuple[int, bytes]:
        """An error answer (status, body) before the answer started, in the family's shape."""
        return families.error_answer(self.family, err)

    def stream_error(self, job: Job, err: ApiError) -> bytes:
        """The last bytes of an open stream that failed: the family's error frame and terminator."""
        return families.stream_error(self.family, err)

    def finish_label(self, finish: str) -> str:
        """The finish reason in the request log."""
        return finish


def finish_name(reason: str) -> str:
    """The internal finish reasons as MindIE's TGI, vLLM and Triton routes name them: a stop
    string ends with ``stop_sequence``, a stop token id with ``eos_token``."""
    if reason == FINISH_STOP:
        return "stop_sequence"
    if reason == FINISH_STOP_TOKEN:
        return FINISH_EOS
    return reason


# -- request helpers ------------------------------------------------------------------------

def request_id(req: falcon.asgi.Request) -> str:
    """The client's ``req-id`` header (what stopInfer names), else a generated id."""
    rid = req.get_header(REQ_ID_HEADER)
    if rid is None:
        return secrets.token_hex(8)
    if not REQ_ID_RE.match(rid):
        raise ApiError(422, "The req-id header can contain only digits, letters, underscores(_), hyphens(-) "
                            "and no more than 256 words in length.")
    return rid


def over_limit(limit: int) -> ApiError:
    """503 "Service Unavailable" past maxLinkNum requests in progress (docs/reliability.md)."""
    return ApiError(503, f"Too many requests: {limit} requests (maxLinkNum) are in progress, try again later.")


async def read_body(req: falcon.asgi.Request, max_mb: int) -> bytes:
    """The request body, refusing more than ``max_mb`` MB (413) without reading it all.

    A body shorter than its Content-Length (the client hung up, and Falcon's stream just ends;
    or httptools stopped at an Upgrade header) is refused with 400 rather than parsed: its
    prefix may be valid JSON. A body that stopped at ``ServerConfig.bodyTimeoutS`` (the
    connection answered 408 and closed: mindie/server/gunicorn_worker.py) is refused with that 408,
    so that it is logged and counted as what it was, and its admission slot given back.
    """
    limit = max_mb * 1024 * 1024
    expected = req.content_length
    if expected is not None and expected > limit:
        raise request_too_large(max_mb)
    chunks = []
    size = 0
    async for chunk in req.stream:
        size += len(chunk)
        if size > limit:
            raise request_too_large(max_mb)
        chunks.append(chunk)
    timed_out = ((getattr(req, "scope", None) or {}).get("extensions") or {}).get(RECEIVE_TIMEOUT_KEY)
    if timed_out:
        raise ApiError(408, timed_out, "Request Timeout")
    if expected is not None and size < expected:
        raise ApiError(400, f"The request body ended after {size} of its {expected} bytes.")
    return b"".join(chunks)


async def disconnected(req: falcon.asgi.Request) -> None:
    """Returns when the client of a non-stream request hangs up (never, where Falcon gives no
    receive callable). The body has been read in full, so the next ASGI message can only be
    the disconnect. Falcon has no public hook for this; ``_receive`` is its ASGI receive
    callable (Falcon 4)."""
    receive = getattr(req, "_receive", None)
    if receive is None:
        await asyncio.Event().wait()
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return


def _run_checks(checks: list[Callable[[], None]]) -> None:
    for check in checks:
        check()


def _check_finished(outs: list[Output]) -> None:
    """Raises ApiError (500) for an output whose pieces ended without a finish reason: an answer
    ends with its full output or with an error, never as a silent success (an empty 200 stream)."""
    if any(not o.finish for o in outs):
        raise ApiError(500, "Internal error: the generation ended without a finish reason")


def finish_ok(metrics: Metrics, rec: RequestRecord, finish: str) -> None:
    """A request that succeeded: MindIE's metrics (TTFT, TPOT, end to end) and its log line."""
    metrics.succeeded(rec.output_tokens)
    n = rec.output_tokens
    e2e = rec.duration_s
    tpot = (e2e - rec.ttft_s) / (n - 1) if n > 1 and rec.ttft_s is not None else None
    metrics.observe(rec.ttft_s, tpot, e2e)
    rec.done(200, finish)


# -- the lifecycle --------------------------------------------------------------------------

class Pipeline:
    """What every inference route serves with: the device workers, the tokenizer, the request
    limits, MindIE's metrics, admission control (maxLinkNum; None = off) and the /stopService
    flag (None = none)."""

    def __init__(self, client: DeviceClient, tokenizer: TextTokenizer, limits: Limits, metrics: Metrics,
                 admission: Admission | None = None, state: ServiceState | None = None,
                 ignored_log: ignored_fields.IgnoredFieldsLog | None = None, roles: pd_role.RoleState | None = None):
        self.client = client
        self.tokenizer = tokenizer
        self.limits = limits
        self.metrics = metrics
        self.admission = admission
        self.state = state
        self.roles = roles  # the instance's PD role (mindie/api/pd_role.py); None = flex
        self.ignored_log = ignored_log or ignored_fields.REPORTER
        self.adapters = Adapters(client)  # the LoRA adapters requests may name (mindie/lora_adapters.py)
        self.structured = Checker(tokenizer)  # structured-output constraints (mindie/text/structured.py)
        # Why the served model cannot generate ("" = it can): a cross-encoder (mindie/text/rerank.py)
        # serves pooling submissions only, so every other request is refused before it is sent.
        self.score_only = ""

    async def serve(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, codec: Codec, **kw: Any) -> None:
        """One request, from admission to its last byte, with ``codec``'s shapes."""
        self.metrics.received()
        rec = RequestRecord("-", req.path, getattr(self.metrics, "model", ""))
        ctx = Context(req, rec, kw)
        req.context.codec = codec
        slot: Slot | None = None
        order: P.PdOrder | None = None
        try:
            rec.request_id = request_id(req)
        except ApiError as e:  # logged, not counted as a failed generation (as MindIE's /infer)
            err = codec.refused(e)
            rec.done(err.status, error=err.message)
            raise err from None
        resp.set_header(REQ_ID_HEADER, rec.request_id)
        try:
            slot = self._admit()
            order = pd.parse_header(req.get_header(pd.HEADER))
            if (refused := pd_role.refusal(self.roles.role if self.roles is not None else pd.FLEX, order)) is not None:
                raise refused
            if order is not None and order.op == pd.WHOLE:
                order = None  # served as a hybrid instance serves it: a plain request from here on
            codec.precheck(ctx)
            body = await read_body(req, self.limits.max_request_length_mb)
            if self.state is not None and self.state.stopped():
                raise ApiError(503, STOPPED_MESSAGE)
            job = await asyncio.to_thread(codec.parse, body, ctx) if len(body) > LARGE_BODY else codec.parse(body, ctx)
            if job.codec is not None:
                codec = req.context.codec = job.codec
            if self.score_only and any(not s.params.pooling for s in job.subs):
                raise ApiError(400, self.score_only)
            if job.checks:
                await asyncio.to_thread(_run_checks, job.checks)
            if job.ignored:  # accepted as before; named in a header and a rate-limited WARNING
                ignored_fields.report(req, resp, job.ignored, self.ignored_log)
            if order is not None and order.op == pd.PREFILL:
                # Prompt only: one submission (its first prompt), one token, no constraint; the answer
                # is the transfer's (mindie/api/pd_role.py), not the family's.
                job.stream = False
                job.subs = job.subs[:1]
                sub0 = job.subs[0]
                sub0.params.max_new_tokens, sub0.params.constraint, sub0.budget = 1, None, None
            rec.input_tokens = job.prompt_tokens()
            rec.stream = job.stream
            outs = self._submit(codec, job, rec, order)
        except Exception as e:
            if slot is not None:
                slot.release()
            err = e if isinstance(e, ApiError) else self._internal(e, req)
            err = codec.refused(err)
            self._failed(rec, err)
            raise err from None
        self.metrics.prompt_tokens(sum(len(o.sub.input_ids) for o in outs))
        if order is not None and order.op == pd.PREFILL:
            try:
                await self._prefill(codec, outs, ctx, resp, order)
            finally:
                if slot is not None:
                    slot.release()
            return
        if job.stream:
            sse.start_stream(resp, self._stream(codec, job, outs, ctx, slot), codec.content_type)
            return
        try:
            await self._collect(codec, job, outs, ctx, resp)
        finally:
            if slot is not None:
                slot.release()

    def _admit(self) -> Slot | None:
        if self.admission is None:
            return None
        slot = self.admission.try_acquire()
        if slot is None:
            raise over_limit(self.admission.limit)
        return slot

    @staticmethod
    def _internal(e: Exception, req: falcon.asgi.Request) -> ApiError:
        log.exception("%s %s: unexpected error", req.method, req.path)
        return ApiError(500, f"Internal error: {type(e).__name__}")

    def _failed(self, rec: RequestRecord, err: ApiError) -> None:
        # The tokens it produced before it failed (499, a timeout) are generated tokens too: the
        # request log's output_tokens and generation_tokens_total count the same tokens.
        self.metrics.failed(rec.output_tokens)
        rec.done(err.status, error=err.message)

    def _succeeded(self, codec: Codec, rec: RequestRecord, outs: list[Output]) -> None:
        finish_ok(self.metrics, rec, codec.finish_label(outs[0].finish if outs else ""))

    async def _prefill(self, codec: Codec, outs: list[Output], ctx: Context, resp: falcon.asgi.Response,
                       order: P.PdOrder) -> None:
        """A PD prefill request: its prompt computed and its KV blocks acknowledged by the decode
        worker; answered with the transfer's figures (mindie/api/pd_role.py)."""
        t0 = time.monotonic()
        try:
            await self._drain(outs, ctx.rec)
        except ApiError as e:
            self._failed(ctx.rec, e)
            raise codec.refused(e) from None
        n = len(outs[0].sub.input_ids)
        resp.content_type = falcon.MEDIA_JSON
        resp.data = pd.prefill_answer(order.transfer_id, n, (time.monotonic() - t0) * 1000.0)
        finish_ok(self.metrics, ctx.rec, "pd_prefill")

    def _submit(self, codec: Codec, job: Job, rec: RequestRecord, order: P.PdOrder | None = None) -> list[Output]:
        lim = self.limits
        outs: list[Output] = []
        try:
            for i, sub in enumerate(job.subs):
                deadline = Deadline(sub.timeout, lim.token_timeout, lim.e2e_timeout, job.stream)

                def start(ids: list[int], params: P.SamplingParams, sub: Sub = sub,
                          deadline: Deadline = deadline) -> Generation:
                    return Generation(self.client, self.tokenizer, ids, params, deadline, priority=sub.priority,
                                      user_id=sub.user_id or rec.request_id, stops=sub.stops,
                                      include_stop=sub.include_stop, detokenize=codec.detokenize, adapter=sub.adapter,
                                      keep_special=sub.keep_special, pd=order if not outs else None)
                gen = start(sub.input_ids, sub.params) if sub.budget is None else \
                    sub.budget.generation(start, sub.input_ids, sub.params)
                outs.append(Output(i, sub, gen))
        except BaseException:
            for o in outs:
                self.client.cancel(o.gen.stream)
            raise
        return outs

    async def _pieces(self, outs: list[Output], tick: bool) -> AsyncIterator[tuple[Output, Piece] | None]:
        """Pieces of several outputs, merged as they come (None every IDLE_TICK_S while none does,
        with ``tick``); a single output is read from its generation directly (``_drain``,
        ``_stream``). Raises the first ApiError; every generation still running is cancelled when
        this ends, however it ends."""
        q: asyncio.Queue = asyncio.Queue()

        async def pump(o: Output) -> None:
            try:
                async for p in o.gen.pieces():
                    q.put_nowait((o, p))
                q.put_nowait((o, None))
            except ApiError as e:
                q.put_nowait((o, e))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # never a silent hang
                log.exception("output %d of a request failed", o.index)
                q.put_nowait((o, ApiError(500, f"Internal error: {type(e).__name__}: {e}")))

        tasks = [asyncio.create_task(pump(o)) for o in outs]
        left = len(outs)
        try:
            while left:
                if tick:
                    try:
                        o, item = await asyncio.wait_for(q.get(), sse.IDLE_TICK_S)
                    except asyncio.TimeoutError:
                        yield None
                        continue
                else:
                    o, item = await q.get()
                if item is None:
                    left -= 1
                elif isinstance(item, ApiError):
                    raise item
                else:
                    yield o, item
        finally:
            self._cancel(outs)  # however this ends, the generations end with it (no frame comes after)
            for t in tasks:
                t.cancel()

    async def _drain(self, outs: list[Output], rec: RequestRecord) -> None:
        if len(outs) == 1:  # the common case, without the merging layer
            out = outs[0]
            async with contextlib.aclosing(out.gen.pieces()) as pieces:
                async for p in pieces:
                    rec.piece(p)
                    out.add(p)
            return
        async with contextlib.aclosing(self._pieces(outs, tick=False)) as pieces:
            async for item in pieces:
                out, p = item
                rec.piece(p)
                out.add(p)

    async def _collect(self, codec: Codec, job: Job, outs: list[Output], ctx: Context,
                       resp: falcon.asgi.Response) -> None:
        rec = ctx.rec
        work = asyncio.create_task(self._drain(outs, rec))
        gone = asyncio.create_task(disconnected(ctx.req))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            work.cancel()
            raise
        finally:
            gone.cancel()
        if not work.done():  # the client hung up: its generations are cancelled on their workers
            # The workers first: no frame arrives after this. Then the collecting task, again until
            # it ends: Python 3.11's wait_for loses a cancel that lands as its wait completes (a
            # frame arriving), and with no frame left to arrive the next cancel cannot be lost.
            self._cancel(outs)
            while not work.done():
                work.cancel()
                await asyncio.wait({work}, timeout=0.1)
            with contextlib.suppress(BaseException):
                work.result()  # retrieved: a task that ended otherwise is not logged as unhandled
            self._failed(rec, ApiError(499, "client disconnected"))
            resp.status = 499  # nobody reads this
            resp.data = b""
            return
        try:
            work.result()
            _check_finished(outs)
        except ApiError as e:
            self._failed(rec, e)
            raise
        resp.data = codec.reply(job, outs, ctx)
        resp.content_type = falcon.MEDIA_JSON
        self._succeeded(codec, rec, outs)

    def _cancel(self, outs: list[Output]) -> None:
        for o in outs:
            if not o.gen.stream.finished:
                self.client.cancel(o.gen.stream)

    async def _stream(self, codec: Codec, job: Job, outs: list[Output], ctx: Context,
                      slot: Slot | None) -> AsyncIterator[object]:
        rec = ctx.rec
        single = outs[0] if len(outs) == 1 else None  # the common case, without the merging layer
        pieces = single.gen.pieces(tick=True) if single is not None else self._pieces(outs, tick=True)
        render = codec.render
        try:
            for data in codec.open(job, outs, ctx):
                yield sse.Raw(data)
            async for item in pieces:
                if item is None:
                    yield sse.TICK
                    continue
                if single is not None:
                    out, p = single, item
                else:
                    out, p = item
                rec.piece(p)
                out.add(p)
                data = b"".join(render(job, out, p, ctx))
                if data:
                    yield sse.Raw(data)
            _check_finished(outs)
            tail = b"".join(codec.close(job, outs, ctx))
            self._succeeded(codec, rec, outs)
            if tail:
                yield sse.Raw(tail)
        except asyncio.CancelledError:
            raise
        except ApiError as e:
            self._failed(rec, e)
            yield sse.Raw(codec.stream_error(job, e))
        except Exception as e:  # never leave a truncated body without a reason
            log.exception("stream of request %s failed", rec.request_id)
            err = ApiError(500, f"Internal error: {e}")
            self._failed(rec, err)
            yield sse.Raw(codec.stream_error(job, err))
        finally:
            if not rec._logged:
                self._failed(rec, ApiError(499, "client disconnected"))
            try:
                await pieces.aclose()  # cancels the generations' tasks
            except BaseException:  # noqa: BLE001 - closing must not mask the original exit
                pass
            self._cancel(outs)
            if slot is not None:
                slot.release()
