"""POST /infer and POST /infer_token: one handler, token ids or text in, JSON or SSE out.

The request's life as MindIE lives it is here too, for every inference route (TGI, vLLM,
Triton: mindie/api/generate_base.py; OpenAI: mindie/api/openai.py): ``req-id`` and admission
(``admit``, ``serve_admitted``), the body read and parsed (``read_request``), a stream's start
and end (``start_stream``, ``end_stream``, ``Raw``, ``TICK``), a client that hangs up
(``watch_disconnect``), and the metrics and log line of a success (``finish_ok``)."""
from __future__ import annotations

import asyncio
import functools
import logging
import re
import secrets
import time
from typing import AsyncIterator, Awaitable, Callable, TypeVar

import falcon
import falcon.asgi

from mindie import responses as R
from mindie.admission import Admission, Slot
from mindie.api.body import read_body
from mindie.contract.errors import error_type
from mindie.client import DeviceClient, NoWorkerError, RequestStream
from mindie.detokenizer import IncrementalDetokenizer, TextTokenizer
from mindie.errors import ApiError
from mindie.generation import Deadline
from mindie.metrics import Metrics
from mindie.request_log import RequestRecord
from mindie.service_state import STOPPED_MESSAGE, ServiceState
from mindie.validation import InferRequest, Limits, parse_infer_request

log = logging.getLogger("mindie.api")
T = TypeVar("T")

LARGE_BODY = 256 * 1024  # bytes; larger bodies are parsed on a thread
IDLE_TICK_S = 1.0  # how often an idle stream checks for a client disconnect


class Tick:
    """Sent while a stream waits: zero bytes on the wire, but Falcon checks for a client
    disconnect after every item, so a vanished client is noticed within IDLE_TICK_S."""

    def __bool__(self) -> bool:
        return True

    def serialize(self, handler=None) -> bytes:
        return b""


class Raw:
    """Bytes sent as they are into an open stream (Falcon's ``resp.sse`` item)."""

    def __init__(self, data: bytes):
        self.data = data

    def __bool__(self) -> bool:
        return True

    def serialize(self, handler=None) -> bytes:
        return self.data


TICK = Tick()


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


async def watch_disconnect(req: falcon.asgi.Request, gone: asyncio.Event, stream: RequestStream) -> None:
    """Notice a client that hangs up while its non-stream request runs, so the request is
    cancelled on its worker: sets ``gone`` and wakes the collector."""
    await disconnected(req)
    gone.set()
    stream.event.set()  # wake the collector


REQ_ID_HEADER = "req-id"
REQ_ID_RE = re.compile(r"^[a-zA-Z0-9_-]{1,256}$")


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


def admit(req: falcon.asgi.Request, resp: falcon.asgi.Response, rec: RequestRecord, admission: Admission | None,
          metrics: Metrics | None = None) -> Slot | None:
    """The request's id (``req-id``, echoed back) and its admission slot (None without admission
    control). Admission comes first, before the body is read: past maxLinkNum a request costs no
    work. Raises ApiError: 422 for a bad ``req-id``, 503 past maxLinkNum (counted as failed in
    ``metrics`` when given)."""
    rec.request_id = request_id(req)
    resp.set_header(REQ_ID_HEADER, rec.request_id)
    if admission is None:
        return None
    slot = admission.try_acquire()
    if slot is None:
        if metrics is not None:
            metrics.failed()
        raise over_limit(admission.limit)
    return slot


async def serve_admitted(req: falcon.asgi.Request, resp: falcon.asgi.Response, rec: RequestRecord,
                         admission: Admission | None, metrics: Metrics,
                         serve: Callable[[Slot | None], Awaitable[None]]) -> None:
    """``admit``, then ``serve(slot)``; a refusal is logged and raised (MindIE's error answer)."""
    try:
        slot = admit(req, resp, rec, admission, metrics)
    except ApiError as e:
        rec.done(e.status, error=e.message)
        raise
    try:
        await serve(slot)
    finally:
        # Released exactly once: here when no stream was handed out, else by the stream's
        # generator when it ends (or by Slot's finalizer if Falcon never started it).
        if resp.sse is None and slot is not None:
            slot.release()


async def read_request(req: falcon.asgi.Request, limits: Limits, state: ServiceState | None,
                       parse: Callable[[bytes], T]) -> T:
    """The body, read and parsed; 503 after /stopService. Decoding and tokenising megabytes
    takes seconds: a large body is parsed off the event loop, so the front end's other streams
    and its gunicorn heartbeat go on meanwhile."""
    body = await read_body(req, limits.max_request_length_mb)
    if state is not None and state.stopped():
        raise ApiError(503, STOPPED_MESSAGE)
    if len(body) > LARGE_BODY:
        return await asyncio.to_thread(parse, body)
    return parse(body)


def start_stream(resp: falcon.asgi.Response, events: AsyncIterator[object],
                 content_type: str = "text/event-stream") -> None:
    resp.content_type = content_type
    resp.set_header("Cache-Control", "no-cache")
    resp.set_header("X-Accel-Buffering", "no")
    resp.sse = events


def finish_ok(metrics: Metrics, rec: RequestRecord, finish: str) -> None:
    """A request that succeeded: MindIE's metrics (TTFT, TPOT, end to end) and its log line."""
    metrics.succeeded(rec.output_tokens)
    n = rec.output_tokens
    e2e = rec.duration_s
    tpot = (e2e - rec.ttft_s) / (n - 1) if n > 1 and rec.ttft_s is not None else None
    metrics.observe(rec.ttft_s, tpot, e2e)
    rec.done(200, finish)


def end_stream(client: DeviceClient, stream: RequestStream, rec: RequestRecord, slot: Slot | None) -> None:
    """A stream's end, however it ends: logged (499 when nothing else was), its request
    cancelled on its worker if still running, its slot released."""
    if not rec._logged:
        rec.done(499, error="client disconnected")
    try:
        if not stream.finished:
            client.cancel(stream)
    finally:
        if slot is not None:
            slot.release()


class Route:
    """What every inference route serves with: the device workers, the tokenizer, the request
    limits, MindIE's metrics, admission control (maxLinkNum; None = off) and the /stopService
    flag (None = none)."""

    def __init__(self, client: DeviceClient, tokenizer: TextTokenizer, limits: Limits, metrics: Metrics,
                 admission: Admission | None = None, state: ServiceState | None = None):
        self.client = client
        self.tokenizer = tokenizer
        self.limits = limits
        self.metrics = metrics
        self.admission = admission
        self.state = state


class InferResource(Route):
    def __init__(self, client: DeviceClient, tokenizer: TextTokenizer, limits: Limits, metrics: Metrics,
                 admission: Admission | None = None, full_text: bool = False, state: ServiceState | None = None):
        """``full_text``: ServerConfig.fullTextEnabled, each stream frame's ``token.text`` is the
        text so far instead of the new piece. ``state``: the /stopService flag."""
        super().__init__(client, tokenizer, limits, metrics, admission, state)
        self.full_text = full_text

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        self.metrics.received()
        rec = RequestRecord("-", req.path)
        await serve_admitted(req, resp, rec, self.admission, self.metrics,
                             lambda slot: self._serve(req, resp, slot, rec))

    async def _serve(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, slot: Slot | None,
                     rec: RequestRecord) -> None:
        try:
            ireq = await read_request(req, self.limits, self.state, functools.partial(
                parse_infer_request, limits=self.limits, encode=self.tokenizer.encode))
            rec.input_tokens = len(ireq.input_ids)
            rec.stream = ireq.stream
            try:
                stream = self.client.submit(ireq.input_ids, ireq.sampling, ireq.priority, user_id=rec.request_id)
            except NoWorkerError as e:
                raise ApiError(503, f"No device worker is ready: {e}")
        except ApiError as e:
            self.metrics.failed()
            rec.done(e.status, error=e.message)
            raise
        lim = self.limits
        deadlines = Deadline(ireq.timeout, lim.token_timeout, lim.e2e_timeout, ireq.stream)
        self.metrics.prompt_tokens(len(ireq.input_ids))
        if ireq.stream:
            start_stream(resp, self._stream(ireq, stream, deadlines, slot, rec))
            return
        try:
            resp.data = await self._collect(req, ireq, stream, deadlines, rec)
        except ApiError as e:
            self.metrics.failed()
            rec.done(e.status, error=e.message)
            raise
        if resp.data is None:
            resp.status = 499  # the client hung up; nobody reads this
            rec.done(499, error="client disconnected")
        resp.content_type = falcon.MEDIA_JSON

    async def _collect(self, req: falcon.asgi.Request, ireq: InferRequest, stream: RequestStream,
                       dl: Deadline, rec: RequestRecord) -> bytes | None:
        """The JSON reply; None when the client hung up (the request is cancelled)."""
        ids: list[int] = []
        finish = ""
        gone = asyncio.Event()
        watcher = asyncio.create_task(watch_disconnect(req, gone, stream))
        try:
            while not finish:
                deadline, desc = dl.next()
                frames = await stream.get(max(0.0, deadline - time.monotonic()))
                if gone.is_set():
                    self.metrics.failed()
                    return None
                if not frames:
                    if time.monotonic() >= deadline:
                        raise ApiError(500, f"Engine callback timeout: {desc}")
                    continue
                for f in frames:
                    if f.error is not None:
                        raise ApiError(f.error.status, f.error.message, f.error.error_type)
                    ids.extend(f.token_ids)
                    rec.token(len(f.token_ids))
                    if f.finish_reason:
                        finish = f.finish_reason
        finally:
            watcher.cancel()
            if not stream.finished:
                self.client.cancel(stream)
        finish_ok(self.metrics, rec, finish)
        details = R.Details(finish, len(ids), ids, ireq.sampling.seed) if ireq.details else None
        return R.reply(self.tokenizer.decode(ids), details)

    async def _stream(self, ireq: InferRequest, stream: RequestStream, dl: Deadline,
                      slot: Slot | None, rec: RequestRecord) -> AsyncIterator[object]:
        detok = IncrementalDetokenizer(self.tokenizer)
        ids: list[int] = []
        so_far = ""  # fullTextEnabled
        try:
            while True:
                deadline, desc = dl.next()
                wait = min(IDLE_TICK_S, deadline - time.monotonic())
                frames = await stream.get(max(0.0, wait))
                if not frames:
                    if time.monotonic() >= deadline:
                        self.client.cancel(stream)
                        self.metrics.failed()
                        rec.done(500, error=f"Engine callback timeout: {desc}")
                        # MindIE writes the raw text into the open stream, then closes it.
                        yield Raw(f"Engine callback timeout: {desc}".encode())
                        return
                    yield TICK
                    continue
                dl.token()
                for f in frames:
                    if f.error is not None:
                        self.metrics.failed()
                        rec.done(f.error.status, error=f.error.message)
                        yield Raw(R.sse(R.ErrorFrame(f.error.message, f.error.error_type)))
                        return
                    n = len(f.token_ids)
                    rec.token(n)
                    for i, tok in enumerate(f.token_ids):
                        prefill = R.ms(f.prefill_ms) if (not ids and i == 0) else None
                        decode = None if prefill is not None else R.ms(f.decode_ms / max(1, n))
                        ids.append(tok)
                        text = detok.push([tok])
                        if self.full_text:
                            so_far = text = so_far + text
                        if f.finish_reason and i == n - 1:
                            break  # the last token goes out in the final frame, "text": null
                        yield Raw(R.stream_frame([tok], text, prefill, decode))
                    if f.finish_reason:
                        details = R.StreamDetails(f.finish_reason, len(ids), ireq.sampling.seed) \
                            if ireq.details else None
                        finish_ok(self.metrics, rec, f.finish_reason)
                        last = f.token_ids[-1:] if n else []
                        yield Raw(R.final_stream_frame(last, prefill if n else None, decode if n else None,
                                                       detok.full_text(), details))
                        return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never leave a truncated chunked body without a reason
            log.exception("stream of request %s failed", stream.request_id)
            rec.done(500, error=f"Internal error: {e}")
            yield Raw(R.sse(R.ErrorFrame(f"Internal error: {e}", error_type(500))))
        finally:
            end_stream(self.client, stream, rec, slot)
