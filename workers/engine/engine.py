"""The engine: requests in, one batched step at a time, tokens out.

It owns the scheduler and the KV block manager and asks a runner (``ModelRunner`` for a
real model, ``NullRunner`` for the serving-stack benchmark) to compute the scheduled
tokens. It never touches sockets; the worker loop (workers/worker.py) feeds it.
"""
from __future__ import annotations

import collections
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

import numpy as np

from mindie.contract.errors import (FINISH_ABORT, FINISH_EOS, FINISH_LENGTH, FINISH_POOLED, FINISH_STOP_TOKEN,
                                   UnknownAdapterError)
from mindie.contract.grammar import ERROR_STATUS, ConstraintError
from mindie.contract.spec import EngineConfig
from mindie.contract.wire import POOLING_KINDS, Submit
from workers.engine.block_manager import BlockManager
from workers.engine.constraints import ConstraintState, Grammars, MaskJob
from workers.engine.lora_manager import Answer, LoraManager
from workers.engine.scheduler import ScheduledBatch, Scheduler
from workers.engine.sequence import Sequence, Status
from workers.engine.speculative import Controller

log = logging.getLogger("workers.engine")


HYBRID_SPEC_REFUSAL = ("a hybrid linear-attention model (Qwen3-Next / Qwen3.5) keeps no states for verify rows "
                       "(speculationMaxBatch x speculationGamma state scratch rows: 0)")


class CapacityError(ValueError):
    """A request that can never run on this worker (its KV blocks exceed the whole cache)."""


class ConstraintRefused(ValueError):
    """A request whose constraint this worker cannot enforce (``ConstraintError``'s message): a 400."""

    status = ERROR_STATUS



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
    # What the request asked for (SamplingParams.logprobs / prompt_logprobs; wire.TokenFrame):
    logprobs: list[float] = field(default_factory=list)  # one per id of token_ids
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # k best per id
    prompt_logprobs: list[float] = field(default_factory=list)  # on the first output only
    embedding: bytes = b""  # a pooling request's pooled hidden state, float32 little-endian (wire.TokenFrame)
    error: str = ""  # the request failed (a LoRA adapter that could not be read): the message
    error_status: int = 424  # and its HTTP status (400: its constraint, workers/engine/constraints.py)
    spec_draft: int = 0  # speculative decoding: tokens proposed for this step
    spec_accepted: int = 0  # and accepted
    cached_tokens: int = 0  # on the first output: prompt tokens the prefix cache served (Sequence.num_cached)


class RunnerOutput(list):
    """What ``Runner.execute`` returns: the next token of each sequence of the batch (None for a
    prefill chunk that does not reach its end), plus, by batch index, the log-probabilities that
    requests asked for: ``logprobs[i] = (the token's, [(id, logprob)] k best)`` and
    ``prompt_logprobs[i] = (p0, values)``, the values of positions p0, p0 + 1, ... (position p:
    log P(prompt[p + 1] | prompt[:p + 1])). A plain list is accepted from a runner too."""

    def __init__(self, tokens: Iterable[int | None] = ()) -> None:
        super().__init__(tokens)
        self.logprobs: dict[int, tuple[float, list[tuple[int, float]]]] = {}
        self.prompt_logprobs: dict[int, tuple[int, list[float]]] = {}
        # Speculative decoding, by batch index of a sequence that verified k proposed tokens: the
        # k + 1 tokens sampled at its rows (the first is also self[i]), and their log-probabilities.
        self.verified: dict[int, list[int]] = {}
        self.verified_logprobs: dict[int, list[tuple[float, list[tuple[int, float]]]]] = {}
        # Pooling requests (SamplingParams.pooling), by batch index: (the chunk's first position, its
        # part of the pooled vector: model_runner.pool_part, a float32 array or None).
        self.pooled: dict[int, tuple[int, object]] = {}


class Runner(Protocol):
    """Computes one scheduled batch and returns the next token of every sequence whose
    computed tokens reach its end (``None`` for a prefill chunk that does not), as a
    ``RunnerOutput`` (or a plain list when it computes no log-probabilities)."""

    vocab_size: int
    eos_token_ids: frozenset[int]

    def execute(self, batch: ScheduledBatch) -> list[int | None]: ...


class RecentMean:
    """The mean of the last ``size`` values, O(1) per value and per read: a heartbeat after every
    step reads it, from the loop thread or the heartbeat thread, without copying the window."""

    def __init__(self, size: int):
        self.values: collections.deque[float] = collections.deque(maxlen=size)
        self.total = 0.0
        self._adds = 0

    def add(self, value: float) -> None:
        if len(self.values) == self.values.maxlen:
            self.total -= self.values[0]
        self.values.append(value)
        self._adds += 1
        if self._adds % self.values.maxlen == 0:
            self.total = sum(self.values)  # no drift from the running subtractions
        else:
            self.total += value

    @property
    def mean(self) -> float:
        n = len(self.values)
        return self.total / n if n else 0.0


class Engine:
    """With ``cfg.overlap`` the model runs on a compute thread, so that the caller can take in
    jobs, encode and send the previous step's frames while the device (or, on CPU, torch's
    thread pool) computes: ``launch()``, other work, ``collect()``. Without it ``launch()``
    computes at once. ``step()`` is both in one call.

    Requests arrive validated by the front end (mindie/text/validation.py: lengths, ids, the
    output budget); the engine only refuses what it alone can know (``CapacityError``)."""

    def __init__(self, runner: Runner, cfg: EngineConfig, num_blocks: int,
                 thread_init: Callable[[], object] | None = None):
        """``thread_init`` runs once on the compute thread (device binding and torch's thread
        count are per thread: ``Backend.bind_thread``)."""
        if missing := [n for n in cfg.unsettled() if not n.startswith("cpu.")]:  # a plan not settled
            raise ValueError(f"EngineConfig not settled (workers.prepare): {', '.join(missing)} is None")
        self.runner = runner
        self.cfg = cfg
        self.overlap = cfg.overlap
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="engine-compute",
                                        initializer=thread_init) if self.overlap else None
        self._inflight: InFlight | None = None
        self._deferred: list[Sequence] = []  # aborted while their step computes: freed at collect
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_cache)
        if state_slots := getattr(runner, "state_slots", 0):  # a hybrid model's state pool (one slot a sequence)
            self.blocks.enable_states(state_slots, getattr(runner, "state_checkpoints", 0))
        self.scheduler = Scheduler(cfg, self.blocks)
        self.requests: dict[str, Sequence] = {}
        # LoRA adapters (workers/engine/lora_manager.py), set by the assembly; None = none served.
        self.lora: LoraManager | None = None
        # Structured output (workers/engine/constraints.py), set by the assembly; None = constraints
        # refused. Requests whose grammar compiles wait here, outside the scheduler.
        self.grammars: Grammars | None = None
        self._compiling: list[Sequence] = []
        # Called with a sequence just before it ends and its blocks are released (finished or aborted):
        # a KV transfer (workers/pd_transfer.py) holds the blocks it has yet to send. None = none.
        self.finish_hook: Callable[[Sequence], None] | None = None
        self.forced_tokens = 0  # tokens emitted without a model step (jump-forward)
        self.steps = 0
        self.prompt_tokens = 0  # prompt tokens computed (prefill chunks, recomputes included)
        self.generated_tokens = 0
        # Means of the last 1000 first-token and between-token times (ms), for /metrics-json.
        self.ttft_ms = RecentMean(1000)
        self.tbt_ms = RecentMean(1000)
        # Speculative decoding (workers/engine/speculative.py): only with a runner that verifies
        # proposals (ModelRunner; the null model's tokens are no model's).
        # A hybrid model speculates where its runner keeps the verify rows' states (state scratch).
        hybrid = bool(state_slots) and not getattr(runner, "state_scratch", 0)
        self.speculator = Controller(cfg.spec_method if getattr(runner, "verifies_drafts", False) and not hybrid else "",
                               cfg.spec_tokens, cfg.spec_lookup_min, cfg.spec_lookup_max, cfg.spec_max_batch,
                               cfg.spec_min_acceptance, max_stretch=cfg.spec_max_stretch)
        if getattr(runner, "spec_row_cost", None) is not None:  # the backend's figure for the model
            self.speculator.row_cost = runner.spec_row_cost
        why_off = ("ScheduleConfig.speculativeDecoding: false" if not cfg.spec_method else
                   HYBRID_SPEC_REFUSAL if hybrid else
                   "the null model runs no model to verify proposals" if not self.speculator.enabled else
                   "ScheduleConfig.speculationMaxBatch: 0" if cfg.spec_max_batch == 0 else "")
        log.info("speculative decoding: %s", f"off ({why_off})" if why_off else self.speculator.describe())

    # -- intake ---------------------------------------------------------------------------
    def add(self, sub: Submit) -> Sequence:
        """Queue a request; ``CapacityError`` when its blocks exceed the whole cache."""
        n = len(sub.token_ids)
        max_new = sub.params.max_new_tokens
        assert sub.request_id not in self.requests, f"duplicate request id {sub.request_id}"
        assert 0 < n and 0 < max_new and n + max_new <= self.cfg.max_seq_len, \
            f"{n} input + {max_new} output tokens exceed maxSeqLen {self.cfg.max_seq_len}"
        assert not sub.params.pooling or sub.params.pooling in POOLING_KINDS, f"unknown pooling {sub.params.pooling!r}"
        assert 0 <= min(sub.token_ids) and max(sub.token_ids) < self.runner.vocab_size, \
            f"an input id is outside the vocabulary [0, {self.runner.vocab_size})"
        need = self.blocks.blocks_needed(n + max_new)
        if need > self.blocks.num_blocks:
            raise CapacityError(
                f"Failed to enqueue inferRequest. The request needs {need} KV cache blocks "
                f"({n} input + {max_new} output tokens) but the cache holds only {self.blocks.num_blocks} blocks "
                f"of {self.cfg.block_size} tokens")
        seq = Sequence(request_id=sub.request_id, frontend_id=sub.frontend_id, prompt_len=n,
                       tokens=list(sub.token_ids), params=sub.params, max_new_tokens=max_new,
                       priority=sub.priority, arrival=sub.arrival or time.time(), user_id=sub.user_id,
                       enqueue_step=self.steps)
        if sub.params.constraint is not None:
            seq.grammar = self._compile(sub)  # before the adapter: a refused constraint holds nothing
            if not isinstance(seq.grammar, Future):
                self._jump_first(seq)
        if sub.adapter:
            if self.lora is None:
                raise UnknownAdapterError(sub.adapter)
            schedulable = self.lora.acquire(seq, sub.adapter)  # UnknownAdapterError when not served
        else:
            schedulable = True
        self.requests[seq.request_id] = seq
        if isinstance(seq.grammar, Future):
            self._compiling.append(seq)  # poll_constraints schedules it once its grammar is compiled
        elif schedulable:  # else it waits for its adapter's tensors: poll_lora schedules it
            self.scheduler.add(seq)
        return seq

    def _compile(self, sub: Submit) -> ConstraintState | Future:
        """A new request's constraint: its state when the grammar is cached, else the compile's
        future. ``ConstraintRefused`` when it is known to fail (a cached error, no grammar support)."""
        if self.grammars is None:
            raise ConstraintRefused("this device worker does not enforce constraints (no grammar support: "
                                    "llguidance or the model's tokenizer.json is missing)")
        fut = self.grammars.compile(sub.params.constraint)
        if not fut.done():
            return fut
        try:
            return self.grammars.state(fut.result(), sub.params.stop_token_ids)
        except ConstraintError as e:
            raise ConstraintRefused(str(e)) from None

    def _jump_first(self, seq: Sequence) -> None:
        """Jump-forward before the first step: the tokens the grammar forces at the start follow the
        prompt into its prefill (so the first step samples the first free token), and lead the first
        output. At least one token is left to sample."""
        if self.cfg.jump_forward and seq.num_output == 0:
            forced = seq.grammar.jump(seq.max_new_tokens - 1, first=True)
            for f in forced:
                seq.tokens.append(f)
            seq.unsent = forced
            self.generated_tokens += len(forced)
            self.forced_tokens += len(forced)

    @property
    def grammar_busy(self) -> bool:
        """Grammars compiling for waiting requests (the worker loop polls for them more often)."""
        return bool(self._compiling)

    def poll_constraints(self) -> list[StepOutput]:
        """Between steps: the requests whose grammar compiled are scheduled (unless they still wait
        for their LoRA adapter); those whose constraint failed to compile are ended: an output with
        ``error`` (status 400) for each."""
        if not self._compiling:
            return []
        outs: list[StepOutput] = []
        still: list[Sequence] = []
        for seq in self._compiling:
            if self.requests.get(seq.request_id) is not seq:
                continue  # cancelled while it compiled
            if not seq.grammar.done():
                still.append(seq)
                continue
            try:
                seq.grammar = self.grammars.state(seq.grammar.result(), seq.params.stop_token_ids)
                self._jump_first(seq)
            except Exception as e:  # noqa: BLE001  (ConstraintError; anything else is the library's)
                self.requests.pop(seq.request_id, None)
                self._release_adapter(seq)
                seq.finish_reason = FINISH_ABORT
                why = str(e) if isinstance(e, ConstraintError) else f"constraint could not be compiled: {e}"
                outs.append(StepOutput(seq, [], FINISH_ABORT, error=why, error_status=ERROR_STATUS))
                continue
            if seq.adapter is None or seq not in seq.adapter.parked:
                self.scheduler.add(seq)
        self._compiling = still
        return outs

    def with_user_id(self, user_id: str) -> list[Sequence]:
        """The requests that the client named ``user_id`` (stopInfer)."""
        return [seq for seq in self.requests.values() if seq.user_id == user_id]

    def abort(self, request_id: str) -> Sequence | None:
        """Cancel a request and free its blocks now; unknown ids are ignored."""
        seq = self.requests.pop(request_id, None)
        if seq is not None:
            seq.finish_reason = FINISH_ABORT
            if self.finish_hook is not None:
                self.finish_hook(seq)
            if self._inflight is not None and id(seq) in self._inflight.seqs:
                self._deferred.append(seq)  # the compute thread may still read its block table
            else:
                self.scheduler.remove(seq)
            self._release_adapter(seq)
        return seq

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.adapter is not None and self.lora is not None:
            self.lora.release(seq)

    @property
    def lora_busy(self) -> bool:
        """LoRA reads in progress (the worker loop polls for them more often)."""
        return self.lora is not None and self.lora.busy

    def poll_lora(self) -> tuple[list[Answer], list[StepOutput]]:
        """Between steps: adapters whose tensors were read swapped in (their waiting requests
        scheduled). Returns the answers to load requests, and an output with ``error`` set for
        each request whose adapter could not be read."""
        if self.lora is None:
            return [], []
        answers, ready, failed = self.lora.poll()
        for seq in ready:
            if seq.request_id in self.requests and not isinstance(seq.grammar, Future):
                self.scheduler.add(seq)  # (one still compiling its grammar: poll_constraints)
        outs = []
        for seq, why in failed:
            if self.requests.pop(seq.request_id, None) is not None:
                self.lora.release(seq)
                seq.finish_reason = FINISH_ABORT
                outs.append(StepOutput(seq, [], error=why))
        return answers, outs

    # -- state ----------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        """Waiting to be scheduled, including requests waiting for their LoRA adapter's tensors or
        their grammar's compile."""
        parked = self.lora.num_parked if self.lora is not None else 0
        compiling = sum(1 for s in self._compiling if s.adapter is None or s not in s.adapter.parked)
        return self.scheduler.num_waiting + parked + compiling

    @property
    def num_swapped(self) -> int:
        """Preempted requests waiting to be recomputed (MindIE's "swapped": there is no swap space
        here, a preempted request's KV is dropped and recomputed)."""
        return sum(1 for _, seq in self.scheduler.waiting if seq.preemptions)

    # -- one step -------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One step, in-process users' way (tests, benchmarks): grammars compiled since the last
        step joined first (``poll_constraints``: its failures are outputs too), then launch and
        collect. The worker loop calls those itself."""
        outs = self.poll_constraints()
        f = self.launch()
        return outs + self.collect(f) if f is not None else outs

    def launch(self, before: Callable[[int], object] | None = None,
               after: Callable[[], object] | None = None) -> InFlight | None:
        """Schedule the next step and start computing it. ``before(tokens)`` runs first and
        ``after()`` once the step is computed, both on the thread that computes (torch's thread
        count is per thread). None when nothing can run."""
        if self._inflight is not None:
            raise RuntimeError("a step is already in flight: collect() it first")
        proposed = self.speculator.enabled and self._propose()
        batch = self.scheduler.schedule()
        if proposed:
            for seq in self.scheduler.running:
                seq.draft = []  # not scheduled this step (a held decode, no budget): proposed afresh next time
        if batch.empty:
            return None
        try:
            return self._start(batch, before, after)
        except BaseException:
            self.blocks.unpin(batch.block_copies)  # never started: collect() will not unpin them
            raise

    def _start(self, batch: ScheduledBatch, before: Callable[[int], object] | None,
               after: Callable[[], object] | None) -> InFlight:
        """Launch's second half: the step's plans and masks, then its computation started."""
        self.steps += 1
        if self.blocks.free_states is not None:  # a hybrid model: restores and checkpoints of the step
            batch.state_plans = [self.blocks.plan_states(s, 0 if batch.drafts and batch.drafts[i] else n)
                                 for i, (s, n) in enumerate(zip(batch.seqs, batch.num_tokens))]
        # Constrained rows sampled this step: their masks computed on the mask thread beside the step.
        drafts = batch.drafts
        constrained = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_tokens))
                       if s.grammar is not None and s.num_computed + n - (len(drafts[i]) if drafts else 0) == s.num_tokens]
        if constrained and drafts is not None:
            # The masks of the rows after each proposed token (speculative decoding), made here on the
            # loop thread before the mask thread takes the matchers for the first rows.
            batch.draft_masks = {i: batch.seqs[i].grammar.draft_masks(drafts[i]) for i in constrained if drafts[i]}
        if constrained:
            batch.masks = (constrained, self.grammars.masks([batch.seqs[i].grammar for i in constrained]))
        if self.lora is not None and any(s.adapter is not None for s in batch.seqs):
            # A scheduled request's adapter is resident and stays so while it runs (it holds a reference).
            batch.adapters = [None if s.adapter is None else s.adapter.weights for s in batch.seqs]
            assert None not in (batch.adapters[i] for i, s in enumerate(batch.seqs) if s.adapter is not None), \
                "a LoRA request was scheduled before its adapter was resident"

        def compute() -> list[int | None]:
            if before is not None:
                before(sum(batch.num_tokens))
            try:
                return self.runner.execute(batch)
            finally:
                if after is not None:
                    after()

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

    def _propose(self) -> bool:
        """Proposals for this step's decoding requests (the scheduler takes them into the batch
        where its budget and free blocks allow). None in steps with more running requests than
        ``spec_max_batch``: their verify rows would cost other requests' rows the cores. Constrained
        requests speculate too: their proposals are checked against the grammar (check_draft)."""
        running = self.scheduler.running
        if len(running) > self.speculator.max_batch:  # checked first: a large batch pays nothing per step
            return False
        self.speculator.begin_step(sum(1 for seq in running if seq.decoding))
        proposed = False
        for seq in running:
            if not seq.decoding or seq.forced_tail or (
                    seq.grammar is not None and not (isinstance(seq.grammar, ConstraintState) and not seq.grammar.error)):
                continue
            room = seq.max_new_tokens - seq.num_output - 1  # the token sampled after the proposal
            if room > 0:
                draft = self.speculator.propose(seq, room)
                if draft and seq.grammar is not None:
                    draft = seq.grammar.check_draft(draft)
                seq.draft = draft
                proposed = proposed or bool(draft)
        return proposed

    def _verified(self, seq: Sequence, draft: list[int], toks: list[int], lps: list | None,
                  now: float) -> StepOutput:
        """A sequence that verified ``draft``: the accepted prefix and the token sampled after it,
        emitted one by one as the non-speculative steps would (stopping at EOS, a stop id or the
        length); the KV of the rejected tokens dropped (their blocks freed: the prefix cache
        registers only computed tokens, and these are not)."""
        a = 0
        while a < len(draft) and toks[a] == draft[a]:
            a += 1
        self.speculator.record(seq, len(draft), a)
        out = StepOutput(seq, [], spec_draft=len(draft), spec_accepted=a)
        out.decode_ms = (now - seq.last_token_t) * 1000.0
        self.tbt_ms.add(out.decode_ms)
        seq.last_token_t = now
        for j in range(a + 1):
            tok = toks[j]
            seq.tokens.append(tok)
            self.generated_tokens += 1
            out.token_ids.append(tok)
            if lps is not None:
                lp, top = lps[j]
                out.logprobs.append(lp)
                if seq.params.logprobs > 0:
                    out.top_logprobs.append(top)
            out.finish_reason = self._finish_reason(seq, tok)
            if out.finish_reason:
                break
        # Computed now: the last sampled token and the emitted proposed ones (all but the last emitted).
        emitted = len(out.token_ids)
        if seq.state_slot >= 0:  # a hybrid model: its state after the last computed row (state scratch)
            self.runner.rollback_state(seq.state_slot, emitted, len(draft) + 1)
        seq.num_computed += emitted
        self.blocks.trim(seq)
        self.blocks.register_computed(seq)
        if seq.grammar is not None and not out.finish_reason:
            # The matcher over the emitted tokens (the proposal was checked against it, and each
            # sampled one came from its mask), then jump-forward after the last one.
            for tok in out.token_ids[:-1]:
                seq.grammar.consume(tok)
            self._advance_grammar(seq, out.token_ids[-1], out)
        return out

    def collect(self, f: InFlight) -> list[StepOutput]:
        """Wait for a launched step and turn its tokens into outputs (finishing sequences)."""
        try:
            sampled = f.future.result()
        finally:
            self._inflight = None
            self.blocks.unpin(f.batch.block_copies)  # the partial hits' sources: copied (or the step failed)
            if f.batch.masks is not None:  # the matchers are the loop's again (a failed step may not have waited)
                try:
                    f.batch.masks[1].wait()
                except Exception:  # noqa: BLE001  (reported by the step, or by the row below)
                    pass
            for seq in self._deferred:
                self.scheduler.remove(seq)  # (their adapters were released at abort)
            self._deferred.clear()
        batch = f.batch
        now = time.perf_counter()
        outputs: list[StepOutput] = []
        token_lps = getattr(sampled, "logprobs", None)
        prompt_lps = getattr(sampled, "prompt_logprobs", None)
        verified = getattr(sampled, "verified", None)
        pooled = getattr(sampled, "pooled", None)
        for i, (seq, n, tok) in enumerate(zip(batch.seqs, batch.num_tokens, sampled)):
            if seq.finish_reason == FINISH_ABORT:
                continue  # cancelled while it computed
            if verified and i in verified:
                out = self._verified(seq, batch.drafts[i], verified[i], sampled.verified_logprobs.get(i), now)
                if out.finish_reason:
                    self._retire(seq, out.finish_reason)
                outputs.append(out)
                continue
            if prompt_lps and i in prompt_lps:
                p0, vals = prompt_lps[i]
                have = len(seq.prompt_logprobs)
                if p0 <= have < p0 + len(vals):  # contiguous; positions already known are kept
                    seq.prompt_logprobs.extend(vals[have - p0:])
            if not seq.decoding and (seq.num_output == 0 or n > 1 or seq.num_computed + n < len(seq.tokens)):
                self.prompt_tokens += n  # a prefill chunk, or a recompute after preemption
            seq.num_computed += n
            self.blocks.register_computed(seq)
            if pooled and i in pooled:
                if (out := self._pool_chunk(seq, *pooled[i], now)) is not None:
                    outputs.append(out)
                continue
            if tok is None:
                continue
            first = seq.last_token_t == 0.0  # its first output
            seq.tokens.append(tok)
            seq.forced_tail = 0
            self.generated_tokens += 1
            out = StepOutput(seq, seq.unsent + [tok]) if seq.unsent else StepOutput(seq, [tok])
            if first:
                seq.first_token_step = self.steps  # the step collected (one in flight at most)
                out.prefill_ms = (now - seq.enqueue_t) * 1000.0
                out.cached_tokens = seq.num_cached
                self.ttft_ms.add(out.prefill_ms)
            else:
                out.decode_ms = (now - seq.last_token_t) * 1000.0
                self.tbt_ms.add(out.decode_ms)
            seq.last_token_t = now
            if token_lps and i in token_lps:
                lp, top = token_lps[i]
                # (tokens forced before it: the only token of their masks, log-probability 0)
                out.logprobs = [0.0] * len(seq.unsent) + [lp]
                if seq.params.logprobs > 0:
                    out.top_logprobs = [[(f, 0.0)] for f in seq.unsent] + [top]
            seq.unsent = []
            if first and seq.params.prompt_logprobs:
                out.prompt_logprobs = list(seq.prompt_logprobs)
            out.finish_reason = self._finish_reason(seq, tok)
            if seq.grammar is not None and not out.finish_reason:
                self._advance_grammar(seq, tok, out)
            if out.finish_reason:
                self._retire(seq, out.finish_reason)
            outputs.append(out)
        return outputs

    def _retire(self, seq: Sequence, reason: str, learn: bool = True) -> None:
        """A sequence that finished in this step: its reason set, the speculator's memory taught
        (``learn``: a generated answer), the finish hook told, its blocks and adapter released."""
        seq.finish_reason = reason
        if learn and self.speculator.memory is not None:
            self.speculator.finished(seq)
        if self.finish_hook is not None:
            self.finish_hook(seq)
        self.requests.pop(seq.request_id, None)
        self.scheduler.remove(seq)
        self._release_adapter(seq)

    def _pool_chunk(self, seq: Sequence, p0: int, part, now: float) -> StepOutput | None:
        """A pooling request's chunk: its part added (a chunk at position 0 starts afresh: a
        recompute after preemption); the prompt's last chunk ends the request with the pooled
        vector (no token sampled, its blocks freed now)."""
        if p0 == 0:
            seq.pool_sum = None
        if part is not None:
            seq.pool_sum = part if seq.pool_sum is None or seq.params.pooling != "mean" else seq.pool_sum + part
        if seq.num_computed < seq.num_tokens:
            return None
        vec = seq.pool_sum / seq.num_tokens if seq.params.pooling == "mean" else seq.pool_sum
        out = StepOutput(seq, [], FINISH_POOLED, prefill_ms=(now - seq.enqueue_t) * 1000.0,
                         embedding=np.asarray(vec, dtype="<f4").tobytes())
        self.ttft_ms.add(out.prefill_ms)
        self._retire(seq, FINISH_POOLED, learn=False)  # nothing generated to learn from
        return out

    def _finish_reason(self, seq: Sequence, tok: int) -> str:
        """Why ``tok`` (just appended) ends ``seq``, or "". Checked in this order: an EOS id (unless
        ignore_eos; for a constrained request, whose mask allows its grammar's end tokens only once
        the grammar is complete, always), a stop id, the length."""
        if tok in self.runner.eos_token_ids and not seq.params.ignore_eos:
            return FINISH_EOS
        if seq.grammar is not None and tok in seq.grammar.eos:
            return FINISH_EOS
        if seq.params.stop_token_ids and tok in seq.params.stop_token_ids:
            return FINISH_STOP_TOKEN  # the stop id stays in the output (OpenAI/vLLM)
        if seq.num_output >= seq.max_new_tokens:  # within maxSeqLen (checked at add)
            return FINISH_LENGTH
        return ""

    def _advance_grammar(self, seq: Sequence, tok: int, out: StepOutput) -> None:
        """A constrained request's matcher over its sampled token, then (jump-forward) the tokens its
        grammar forces next appended to ``out`` with the log-probability 0 of a one-token mask. A
        grammar that failed (its mask this step, or the token) ends the request with a 400 frame."""
        st: ConstraintState = seq.grammar
        if not st.error and st.consume(tok) and self.cfg.jump_forward:
            forced = st.jump(seq.max_new_tokens - seq.num_output)
            lp = seq.params.logprobs
            n = 0
            for f in forced:
                seq.tokens.append(f)
                seq.forced_tail += 1
                out.token_ids.append(f)
                n += 1
                if out.logprobs:
                    out.logprobs.append(0.0)
                    if lp > 0:
                        out.top_logprobs.append([(f, 0.0)])
                out.finish_reason = self._finish_reason(seq, f)
                if out.finish_reason:
                    break  # (the forced tokens after it are not emitted, nor counted)
            self.generated_tokens += n
            self.forced_tokens += n
        if st.error:
            out.token_ids, out.logprobs, out.top_logprobs = [], [], []
            out.finish_reason = FINISH_ABORT
            out.error_status = ERROR_STATUS
            out.error = f"{seq.params.constraint.kind} constraint could not be followed: {st.error}"

    def check_no_leaks(self) -> bool:
        """True when no request is left and every block is free (used by tests)."""
        return (not self.requests and self._inflight is None and self.blocks.num_free == self.blocks.num_blocks
                and all(b.ref_count == 0 for b in self.blocks.blocks)
                and (self.blocks.free_states is None or len(self.blocks.free_states) == self.runner.state_slots)
                # every state checkpoint free or tied to a cached block, each once
                and len(self.blocks.free_checkpoints) + sum(b.state_row >= 0 for b in self.blocks.blocks)
                == len(set(self.blocks.free_checkpoints) | {b.state_row for b in self.blocks.blocks if b.state_row >= 0})
                == getattr(self.runner, "state_checkpoints", 0)
                and (self.lora is None or all(a.refs == 0 and not a.parked for a in self.lora.adapters.values()))
                and not self._compiling)

    def close(self) -> None:
        """Stop the compute thread (after the step it may be computing) and the LoRA reader."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self.lora is not None:
            self.lora.close()
        if self.grammars is not None:
            self.grammars.close()


__all__ = ["CapacityError", "ConstraintRefused", "Engine", "InFlight", "StepOutput", "Runner", "RunnerOutput", "Status"]
