"""A request as the engine sees it: tokens, progress, KV blocks and timing."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, overload

import numpy as np

from mindie.contract.wire import SamplingParams
from workers.engine.speculative import SpecStats


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class TokenIds:
    """Prompt + generated ids of one request, the only copy: a growable int64 numpy buffer.

    The engine uses it like a list (``append``, ``len``, indexing, slices and iteration give
    Python ints); ``array`` is a zero-copy view for the sampler (the repetition penalty reads
    it every step through ``torch.from_numpy``)."""

    __slots__ = ("_buf", "_n")

    def __init__(self, ids: list[int] | tuple[int, ...] | np.ndarray = (), capacity: int = 0) -> None:
        a = np.asarray(ids, dtype=np.int64).reshape(-1)
        self._n = len(a)
        self._buf = np.empty(max(capacity, self._n, 16), dtype=np.int64)
        self._buf[: self._n] = a

    @property
    def array(self) -> np.ndarray:
        """The ids as a view of the buffer (later appends do not show in it)."""
        return self._buf[: self._n]

    def append(self, token_id: int) -> None:
        if self._n == len(self._buf):
            self._buf = np.concatenate([self._buf, np.empty_like(self._buf)])
        self._buf[self._n] = token_id
        self._n += 1

    def tolist(self) -> list[int]:
        return self._buf[: self._n].tolist()

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return self._buf[: self._n][i].tolist()
        return int(self._buf[: self._n][i])

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def __eq__(self, other: object) -> bool:
        return self.tolist() == (other.tolist() if isinstance(other, TokenIds) else other)

    def __repr__(self) -> str:
        return f"TokenIds({self.tolist()})"


@dataclass(eq=False)
class Sequence:
    """One request inside a worker.

    ``tokens`` is prompt + generated ids (``TokenIds``; a list given to the constructor is
    converted), the request's one token history: the sampler reads it too (``token_ids``).
    ``num_computed`` counts the tokens whose KV is in the cache; the tokens still to compute
    are ``tokens[num_computed:]`` (a whole prompt, a prefill chunk, or the last generated
    token during decode).
    """

    request_id: str
    frontend_id: str
    prompt_len: int
    tokens: TokenIds  # a list[int] is accepted and converted
    params: SamplingParams
    max_new_tokens: int  # already capped by maxIterTimes and maxSeqLen
    priority: int = 5
    arrival: float = field(default_factory=time.time)
    order: int = 0  # arrival order inside this worker, ties broken by it
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    state_slot: int = -1  # a hybrid model's state pool slot (BlockManager.admit; -1: none held)
    # a prefix hit's state checkpoint (pool row) its slot starts from at its next step (-1: none)
    state_restore: int = -1
    num_cached: int = 0  # prompt tokens served from the prefix cache at admission
    num_hashed_blocks: int = 0  # leading full blocks already registered in the prefix cache
    preemptions: int = 0
    enqueue_t: float = field(default_factory=time.perf_counter)
    last_token_t: float = 0.0
    # Engine steps launched before it was added, and the step that gave its first output (0 =
    # none yet): which prompts came in one burst with it (Scheduler.hold_decodes).
    enqueue_step: int = 0
    first_token_step: int = 0
    finish_reason: str = ""
    user_id: str = ""  # the client's id (req-id header), what stopInfer names
    # With params.prompt_logprobs: log P(tokens[p + 1] | tokens[:p + 1]) for prompt positions
    # p = 0, 1, ... as prefill chunks compute them (complete at prompt_len - 1 values).
    prompt_logprobs: list[float] = field(default_factory=list)
    # A pooling request (params.pooling): the float32 sum of the pooled positions' hidden states so
    # far and how many prompt positions it covers (a recompute after preemption skips those).
    pool_sum: Any = None
    pool_upto: int = 0
    # The LoRA adapter it runs with (workers.engine.lora_manager.Adapter), None = the base model;
    # set while the request holds it (from Engine.add to its end).
    adapter: Any = None
    # Structured output (params.constraint): a Future of the compiled grammar while it compiles,
    # then the request's workers.engine.constraints.ConstraintState; None = unconstrained.
    grammar: Any = None
    # Tokens at the end of ``tokens`` that the grammar forced after the last sampled one
    # (jump-forward): emitted already, computed with it in its next step (a short chunk).
    forced_tail: int = 0
    # Tokens the grammar forced before the first step (after the prompt), in no output yet: they
    # lead the first one (computed in the prefill, with the prompt).
    unsent: list[int] = field(default_factory=list)
    # Speculative decoding (workers/engine/speculative.py): the tokens proposed for its next step
    # (set by the engine before scheduling, taken by the scheduler into ScheduledBatch.drafts), and
    # its counts and back-off state.
    draft: list[int] = field(default_factory=list)
    spec_stats: SpecStats = field(default_factory=SpecStats)

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, TokenIds):
            # Room for the whole output (max_new_tokens is capped by maxSeqLen): no regrowth.
            self.tokens = TokenIds(self.tokens, len(self.tokens) + min(self.max_new_tokens, 1 << 16))

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def token_ids(self) -> np.ndarray:
        """``tokens`` as an int64 numpy view, no copy (what the sampler reads)."""
        return self.tokens.array

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def num_output(self) -> int:
        """Generated tokens so far (also the sampler's draw index)."""
        return len(self.tokens) - self.prompt_len

    @property
    def decoding(self) -> bool:
        """Past its prompt with nothing but its last sampled token (and the tokens the grammar forced
        after it) to compute: a decode, whatever its token count."""
        return self.num_output > 0 and self.num_tokens - self.num_computed == 1 + self.forced_tail

    @property
    def cache_salt(self) -> int | None:
        """What the prefix cache's first block hash starts from: None for the base model, the
        adapter's registration for a LoRA request (its KV differs from the base model's)."""
        return None if self.adapter is None else self.adapter.salt

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: priority 1 first, then arrival."""
        return (self.priority, self.order)
