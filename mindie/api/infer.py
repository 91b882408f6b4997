"""POST /infer and POST /infer_token: one handler, token ids or text in, JSON or SSE out."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import falcon
import falcon.asgi

from mindie import responses as R
from mindie.admission import Admission, Slot
from mindie.api.body import read_body
from mindie.contract.errors import error_type
from mindie.client import DeviceClient, NoWorkerError, RequestStream
from mindie.detokenizer import IncrementalDetokenizer, TextTokenizer
from mindie.errors import ApiError
from mindie.metrics import Metrics
from mindie.validation import InferRequest, Limits, parse_infer_request

log = logging.getLogger("mindie.api")

LARGE_BODY = 256 * 1024  # bytes; larger bodies are parsed on a thread
IDLE_TICK_S = 1.0  # how often an idle stream checks for a client disconnect


class _Tick:
    """Sent while a stream waits: zero bytes on the wire, but Falcon checks for a client
    disconnect after every item, so a vanished client is noticed within IDLE_TICK_S."""

    def __bool__(self) -> bool:
        return True

    def serialize(self, handler=None) -> bytes:
        return b""


class _Raw:
    def __init__(self, data: bytes):
        self.data = data

    def __bool__(self) -> bool:
        return True

    def serialize(self, handler=None) -> bytes:
        return self.data


_TICK = _Tick()


async def _watch_disconnect(req: falcon.asgi.Request, gone: asyncio.Event, stream: RequestStream) -> None:
    """Notice a client that hangs up while its non-stream request runs, so the request is
    cancelled on its worker. The body has been read in full, so the next ASGI message can
    only be the disconnect. Falcon has no public hook for this; ``_receive`` is its ASGI
    receive callable (Falcon 4)."""
    receive = getattr(req, "_receive", None)
    if receive is None:
        return
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            gone.set()
            stream.event.set()  # wake the collector
            return


class Deadlines:
    """MindIE's wait deadline (mindie.md §4.2): min(client timeout, tokenTimeout) measured from
    the last token for streams (from the start otherwise), and e2eTimeout from the start."""

    def __init__(self, timeout: int | None, token_timeout: float, e2e_timeout: float, stream: bool):
        self.start = time.monotonic()
        self.timeout = timeout
        self.token_timeout = token_timeout
        self.e2e_end = self.start + e2e_timeout
        self.stream = stream
        self.mark = self.start

    def token(self) -> None:
        if self.stream:
            self.mark = time.monotonic()

    def next(self) -> tuple[float, str]:
        """(monotonic deadline, MindIE's description of it)."""
        cands = [(self.mark + self.token_timeout, "server tokenTimeout"), (self.e2e_end, "server e2eTimeout")]
        if self.timeout is not None:
            cands.append((self.mark + self.timeout, "client timeout"))
        return min(cands)


def over_limit(limit: int) -> ApiError:
    """503 "Service Unavailable" past maxLinkNum requests in progress (docs/reliability.md)."""
    return ApiError(503, f"Too many requests: {limit} requests (maxLinkNum) are in progress, try again later.")


class InferResource:
    def __init__(self, client: DeviceClient, tokenizer: TextTokenizer, limits: Limits, metrics: Metrics,
                 admission: Admission | None = None, full_text: bool = False):
        """``full_text``: ServerConfig.fullTextEnabled, each stream frame's ``token.text`` is the
        text so far instead of the new piece."""
        self.client = client
        self.full_text = full_text
        self.tokenizer = tokenizer
        self.limits = limits
        self.metrics = metrics
        self.admission = admission

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        self.metrics.received()
        if self.admission is None:
            return await self._serve(req, resp, None)
        # Admission comes first, before the body is read: past maxLinkNum a request costs no work.
        slot = self.admission.try_acquire()
        if slot is None:
            self.metrics.failed()
            raise over_limit(self.admission.limit)
        try:
            await self._serve(req, resp, slot)
        finally:
            # Released exactly once: here when no stream was handed out, else by the stream's
            # generator when it ends (or by Slot's finalizer if Falcon never started it).
            if resp.sse is None:
                slot.release()

    async def _serve(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, slot: Slot | None) -> None:
        try:
            body = await read_body(req, self.limits.max_request_length_mb)
            if len(body) > LARGE_BODY:
                # Decoding and tokenising megabytes takes seconds: off the event loop, so the
                # front end's other streams and its gunicorn heartbeat go on meanwhile.
                ireq = await asyncio.to_thread(parse_infer_request, body, self.limits, encode=self.tokenizer.encode)
            else:
                ireq = parse_infer_request(body, self.limits, encode=self.tokenizer.encode)
            try:
                stream = self.client.submit(ireq.input_ids, ireq.sampling, ireq.priority)
            except NoWorkerError as e:
                raise ApiError(503, f"No device worker is ready: {e}")
        except ApiError:
            self.metrics.failed()
            raise
        lim = self.limits
        deadlines = Deadlines(ireq.timeout, lim.token_timeout, lim.e2e_timeout, ireq.stream)
        self.metrics.prompt_tokens(len(ireq.input_ids))
        if ireq.stream:
            resp.content_type = "text/event-stream"
            resp.set_header("Cache-Control", "no-cache")
            resp.set_header("X-Accel-Buffering", "no")
            resp.sse = self._stream(ireq, stream, deadlines, slot)
            return
        try:
            resp.data = await self._collect(req, ireq, stream, deadlines)
        except ApiError:
            self.metrics.failed()
            raise
        if resp.data is None:
            resp.status = 499  # the client hung up; nobody reads this
        resp.content_type = falcon.MEDIA_JSON

    async def _collect(self, req: falcon.asgi.Request, ireq: InferRequest, stream: RequestStream,
                       dl: Deadlines) -> bytes | None:
        """The JSON reply; None when the client hung up (the request is cancelled)."""
        ids: list[int] = []
        finish = ""
        gone = asyncio.Event()
        watcher = asyncio.create_task(_watch_disconnect(req, gone, stream))
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
                    if f.finish_reason:
                        finish = f.finish_reason
        finally:
            watcher.cancel()
            if not stream.finished:
                self.client.cancel(stream)
        self.metrics.succeeded(len(ids))
        details = R.Details(finish, len(ids), ids, ireq.sampling.seed) if ireq.details else None
        return R.reply(self.tokenizer.decode(ids), details)

    async def _stream(self, ireq: InferRequest, stream: RequestStream, dl: Deadlines,
                      slot: Slot | None) -> AsyncIterator[object]:
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
                        # MindIE writes the raw text into the open stream, then closes it.
                        yield _Raw(f"Engine callback timeout: {desc}".encode())
                        return
                    yield _TICK
                    continue
                dl.token()
                for f in frames:
                    if f.error is not None:
                        self.metrics.failed()
                        yield _Raw(R.sse(R.ErrorFrame(f.error.message, f.error.error_type)))
                        return
                    n = len(f.token_ids)
                    for i, tok in enumerate(f.token_ids):
                        prefill = R.ms(f.prefill_ms) if (not ids and i == 0) else None
                        decode = None if prefill is not None else R.ms(f.decode_ms / max(1, n))
                        ids.append(tok)
                        text = detok.push([tok])
                        if self.full_text:
                            so_far = text = so_far + text
                        if f.finish_reason and i == n - 1:
                            break  # the last token goes out in the final frame, "text": null
                        yield _Raw(R.stream_frame([tok], text, prefill, decode))
                    if f.finish_reason:
                        details = R.StreamDetails(f.finish_reason, len(ids), ireq.sampling.seed) \
                            if ireq.details else None
                        self.metrics.succeeded(len(ids))
                        last = f.token_ids[-1:] if n else []
                        yield _Raw(R.final_stream_frame(last, prefill if n else None, decode if n else None,
                                                        detok.full_text(), details))
                        return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never leave a truncated chunked body without a reason
            log.exception("stream of request %s failed", stream.request_id)
            yield _Raw(R.sse(R.ErrorFrame(f"Internal error: {e}", error_type(500))))
        finally:
            try:
                if not stream.finished:
                    self.client.cancel(stream)
            finally:
                if slot is not None:
                    slot.release()
