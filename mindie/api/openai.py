"""OpenAI-compatible ``POST /v1/completions`` and ``POST /v1/chat/completions`` (vLLM-flavoured,
as MindIE's ``openAiSupport: "vllm"``), on the shared generation loop (mindie/text/generation.py).

Decisions (docs/apis.md has the user's view):
- Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with vLLM's
  types and ``code`` = the HTTP status: 400 ``BadRequestError`` (bad JSON, bad parameter, prompt
  too long, ids outside the vocabulary, the chat template refusing the messages), 404
  ``NotFoundError`` (``The model `x` does not exist.``: any name but the served one and the
  placeholders TGI's clients send, ``PLACEHOLDER_MODELS``), 413 (body over maxRequestLength), 503
  ``ServiceUnavailableError`` (after /stopService, maxLinkNum requests in progress, no device
  worker), 500 ``InternalServerError`` (timeouts ``Engine callback timeout: ...``, a worker lost
  mid-request). A stream that fails after its 200 ends with ``data: {"error": {...}}`` and
  ``data: [DONE]`` (the family's shapes, shared with the coordinator: mindie/contract/families.py).
- ``max_tokens`` (chat: ``max_completion_tokens``, else ``max_tokens``) defaults to MindIE's
  ``maxIterTimes`` (not OpenAI's 16), and is capped as MindIE caps ``max_new_tokens``:
  min(max_tokens, maxIterTimes, maxSeqLen - prompt length).
- ``temperature`` 0 is greedy; absent means 1.0 (OpenAI's default: sampling). ``top_k`` -1 or 0
  is off. ``seed`` absent: a random seed per choice. ``n`` choices are n submissions with seeds
  seed, seed + 1, ... (vLLM's rule); a list prompt gives n choices per prompt, choice index
  = prompt index * n + j. Same seed and parameters give the same tokens as /infer.
- ``usage.prompt_tokens`` counts each prompt once (not once per choice), ``completion_tokens``
  every generated id of every choice (the ids up to the one that completed a stop string).
- ``finish_reason``: "length", else "tool_calls" when the answer holds tool calls, else "stop"
  (EOS, stop string, stop token id, stopInfer); ``stop_reason`` is the matched stop string or
  stop token id (vLLM), else null.
- Structured output (mindie/text/structured.py): ``response_format`` (``json_object``, ``json_schema``
  with ``strict``; TGI's ``{"type", "value"}`` form), vLLM's ``structured_outputs`` and older
  ``guided_*`` fields, on both routes; at most one of them. The constraint goes to the worker in
  ``SamplingParams.constraint``; one the front end has not compiled before is compiled off the
  event loop (``Job.checks``) and a bad one is a 400 naming the field.
- Reasoning (chat, mindie/text/reasoning.py): with a reasoning parser (configured or detected from the
  chat template) the thinking comes back as ``reasoning_content`` (stream: its own deltas) and
  ``usage.completion_tokens_details.reasoning_tokens`` counts it. An answer constrained by a JSON
  schema, JSON object or choice, or by a tool call's grammar, is all content (the constraint
  leaves no room for a think block).
- Tool calls (chat, mindie/text/tool_calls.py, mindie/text/tool_parsers/): ``tools`` with ``tool_choice``
  auto, required or a named function are parsed out of the content (after the reasoning split) in
  the model's format into ``message.tool_calls`` (streamed as OpenAI's ``delta.tool_calls``), the
  markup never shown as content; required and a named function also carry the call's grammar
  (``SamplingParams.constraint``, checked like a structured-output one; with another constraint:
  a 400); ``none`` gives the template the tools and parses nothing.
- The request's life is the shared pipeline's (mindie/pipeline.py); this module is the
  family's codec: parse a body into submissions, render answers, chunks and errors.
- ``MINDIE_LLM_BENCHMARK_ENABLE=1|2``: a non-stream body gets top-level ``prefill_time`` (ms)
  and ``decode_time_arr`` (ms per decoded token) of its first choice, after ``usage`` (where
  MindIE's chat route puts them); in a stream each choice's finishing chunk carries them.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Container

import falcon.asgi
import msgspec

from mindie.api import openai_schema as S
from mindie.text.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from mindie.contract import families
from mindie.contract import wire as P
from mindie.contract.errors import FINISH_LENGTH
from mindie.contract.sse_framing import json_event
from mindie.text.detokenizer import TextTokenizer
from mindie.contract.http_error import ApiError
from mindie.text.generation import Piece
from mindie.pipeline import Codec, Context, Job, Output, Pipeline, Sub
from mindie.text.reasoning import (DEFAULT_EARLY_STOPPING_TEXT, MAX_THINKING_BUDGET, ReasoningParser, ThinkingBudget, choose,
                              split)
from mindie.text.structured import Checker, from_guided, from_response_format, from_structured_outputs, one_of
from mindie.text.tool_calls import ToolRequest, ToolSupport, configured_options
from mindie.text.tool_parsers.base import ToolCallStream, parse_text
from mindie.text.validation import Limits, cap_max_new_tokens, check_token_count, check_token_ids, random_seed

log = logging.getLogger("mindie.api.openai")

_SEED_MOD = 2**63
_enc = msgspec.json.Encoder()
# Model names that mean "whatever this server serves", as TGI (which serves one model and takes
# any name) is addressed: huggingface_hub.InferenceClient(base_url).chat_completion() sends
# "dummy" when given no model, TGI's documentation tells OpenAI clients to send "tgi".
PLACEHOLDER_MODELS = frozenset({"tgi", "dummy"})


def benchmark_enabled() -> bool:
    return os.environ.get("MINDIE_LLM_BENCHMARK_ENABLE", "").strip() in ("1", "2")


def _finish(reason: str, tool_calls: bool = False) -> str:
    if reason == FINISH_LENGTH:
        return "length"
    return "tool_calls" if tool_calls else "stop"


@dataclass
class OpenAIRequest:
    """A validated request: its prompts and what the answer needs."""

    prompts: list[list[int]]
    prompt_texts: list[str]
    stream: bool
    include_usage: bool
    logprobs: int | None  # completions: top-k; chat: top_logprobs (0 with logprobs true)
    echo: bool = False
    rid: str = ""
    created: int = 0
    adapter: str = ""  # the LoRA adapter ``model`` names ("" = the base model); the answers' ``model``
    reasoning: ReasoningParser | None = None  # chat: the parser splitting this request's answers (None: off)
    tools: ToolRequest | None = None  # chat: the request's tools (None: no tool calls parsed)


class _OpenAICodec(Codec):
    family = families.OPENAI  # OpenAI's error object and its stream's [DONE]
    kind = ""  # "cmpl" | "chatcmpl"
    chunk_object = ""

    def __init__(self, tokenizer: TextTokenizer, limits: Limits, model_name: str, max_n: int = S.MAX_N,
                 adapters: Container[str] = (), structured: Checker | None = None, cache_report: bool = False):
        """``max_n``: ScheduleConfig.maxN, the most choices one request may ask (n x prompts);
        ``adapters``: the LoRA adapters ``model`` may name (mindie/lora_adapters.py); ``structured``:
        the front end's constraint checker (mindie/text/structured.py; None: one of its own);
        ``cache_report``: ServerConfig.enablePromptTokensDetails (usage's cached prompt tokens)."""
        self.cache_report = cache_report
        self.tokenizer = tokenizer
        self.structured = structured if structured is not None else Checker(tokenizer)
        self.limits = limits
        self.model_name = model_name
        self.adapters = adapters
        self.max_n = max_n
        self.benchmark = benchmark_enabled()
        self._tok_text: dict[int, str] = {}

    # -- errors --------------------------------------------------------------------------------
    def refused(self, err: ApiError) -> ApiError:
        """MindIE's 422/424 checks are the client's fault: 400 here."""
        if err.status in (422, 424):
            return ApiError(400, err.message, param=err.param)
        return err

    # -- helpers shared by both routes ---------------------------------------------------------
    def _token_text(self, tid: int) -> str:
        s = self._tok_text.get(tid)
        if s is None:
            s = self.tokenizer.tokenizer.decode([tid], skip_special_tokens=False)
            if len(self._tok_text) < 200_000:
                self._tok_text[tid] = s
        return s

    def _check_model(self, model: str | None) -> str:
        """The LoRA adapter ``model`` names, or "" for the base model: the served name, none, or a
        placeholder TGI's clients send (``PLACEHOLDER_MODELS``); any other name is a 404, as
        OpenAI's and vLLM's servers answer it."""
        if model is None or model == self.model_name or model in PLACEHOLDER_MODELS:
            return ""
        if model in self.adapters:
            return model
        raise ApiError(404, f"The model `{model}` does not exist.", param="model")

    def _check_ids(self, ids: list[int]) -> list[int]:
        check_token_count(len(ids))
        vocab = self.limits.vocab_size
        for t in ids:
            if t < 0 or (vocab > 0 and t >= vocab):
                raise ApiError(400, f"Token id {t} is out of vocabulary (size {vocab}).", param="prompt")
        return check_token_ids(ids, self.limits)

    def _sampling(self, r: S._Sampling, max_tokens: int | None, logprobs: int,
                  prompt_logprobs: bool) -> P.SamplingParams:
        t = 1.0 if r.temperature is None else float(r.temperature)
        greedy = t == 0.0
        top_k = r.top_k or 0
        if top_k < 0:
            top_k = 0
        if top_k and self.limits.vocab_size > 0:
            top_k = min(top_k, self.limits.vocab_size)
        mnt = cap_max_new_tokens(max_tokens if max_tokens is not None else self.limits.max_iter_times, 0,
                                 self.limits)
        return P.SamplingParams(
            do_sample=not greedy, temperature=1.0 if greedy else t, top_k=top_k,
            top_p=1.0 if r.top_p is None else float(r.top_p),
            repetition_penalty=1.0 if r.repetition_penalty is None else float(r.repetition_penalty),
            seed=0, max_new_tokens=max(1, mnt), ignore_eos=r.ignore_eos, stop_token_ids=list(r.stop_token_ids or []),
            logprobs=logprobs, presence_penalty=float(r.presence_penalty or 0.0),
            frequency_penalty=float(r.frequency_penalty or 0.0), prompt_logprobs=prompt_logprobs)

    def _constraint(self, r: S._Sampling, params: P.SamplingParams,
                    checks: list) -> tuple[P.SamplingParams, P.Constraint | None]:
        """The request's structured-output constraint (at most one field gives one) put into
        ``params``; a constraint not compiled before leaves its check in ``checks``."""
        special = self.structured.is_special
        rf = msgspec.to_builtins(r.response_format) if r.response_format is not None else None
        so = msgspec.to_builtins(r.structured_outputs) if r.structured_outputs is not None else None
        guided = {k: getattr(r, k) for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                             "guided_whitespace_pattern", "guided_decoding_backend")}
        c, field = one_of((from_response_format(rf, special=special), "response_format"),
                          (from_structured_outputs(so, special=special), "structured_outputs"), from_guided(guided))
        if c is None:
            return params, None
        checks += self.structured.pending(c, field)
        return msgspec.structs.replace(params, constraint=c), c

    def _job(self, req: OpenAIRequest, params: P.SamplingParams, seed: int | None, n: int, stops: list[str],
             include_stop: bool) -> Job:
        """``n`` submissions per prompt, with seeds seed, seed + 1, ... (vLLM's rule)."""
        total = n * len(req.prompts)
        if total > self.max_n:
            raise ApiError(400, f"{total} choices asked (n = {n} x {len(req.prompts)} prompts), more than "
                                f"ScheduleConfig.maxN = {self.max_n}.", param="n")
        subs = []
        keep = req.tools.keep_special if req.tools is not None and req.tools.parser is not None else frozenset()
        if req.reasoning is not None:
            keep |= getattr(self, "_reasoning_keep", frozenset())
        for p, ids in enumerate(req.prompts):
            mnt = cap_max_new_tokens(params.max_new_tokens, len(ids), self.limits)
            for j in range(n):
                s = (seed + j) % _SEED_MOD if seed is not None else random_seed()
                subs.append(Sub(ids, msgspec.structs.replace(params, seed=s, max_new_tokens=max(1, mnt)), stops=stops,
                                include_stop=include_stop, prompt=p, adapter=req.adapter, keep_special=keep))
        req.rid = f"{self.kind}-{secrets.token_hex(16)}"
        req.created = int(time.time())
        return Job(subs, req.stream, req)

    def _head(self, req: OpenAIRequest, obj: str) -> dict:
        return {"id": req.rid, "object": obj, "created": req.created, "model": req.adapter or self.model_name}

    def _usage(self, job: Job, outs: list[Output]) -> dict:
        prompt = job.prompt_tokens()
        completion = sum(len(o.ids) for o in outs)
        usage: dict = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if self.cache_report:  # OpenAI's shape (and vLLM's with --enable-prompt-tokens-details)
            usage["prompt_tokens_details"] = {"cached_tokens": job.cached_tokens(outs)}
        return usage

    # -- answers -------------------------------------------------------------------------------
    def reply(self, job: Job, outs: list[Output], ctx: Context) -> bytes:
        body = self.response(job, outs)
        if self.benchmark and outs:
            body["prefill_time"] = outs[0].prefill_ms
            body["decode_time_arr"] = outs[0].decode_ms
        return _enc.encode(body)

    def render(self, job: Job, out: Output, p: Piece, ctx: Context) -> Iterator[bytes]:
        chunk = self.chunk(job, out, p, len(out.ids) - len(p.token_ids))
        if chunk is None:
            return
        if p.finish_reason and self.benchmark:
            chunk["prefill_time"] = out.prefill_ms
            chunk["decode_time_arr"] = out.decode_ms
        if job.request.include_usage:
            chunk["usage"] = None
        yield json_event(chunk)

    def close(self, job: Job, outs: list[Output], ctx: Context) -> Iterator[bytes]:
        if job.request.include_usage:
            yield json_event({**self._head(job.request, self.chunk_object), "choices": [],
                                  "usage": self._usage(job, outs)})
        yield families.terminator(self.family)

    # -- per route -----------------------------------------------------------------------------
    def response(self, job: Job, outs: list[Output]) -> dict:
        raise NotImplementedError

    def chunk(self, job: Job, out: Output, p: Piece, before: int) -> dict | None:
        raise NotImplementedError


class CompletionsCodec(_OpenAICodec):
    """POST /v1/completions."""

    kind = "cmpl"
    chunk_object = "text_completion"

    def parse(self, body: bytes, ctx: Context) -> Job:
        r = S.decode_completion(body)
        raw_prompts = S.prompts(r.prompt)
        adapter = self._check_model(r.model)
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
        params = self._sampling(r, r.max_tokens, -1 if k is None else k, bool(r.echo and k is not None))
        checks: list = []
        params, _ = self._constraint(r, params, checks)
        req = OpenAIRequest(prompts, texts, bool(r.stream),
                            bool(r.stream and r.stream_options and r.stream_options.include_usage), k, bool(r.echo))
        req.adapter = adapter
        job = self._job(req, params, r.seed, r.n or 1, S.stops(r.stop), r.include_stop_str_in_output)
        job.ignored = S.ignored(body, chat=False)
        job.checks = checks
        return job

    def _logprobs(self, req: OpenAIRequest, c: Output, start: int, end: int, with_prompt: bool) -> dict | None:
        """OpenAI's completions logprobs object for ids[start:end] (and the prompt first)."""
        if req.logprobs is None:
            return None
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict | None] = []
        offsets: list[int] = []

        def add(s: str, lp, top) -> None:
            tokens.append(s)
            token_lps.append(lp)
            tops.append(top)
            offsets.append(c.state.get("offset", 0))
            c.state["offset"] = c.state.get("offset", 0) + len(s)

        if with_prompt:
            pids = req.prompts[c.sub.prompt]
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

    def response(self, job: Job, outs: list[Output]) -> dict:
        req: OpenAIRequest = job.request
        choices = []
        for c in outs:
            choices.append({"index": c.index, "text": (req.prompt_texts[c.sub.prompt] if req.echo else "") + c.text,
                            "logprobs": self._logprobs(req, c, 0, len(c.ids), req.echo),
                            "finish_reason": _finish(c.finish), "stop_reason": c.stop_reason()})
        return {**self._head(req, "text_completion"), "choices": choices, "usage": self._usage(job, outs)}

    def chunk(self, job: Job, c: Output, p: Piece, before: int) -> dict | None:
        req: OpenAIRequest = job.request
        first = not c.state.get("started")
        text = p.text
        if first:
            c.state["started"] = True
            if req.echo:
                text = req.prompt_texts[c.sub.prompt] + text
        lp = self._logprobs(req, c, before, len(c.ids), req.echo and first)
        if not (text or p.finish_reason or (lp is not None and lp["tokens"])):
            return None
        return {**self._head(req, "text_completion"),
                "choices": [{"index": c.index, "text": text, "logprobs": lp,
                             "finish_reason": _finish(c.finish) if p.finish_reason else None,
                             "stop_reason": c.stop_reason() if p.finish_reason else None}]}


class ChatCompletionsCodec(_OpenAICodec):
    """POST /v1/chat/completions."""

    kind = "chatcmpl"
    chunk_object = "chat.completion.chunk"

    def __init__(self, *args: Any, model_dir: str, reasoning_parser: str = "auto",
                 enable_reasoning: dict[str, bool] | None = None, early_stopping_text: str | None = None,
                 tool_call_parser: str = "", chat_template: str = "", **kwargs: Any):
        """``reasoning_parser``: ModelConfig.reasoningParser; ``enable_reasoning``: MindIE's
        ModelConfig.models.<type>.enable_reasoning the config sets (mindie/text/reasoning.py ``choose``);
        ``early_stopping_text``: MindIE's ModelConfig.models.<type>.early_stopping_text (the thinking
        budget's text; None: MindIE's example for Qwen3); ``tool_call_parser``, ``chat_template``: the
        served model type's ``ModelConfig[].models`` options (MindIE's keys; "" = detect the parser,
        the checkpoint's template)."""
        super().__init__(*args, **kwargs)
        self.early_text = early_stopping_text or DEFAULT_EARLY_STOPPING_TEXT
        self.early_ids = tuple(self.tokenizer.tokenizer.encode(self.early_text, add_special_tokens=False).ids)
        self.template: ChatTemplate = load_chat_template(model_dir, chat_template)
        if self.template.fallback:
            log.warning("the model in %s has no chat template (tokenizer_config.json chat_template, "
                        "chat_template.jinja): /v1/chat/completions uses a plain ChatML template", model_dir)
        self.reasoning = choose(reasoning_parser, enable_reasoning or {}, self.template)
        if self.reasoning is not None:
            log.info("reasoning parser %s: /v1/chat/completions answers the thinking as reasoning_content",
                     self.reasoning.name)
        end_id = self.tokenizer.tokenizer.token_to_id(self.reasoning.end) if self.reasoning else None
        self._end_id = end_id  # </think> as one token of the vocabulary (else None)
        # A format whose markers are special tokens (harmony's): the detokeniser keeps their text for the parser.
        tok = self.tokenizer
        self._reasoning_keep = frozenset(i for m in getattr(self.reasoning, "markers", ())
                                         if (i := tok.tokenizer.token_to_id(m)) is not None and i in tok.special_ids)
        self.tools = ToolSupport(self.template, self.tokenizer, tool_call_parser)

    def _encode(self, text: str) -> list[int]:
        """Rendered chat text to ids without adding BOS/EOS (the template writes them, as
        transformers' apply_chat_template(tokenize=True) and vLLM do)."""
        tok = self.tokenizer.tokenizer
        if len(text) > 1 << 16:
            return tok.encode_batch([text], add_special_tokens=False)[0].ids
        return tok.encode(text, add_special_tokens=False).ids

    def parse(self, body: bytes, ctx: Context) -> Job:
        job = self.job_of(S.decode_chat(body))
        job.ignored = S.ignored(body, chat=True)
        return job

    def job_of(self, r: S.ChatCompletionRequest) -> Job:
        """The job of a decoded chat request (also what other families that render a chat
        conversation build theirs from: mindie/api/anthropic.py)."""
        adapter = self._check_model(r.model)
        checks: list = []  # compiles not seen before, run off the event loop (pipeline Job.checks)
        treq = self.tools.request(r.tools, r.tool_choice, r.parallel_tool_calls, checks)
        messages = self.tools.messages(r.messages, treq)
        try:
            # with tool_choice "none" too: the model still sees its tools, as vLLM renders them
            text = self.template.render(messages, tools=r.tools or None, add_generation_prompt=r.add_generation_prompt,
                                        **(r.chat_template_kwargs or {}))
        except ChatTemplateError as e:
            raise ApiError(400, f"The chat template refused the messages: {e}", param="messages") from None
        ids = self._check_ids(self._encode(text))
        k = (r.top_logprobs or 0) if r.logprobs else None
        max_tokens = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
        params = self._sampling(r, max_tokens, -1 if k is None else k, False)
        params, c = self._constraint(r, params, checks)
        tool_grammar = treq is not None and treq.constraint is not None
        if tool_grammar:
            if c is not None:
                raise ApiError(400, f"tool_choice {r.tool_choice!r} constrains the output to a tool call; it cannot be "
                                    "combined with response_format, structured_outputs or guided_*.", param="tool_choice")
            c = treq.constraint
            checks += self.structured.pending(c, "tools")  # compiled against the tokenizer, off the event loop
            params = msgspec.structs.replace(params, constraint=c)
        req = OpenAIRequest([ids], [text], bool(r.stream),
                            bool(r.stream and r.stream_options and r.stream_options.include_usage), k)
        req.adapter = adapter
        req.tools = treq if treq is not None and treq.parser is not None else None
        # A JSON, choice or tool-call constraint leaves no room for a think block: its answer is all content.
        if c is None or (c.kind in ("regex", "lark", "gbnf") and not tool_grammar):
            req.reasoning = self.reasoning
        budget = self._thinking_budget(r, req, text, c)
        job = self._job(req, params, r.seed, r.n or 1, S.stops(r.stop), r.include_stop_str_in_output)
        for sub in job.subs:
            sub.budget = budget
        job.checks = checks
        return job

    def _thinking_budget(self, r: S.ChatCompletionRequest, req: OpenAIRequest, prompt: str,
                         c: P.Constraint | None) -> ThinkingBudget | None:
        """MindIE's ``chat_template_kwargs.thinking_budget`` (vLLM's ``thinking_token_budget``):
        applied where a reasoning parser splits the answer and no constraint shapes it (a
        continuation could not resume a grammar); otherwise it only reaches the template."""
        kwargs = r.chat_template_kwargs or {}
        tokens, field = kwargs.get("thinking_budget"), "chat_template_kwargs"
        if tokens is None and r.thinking_token_budget is not None and r.thinking_token_budget != -1:
            tokens, field = r.thinking_token_budget, "thinking_token_budget"
        if tokens is None:
            return None
        if type(tokens) is not int or not 1 <= tokens <= MAX_THINKING_BUDGET:
            raise ApiError(400, f"thinking_budget must be an integer in [1, {MAX_THINKING_BUDGET}], got "
                                f"{json.dumps(tokens)}.", param=field)
        if req.reasoning is None or c is not None:
            return None
        return ThinkingBudget(tokens, req.reasoning, prompt, self.early_ids, self.early_text)

    def _split(self, req: OpenAIRequest, c: Output) -> tuple[str | None, str]:
        """(reasoning_content, content) of a whole answer."""
        if req.reasoning is None:
            return None, c.text
        return split(req.reasoning, req.prompt_texts[c.sub.prompt], c.text)

    def _reasoning_tokens(self, req: OpenAIRequest, c: Output) -> int:
        """Tokens of the thinking, the tags included: up to the token that completes the first
        ``</think>`` (the closing one), all of them when the thinking never closed."""
        if req.reasoning is None or self._split(req, c)[0] is None:
            return 0
        ids, end = c.ids, req.reasoning.end
        if self._end_id is not None and self._end_id in ids:  # the tag is one token
            return ids.index(self._end_id) + 1
        decode = self.tokenizer.decode
        if end not in decode(ids):
            return len(ids)
        lo, hi = 1, len(ids)  # the shortest prefix whose text holds the tag
        while lo < hi:
            mid = (lo + hi) // 2
            if end in decode(ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _usage(self, job: Job, outs: list[Output]) -> dict:
        usage = super()._usage(job, outs)
        if self.reasoning is not None:
            usage["completion_tokens_details"] = {
                "reasoning_tokens": sum(self._reasoning_tokens(job.request, o) for o in outs)}
        return usage

    def _logprobs(self, req: OpenAIRequest, c: Output, start: int, end: int) -> dict | None:
        if req.logprobs is None:
            return None
        content = []
        for i in range(start, min(end, len(c.logprobs))):
            s = self._token_text(c.ids[i])
            tops = c.tops[i][:req.logprobs] if i < len(c.tops) else []
            content.append({"token": s, "logprob": c.logprobs[i], "bytes": list(s.encode("utf-8")),
                            "top_logprobs": [{"token": (ts := self._token_text(t)), "logprob": v,
                                              "bytes": list(ts.encode("utf-8"))} for t, v in tops]})
        return {"content": content}

    def response(self, job: Job, outs: list[Output]) -> dict:
        req: OpenAIRequest = job.request
        choices = []
        for c in outs:
            message = self._message(req, c)
            calls: list[dict] = []
            if req.tools is not None:
                message["content"], calls = parse_text(req.tools.parser, message["content"] or "", req.tools.parallel)
                if calls:
                    message["tool_calls"] = calls
            choices.append({"index": c.index, "message": message, "logprobs": self._logprobs(req, c, 0, len(c.ids)),
                            "finish_reason": _finish(c.finish, bool(calls)), "stop_reason": c.stop_reason()})
        return {**self._head(req, "chat.completion"), "choices": choices, "usage": self._usage(job, outs)}

    def _message(self, req: OpenAIRequest, c: Output) -> dict:
        if self.reasoning is None:
            return {"role": "assistant", "content": c.text}
        reasoning, content = self._split(req, c)
        return {"role": "assistant", "content": content, "reasoning_content": reasoning}

    def open(self, job: Job, outs: list[Output], ctx: Context) -> Iterator[bytes]:
        req: OpenAIRequest = job.request
        for c in outs:
            ch = {**self._head(req, self.chunk_object),
                  "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}]}
            if req.include_usage:
                ch["usage"] = None
            yield json_event(ch)

    def chunk(self, job: Job, c: Output, p: Piece, before: int) -> dict | None:
        req: OpenAIRequest = job.request
        lp = self._logprobs(req, c, before, len(c.ids))
        if req.reasoning is None:
            delta = {"content": p.text} if p.text else {}
        else:
            sp = c.state.get("reasoning")
            if sp is None:
                sp = c.state["reasoning"] = req.reasoning.splitter(req.prompt_texts[c.sub.prompt])
            reasoning, content = sp.push(p.text)
            if p.finish_reason:
                more_r, more_c = sp.flush()
                reasoning, content = reasoning + more_r, content + more_c
            delta = {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content:
                delta["content"] = content
        called = False
        if req.tools is not None:  # the content goes through the tool parser: content and tool-call deltas
            stream = c.state.get("tools")
            if stream is None:
                stream = c.state["tools"] = ToolCallStream(req.tools.parser, req.tools.parallel)
            content, calls = stream.push(delta.pop("content", ""), final=bool(p.finish_reason))
            if content:
                delta["content"] = content
            if calls:
                delta["tool_calls"] = calls
            called = bool(stream.calls)
        if not (delta or p.finish_reason or (lp is not None and lp["content"])):
            return None
        return {**self._head(req, self.chunk_object), "choices": [{
            "index": c.index, "delta": delta, "logprobs": lp,
            "finish_reason": _finish(c.finish, called) if p.finish_reason else None,
            "stop_reason": c.stop_reason() if p.finish_reason else None}]}


class OpenAIResource:
    """One route the pipeline serves with a codec (``/v1/completions``, ``/v1/chat/completions``;
    Anthropic's ``/v1/messages``, mindie/api/anthropic.py)."""

    def __init__(self, pipeline: Pipeline, codec: Codec):
        self.pipeline = pipeline
        self.codec = codec

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        await self.pipeline.serve(req, resp, self.codec)


def openai_routes(fe, pipeline: Pipeline) -> tuple[OpenAIResource, OpenAIResource]:
    """The two resources of a front end (mindie/server/frontend.py FrontEnd)."""
    args = (fe.tokenizer, fe.limits, fe.model_name)
    max_n = fe.config.backend.schedule.max_n
    report = fe.config.server.enable_prompt_tokens_details
    model = fe.config.backend.model_deploy.models[0]
    enable = {t: o.enable_reasoning for t, o in model.models.items() if o.enable_reasoning is not None}
    early = next((o.early_stopping_text for o in model.models.values() if o.early_stopping_text), None)
    parser, template = configured_options(model.models, fe.model_dir)
    return (OpenAIResource(pipeline, CompletionsCodec(*args, max_n=max_n, adapters=pipeline.adapters,
                                                      structured=pipeline.structured, cache_report=report)),
            OpenAIResource(pipeline, ChatCompletionsCodec(*args, model_dir=fe.model_dir, max_n=max_n,
                                                          adapters=pipeline.adapters, structured=pipeline.structured,
                                                          cache_report=report,
                                                          reasoning_parser=model.reasoning_parser,
                                                          enable_reasoning=enable, early_stopping_text=early,
                                                          tool_call_parser=parser, chat_template=template)))
