"""OpenAI-compatible ``POST /v1/completions`` and ``POST /v1/chat/completions`` (vLLM-flavoured,
as MindIE's ``openAiSupport: "vllm"``), on the shared generation loop (mindie/generation.py).

Decisions (docs/apis.md has the user's view):
- Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with vLLM's
  types and ``code`` = the HTTP status: 400 ``BadRequestError`` (bad JSON, bad parameter, prompt
  too long, ids outside the vocabulary, the chat template refusing the messages), 404
  ``NotFoundError`` (``The model `x` does not exist.``), 413 (body over maxRequestLength), 503
  ``ServiceUnavailableError`` (after /stopService, maxLinkNum requests in progress, no device
  worker), 500 ``InternalServerError`` (timeouts ``Engine callback timeout: ...``, a worker lost
  mid-request). A stream that fails after its 200 ends with ``data: {"error": {...}}`` and
  ``data: [DONE]``.
- ``max_tokens`` (chat: ``max_completion_tokens``, else ``max_tokens``) defaults to MindIE's
  ``maxIterTimes`` (not OpenAI's 16), and is capped as MindIE caps ``max_new_tokens``:
  min(max_tokens, maxIterTimes, maxSeqLen - prompt length).
- ``temperature`` 0 is greedy; absent means 1.0 (OpenAI's default: sampling). ``top_k`` -1 or 0
  is off. ``seed`` absent: a random seed per choice. ``n`` choices are n submissions with seeds
  seed, seed + 1, ... (vLLM's rule); a list prompt gives n choices per prompt, choice index
  = prompt index * n + j. Same seed and parameters give the same tokens as /infer.
- ``usage.prompt_tokens`` counts each prompt once (not once per choice), ``completion_tokens``
  every generated id of every choice (the ids up to the one that completed a stop string).
- ``finish_reason``: "length", else "stop" (EOS, stop string, stop token id, stopInfer);
  ``stop_reason`` is the matched stop string or stop token id (vLLM), else null.
- ``response_format`` json_object is accepted and NOT enforced (MindIE accepts it too);
  json_schema is refused. ``tools`` are passed to the chat template, never parsed: the output
  comes back as content, finish_reason is never "tool_calls"; ``tool_choice`` other than
  "none"/"auto" is refused.
- ``MINDIE_LLM_BENCHMARK_ENABLE=1|2``: a non-stream body gets top-level ``prefill_time`` (ms)
  and ``decode_time_arr`` (ms per decoded token) of its first choice, after ``usage`` (where
  MindIE's chat route puts them); in a stream each choice's finishing chunk carries them.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Union

import falcon
import falcon.asgi
import msgspec

from mindie import responses as R
from mindie.admission import Admission, Slot
from mindie.api import openai_schema as S
from mindie.api.body import read_body
from mindie.api.infer import LARGE_BODY, TICK, Raw, Route, admit, disconnected, finish_ok, start_stream
from mindie.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from mindie.client import DeviceClient
from mindie.contract import wire as P
from mindie.contract.errors import FINISH_LENGTH, FINISH_STOP, FINISH_STOP_TOKEN
from mindie.detokenizer import TextTokenizer
from mindie.errors import ApiError
from mindie.generation import Deadline, Generation, GenerationError, Piece
from mindie.metrics import Metrics
from mindie.request_log import RequestRecord
from mindie.service_state import STOPPED_MESSAGE, ServiceState
from mindie.validation import Limits, cap_max_new_tokens, check_token_count, check_token_ids, random_seed

log = logging.getLogger("mindie.api.openai")

IDLE_TICK_S = 1.0
_SEED_MOD = 2**63
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 413: "RequestEntityTooLargeError",
                500: "InternalServerError", 503: "ServiceUnavailableError"}
_enc = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


def benchmark_enabled() -> bool:
    return os.environ.get("MINDIE_LLM_BENCHMARK_ENABLE", "").strip() in ("1", "2")


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, etype: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = etype or _ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")

    def payload(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}

    def body(self) -> bytes:
        return _enc.encode(self.payload())


def _from_api_error(e: ApiError) -> OpenAIError:
    """MindIE's 422/424 checks are the client's fault: 400 here."""
    return OpenAIError(400 if e.status in (422, 424) else e.status, e.message)


def _sse(obj: Any) -> bytes:
    return b"data: " + _enc.encode(obj) + b"\n\n"


def _finish(reason: str) -> str:
    return "length" if reason == FINISH_LENGTH else "stop"


@dataclass
class _Choice:
    """One choice: its submission and what came back."""

    index: int
    prompt: int  # index of its prompt
    gen: Generation
    text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    finish: str = ""
    stop: str | None = None
    prefill_ms: float | None = None
    decode_ms: list[float] = field(default_factory=list)
    offset: int = 0  # completions logprobs: text_offset of the next token
    started: bool = False  # a stream chunk of it went out

    def add(self, p: Piece) -> None:
        self.text += p.text
        if p.token_ids:
            if self.prefill_ms is None:
                self.prefill_ms = R.ms(p.prefill_ms)
                rest = len(p.token_ids) - 1
            else:
                rest = len(p.token_ids)
            if rest:
                self.decode_ms += [R.ms(p.decode_ms / len(p.token_ids))] * rest
        self.ids += p.token_ids
        self.logprobs += p.logprobs
        self.tops += p.top_logprobs
        if p.prompt_logprobs and not self.prompt_logprobs:
            self.prompt_logprobs = list(p.prompt_logprobs)
        if p.finish_reason:
            self.finish = p.finish_reason
            self.stop = p.stop

    def stop_reason(self) -> Union[str, int, None]:
        if self.finish == FINISH_STOP:
            return self.stop
        if self.finish == FINISH_STOP_TOKEN and self.ids:
            return self.ids[-1]
        return None


@dataclass
class _Plan:
    """A validated request, ready to submit."""

    prompts: list[list[int]]
    prompt_texts: list[str]
    params: P.SamplingParams
    seed: int | None
    n: int
    stops: list[str]
    include_stop: bool
    stream: bool
    include_usage: bool
    logprobs: int | None  # completions: top-k; chat: top_logprobs (0 with logprobs true)
    echo: bool = False


class _OpenAIRoute(Route):
    kind = ""  # "cmpl" | "chatcmpl"

    def __init__(self, client: DeviceClient, tokenizer: TextTokenizer, limits: Limits, metrics: Metrics,
                 model_name: str, admission: Admission | None = None, state: ServiceState | None = None,
                 max_n: int = S.MAX_N):
        """``max_n``: ScheduleConfig.maxN, the most choices one request may ask (n x prompts)."""
        super().__init__(client, tokenizer, limits, metrics, admission, state)
        self.model_name = model_name
        self.max_n = max_n
        self.benchmark = benchmark_enabled()
        self._tok_text: dict[int, str] = {}

    # -- helpers shared by both routes ---------------------------------------------------------
    def _token_text(self, tid: int) -> str:
        s = self._tok_text.get(tid)
        if s is None:
            s = self.tokenizer.tokenizer.decode([tid], skip_special_tokens=False)
            if len(self._tok_text) < 200_000:
                self._tok_text[tid] = s
        return s

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist.", "model")

    def _check_ids(self, ids: list[int]) -> list[int]:
        try:
            check_token_count(len(ids))
            vocab = self.limits.vocab_size
            for t in ids:
                if t < 0 or (vocab > 0 and t >= vocab):
                    raise OpenAIError(400, f"Token id {t} is out of vocabulary (size {vocab}).", "prompt")
            return check_token_ids(ids, self.limits)
        except ApiError as e:
            raise _from_api_error(e) from None

    def _sampling(self, r: S._Sampling, max_tokens: int | None, prompt_len: int, logprobs: int,
                  prompt_logprobs: bool) -> P.SamplingParams:
        t = 1.0 if r.temperature is None else float(r.temperature)
        greedy = t == 0.0
        top_k = r.top_k or 0
        if top_k < 0:
            top_k = 0
        if top_k and self.limits.vocab_size > 0:
            top_k = min(top_k, self.limits.vocab_size)
        mnt = cap_max_new_tokens(max_tokens if max_tokens is not None else self.limits.max_iter_times,
                                 prompt_len, self.limits)
        return P.SamplingParams(
            do_sample=not greedy, temperature=1.0 if greedy else t, top_k=top_k,
            top_p=1.0 if r.top_p is None else float(r.top_p),
            repetition_penalty=1.0 if r.repetition_penalty is None else float(r.repetition_penalty),
            seed=0, max_new_tokens=max(1, mnt), ignore_eos=r.ignore_eos, stop_token_ids=list(r.stop_token_ids or []),
            logprobs=logprobs, presence_penalty=float(r.presence_penalty or 0.0),
            frequency_penalty=float(r.frequency_penalty or 0.0), prompt_logprobs=prompt_logprobs)

    def plan(self, body: bytes) -> _Plan:
        raise NotImplementedError

    # -- the request ---------------------------------------------------------------------------
    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        self.metrics.received()
        rec = RequestRecord("-", req.path)
        slot: Slot | None = None
        choices: list[_Choice] = []
        try:
            try:
                slot = admit(req, resp, rec, self.admission)
            except ApiError as e:  # 422 bad req-id: 400 here; 503 past maxLinkNum
                raise OpenAIError(503 if e.status == 503 else 400, e.message) from None
            try:
                body = await read_body(req, self.limits.max_request_length_mb)
            except ApiError as e:
                raise _from_api_error(e) from None
            if self.state is not None and self.state.stopped():
                raise OpenAIError(503, STOPPED_MESSAGE)
            plan = await asyncio.to_thread(self.plan, body) if len(body) > LARGE_BODY else self.plan(body)
            rec.input_tokens = sum(len(p) for p in plan.prompts)
            rec.stream = plan.stream
            choices = self._submit(plan, rec)
        except Exception as e:
            if not isinstance(e, OpenAIError):
                log.exception("%s %s: unexpected error", req.method, req.path)
                e = OpenAIError(500, f"Internal error: {type(e).__name__}")
            self._fail(resp, rec, e)
            if slot is not None:
                slot.release()
            return
        self.metrics.prompt_tokens(sum(len(plan.prompts[c.prompt]) for c in choices))
        rid = f"{self.kind}-{secrets.token_hex(16)}"
        created = int(time.time())
        if plan.stream:
            start_stream(resp, self._stream(plan, choices, rid, created, rec, slot))
            return
        try:
            await self._collect(req, resp, plan, choices, rid, created, rec)
        finally:
            if slot is not None:
                slot.release()

    def _fail(self, resp: falcon.asgi.Response, rec: RequestRecord, e: OpenAIError) -> None:
        self.metrics.failed()
        rec.done(e.status, error=e.message)
        resp.status = e.status
        resp.content_type = falcon.MEDIA_JSON
        resp.data = e.body()

    def _submit(self, plan: _Plan, rec: RequestRecord) -> list[_Choice]:
        lim = self.limits
        total = plan.n * len(plan.prompts)
        if total > self.max_n:
            raise OpenAIError(400, f"{total} choices asked (n = {plan.n} x {len(plan.prompts)} prompts), more than "
                                   f"ScheduleConfig.maxN = {self.max_n}.", "n")
        choices: list[_Choice] = []
        try:
            for p, ids in enumerate(plan.prompts):
                mnt = cap_max_new_tokens(plan.params.max_new_tokens, len(ids), lim)
                for j in range(plan.n):
                    seed = (plan.seed + j) % _SEED_MOD if plan.seed is not None else random_seed()
                    params = msgspec.structs.replace(plan.params, seed=seed, max_new_tokens=max(1, mnt))
                    gen = Generation(self.client, self.tokenizer, ids, params,
                                     Deadline(None, lim.token_timeout, lim.e2e_timeout, plan.stream),
                                     user_id=rec.request_id, stops=plan.stops, include_stop=plan.include_stop)
                    choices.append(_Choice(len(choices), p, gen))
        except GenerationError as e:
            for c in choices:
                self.client.cancel(c.gen.stream)
            raise OpenAIError(e.status, e.message) from None
        return choices

    async def _merged(self, choices: list[_Choice], tick: bool) -> AsyncIterator[tuple[_Choice, Piece] | None]:
        """Pieces of every choice as they come (None every IDLE_TICK_S while none does, with
        ``tick``). Raises the first GenerationError; every choice still running is cancelled
        when this ends, however it ends."""
        q: asyncio.Queue = asyncio.Queue()

        async def pump(c: _Choice) -> None:
            try:
                async for p in c.gen.pieces():
                    q.put_nowait((c, p))
                q.put_nowait((c, None))
            except GenerationError as e:
                q.put_nowait((c, e))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # never a silent hang
                log.exception("OpenAI choice %d failed", c.index)
                q.put_nowait((c, GenerationError(500, f"Internal error: {type(e).__name__}: {e}")))

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        left = len(choices)
        try:
            while left:
                if tick:
                    try:
                        c, item = await asyncio.wait_for(q.get(), IDLE_TICK_S)
                    except asyncio.TimeoutError:
                        yield None
                        continue
                else:
                    c, item = await q.get()
                if item is None:
                    left -= 1
                elif isinstance(item, GenerationError):
                    raise item
                else:
                    yield c, item
        finally:
            for t in tasks:
                t.cancel()

    async def _collect(self, req, resp, plan: _Plan, choices: list[_Choice], rid: str, created: int,
                       rec: RequestRecord) -> None:
        async def run() -> None:
            async for c, p in self._merged(choices, tick=False):
                rec.token(len(p.token_ids))
                c.add(p)

        work = asyncio.create_task(run())
        gone = asyncio.create_task(disconnected(req))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            work.cancel()
            raise
        finally:
            gone.cancel()
        if not work.done():  # the client hung up: the choices are cancelled on their workers
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            self.metrics.failed()
            rec.done(499, error="client disconnected")
            resp.status = 499  # nobody reads this
            return
        try:
            work.result()
        except GenerationError as e:
            self._fail(resp, rec, OpenAIError(e.status, e.message))
            return
        body = self.response(plan, choices, rid, created)
        if self.benchmark and choices:
            body["prefill_time"] = choices[0].prefill_ms
            body["decode_time_arr"] = choices[0].decode_ms
        finish_ok(self.metrics, rec, choices[0].finish if choices else "")
        resp.content_type = falcon.MEDIA_JSON
        resp.data = _enc.encode(body)

    def _usage(self, plan: _Plan, choices: list[_Choice]) -> dict:
        prompt = sum(len(p) for p in plan.prompts)
        completion = sum(len(c.ids) for c in choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def _stream(self, plan: _Plan, choices: list[_Choice], rid: str, created: int, rec: RequestRecord,
                      slot: Slot | None) -> AsyncIterator[object]:
        merged = self._merged(choices, tick=True)
        try:
            for chunk in self.first_chunks(plan, choices, rid, created):
                yield Raw(_sse(chunk))
            async for item in merged:
                if item is None:
                    yield TICK
                    continue
                c, p = item
                rec.token(len(p.token_ids))
                before = len(c.ids)
                c.add(p)
                chunk = self.chunk(plan, c, p, before, rid, created)
                if chunk is None:
                    continue
                if p.finish_reason and self.benchmark:
                    chunk["prefill_time"] = c.prefill_ms
                    chunk["decode_time_arr"] = c.decode_ms
                if plan.include_usage:
                    chunk["usage"] = None
                yield Raw(_sse(chunk))
            if plan.include_usage:
                yield Raw(_sse({"id": rid, "object": self.chunk_object, "created": created, "model": self.model_name,
                                 "choices": [], "usage": self._usage(plan, choices)}))
            finish_ok(self.metrics, rec, choices[0].finish if choices else "")
            yield Raw(DONE)
        except asyncio.CancelledError:
            raise
        except GenerationError as e:
            self.metrics.failed()
            rec.done(e.status, error=e.message)
            yield Raw(_sse(OpenAIError(e.status, e.message).payload()) + DONE)
        except Exception as e:  # never leave a truncated chunked body without a reason
            log.exception("OpenAI stream %s failed", rid)
            self.metrics.failed()
            rec.done(500, error=f"Internal error: {e}")
            yield Raw(_sse(OpenAIError(500, f"Internal error: {type(e).__name__}").payload()) + DONE)
        finally:
            if not rec._logged:
                self.metrics.failed()
                rec.done(499, error="client disconnected")
            try:
                await merged.aclose()  # cancels the choices' tasks
            except BaseException:  # noqa: BLE001 - closing must not mask the original exit
                pass
            for c in choices:
                if not c.gen.stream.finished:
                    self.client.cancel(c.gen.stream)
            if slot is not None:
                slot.release()

    # -- per route -------------------------------------------------------------------------------
    chunk_object = ""

    def response(self, plan: _Plan, choices: list[_Choice], rid: str, created: int) -> dict:
        raise NotImplementedError

    def first_chunks(self, plan: _Plan, choices: list[_Choice], rid: str, created: int) -> list[dict]:
        return []

    def chunk(self, plan: _Plan, c: _Choice, p: Piece, before: int, rid: str, created: int) -> dict | None:
        raise NotImplementedError


class CompletionsResource(_OpenAIRoute):
    """POST /v1/completions."""

    kind = "cmpl"
    chunk_object = "text_completion"

    def plan(self, body: bytes) -> _Plan:
        try:
            r = S.decode_completion(body)
            raw_prompts = S.prompts(r.prompt)
        except S.SchemaError as e:
            raise OpenAIError(400, e.message, e.param) from None
        self._check_model(r.model)
        prompts, texts = [], []
        for pr in raw_prompts:
            if isinstance(pr, str):
                ids = self._check_ids(self.tokenizer.encode(pr))
                texts.append(pr)
            else:
                ids = self._check_ids(list(pr))
                texts.append(self.tokenizer.decode(ids))
            prompts.append(ids)
        k = r.logprobs
        params = self._sampling(r, r.max_tokens, 0, -1 if k is None else k, bool(r.echo and k is not None))
        return _Plan(prompts, texts, params, r.seed, r.n or 1, S.stops(r.stop), r.include_stop_str_in_output,
                     bool(r.stream), bool(r.stream and r.stream_options and r.stream_options.include_usage),
                     k, bool(r.echo))

    def _logprobs(self, plan: _Plan, c: _Choice, start: int, end: int, with_prompt: bool) -> dict | None:
        """OpenAI's completions logprobs object for ids[start:end] (and the prompt first)."""
        if plan.logprobs is None:
            return None
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict | None] = []
        offsets: list[int] = []

        def add(s: str, lp, top) -> None:
            tokens.append(s)
            token_lps.append(lp)
            tops.append(top)
            offsets.append(c.offset)
            c.offset += len(s)

        if with_prompt:
            pids = plan.prompts[c.prompt]
            for i, t in enumerate(pids):
                s = self._token_text(t)
                lp = c.prompt_logprobs[i - 1] if 0 < i <= len(c.prompt_logprobs) else None
                add(s, lp, None if lp is None else {s: lp})
        for i in range(start, end):
            s = self._token_text(c.ids[i])
            lp = c.logprobs[i] if i < len(c.logprobs) else None
            top = {self._token_text(t): v for t, v in c.tops[i]} if i < len(c.tops) else {}
            if lp is not None and s not in top:
                top[s] = lp  # vLLM: the sampled token is always among them
            add(s, lp, top if (top or lp is not None) else None)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _text(self, plan: _Plan, c: _Choice) -> str:
        return (plan.prompt_texts[c.prompt] if plan.echo else "") + c.text

    def response(self, plan: _Plan, choices: list[_Choice], rid: str, created: int) -> dict:
        out = []
        for c in choices:
            out.append({"index": c.index, "text": self._text(plan, c),
                        "logprobs": self._logprobs(plan, c, 0, len(c.ids), plan.echo),
                        "finish_reason": _finish(c.finish), "stop_reason": c.stop_reason()})
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": out, "usage": self._usage(plan, choices)}

    def chunk(self, plan: _Plan, c: _Choice, p: Piece, before: int, rid: str, created: int) -> dict | None:
        first = not c.started
        text = p.text
        if first:
            c.started = True
            if plan.echo:
                text = plan.prompt_texts[c.prompt] + text
        lp = self._logprobs(plan, c, before, len(c.ids), plan.echo and first)
        if not (text or p.finish_reason or (lp is not None and lp["tokens"])):
            return None
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": [{"index": c.index, "text": text, "logprobs": lp,
                             "finish_reason": _finish(c.finish) if p.finish_reason else None,
                             "stop_reason": c.stop_reason() if p.finish_reason else None}]}


class ChatCompletionsResource(_OpenAIRoute):
    """POST /v1/chat/completions."""

    kind = "chatcmpl"
    chunk_object = "chat.completion.chunk"

    def __init__(self, *args, model_dir: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.template: ChatTemplate = load_chat_template(model_dir)
        if self.template.fallback:
            log.warning("the model in %s has no chat template (tokenizer_config.json chat_template, "
                        "chat_template.jinja): /v1/chat/completions uses a plain ChatML template", model_dir)

    def _encode(self, text: str) -> list[int]:
        """Rendered chat text to ids without adding BOS/EOS (the template writes them, as
        transformers' apply_chat_template(tokenize=True) and vLLM do)."""
        tok = self.tokenizer.tokenizer
        if len(text) > 1 << 16:
            return tok.encode_batch([text], add_special_tokens=False)[0].ids
        return tok.encode(text, add_special_tokens=False).ids

    def plan(self, body: bytes) -> _Plan:
        try:
            r = S.decode_chat(body)
        except S.SchemaError as e:
            raise OpenAIError(400, e.message, e.param) from None
        self._check_model(r.model)
        tools = r.tools if r.tools and r.tool_choice != "none" else None
        try:
            text = self.template.render(r.messages, tools=tools, add_generation_prompt=r.add_generation_prompt,
                                        **(r.chat_template_kwargs or {}))
        except ChatTemplateError as e:
            raise OpenAIError(400, f"The chat template refused the messages: {e}", "messages") from None
        ids = self._check_ids(self._encode(text))
        k = (r.top_logprobs or 0) if r.logprobs else None
        max_tokens = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
        params = self._sampling(r, max_tokens, 0, -1 if k is None else k, False)
        return _Plan([ids], [text], params, r.seed, r.n or 1, S.stops(r.stop), r.include_stop_str_in_output,
                     bool(r.stream), bool(r.stream and r.stream_options and r.stream_options.include_usage), k)

    def _logprobs(self, plan: _Plan, c: _Choice, start: int, end: int) -> dict | None:
        if plan.logprobs is None:
            return None
        content = []
        for i in range(start, min(end, len(c.logprobs))):
            s = self._token_text(c.ids[i])
            tops = c.tops[i][:plan.logprobs] if i < len(c.tops) else []
            content.append({"token": s, "logprob": c.logprobs[i], "bytes": list(s.encode("utf-8")),
                            "top_logprobs": [{"token": (ts := self._token_text(t)), "logprob": v,
                                              "bytes": list(ts.encode("utf-8"))} for t, v in tops]})
        return {"content": content}

    def response(self, plan: _Plan, choices: list[_Choice], rid: str, created: int) -> dict:
        out = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": self._logprobs(plan, c, 0, len(c.ids)), "finish_reason": _finish(c.finish),
                "stop_reason": c.stop_reason()} for c in choices]
        return {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": out, "usage": self._usage(plan, choices)}

    def _chunk(self, rid: str, created: int, choice: dict) -> dict:
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                "choices": [choice]}

    def first_chunks(self, plan: _Plan, choices: list[_Choice], rid: str, created: int) -> list[dict]:
        out = []
        for c in choices:
            ch = self._chunk(rid, created, {"index": c.index, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None})
            if plan.include_usage:
                ch["usage"] = None
            out.append(ch)
        return out

    def chunk(self, plan: _Plan, c: _Choice, p: Piece, before: int, rid: str, created: int) -> dict | None:
        lp = self._logprobs(plan, c, before, len(c.ids))
        if not (p.text or p.finish_reason or (lp is not None and lp["content"])):
            return None
        return self._chunk(rid, created, {
            "index": c.index, "delta": {"content": p.text} if p.text else {}, "logprobs": lp,
            "finish_reason": _finish(c.finish) if p.finish_reason else None,
            "stop_reason": c.stop_reason() if p.finish_reason else None})


def openai_routes(fe) -> tuple[CompletionsResource, ChatCompletionsResource]:
    """The two resources of a front end (mindie/frontend.py FrontEnd)."""
    args = (fe.client, fe.tokenizer, fe.limits, fe.metrics, fe.model_name)
    kw = {"admission": fe.admission, "state": fe.state, "max_n": fe.config.backend.schedule.max_n}
    return CompletionsResource(*args, **kw), ChatCompletionsResource(*args, model_dir=fe.model_dir, **kw)
