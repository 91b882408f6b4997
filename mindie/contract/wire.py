"""Wire protocol between front ends and device workers (ZeroMQ + msgspec msgpack). Every message is an
``array_like`` msgspec Struct with an integer tag, so a message encodes as a compact
msgpack array whose first element is the tag. Evolve messages only by appending fields
with defaults (older peers ignore trailing items, newer peers fill missing ones).

Sockets (see docs/design.md):
  front end PUSH  --Submit/Cancel/Hello-->  worker PULL   (one PUSH per worker)
  worker PUB      --[topic, FrameBatch|Welcome|Heartbeat]-->  front end SUB
The PUB topic is the front-end id for Welcome/FrameBatch, and ``HEARTBEAT_TOPIC`` for heartbeats.
"""
from __future__ import annotations

from typing import Union

import msgspec

from mindie.contract.errors import error_type

HEARTBEAT_TOPIC = b"\x00hb"


class Message(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """Base of every wire message."""


# Request defaults, defined once: every API family and the worker read these.
DEFAULT_MAX_NEW_TOKENS = 20  # MindIE's max_new_tokens when a request gives none
DEFAULT_PRIORITY = 5  # MindIE's priority when a request gives none (1 = first, 5 = last)


class Constraint(msgspec.Struct, array_like=True, gc=False, omit_defaults=True, frozen=True):
    """A structured-output constraint on a request's generated tokens (issue 29): the front end
    builds it from whatever field its API uses (mindie/text/structured.py), the worker compiles it
    (cached by content) and masks the constrained rows' logits in the sampler.

    ``kind`` and ``spec``:
      "json_schema"  spec = the JSON Schema, as JSON text
      "json_object"  spec = "" (any JSON object)
      "regex"        spec = the regular expression (the whole output must match it)
      "choice"       spec = a JSON list of strings (the output is exactly one of them)
      "lark"         spec = a grammar in llguidance's Lark syntax
      "gbnf"         spec = a grammar in llama.cpp's GBNF
    """

    kind: str
    spec: str = ""


CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "lark", "gbnf")


class SamplingParams(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """Per-request sampling parameters; the defaults mean greedy decoding."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0
    watermark: bool = False
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    ignore_eos: bool = False
    stop_token_ids: list[int] = []  # a sampled id in this list ends the request (FINISH_STOP_TOKEN)
    logprobs: int = -1  # -1: none; 0: each sampled token's log-probability; k (<= 20): also the top k
    presence_penalty: float = 0.0  # OpenAI: subtracted once from the logit of every id already generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the generated ids
    prompt_logprobs: bool = False  # the first frame carries the log-probability of each prompt token
    constraint: Constraint | None = None  # structured output: every generated token must keep it satisfiable
    # Embeddings (issue 54): a pooling request computes its prompt only, samples nothing and ends
    # with its pooled final hidden state (TokenFrame.embedding). "" = generate; else POOLING_KINDS.
    pooling: str = ""
    # Rerank and score (issue 54) with pooling "score": the last position's logits at these ids (a
    # decoder reranker's "no" and "yes"); empty: every logit of the model's head (a sequence-
    # classification model's num_labels).
    score_tokens: list[int] = []


# How a pooling request reduces its prompt's final hidden states (after the final norm) to one
# vector: their mean, the last position's, the first position's (CLS). The worker pools only;
# normalising and truncating (Matryoshka ``dimensions``) are the front end's (mindie/api/embeddings.py).
# "score": the last position's logits through the model's head (``score_tokens``), which the front
# end turns into a relevance score (mindie/api/rerank.py).
POOLING_KINDS = ("mean", "last", "cls", "score")


class PdOrder(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A request's part in prefill/decode disaggregation (the X-Mindie-PD header, mindie/contract/pd.py):
    ``op`` "prefill" (compute the prompt, push its KV blocks to ``kv_endpoint``, the decode worker's)
    or "decode" (wait for transfer ``transfer_id`` at this worker's ``kv_endpoint``, then continue).
    ``kv_server_key``: the decode worker's CURVE public key (Z85) for a tcp endpoint ("" = the
    prefill worker's own workers' key: one fleet, one key directory)."""

    op: str
    transfer_id: str
    kv_endpoint: str
    kv_server_key: str = ""


class Submit(Message, tag=1):
    """A new request for a worker."""

    request_id: str
    frontend_id: str
    token_ids: list[int]
    params: SamplingParams
    priority: int = DEFAULT_PRIORITY
    arrival: float = 0.0  # wall-clock epoch seconds when the front end accepted it
    user_id: str = ""  # the client's id (req-id header): what stopInfer names; need not be unique
    adapter: str = ""  # the LoRA adapter the request runs with ("" = the base model)
    pd: PdOrder | None = None  # prefill/decode disaggregation (workers/pd_transfer.py); None = hybrid


class Cancel(Message, tag=2):
    """Abort requests (client gone, timeout). Unknown ids are ignored."""

    frontend_id: str
    request_ids: list[str]


class Hello(Message, tag=3):
    """Front-end liveness, sent every ``HELLO_INTERVAL_S`` to every worker.

    ``want_welcome`` asks the worker to (re)send ``Welcome``: the front end has not yet
    seen one, so its subscription is not proven live.
    """

    frontend_id: str
    pid: int
    want_welcome: bool = True


class Stop(Message, tag=7):
    """stopInfer: end every request whose ``user_id`` is ``user_id`` at once (its owner gets a
    final frame). The worker answers ``Stopped`` with ``token`` on the asker's topic."""

    frontend_id: str  # the asker
    user_id: str
    token: str


class LoadAdapter(Message, tag=9):
    """/v1/load_lora_adapter: register the peft LoRA adapter at ``path`` as ``name``. Every worker
    answers ``AdapterAnswer`` with ``token`` on the asker's topic once it has read it (or refused)."""

    frontend_id: str  # the asker
    token: str
    name: str
    path: str


class UnloadAdapter(Message, tag=10):
    """/v1/unload_lora_adapter: the name goes at once, the requests in flight on it finish on it.
    Answered at once with ``AdapterAnswer``."""

    frontend_id: str
    token: str
    name: str


class AdapterAnswer(Message, tag=11):
    """A worker's answer to ``LoadAdapter`` or ``UnloadAdapter``: an HTTP status and MindIE's message."""

    worker_id: str
    frontend_id: str
    token: str
    status: int
    message: str


class AdapterInfo(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A LoRA adapter requests may name (``Heartbeat.adapters``)."""

    name: str
    path: str


class Welcome(Message, tag=4):
    """Answer to Hello on the front end's topic. ``seq`` is the last frame sequence sent
    to that front end; the next FrameBatch carries ``seq + 1``."""

    worker_id: str
    instance: str  # random per worker process start: a change means a restarted worker
    frontend_id: str
    seq: int
    # The model as the worker parsed it (ModelArgs), for the front end's request checks; new
    # fields go last with defaults so peers of either version decode each other. 0 = unknown.
    vocab_size: int = 0
    max_position_embeddings: int = 0


class RequestError(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """Why a request ended with an error; status/error_type as MindIE reports them."""

    status: int
    error_type: str
    message: str


def request_error(status: int, message: str) -> RequestError:
    """A RequestError with MindIE's error type for ``status``."""
    return RequestError(status, error_type(status), message)


class TokenFrame(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """What one engine step produced for one request."""

    request_id: str
    token_ids: list[int] = []
    finish_reason: str = ""  # "" while running
    prefill_ms: float = 0.0  # set on the first frame of a request
    decode_ms: float = 0.0  # ms since this request's previous token
    error: Union[RequestError, None] = None
    # With SamplingParams.logprobs >= 0: one entry per id of token_ids, from the distribution the
    # sampler drew from; with logprobs = k > 0 also the k most likely (id, logprob), best first.
    logprobs: list[float] = []
    top_logprobs: list[list[tuple[int, float]]] = []
    # With SamplingParams.prompt_logprobs, on the first frame: log P(prompt[i] | prompt[:i]) for
    # i = 1 .. len(prompt) - 1 (the first prompt token has none).
    prompt_logprobs: list[float] = []
    # Speculative decoding in this step (workers/engine/speculative.py): tokens proposed and accepted.
    spec_draft: int = 0
    spec_accepted: int = 0
    # A pooling request's (SamplingParams.pooling) only frame: its pooled hidden state, float32
    # little-endian bytes (compact on the wire; the front end reads them with numpy).
    embedding: bytes = b""
    # On the first frame: prompt tokens whose KV came from the prefix cache (usage's cached_tokens).
    cached_tokens: int = 0


class FrameBatch(Message, tag=5):
    """All frames of one engine step for one front end."""

    worker_id: str
    instance: str
    seq: int
    frames: list[TokenFrame]


class Heartbeat(Message, tag=6):
    """Worker load, published every ``HEARTBEAT_INTERVAL_S`` on HEARTBEAT_TOPIC."""

    worker_id: str
    instance: str
    device: str
    pid: int
    model_name: str
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    preempted: int = 0
    prefix_hit_rate: float = 0.0
    block_size: int = 0
    steps: int = 0
    ready: bool = True  # False: the worker's last heartbeat (it is stopping; its requests got 503 frames)
    max_batch_size: int = 0  # slots (ScheduleConfig.maxBatchSize)
    prompt_tokens: int = 0  # prompt tokens computed since the worker started (recomputes included)
    generated_tokens: int = 0  # tokens sampled since the worker started
    ttft_ms: float = 0.0  # mean time to first token (arrival to first token) of the last 1000 requests
    tbt_ms: float = 0.0  # mean time between tokens of the last 1000 decode tokens
    swapped: int = 0  # preempted requests waiting to be recomputed
    decode_holds: int = 0  # steps that held the running requests' decodes for prompts (decodeHoldMs)
    adapters: list[AdapterInfo] = []  # LoRA adapters registered and not being unloaded
    kv_held: int = 0  # KV blocks held for transfers (workers/pd_transfer.py), both directions
    kv_transfers: int = 0  # transfers in progress (sent, received, or decode requests waiting for one)
    # Speculative decoding since the worker started: verify steps with a proposal, tokens proposed,
    # tokens accepted, and accepted counts by position in the proposal (vLLM's spec_decode counters).
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    # Seconds since the worker's engine was built (its counters' 0): a front end that first hears
    # a worker minutes after it started counts the tokens of its first seconds too.
    uptime_s: float = 0.0


class Stopped(Message, tag=8):
    """A worker's answer to ``Stop``: how many requests it ended."""

    worker_id: str
    frontend_id: str
    token: str
    found: int


JobMessage = Union[Submit, Cancel, Hello, Stop, LoadAdapter, UnloadAdapter]
PubMessage = Union[Welcome, FrameBatch, Heartbeat, Stopped, AdapterAnswer]

HELLO_INTERVAL_S = 0.5
HEARTBEAT_INTERVAL_S = 0.25
# A worker not heard from for this long is dead for a front end; a front end whose Hellos
# stop for FRONTEND_TIMEOUT_S is dead for a worker.
WORKER_TIMEOUT_S = 3.0
FRONTEND_TIMEOUT_S = 5.0

_encoder = msgspec.msgpack.Encoder()
_job_decoder = msgspec.msgpack.Decoder(JobMessage)
_pub_decoder = msgspec.msgpack.Decoder(PubMessage)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode_job(data: bytes) -> JobMessage:
    return _job_decoder.decode(data)


def decode_pub(data: bytes) -> PubMessage:
    return _pub_decoder.decode(data)
