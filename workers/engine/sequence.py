"""A request as the engine sees it: tokens, progress, KV blocks and timing."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from mindie.protocol import SamplingParams


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(eq=False)
class Sequence:
    """One request inside a worker.

    ``tokens`` is prompt + generated ids. ``num_computed`` counts the tokens whose KV is
    in the cache; the tokens still to compute are ``tokens[num_computed:]`` (a whole
    prompt, a prefill chunk, or the last generated token during decode).
    """

    request_id: str
    frontend_id: str
    prompt_len: int
    tokens: list[int]
    params: SamplingParams
    max_new_tokens: int  # already capped by maxIterTimes and maxSeqLen
    priority: int = 5
    arrival: float = field(default_factory=time.time)
    deadline: float = 0.0
    order: int = 0  # arrival order inside this worker, ties broken by it
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached: int = 0  # prompt tokens served from the prefix cache at admission
    num_hashed_blocks: int = 0  # leading full blocks already registered in the prefix cache
    preemptions: int = 0
    enqueue_t: float = field(default_factory=time.perf_counter)
    last_token_t: float = 0.0
    finish_reason: str = ""
    sampler_state: object = None  # the sampler's per-request history (workers/engine/sampler.py)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: priority 1 first, then arrival."""
        return (self.priority, self.order)
