"""The engine: requests in, one batched step at a time, tokens out.

It owns the scheduler and the KV block manager and asks a runner (``ModelRunner`` for a
real model, ``NullRunner`` for the serving-stack benchmark) to compute the scheduled
tokens. It never touches sockets; the worker loop (workers/worker.py) feeds it.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Protocol

from mindie.protocol import FINISH_ABORT, FINISH_EOS, FINISH_LENGTH, RequestError, Submit
from workers.engine.block_manager import BlockManager
from workers.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from workers.engine.sequence import Sequence, Status

log = logging.getLogger("workers.engine")


@dataclass
class EngineConfig:
    num_blocks: int
    block_size: int = 128
    max_seq_len: int = 2560
    max_iter_times: int = 512
    max_batch_size: int = 200
    max_prefill_batch_size: int = 50
    max_prefill_tokens: int = 8192
    enable_prefix_cache: bool = True


@dataclass
class InFlight:
    """A launched step: its batch and the future of its sampled tokens."""

    batch: ScheduledBatch
    future: Future
    seqs: set[int]  # id() of the batch's sequences, for abort()


@dataclass
class StepOutput:
    seq: Sequence
    token_ids: list[int]
    finish_reason: str = ""
    prefill_ms: float = 0.0
    decode_ms: float = 0.0


class Runner(Protocol):
    """Computes one scheduled batch and returns the next token of every sequence whose
    computed tokens reach its end (``None`` for a prefill chunk that does not)."""

    vocab_size: int
    eos_token_ids: frozenset[int]

    def execute(self, batch: ScheduledBatch) -> list[int | None]: ...


class Engine:
    """``overlap``: run the model on a compute thread, so that the caller can take in jobs,
    encode and send the previous step's frames while the device (or, on CPU, torch's
    thread pool) computes: ``launch()``, other work, ``collect()``. Without it ``launch()``
    computes at once. ``step()`` is both in one call."""

    def __init__(self, runner: Runner, cfg: EngineConfig, overlap: bool = False,
                 thread_init: Callable[[], object] | None = None):
        """``thread_init`` runs once on the compute thread (device binding and torch's thread
        count are per thread: ``Backend.bind_thread``)."""
        self.runner = runner
        self.cfg = cfg
        self.overlap = overlap
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="engine-compute",
                                        initializer=thread_init) if overlap else None
        self._inflight: InFlight | None = None
        self._deferred: list[Sequence] = []  # aborted while their step computes: freed at collect
        self.blocks = BlockManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_cache)
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_batch_size, cfg.max_prefill_batch_size, cfg.max_prefill_tokens), self.blocks)
        self.requests: dict[str, Sequence] = {}
        self.steps = 0

    # -- intake ---------------------------------------------------------------------------
    def add(self, sub: Submit) -> Sequence | RequestError:
        """Queue a request, or say why it can never run."""
        n = len(sub.token_ids)
        if sub.request_id in self.requests:
            return RequestError(422, "Input Validation Error", f"Duplicate request id {sub.request_id}.")
        if n == 0:
            return RequestError(422, "Input Validation Error", "Inputs token length must be in (0, 1048576], but got 0")
        if n >= self.cfg.max_seq_len:
            return RequestError(424, "Generation Error",
                                f"Failed to enqueue inferRequest. This model's maximum input ids length cannot be "
                                f"greater than {self.cfg.max_seq_len - 1},the input ids length is {n}")
        if max(sub.token_ids) >= self.runner.vocab_size or min(sub.token_ids) < 0:
            return RequestError(424, "Generation Error", "Failed to enqueue inferRequest. Invalid Input Ids")
        max_new = max(1, min(sub.params.max_new_tokens, self.cfg.max_iter_times, self.cfg.max_seq_len - n))
        need = self.blocks.blocks_needed(n + max_new)
        if need > self.blocks.num_blocks:
            return RequestError(
                424, "Generation Error",
                f"Failed to enqueue inferRequest. The request needs {need} KV cache blocks "
                f"({n} input + {max_new} output tokens) but the cache holds only {self.blocks.num_blocks} blocks "
                f"of {self.cfg.block_size} tokens")
        seq = Sequence(request_id=sub.request_id, frontend_id=sub.frontend_id, prompt_len=n,
                       tokens=list(sub.token_ids), params=sub.params, max_new_tokens=max_new,
                       priority=sub.priority, arrival=sub.arrival or time.time(), deadline=sub.deadline)
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        """Cancel a request and free its blocks now; unknown ids are ignored."""
        seq = self.requests.pop(request_id, None)
        if seq is not None:
            seq.finish_reason = FINISH_ABORT
            if self._inflight is not None and id(seq) in self._inflight.seqs:
                self._deferred.append(seq)  # the compute thread may still read its block table
            else:
                self.scheduler.remove(seq)
        return seq

    def expire(self, now: float) -> list[Sequence]:
        """Abort requests past their deadline."""
        late = [s for s in self.requests.values() if s.deadline and s.deadline < now]
        for seq in late:
            self.abort(seq.request_id)
        return late

    # -- state ----------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    # -- one step -------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        f = self.launch()
        return self.collect(f) if f is not None else []

    def launch(self, before: Callable[[], object] | None = None) -> InFlight | None:
        """Schedule the next step and start computing it (``before`` runs first, on the thread
        that computes: torch's thread count is per thread). None when nothing can run."""
        if self._inflight is not None:
            raise RuntimeError("a step is already in flight: collect() it first")
        batch = self.scheduler.schedule()
        if batch.empty:
            return None
        self.steps += 1

        def compute() -> list[int | None]:
            if before is not None:
                before()
            return self.runner.execute(batch)

        if self._pool is not None:
            future = self._pool.submit(compute)
        else:
            future = Future()
            try:
                future.set_result(compute())
            except Exception as e:  # raised again by collect(), as the threaded path does
                future.set_exception(e)
        self._inflight = InFlight(batch, future, {id(s) for s in batch.seqs})
        return self._inflight

    def collect(self, f: InFlight) -> list[StepOutput]:
        """Wait for a launched step and turn its tokens into outputs (finishing sequences)."""
        try:
            sampled = f.future.result()
        finally:
            self._inflight = None
            for seq in self._deferred:
                self.scheduler.remove(seq)
            self._deferred.clear()
        batch = f.batch
        now = time.perf_counter()
        outputs: list[StepOutput] = []
        for seq, n, tok in zip(batch.seqs, batch.num_tokens, sampled):
            if seq.finish_reason == FINISH_ABORT:
                continue  # cancelled while it computed
            seq.num_computed += n
            self.blocks.register_computed(seq)
            if tok is None:
                continue
            first = seq.num_output == 0
            seq.tokens.append(tok)
            out = StepOutput(seq, [tok])
            if first:
                out.prefill_ms = (now - seq.enqueue_t) * 1000.0
            else:
                out.decode_ms = (now - seq.last_token_t) * 1000.0
            seq.last_token_t = now
            if tok in self.runner.eos_token_ids and not seq.params.ignore_eos:
                out.finish_reason = FINISH_EOS
            elif seq.num_output >= seq.max_new_tokens or seq.num_tokens >= self.cfg.max_seq_len:
                out.finish_reason = FINISH_LENGTH
            if out.finish_reason:
                seq.finish_reason = out.finish_reason
                self.requests.pop(seq.request_id, None)
                self.scheduler.remove(seq)
            outputs.append(out)
        return outputs

    def check_no_leaks(self) -> bool:
        """True when no request is left and every block is free (used by tests)."""
        return (not self.requests and self._inflight is None and self.blocks.num_free == self.blocks.num_blocks
                and all(b.ref_count == 0 for b in self.blocks.blocks))

    def close(self) -> None:
        """Stop the compute thread (after the step it may be computing)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)


__all__ = ["Engine", "EngineConfig", "InFlight", "StepOutput", "Runner", "Status"]
