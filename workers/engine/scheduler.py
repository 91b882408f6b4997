"""Continuous-batching scheduler: priorities, token budget, chunked prefill, preemption.

Each step:
1. Running sequences go first, in (priority, arrival) order: a decode needs one token,
   a sequence part-way through its prompt gets the next chunk the token budget allows. The
   prompt tokens of a step are capped at ``max_prefill_tokens``, or at ``prefill_chunk_tokens``
   less the step's decodes when more than one request has work (``prompt_budget``).
   When KV blocks run out, the lowest-priority, newest running sequence is preempted
   (blocks freed, recomputed later from its prompt + generated tokens).
   A step that can complete a prompt's prefill holds the decodes back (prefill first,
   ``hold_decodes``) while no running request has waited ``decode_hold_ms`` for its next token,
   and past that while the prompts it completes were queued before the held requests' last
   tokens (one wave, ``decode_hold_wave``). Such a step takes whole prompts up to
   ``HOLD_CHUNKS`` prefill chunks.
2. Waiting sequences are admitted in (priority, arrival) order while the batch cap, the
   prefill-batch cap, the token budget and free blocks allow; a prefix-cache hit skips the
   cached part of the prompt (for a request with ``prompt_logprobs``, only the part whose
   log-probabilities it already has: the rest is recomputed to get its logits; for a pooling
   request with mean or CLS pooling, none: every position's hidden state is pooled).
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

from mindie.contract.spec import EngineConfig
from workers.engine.block_manager import BlockManager
from workers.engine.sequence import Sequence, Status

# A step that holds the decodes takes whole prompts up to this many prefill chunks (Scheduler._schedule)
HOLD_CHUNKS = 4


def _prompt_take(need: int, budget: int, chunk_left: int, hold_left: int) -> int:
    """Prompt tokens a sequence computes this step: the whole rest of its prompt where a held
    step's room allows (``hold_left``), else what the step's chunk leaves (0: none)."""
    if 0 < need <= hold_left:
        return min(need, budget)
    return max(0, min(need, budget, chunk_left))


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]  # tokens computed this step, per sequence
    preempted: list[Sequence]
    # Per sequence, its LoRA adapter's tensors (workers.models.lora.AdapterWeights) or None, taken
    # by the engine at launch (the compute thread reads these, never the sequences' adapters);
    # None = no LoRA request in the step.
    adapters: list | None = None
    # The constrained rows sampled this step and their token masks, set by the engine at launch:
    # (batch indices, workers.engine.constraints.MaskJob, computing beside the step); None = none.
    masks: tuple | None = None
    # Speculative decoding: per sequence, the proposed tokens it verifies this step (counted in
    # its num_tokens, after its last sampled token); None = no proposal in the step.
    drafts: list[list[int]] | None = None
    # Constrained sequences verifying proposed tokens: batch index -> the masks of their rows after
    # the first (ConstraintState.draft_masks), set by the engine at launch.
    draft_masks: dict | None = None
    # A hybrid model's state plan per sequence, set by the engine at launch (BlockManager.plan_states):
    # (pool row its state is restored from or -1, [(after m rows, checkpoint row)]); None = no state pool.
    state_plans: list[tuple[int, list[tuple[int, int]]]] | None = None
    # Partial prefix hits (BlockManager.match_partial): (cached block, fresh block) copies the step
    # makes before its forward; the sources stay pinned until the engine collects it (unpin).
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, cfg: EngineConfig, blocks: BlockManager):
        self.cfg = cfg
        self.blocks = blocks
        self.waiting: list[tuple[tuple[int, int], Sequence]] = []  # heap on sort_key
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_decode_holds = 0  # steps that held the running requests' decodes (hold_decodes)
        self._held_tokens = 0  # prompt tokens computed in hold steps since decodes last ran
        self._order = 0

    # -- queue management -----------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self._order += 1
        seq.order = self._order
        seq.status = Status.WAITING
        heapq.heappush(self.waiting, (seq.sort_key, seq))

    def remove(self, seq: Sequence) -> None:
        """Drop ``seq`` wherever it is and free its blocks (finish, cancel, timeout)."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting = [item for item in self.waiting if item[1] is not seq]
            heapq.heapify(self.waiting)
        self.blocks.release(seq)
        seq.status = Status.FINISHED

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.preemptions += 1
        seq.status = Status.WAITING
        self.num_preemptions += 1
        heapq.heappush(self.waiting, (seq.sort_key, seq))

    # -- one step -------------------------------------------------------------------------
    def prompt_budget(self, decodes: int) -> int:
        """Prompt tokens (prefill chunks, recomputes) this step may compute. While more than one
        request has work: the prefill chunk less the step's ``decodes``, so that a wave of
        prompts yields first tokens step by step instead of all after one long step, running
        requests keep decoding, and a step keeps the chunk's row count (the CPU's linears pad
        rows to buckets: 256 prompt rows + 2 decodes would run as 320). At least an eighth of the
        chunk, so prompts are never starved by many decodes. A prompt alone takes the whole
        ``max_prefill_tokens``."""
        budget = self.cfg.max_prefill_tokens
        chunk = self.cfg.prefill_chunk_tokens
        if 0 < chunk < budget and len(self.running) + len(self.waiting) > 1:
            return max(chunk - decodes, chunk // 8, 1)
        return budget

    @staticmethod
    def _decoding(seq: Sequence) -> bool:
        """Past its prompt: the tokens to compute are its last sampled one and those its grammar
        forced after it (jump-forward, ``Sequence.forced_tail``)."""
        return seq.decoding

    def hold_decodes(self) -> bool:
        """Whether this step computes prompt tokens only, holding the running requests' decodes.

        It does when the step can complete a prompt's prefill (the next prompt in scheduling order
        fits in the step's prompt budget) and no request holding a token has waited
        ``decode_hold_ms`` since it. A burst of prompts then gets its first tokens one chunk step
        after another, each step not slowed by the decodes of the prompts before it. A long prompt
        alone holds nothing until its last chunk, so decodes keep flowing between its chunks. A
        prompt never holds a request of higher priority than its own.

        Past ``decode_hold_ms`` the hold goes on while the prompt it completes was queued before
        every held request had its first token (``decode_hold_wave``; counted in engine steps): the rest of a burst whose
        first prompts are already answered. Where one prompt step takes longer than
        ``decode_hold_ms`` (a 1B model on a CPU core: seconds) the time bound alone holds one
        step, then mixes the burst's remaining prompt chunks with the decodes, so every request
        already answered waits a prompt step per token until the burst ends; the wave rule makes
        that one wait, and the prompt steps carry no decode rows (which cost a CPU what prompt
        rows do). Requests that were decoding before a burst arrived are held by
        ``decode_hold_ms`` alone, as before. Bounds: ``max_prefill_tokens`` prompt tokens per
        hold, and half the token timeout of the request waiting longest."""
        hold_ms = self.cfg.decode_hold_ms
        if hold_ms <= 0:
            return False
        decoding = [s for s in self.running if self._decoding(s)]
        if not decoding:
            return False
        waited_ms = (time.perf_counter() - min(s.last_token_t for s in decoding)) * 1000.0
        # A prompt of the burst was added before the step after the one that answered the first
        # of the held requests (a worker takes in requests between steps: those sent while a step
        # computes are added after it). Steps, not clocks: no dependence on when the loop reads.
        answered = min(s.first_token_step for s in decoding)
        wave = waited_ms >= hold_ms
        if wave and not (self.cfg.decode_hold_wave and answered > 0 and self._held_tokens < self.cfg.max_prefill_tokens
                         and waited_ms < self.cfg.token_timeout_s * 500.0):
            return False
        top = min(s.priority for s in decoding)
        budget = min(self.cfg.max_prefill_tokens, self.prompt_budget(0))
        prefills = 0
        for seq in self.running:
            need = seq.num_tokens - seq.num_computed
            if self._decoding(seq) or need <= 0:
                continue
            if need <= budget:
                return seq.priority <= top and (not wave or seq.enqueue_step <= answered)
            budget -= need
            prefills += 1
            if budget <= 0:
                return False
        if (not self.waiting or len(self.running) >= self.cfg.max_batch_size
                or prefills >= self.cfg.max_prefill_batch_size):
            return False
        seq = self.waiting[0][1]
        need = seq.num_tokens  # a prefix-cache hit would only shorten it
        return (seq.priority <= top and need <= budget and self.blocks.blocks_needed(need) <= self.blocks.num_free
                and (not wave or seq.enqueue_step <= answered))

    def schedule(self) -> ScheduledBatch:
        self.running.sort(key=lambda s: s.sort_key)
        if not self.hold_decodes():
            self._held_tokens = 0
            return self._schedule(hold=False)
        out = self._schedule(hold=True)
        if not out.seqs:  # the predicted prompt could not be admitted after all: decode
            self._held_tokens = 0
            again = self._schedule(hold=False)
            again.preempted[:0] = out.preempted
            return again
        self.num_decode_holds += 1
        self._held_tokens += sum(out.num_tokens)
        return out

    def _schedule(self, hold: bool) -> ScheduledBatch:
        budget = self.cfg.max_prefill_tokens
        # Decode tokens: a decode's last sampled token and the tokens its grammar forced after it.
        decodes = 0 if hold else sum(s.num_tokens - s.num_computed for s in self.running
                                     if s.decoding or s.num_tokens - s.num_computed == 1)
        prompt_budget = self.prompt_budget(decodes)
        # A held step (prompts only) also takes whole prompts beyond the chunk, up to HOLD_CHUNKS
        # chunks: nobody decodes beside it and the held requests wait for the whole burst anyway,
        # which fewer, fuller steps finish sooner (CPU, 40M model: a 128-token prompt step 19 ms,
        # four in one step 43 ms; docs/performance.md "Prefill first"). A prompt that does not
        # complete within it still gets only the chunk, so a long prompt alone holds no longer.
        hold_left = min(HOLD_CHUNKS * prompt_budget, budget) if hold and prompt_budget < budget else 0
        out = ScheduledBatch([], [], [])
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted by an earlier sequence this step
            if budget <= 0:
                break
            if hold and self._decoding(seq):
                continue
            need = seq.num_tokens - seq.num_computed
            decode = need == 1 or seq.decoding
            n = min(need, budget) if decode else _prompt_take(need, budget, prompt_budget, hold_left)
            if n <= 0:
                continue  # its next prompt chunk waits for a later step
            draft = seq.draft
            if draft:
                seq.draft = []
                # Proposed tokens ride along only where the budget and free blocks allow: never
                # a preemption for a guess.
                k = min(len(draft), budget - n) if decode and need == 1 else 0
                if k > 0 and self.blocks.can_grow(seq, n + k):
                    if out.drafts is None:
                        out.drafts = [[] for _ in out.seqs]
                    draft = draft[:k]
                    n += k
                else:
                    draft = []
            while not self.blocks.can_grow(seq, n):
                victim = self.running[-1]  # sorted: lowest priority, newest
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            self.blocks.grow(seq, n)
            out.seqs.append(seq)
            out.num_tokens.append(n)
            if out.drafts is not None:
                out.drafts.append(draft)
            budget -= n
            if not decode:
                prompt_budget -= n
                hold_left -= n

        prefills = sum(1 for s, n in zip(out.seqs, out.num_tokens)
                       if not s.decoding and (s.num_computed + n < s.num_tokens or n > 1))
        while (self.waiting and budget > 0 and max(prompt_budget, hold_left) > 0
               and len(self.running) < self.cfg.max_batch_size and prefills < self.cfg.max_prefill_batch_size):
            seq = self.waiting[0][1]
            hits = self.blocks.match_prefix(seq)
            if hits and seq.params.prompt_logprobs:
                # The positions whose prompt log-probabilities are still missing must run through
                # the model: reuse only cached blocks wholly before them.
                hits = hits[:len(seq.prompt_logprobs) // self.blocks.block_size]
            if hits and seq.params.pooling in ("mean", "cls"):
                hits = []  # the pooled positions' hidden states are computed, not cached
            hits = self.blocks.resumable(hits)  # a hybrid model: up to a block with a state checkpoint
            start = len(hits) * self.blocks.block_size
            # The positions after the full hits that another block holds (copied at the step's start):
            # never those whose prompt log-probabilities or pooled states must be computed.
            limit = (0 if seq.params.pooling in ("mean", "cls")
                     else len(seq.prompt_logprobs) - start if seq.params.prompt_logprobs else seq.num_tokens)
            for partial in (self.blocks.match_partial(seq, hits, limit), (-1, 0)):
                n = _prompt_take(seq.num_tokens - start - partial[1], budget, prompt_budget, hold_left)
                fresh = self.blocks.blocks_needed(start + partial[1] + n) - len(hits)
                # Cached blocks sitting in the free list are taken too (a partial hit's source is pinned
                # beside its copy), so count them; a partial hit that does not fit is computed instead.
                reclaimed = sum(1 for b in hits + [partial[0]] if b >= 0 and self.blocks.blocks[b].ref_count == 0)
                if n > 0 and fresh + reclaimed <= self.blocks.num_free:
                    break
            if n <= 0:
                break  # beyond this step's chunk, and not whole within a held step's room
            if fresh + reclaimed > self.blocks.num_free:
                break  # wait for blocks; never preempt running work for a newcomer
            heapq.heappop(self.waiting)
            self.blocks.admit(seq, hits, partial)
            self.blocks.grow(seq, n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_tokens.append(n)
            if out.drafts is not None:
                out.drafts.append([])
            budget -= n
            prompt_budget -= n
            hold_left -= n
            prefills += 1
        out.block_copies = self.blocks.take_copies()
        return out
