"""The predict port: every inference route of the server, relayed to one instance.

A raw ASGI app (no framework between the client's bytes and the instance's): the body is read
(``request_limit.body_limit`` MB), the request admitted (``max_requests`` in flight, else 429 at
once; no instance ready, 503), routed (coordinator/router.py), sent to the instance, and
the instance's status, headers and body relayed as they come, chunk by chunk (a stream's frames
are never gathered). Failover:

- the instance refuses the connection, answers 503 (or 200 with an empty body), fails, or
  sends no first byte within
  ``first_token_timeout`` (streams; a non-stream answer has ``infer_timeout``): the request goes
  to another instance, at most ``max_retry`` more times, each instance once; the failure counts
  for the instance's circuit breaker (a 503 does not: it says "not now", e.g. draining);
- the instance fails after the first byte: the stream ends with an error frame in its API's shape
  (mindie/contract/families.py, the server's own shapes), never a silent cut;
- the client hangs up: the instance's connection is closed, which the server takes as a cancel
  (its request stops, its KV blocks are freed).

Several models: a request naming a model some instance serves (the path's ``/v2/models/{m}``,
else the body's ``model``; coordinator/model_index.py) is routed only among the instances that
list it (503 when none of them is ready); one naming no model, or a model no instance lists, goes
to any instance (whose own 404 answers an unknown name). ``GET /v1/models`` and Ollama's
``GET /api/tags`` are answered here: every model the ready instances serve, once (``/v1/models``
with how many serve it), from what their admission read; Ollama's ``GET /api/ps`` asks every
ready instance's ``/api/ps`` at once and lists each model loaded somewhere once.

One request-log line per request (logger ``coordinator.request``) names the instance; it
is written once the request's work is over (after its last byte). Its counters and latency
(``coordinator_request_success_total`` and the rest) are recorded just before its last byte goes
out, so a client that reads /metrics after its answer finds its request counted.

``deploy_mode: pd_separate`` (coordinator/pd_pairing.py): a generation request is first sent to
a prefill instance (the handoff headers; its answer, a small JSON, is read whole within
``first_token_timeout``), then to a decode instance with the prefill's answer, whose status,
headers and body are relayed as above. A prefill instance that fails (refused connection, 5xx,
no answer in time) or a decode instance that fails before its first byte sends the request
through another pair (prefill again: the blocks went to the failed one), at most ``max_retry``
more times; after the decode instance's first byte a failure is an error frame. A prefill
instance's 4xx (a request it refuses) is the client's answer. No ready pair: a ``flex``
(hybrid) instance serves the request whole.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from typing import Any, Optional

import httpx

from coordinator.model_index import aggregate, aggregate_tags, merge_ps
from coordinator.pd_pairing import PD_HEADERS, WHOLE_HEADER, handoff_header, pick_endpoint
from coordinator.upstream import Response, UpstreamError
from mindie.contract import families
from mindie.contract.pd import DECODE, PREFILL
from mindie.contract.http_error import STOPPED_MESSAGE, ApiError

_TIMEOUT = getattr(asyncio, "timeout", None)  # Python >= 3.11
log = logging.getLogger("mindie.coordinator")
reqlog = logging.getLogger("mindie.coordinator.request")

# (method, path pattern, streams by path). GET and DELETE routes are answered by any ready instance
# (of the model the path names; GET /v1/models by the coordinator itself).
ROUTES = [
    ("POST", re.compile(r"/infer|/infer_token|/v1/tokenizer|/generate|/v1/completions|/v1/chat/completions|/"
                        r"|/v1/messages|/v1/messages/count_tokens|/v1/embeddings|/v2/models/[^/]+/(infer|generate)|/api/(chat|generate|show|embed)"
                        r"|/v1/responses|/rerank|/v1/rerank|/v2/rerank|/score|/v1/score"), False),
    ("POST", re.compile(r"/generate_stream|/v2/models/[^/]+/generate_stream"), True),
    ("POST", re.compile(r"/v2/models/[^/]+/stopInfer"), False),
    ("GET", re.compile(r"/v1/models(/[^/]+)?|/v2|/v2/models/[^/]+(/config)?|/info|/api/(tags|ps|version)"
                       r"|/v1/responses/[^/]+"), False),
    # a stored response of OpenAI's Responses API: any instance reads and deletes the store, which
    # instances share only when ServerConfig.responsesStorePath names a shared volume (docs/apis.md)
    ("DELETE", re.compile(r"/v1/responses/[^/]+"), False),
]
# POST routes that generate nothing: any ready instance answers them, in PD too (no handoff).
NOT_GENERATION = frozenset({"/v1/tokenizer", "/api/show", "/api/embed", "/v1/messages/count_tokens", "/v1/embeddings",
                            "/rerank", "/v1/rerank", "/v2/rerank", "/score", "/v1/score"})
# Not relayed either way: hop-by-hop fields, and those this hop writes itself (uvicorn adds date;
# a second date from the instance would make the singleton field appear twice).
HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
       "transfer-encoding", "upgrade", "host", "content-length", "server", "date"}


def _match(method: str, path: str) -> tuple[bool, bool]:
    """(known route, streams by its path) for ``method`` and ``path``; a known path with another
    method is (True, ...) with the method refused later."""
    for m, pat, streams in ROUTES:
        if pat.fullmatch(path) and m == method:
            return True, streams
    return False, False


class _ShortAnswer(Exception):
    """Ends the ASGI call without finishing the answer: uvicorn closes the connection."""


class _Retry(Exception):
    def __init__(self, reason: str, detail: str, breaker: bool = True, inst: Any = None) -> None:
        super().__init__(detail)
        self.reason, self.detail, self.breaker = reason, detail, breaker
        self.inst = inst  # the instance that failed, when not the one the attempt was for (prefill)


class Relay:
    def __init__(self, coord: Any) -> None:
        self.coord = coord
        c = coord.config
        self.limit = c.request_limit
        self.exc = c.exception_config
        self.body_max = c.request_limit.body_limit << 20
        self.server_name = c.http_config.server_name.encode()
        self.inflight = 0  # admitted requests not finished (the max_requests bound)
        self.received = 0
        self.input_chars = 0  # of the bodies relayed (coordinator_info's request_length_info)
        self._room = asyncio.Event()
        # admitted requests' work (task -> its record): what a drain waits for, and cuts at its end
        self.active: dict[asyncio.Task, dict] = {}

    # -- ASGI ------------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        t0 = time.monotonic()
        rid = uuid.uuid4().hex[:16]
        method, path = scope["method"], scope["path"]
        known, by_path = _match(method, path)
        rec = {"id": rid, "method": method, "path": path, "instance": "-", "status": 0, "decision": "-",
               "attempts": 0, "retries": [], "ttft_ms": None, "bytes": 0, "outcome": ""}
        m = self.coord.metrics
        m.received(path)
        self.received += 1
        counted = False
        outer = send

        async def send(msg: dict) -> None:
            # counted before the answer's last byte: a client reading /metrics after its answer
            # ended finds it there (the log line waits for the bookkeeping after that byte)
            nonlocal counted
            if msg["type"] == "http.response.body" and not msg.get("more_body") and not counted:
                counted = True
                rec["ended"] = True  # the answer is whole: a drain's cut has nothing left to end
                m.finished(rec, time.monotonic() - t0)
            await outer(msg)

        try:
            if not known:
                other = any(pat.fullmatch(path) for _, pat, _ in ROUTES)
                err = ApiError(405, f"{method} is not allowed on {path}", "Method Not Allowed") if other \
                    else ApiError(404, f"{path} is not a route of this coordinator", "NotFoundError")
                # an unknown /v1/... path in OpenAI's shape (Anthropic's under /v1/messages), as the server
                return await self._answer(send, rec, families.OTHER if other else families.unrouted(path), err,
                                          "refused")
            fam = families.family(path, None)  # refusals in the shape of the route's family
            if self.coord.stopping:
                return await self._answer(send, rec, fam, ApiError(503, "The service has been stopped.",
                                                                   "Service Unavailable"), "stopping")
            if self.inflight >= self.limit.max_requests:
                m.refused("max_requests")
                return await self._answer(send, rec, fam, ApiError(429, "Too many requests", "Too Many Requests"),
                                          "refused")
            self.inflight += 1
            try:
                await self._admitted(scope, receive, send, rec, by_path, t0)
            except _ShortAnswer:
                pass
            finally:
                self.inflight -= 1
                self._room.set()
        finally:
            dur = (time.monotonic() - t0) * 1000
            if not counted:  # no whole answer went out (a cut, a client that left)
                m.finished(rec, dur / 1000)
            reqlog.info("request %s %s %s -> instance %s status %s %s attempts %d%s ttft_ms %s duration_ms %.1f "
                        "bytes %d%s%s", rid, method, path, rec["instance"], rec["status"], rec["decision"],
                        rec["attempts"], f" retries {','.join(rec['retries'])}" if rec["retries"] else "",
                        "-" if rec["ttft_ms"] is None else f"{rec['ttft_ms']:.1f}", dur, rec["bytes"],
                        _pd_note(rec), f" {rec['outcome']}" if rec["outcome"] else "",
                        extra={"request": {k: v for k, v in rec.items()} | {"duration_ms": round(dur, 1)}})

    async def drain(self, drain_s: float, now: asyncio.Event) -> int:
        """The predict port's side of a stop (new requests get 503 already: ``coord.stopping``):
        wait until no admitted request is left, at most ``drain_s`` seconds (or until ``now`` is
        set: a second stop signal), then cut what still runs -- a stream ends with an error frame
        in its family's shape, an answer not begun gets the 503, and each one's request-log line
        says the drain cut it. Returns how many were cut."""
        deadline = time.monotonic() + drain_s
        while self.active and not now.is_set() and (left := deadline - time.monotonic()) > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(now.wait(), min(0.1, left))  # a bounded look, not a busy loop
        if not self.active:
            return 0
        forced = now.is_set()
        why = (f"{STOPPED_MESSAGE} The request was cut by a second stop signal before it finished."
               if forced else
               f"{STOPPED_MESSAGE} The request was still running at the end of the coordinator's drain "
               f"(http_config.drainTimeoutS = {drain_s:g} s) and was cut.")
        tasks = [t for t in self.active if not t.done()]
        for t in tasks:
            self.active[t]["drain_cut"] = why
            t.cancel()
        log.warning("stop: cut %d request(s) still in flight %s", len(tasks),
                    "(second stop signal)" if forced else f"at the end of the drain ({drain_s:g} s)")
        # each cut request writes its last frame and its log line (bounded: a client that does not read)
        end = time.monotonic() + 5.0
        while self.active and time.monotonic() < end:
            await asyncio.sleep(0.02)
        return len(tasks)

    async def _drain_cut(self, send, rec: dict, fam: str, stream: bool) -> None:
        """The end of a request the drain cut (its work was cancelled): an error frame in the
        stream's shape, or MindIE's 503 when nothing was sent yet; nothing when its answer was
        already whole."""
        if rec.get("ended"):
            return
        self.coord.metrics.cut()
        err = ApiError(503, rec["drain_cut"], "Service Unavailable")
        outcome = "cut by the coordinator's drain"
        if not rec.get("sent"):
            return await self._answer(send, rec, fam, err, outcome)
        await self._cut(send, rec, fam, err, outcome, stream)

    async def _answer(self, send, rec: dict, fam: str, err: ApiError, outcome: str) -> None:
        status, body = families.error_answer(fam, err)
        rec["status"], rec["outcome"] = status, outcome or err.message
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"server", self.server_name)]})
        await send({"type": "http.response.body", "body": body})

    async def _json(self, send, rec: dict, status: int, body: bytes) -> None:
        """An answer of the coordinator's own (not an error)."""
        rec["status"] = status
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"server", self.server_name)]})
        await send({"type": "http.response.body", "body": body})
        rec["bytes"] += len(body)

    async def _read_body(self, receive) -> Optional[bytes]:
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.body_max:
                raise ApiError(413, f"The request body is larger than request_limit.body_limit "
                                    f"({self.limit.body_limit} MB).", "Request Entity Too Large")
            chunks.append(chunk)
            if not msg.get("more_body"):
                return b"".join(chunks)

    async def _admitted(self, scope, receive, send, rec: dict, by_path: bool, t0: float) -> None:
        path = scope["path"]
        try:
            body = await self._read_body(receive)
        except ApiError as e:
            return await self._answer(send, rec, families.family(path, None), e, "refused")
        if body is None:
            rec["outcome"] = "client disconnected"
            return
        self.input_chars += len(body)
        try:
            parsed = json.loads(body) if body else None
        except (ValueError, UnicodeDecodeError):
            parsed = None  # the instance answers the malformed body in its own words
        fam = families.family(path, parsed)
        stream = by_path or families.streams(path, parsed)
        work = asyncio.ensure_future(self._route(scope, send, rec, body, parsed, fam, stream, t0))
        gone = asyncio.ensure_future(self._disconnect(receive))
        self.active[work] = rec
        try:
            await self._settle(work, gone, send, rec, fam, stream)
        finally:
            self.active.pop(work, None)  # after its last frame: a drain waits for that too

    async def _settle(self, work: asyncio.Task, gone: asyncio.Task, send, rec: dict, fam: str, stream: bool) -> None:
        """Waits for the request's work or the client's hang-up, and ends the request either way."""
        try:
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            gone.cancel()
            raise
        if work in done and work.cancelled() and rec.get("drain_cut"):
            gone.cancel()
            await self._drain_cut(send, rec, fam, stream)
            if rec.get("cut"):
                raise _ShortAnswer
        elif work in done:
            gone.cancel()
            work.result()
            if rec.get("cut"):
                raise _ShortAnswer
        elif rec.get("complete"):
            # the whole answer was sent and the client closed at once (before our bookkeeping
            # ended, e.g. a handoff's cleanup): not a disconnect
            await asyncio.gather(work, return_exceptions=True)
        else:
            # the client hung up: stop relaying; closing the instance's connection cancels there
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            rec["outcome"] = "client disconnected"
            self.coord.metrics.disconnect()

    @staticmethod
    async def _disconnect(receive) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return

    async def _route(self, scope, send, rec, body: bytes, parsed: Any, fam: str, stream: bool, t0: float) -> None:
        coord = self.coord
        reg, router, m = coord.registry, coord.router, coord.metrics
        e = self.exc
        if not reg.ready():
            return await self._answer(send, rec, fam, ApiError(503, "MindIE-MS Coordinator is not ready",
                                                              "Service Unavailable"), "no instance ready")
        if scope["path"].endswith("/stopInfer"):
            return await self._broadcast(scope, send, rec, body, fam)
        if scope["method"] == "GET" and scope["path"] == "/v1/models":  # the fleet's models, from the registry
            rec["instance"], rec["decision"] = "-", "models"
            return await self._json(send, rec, 200, json.dumps(aggregate(reg.ready())).encode())
        if scope["method"] == "GET" and scope["path"] == "/api/tags":  # the same, in Ollama's shape
            rec["instance"], rec["decision"] = "-", "models"
            return await self._json(send, rec, 200, json.dumps(aggregate_tags(reg.ready())).encode())
        if scope["method"] == "GET" and scope["path"] == "/api/ps":
            return await self._ps(send, rec)
        info = router.info(scope["path"], parsed)
        if info.scope and not router.serving_ready(info):
            return await self._answer(send, rec, fam, ApiError(
                503, f"No instance serving the model {info.scope!r} is ready", "Service Unavailable"),
                "no instance of the model ready")
        tried: set[int] = set()
        last: Optional[_Retry] = None
        limit = e.tokenizer_timeout if scope["path"] == "/v1/tokenizer" else e.infer_timeout
        deadline = t0 + limit if limit else None
        # pd_separate: generation goes prefill -> decode; the tokenizer and GET routes go to any instance
        handoff = router.pd and scope["method"] == "POST" and scope["path"] not in NOT_GENERATION
        while True:
            p_inst = None
            if handoff:
                p_inst, inst, decision = router.pick_pd(info, tried)
            elif router.pd:  # any ready instance answers these, whatever its role
                inst, decision = router.pick(info, tried, "")
            else:
                inst, decision = router.pick(info, tried)
            if inst is None and not tried and reg.ready():
                p_inst, inst, decision = await self._wait_room(info, t0, handoff)
                if inst is None:
                    return await self._answer(send, rec, fam, ApiError(
                        503, "Request schedule timeout: every ready instance is at "
                             "request_limit.single_node_max_requests", "Service Unavailable"), "schedule timeout")
            if inst is None:
                err = ApiError(503, f"No instance could serve the request: {last.detail}" if last
                               else "MindIE-MS Coordinator is not ready", "Service Unavailable")
                return await self._answer(send, rec, fam, err, "no instance left")
            rec["instance"] = f"{inst.id}({inst.host}:{inst.business_port})"
            if p_inst is not None:
                rec["instance"] += f" prefill {p_inst.id}({p_inst.host}:{p_inst.business_port})"
            rec["decision"] = decision if p_inst is None else f"pd_{decision}"
            rec["attempts"] += 1
            m.routed(rec["decision"], inst.id)
            try:
                if p_inst is not None:
                    await self._handoff(scope, send, rec, p_inst, inst, body, fam, stream, t0, deadline)
                elif router.pd and inst.role == PREFILL:  # no decode instance: served whole
                    await self._attempt(scope, send, rec, inst, body, fam, stream, t0, deadline,
                                        extra=[WHOLE_HEADER])
                else:
                    await self._attempt(scope, send, rec, inst, body, fam, stream, t0, deadline)
                return
            except _Retry as r:
                last = r
                inst = r.inst or inst
                tried.add(inst.id)
                rec["retries"].append(f"{inst.id}:{r.reason}")
                log.warning("request %s: instance %d %s: %s", rec["id"], inst.id, r.reason, r.detail)
                if r.breaker and inst.breaker.failure():
                    m.breaker_trip(inst.id)
                    log.warning("instance %d %s isolated (circuit breaker open %.1f s): %s", inst.id, inst.base_url,
                                inst.breaker.open_s * inst.breaker.backoff, r.detail)
                    reg.note()
                if rec["attempts"] > e.max_retry:
                    if r.reason == "first_token_timeout":
                        err = ApiError(504, "Request first token timeout", "Gateway Timeout")
                    else:
                        err = ApiError(503, f"No instance could serve the request after {rec['attempts']} "
                                            f"attempt(s): {r.detail}", "Service Unavailable")
                    return await self._answer(send, rec, fam, err, "retries exhausted")
                m.retry(r.reason)

    async def _wait_room(self, info, t0: float, handoff: bool = False):
        """Every ready instance is full: wait for room until ``schedule_timeout`` (0: no bound).
        (prefill or None, instance or None, decision)."""
        st = self.exc.schedule_timeout
        router = self.coord.router
        while True:
            self._room.clear()
            left = None if not st else t0 + st - time.monotonic()
            if left is not None and left <= 0:
                return None, None, "schedule_timeout"
            try:
                await asyncio.wait_for(self._room.wait(), timeout=min(0.5, left) if left else 0.5)
            except asyncio.TimeoutError:
                pass
            if handoff:
                p, inst, decision = router.pick_pd(info, set())
            else:
                p, (inst, decision) = None, router.pick(info, set(), "" if router.pd else None)
            if inst is not None:
                return p, inst, decision

    def _headers(self, scope) -> list[tuple[bytes, bytes]]:
        return [(k, v) for k, v in scope["headers"] if k.decode("latin-1").lower() not in HOP
                and k.lower() not in PD_HEADERS]

    async def _handoff(self, scope, send, rec, p_inst, d_inst, body: bytes, fam: str, stream: bool, t0: float,
                       deadline: Optional[float]) -> None:
        """pd_separate: step A (prefill on ``p_inst``, its KV pushed to ``d_inst``) and step B
        (``d_inst`` waits for the blocks, then answers) sent at once, so the transfer overlaps;
        ``d_inst``'s answer is relayed. A prefill failure before the decode side's first byte
        cancels step B and retries with another pair; a prefill 4xx is the client's answer."""
        tid = f"{rec['id']}-{rec['attempts']}"
        ep = pick_endpoint(d_inst.kv_endpoints, p_inst.ip == d_inst.ip, d_inst.handoffs)
        d_inst.handoffs += 1
        rec["transfer"] = tid
        p_task = asyncio.ensure_future(self._prefill(scope, rec, p_inst, body, handoff_header(
            PREFILL, tid, ep, d_inst.kv_curve_key), deadline))
        d_task = asyncio.ensure_future(self._attempt(scope, send, rec, d_inst, body, fam, stream, t0, deadline,
                                                     extra=[handoff_header(DECODE, tid, ep)]))
        try:
            done, _ = await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
            if p_task in done and not d_task.done():
                refused = p_task.exception() or p_task.result()
                if refused is not None and not rec.get("sent"):
                    # prefill failed (or refused the request) before the client saw a byte: step B goes
                    d_task.cancel()
                    await asyncio.gather(d_task, return_exceptions=True)
                    if isinstance(refused, BaseException):
                        raise refused
                    return await self._relay_answer(send, rec, *refused)
            await d_task  # the decode side's answer (or its _Retry before its first byte)
        finally:
            for t in (p_task, d_task):
                if not t.done():
                    t.cancel()  # closes that instance's connection: it cancels there
            await asyncio.gather(p_task, d_task, return_exceptions=True)

    async def _prefill(self, scope, rec, p_inst, body: bytes, hdr: tuple[bytes, bytes],
                       deadline: Optional[float]) -> Optional[tuple]:
        """Step A: None when the prefill instance answered 200 (its KV is at the decode side);
        (status, headers, body) of a 4xx it answered (the request is refused: relay it);
        raises _Retry (for ``p_inst``) when it failed or did not answer within first_token_timeout."""
        coord, e = self.coord, self.exc
        by = time.monotonic() + e.first_token_timeout if e.first_token_timeout else None
        if deadline is not None:
            by = deadline if by is None else min(by, deadline)
        p_inst.inflight += 1
        p_inst.breaker.on_dispatch()
        coord.metrics.inflight(p_inst.id, p_inst.inflight)
        resp: Optional[Response] = None
        t_p = time.monotonic()
        try:
            try:
                resp = await coord.pool.request(p_inst.ip, p_inst.business_port, scope["method"], _target(scope),
                                                self._headers(scope) + [hdr], body, _left(by))
                answer = await asyncio.wait_for(resp.read(1 << 20), _left(by))
            except asyncio.TimeoutError:
                raise _Retry("prefill_timeout", f"prefill instance {p_inst.id}: no answer within "
                             f"{_left_s(by, e)}", inst=p_inst) from None
            except UpstreamError as x:
                raise _Retry("prefill_connect", f"prefill instance {p_inst.id}: {x}", inst=p_inst) from None
            if resp.status >= 500:
                raise _Retry(f"prefill_{resp.status}", f"prefill instance {p_inst.id} answered {resp.status}: "
                             f"{answer[:300].decode('utf-8', 'replace')}", breaker=resp.status != 503, inst=p_inst)
            p_inst.breaker.success()
            rec["prefill_ms"] = (time.monotonic() - t_p) * 1000
            if resp.status == 200:
                with contextlib.suppress(ValueError, UnicodeDecodeError):
                    a = json.loads(answer)
                    if isinstance(a, dict):
                        rec["pd"] = a
                return None
            headers = [(k, v) for k, v in resp.headers if k.decode("latin-1").lower() not in HOP]
            return resp.status, headers, answer
        finally:
            p_inst.inflight -= 1
            coord.metrics.inflight(p_inst.id, p_inst.inflight)
            if resp is not None:
                resp.release()

    async def _relay_answer(self, send, rec, status: int, headers: list, answer: bytes) -> None:
        rec["status"] = status
        rec["outcome"] = "refused by the prefill instance"
        headers = headers + [(b"content-length", str(len(answer)).encode()), (b"server", self.server_name)]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": answer})
        rec["complete"] = True
        rec["bytes"] += len(answer)

    async def _attempt(self, scope, send, rec, inst, body: bytes, fam: str, stream: bool, t0: float,
                       deadline: Optional[float], extra: Optional[list] = None) -> None:
        coord = self.coord
        e = self.exc
        target = _target(scope)
        first_by = None
        if stream and e.first_token_timeout:
            first_by = time.monotonic() + e.first_token_timeout
        if deadline is not None:
            first_by = deadline if first_by is None else min(first_by, deadline)
        inst.inflight += 1
        inst.breaker.on_dispatch()
        coord.metrics.inflight(inst.id, inst.inflight)
        resp: Optional[Response] = None
        try:
            try:
                resp = await coord.pool.request(inst.ip, inst.business_port, scope["method"], target,
                                                self._headers(scope) + (extra or []), body, _left(first_by))
            except asyncio.TimeoutError:
                raise _Retry("first_token_timeout", f"no answer within {_left_s(first_by, e)}") from None
            except UpstreamError as x:
                raise _Retry("connect", str(x)) from None
            if resp.status == 503:
                try:
                    text = (await asyncio.wait_for(resp.read(300), 5))[:300].decode("utf-8", "replace")
                except (UpstreamError, asyncio.TimeoutError):
                    text = ""
                raise _Retry("503", f"answered 503: {text}", breaker=False)
            it = resp.chunks()
            try:
                first = await asyncio.wait_for(anext(it, b""), _left(first_by))
            except asyncio.TimeoutError:
                raise _Retry("first_token_timeout", f"no first byte within {_left_s(first_by, e)}") from None
            except UpstreamError as x:
                raise _Retry("cut_before_first_token", str(x)) from None
            if not first and resp.status == 200 and scope["method"] == "POST":
                # no inference API answers 200 with nothing: an instance that ended the answer
                # before writing a byte is treated as one that failed before its first token
                raise _Retry("empty_answer", "answered 200 with an empty body", breaker=False)
            rec["ttft_ms"] = (time.monotonic() - t0) * 1000
            rec["status"] = resp.status
            headers = [(k, v) for k, v in resp.headers
                       if (lk := k.decode("latin-1").lower()) not in HOP or (lk == "content-length" and not stream)]
            headers.append((b"server", self.server_name))
            rec["sent"] = True
            await send({"type": "http.response.start", "status": resp.status, "headers": headers})
            rec["bytes"] += len(first)
            await send({"type": "http.response.body", "body": first, "more_body": True})
            try:
                await self._pump(it, send, rec, deadline)
            except asyncio.TimeoutError:
                err = ApiError(504, "Request inference timeout", "Gateway Timeout")
                await self._cut(send, rec, fam, err, "infer_timeout", stream)
                return
            except UpstreamError as x:
                # the instance died (or closed) mid-answer: say so in the stream's own shape
                if inst.breaker.failure():
                    coord.metrics.breaker_trip(inst.id)
                coord.metrics.cut()
                err = ApiError(500, f"The instance serving this request failed after the first token ({x}); "
                                    "the answer is incomplete.", "Incomplete Generation")
                await self._cut(send, rec, fam, err, "instance failed mid-stream", stream)
                return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            rec["complete"] = True
            if resp.status >= 500:
                if inst.breaker.failure():
                    coord.metrics.breaker_trip(inst.id)
            else:
                inst.breaker.success()
        finally:
            inst.inflight -= 1
            coord.metrics.inflight(inst.id, inst.inflight)
            if resp is not None:
                resp.release()

    @staticmethod
    async def _pump(it, send, rec: dict, deadline: Optional[float]) -> None:
        """Each chunk of the instance's answer to the client as it comes. One timer for the whole
        answer (``asyncio.timeout``), not one per chunk: thousands of streams stay cheap."""
        if deadline is not None and _TIMEOUT is None:  # Python 3.10: a timer per chunk
            while (chunk := await asyncio.wait_for(anext(it, None), max(0.0, deadline - time.monotonic()))) is not None:
                rec["bytes"] += len(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            return
        async with (_TIMEOUT(max(0.0, deadline - time.monotonic())) if deadline is not None
                    else contextlib.nullcontext()):
            async for chunk in it:
                rec["bytes"] += len(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def _cut(self, send, rec, fam: str, err: ApiError, outcome: str, stream: bool) -> None:
        rec["outcome"] = outcome
        if stream:
            frame = families.stream_error(fam, err)
            rec["bytes"] += len(frame)
            await send({"type": "http.response.body", "body": frame, "more_body": False})
        else:
            # a non-stream answer cannot carry an error once its body began: it ends short of its
            # Content-Length, which every HTTP client reports as an incomplete answer
            rec["cut"] = True

    async def _ps(self, send, rec) -> None:
        """Ollama's ``GET /api/ps`` of the fleet: every ready instance's, merged (model_index.merge_ps);
        an instance that does not answer in time counts as having nothing loaded."""
        coord = self.coord
        insts = coord.registry.ready()

        async def one(inst):
            try:
                r = await coord.business.get(inst.base_url + "/api/ps", timeout=5.0)
                return r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                return None
        answers = await asyncio.gather(*(one(i) for i in insts))
        rec["instance"], rec["decision"] = ",".join(str(i.id) for i in insts), "models"
        await self._json(send, rec, 200, json.dumps(merge_ps(answers)).encode())

    async def _broadcast(self, scope, send, rec, body: bytes, fam: str) -> None:
        """stopInfer: the coordinator does not know which instance holds the id; ask every ready one."""
        coord = self.coord
        answers = []
        insts = coord.registry.ready()

        async def one(inst):
            url = inst.base_url + scope["raw_path"].decode("latin-1")
            try:
                r = await coord.business.post(url, content=body, headers=self._headers(scope))
                return inst, r.status_code, r.content, r.headers.get("content-type", "application/json")
            except httpx.HTTPError as x:
                return inst, 0, str(x).encode(), "text/plain"
        answers = await asyncio.gather(*(one(i) for i in insts))
        ok = [a for a in answers if a[1] == 200]
        inst, status, content, ctype = (ok or sorted(answers, key=lambda a: -a[1]))[0]
        rec["instance"] = ",".join(str(a[0].id) for a in (ok or answers))
        rec["status"] = status or 503
        await send({"type": "http.response.start", "status": status or 503,
                    "headers": [(b"content-type", ctype.encode()), (b"server", self.server_name)]})
        await send({"type": "http.response.body", "body": content})


def _pd_note(rec: dict) -> str:
    """`` pd transfer <id> prefill_ms F prompt_tokens N server_prefill_ms F`` for a handoff:
    step A's time as the coordinator saw it (prefill + KV push + the decode side's ack), then
    what the prefill instance answered; else ""."""
    if "transfer" not in rec:
        return ""
    a = rec.get("pd") or {}
    out = f" pd transfer {rec['transfer']}"
    if "prefill_ms" in rec:
        out += f" prefill_ms {rec['prefill_ms']:.1f}"
    for k, name in (("blocks", "blocks"), ("bytes", "kv_bytes"), ("promptTokens", "prompt_tokens"),
                    ("prefillMs", "server_prefill_ms"), ("transferMs", "transfer_ms")):
        if isinstance(a.get(k), (int, float)):
            out += f" {name} {a[k]:.1f}" if isinstance(a[k], float) else f" {name} {a[k]}"
    return out


def _target(scope) -> str:
    target = scope["raw_path"].decode("latin-1")
    if scope.get("query_string"):
        target += "?" + scope["query_string"].decode("latin-1")
    return target


def _left(by: Optional[float]) -> Optional[float]:
    return None if by is None else max(0.0, by - time.monotonic())


def _left_s(by: Optional[float], e) -> str:
    return f"first_token_timeout {e.first_token_timeout} s" if e.first_token_timeout else "infer_timeout"
