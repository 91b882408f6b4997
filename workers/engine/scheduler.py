"""Continuous-batching scheduler: priorities, token budget, chunked prefill, preemption.

Each step:
1. Running sequences go first, in (priority, arrival) order: a decode needs one token,
   a sequence part-way through its prompt gets the next chunk the token budget allows.
   When KV blocks run out, the lowest-priority, newest running sequence is preempted
   (blocks freed, recomputed later from its prompt + generated tokens).
2. Waiting sequences are admitted in (priority, arrival) order while the batch cap, the
   prefill-batch cap, the token budget and free blocks allow; a prefix-cache hit skips the
   cached part of the prompt (for a request with ``prompt_logprobs``, only the part whose
   log-probabilities it already has: the rest is recomputed to get its logits).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from mindie.contract.spec import EngineConfig
from workers.engine.block_manager import BlockManager
from workers.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]  # tokens computed this step, per sequence
    preempted: list[Sequence]

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
    def schedule(self) -> ScheduledBatch:
        budget = self.cfg.max_prefill_tokens
        out = ScheduledBatch([], [], [])
        self.running.sort(key=lambda s: s.sort_key)
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:
                continue  # preempted by an earlier sequence this step
            if budget <= 0:
                break
            n = min(seq.num_tokens - seq.num_computed, budget)
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
            budget -= n

        prefills = sum(1 for s, n in zip(out.seqs, out.num_tokens) if s.num_computed + n < s.num_tokens or n > 1)
        while (self.waiting and budget > 0 and len(self.running) < self.cfg.max_batch_size
               and prefills < self.cfg.max_prefill_batch_size):
            seq = self.waiting[0][1]
            hits = self.blocks.match_prefix(seq)
            if hits and seq.params.prompt_logprobs:
                # The positions whose prompt log-probabilities are still missing must run through
                # the model: reuse only cached blocks wholly before them.
                hits = hits[:len(seq.prompt_logprobs) // self.blocks.block_size]
            n = min(seq.num_tokens - len(hits) * self.blocks.block_size, budget)
            fresh = self.blocks.blocks_needed(len(hits) * self.blocks.block_size + n) - len(hits)
            # Cached blocks sitting in the free list are taken too, so count them.
            reclaimed = sum(1 for b in hits if self.blocks.blocks[b].ref_count == 0)
            if fresh + reclaimed > self.blocks.num_free:
                break  # wait for blocks; never preempt running work for a newcomer
            heapq.heappop(self.waiting)
            self.blocks.admit(seq, hits)
            self.blocks.grow(seq, n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_tokens.append(n)
            budget -= n
            prefills += 1
        return out
