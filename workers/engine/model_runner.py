"""Runners: turn a scheduled batch into next tokens.

``ModelRunner`` runs a torch decoder over the flat batch with paged attention and samples;
``NullRunner`` produces tokens with no model compute, to measure the serving stack alone.

Both return a ``RunnerOutput`` (a list of the next token per sequence, or None) that also
carries the log-probabilities requests asked for (``SamplingParams.logprobs`` and
``prompt_logprobs``); the engine attaches them to its outputs. A worker's runner is built by
workers/engine/assembly.py (``load_runner``); its KV cache is workers/attention/kv_cache.py's.
"""
from __future__ import annotations

import itertools
import math
import time
from typing import Callable

import numpy as np
import torch

from workers.attention import PagedAttention, kv_cache
from workers.attention.state_cache import StateCache
from workers.engine.engine import RunnerOutput
from workers.engine.constraints import first_allowed
from workers.engine.sampler import MAX_TOP_LOGPROBS
from workers.engine.scheduler import ScheduledBatch
from workers.engine.sequence import Sequence
from workers.engine.tp_group import Group, StepInputs
from workers.models.lora import LoraStacks, LoraStep

# (logits [B, V], the B sequences to sample[, their token masks]) -> LongTensor [B]: a
# workers.engine.sampler.Sampler. The masks (structured output) are passed only when a row has one.
SampleFn = Callable[..., torch.Tensor]


class ModelRunner:
    verifies_drafts = True  # speculative decoding: execute() samples every row of batch.drafts
    def __init__(self, model: torch.nn.Module, kv_shape: tuple[int, int, int], kv_dtype: torch.dtype,
                 sample: SampleFn, vocab_size: int, eos_token_ids: frozenset[int], device: torch.device,
                 attention_cls: type = PagedAttention, after_step: Callable[[], None] | None = None,
                 group: Group | None = None):
        """``group``: this is rank 0 of a tensor-parallel instance (workers/engine/tp_group.py)."""
        self.model = model
        self.group = group
        self.after_step = after_step  # the backend's housekeeping (Backend.after_step)
        self.attention_cls = attention_cls  # workers.attention.for_device: portable, the CPU's or the NPU's
        self.kv_shape = kv_shape  # (num_layers, n_kv_heads, head_dim)
        self.kv_dtype = kv_dtype
        self.attn = None
        # A hybrid linear-attention model's state pool (workers/attention/state_cache.py): its slot
        # count (set by the assembly: maxBatchSize), made beside the KV cache by allocate_kv.
        self.state_slots = 0
        # ... and its rows keeping states at prompt block boundaries (prefix caching), and for verify
        # rows (speculative decoding: speculationMaxBatch x speculationGamma), set by the assembly too.
        self.state_checkpoints = 0
        self.state_scratch = 0
        self.states: StateCache | None = None
        self._scratch_of: dict[int, int] = {}  # the last step's verifying slots -> their first scratch row
        self._state_copies: list[tuple[int, int]] = []  # rollbacks made at the next step's start
        self._lora_stacks = LoraStacks()  # the last step's adapters, stacked (workers/models/lora.py)
        self.sample = sample
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device

    def bytes_per_block(self, block_size: int) -> int:
        return kv_cache.bytes_per_block(self.attention_cls, self.kv_shape, self.kv_dtype, block_size)

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        """The KV cache (workers/attention/kv_cache.py): owned by the attention object."""
        self.attn = kv_cache.allocate(self.attention_cls, self.kv_shape, self.kv_dtype, num_blocks, block_size,
                                      self.device)
        if self.state_slots:
            hy = self.model.local_args.hybrid  # a TP rank's pool holds its own heads' states
            self.states = StateCache(len(hy.linear_layers), self.state_slots, hy.conv_dim, hy.conv_kernel - 1,
                                     hy.num_v_heads, hy.head_k_dim, hy.head_v_dim, self.kv_dtype, self.device,
                                     self.state_checkpoints, self.state_scratch)
            self.model.states = self.states

    def rollback_state(self, slot: int, kept: int, rows: int) -> None:
        """A sequence of state slot ``slot`` verified ``rows`` rows last step and keeps the first
        ``kept``: its state becomes the one after them (kept in the scratch row of its save after
        ``kept`` rows), copied at the next step's start (before any slot is restored or reused)."""
        if 0 < kept < rows:
            self._state_copies.append((self._scratch_of[slot] + kept - 1, slot))

    def state_bytes_per_seq(self) -> tuple[int, int]:
        """(conv, recurrent) state bytes of one sequence (0, 0 for a model without a state pool)."""
        hy = getattr(getattr(self.model, "local_args", self.model.args), "hybrid", None)  # a TP rank's heads
        return hy.state_bytes(torch.empty((), dtype=self.kv_dtype).element_size()) if hy is not None else (0, 0)

    @staticmethod
    def flat_order(batch: ScheduledBatch) -> list[int] | range:
        """The order of the batch's sequences in the flat batch: as scheduled, except that with LoRA
        requests the rows of each adapter are put together (base model first), so each adapter's
        rows are one range (workers/models/lora.py). Any order computes the same rows."""
        ad = batch.adapters
        if ad is None or all(w is None for w in ad):
            return range(len(batch.seqs))
        return sorted(range(len(ad)), key=lambda i: "" if ad[i] is None else "\0" + ad[i].name)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        ids: list[int] = []
        pos: list[int] = []
        last_rows: list[int] = []
        sampled_seqs: list[Sequence] = []
        sampled_idx: list[int] = []  # their batch indices
        # (batch index, first flat row, first position, count): prompt positions whose next-token
        # log-probability a request asked for (SamplingParams.prompt_logprobs) and does not have yet.
        prompt_spans: list[tuple[int, int, int, int]] = []
        pool_spans: list[tuple[int, int, int, int]] = []  # (batch index, first row, first position, count)
        want_lp = False
        order = self.flat_order(batch)
        segments: list[tuple[int, int, object]] = []  # (first row, end row, adapter weights)
        # Per sequence of the flat batch (in order): its block table, first position and rows as
        # the attention sees them. A sequence verifying k proposed tokens (batch.drafts) is 1 + k
        # decode rows at consecutive positions sharing its block table: every attention path writes
        # the step's KV before it reads any, so row j sees the rows before it, as a prompt chunk's
        # row would, and an all-decode step keeps the fused decode path.
        tables: list[list[int]] = []
        starts: list[int] = []
        counts: list[int] = []
        drafts = batch.drafts
        # A hybrid model's state pool per sequence (state_cache.py): slot, first position, rows,
        # restore, saves, verify. A verify of k proposed tokens keeps its state after each of its
        # first k rows in scratch rows (k from its own first row), one of which rollback_state keeps.
        st: tuple[list, ...] = ([], [], [], [], [], [])
        self._scratch_of = {}
        scratch = self.state_slots + self.state_checkpoints
        for i in order:
            seq, n = batch.seqs[i], batch.num_tokens[i]
            draft = drafts[i] if drafts is not None else ()
            if self.states is not None:
                restore, saves = batch.state_plans[i] if batch.state_plans is not None else (-1, [])
                if draft:
                    if scratch + len(draft) > self.states.rows:
                        raise RuntimeError(f"more verify rows than the state scratch ({self.state_scratch} rows)")
                    self._scratch_of[seq.state_slot] = scratch
                    saves = [(j, scratch + j - 1) for j in range(1, len(draft) + 1)]
                    scratch += len(draft)
                for lst, v in zip(st, (seq.state_slot, seq.num_computed, n, restore, saves, bool(draft))):
                    lst.append(v)
            if batch.adapters is not None and (w := batch.adapters[i]) is not None:
                if segments and segments[-1][2] is w:
                    segments[-1] = (segments[-1][0], len(ids) + n, w)
                else:
                    segments.append((len(ids), len(ids) + n, w))
            start = seq.num_computed
            if seq.params.prompt_logprobs:
                # position p predicts prompt token p + 1: positions done .. prompt_len - 2
                lo, hi = max(start, len(seq.prompt_logprobs)), min(start + n, seq.prompt_len - 1)
                if lo < hi:
                    prompt_spans.append((i, len(ids) + lo - start, lo, hi - lo))
            if draft:
                k = len(draft)
                ids.extend(seq.tokens[start:start + n - k])
                ids.extend(draft)
                pos.extend(range(start, start + n))
                tables.extend([seq.block_table] * n)
                starts.extend(range(start, start + n))
                counts.extend([1] * n)
                last_rows.extend(range(len(ids) - n, len(ids)))
                sampled_seqs.append(seq)
                sampled_seqs.extend(DraftRow(seq, draft, j) for j in range(1, k + 1))
                sampled_idx.extend([i] * n)
                want_lp = want_lp or seq.params.logprobs >= 0
                continue
            tables.append(seq.block_table)
            starts.append(start)
            counts.append(n)
            if seq.params.pooling:  # a pooling request: its rows pooled, nothing sampled
                pool_spans.append((i, len(ids), start, n))
            ids.extend(seq.tokens[start:start + n])
            pos.extend(range(start, start + n))
            if start + n == seq.num_tokens and not seq.params.pooling:
                last_rows.append(len(ids) - 1)
                sampled_seqs.append(seq)
                sampled_idx.append(i)
                want_lp = want_lp or seq.params.logprobs >= 0
        # The LM-head calls of this step, in order: prompt log-probability chunks, the last rows of
        # the score requests whose prompt ends here (rerank: one call), then sampling.
        chunk = self.prompt_chunk_rows()
        logit_rows = [list(range(row0 + a, row0 + min(a + chunk, cnt)))
                      for _, row0, _, cnt in prompt_spans for a in range(0, cnt, chunk)]
        scored = [(i, row0 + cnt - 1) for i, row0, p0, cnt in pool_spans
                  if batch.seqs[i].params.pooling == "score" and p0 + cnt == batch.seqs[i].num_tokens]
        if scored:
            logit_rows.append([row for _, row in scored])
        if sampled_seqs:
            logit_rows.append(last_rows)
        inputs = StepInputs(ids, pos, tables, starts, counts, logit_rows, block_copies=batch.block_copies)
        if self.states is not None:
            (inputs.state_slots, inputs.state_starts, inputs.state_counts, inputs.state_restores, inputs.state_saves,
             inputs.state_verify) = st
            inputs.state_copies, self._state_copies = self._state_copies, []
        if self.group is not None:
            self.group.send_step(inputs)  # the other ranks of a tensor-parallel instance run it too
        if segments:
            self.model.lora.step = LoraStep(segments, len(ids), self._lora_stacks)
        try:
            hidden = self.forward(inputs)
        finally:
            self.model.lora.step = None
        calls = iter(logit_rows)
        result = RunnerOutput([None] * len(batch.seqs))
        for i, _, p0, cnt in prompt_spans:
            targets = batch.seqs[i].tokens[p0 + 1:p0 + 1 + cnt]  # inside the prompt (p0 + cnt < prompt_len)
            tgt = torch.tensor(targets, dtype=torch.long, device=self.device)
            values: list[float] = []
            for a in range(0, cnt, chunk):
                lsm = torch.log_softmax(self.logits(hidden, next(calls)), dim=-1)
                values.extend(lsm.gather(1, tgt[a:a + chunk, None])[:, 0].tolist())
            result.prompt_logprobs[i] = (p0, values)
        for i, row0, p0, cnt in pool_spans:
            result.pooled[i] = (p0, pool_part(batch.seqs[i], hidden[row0:row0 + cnt], p0))
        if scored:
            head = self.logits(hidden, next(calls))
            for j, (i, _) in enumerate(scored):
                result.pooled[i] = (result.pooled[i][0], score_part(batch.seqs[i], head[j]))
        if sampled_seqs:
            logits = self.logits(hidden, next(calls))
            # The constrained rows' masks, computed on the mask thread while the model ran.
            extra = (sample_masks(batch, sampled_idx),) if batch.masks is not None else ()
            with_lp = getattr(self.sample, "sample_with_logprobs", None) if want_lp else None
            if with_lp is not None:
                toks, lps = with_lp(logits, sampled_seqs, *extra)
            else:
                toks, lps = self.sample(logits, sampled_seqs, *extra), None
            it = iter(enumerate(toks.tolist()))
            for i in order:  # the order of sampled_seqs
                seq, n = batch.seqs[i], batch.num_tokens[i]
                k = len(drafts[i]) if drafts is not None else 0
                if seq.num_computed + n - k == seq.num_tokens and not seq.params.pooling:
                    j, tok = next(it)
                    result[i] = int(tok)
                    if lps is not None and lps[j] is not None:
                        result.logprobs[i] = lps[j]
                    if k:  # the tokens sampled after each proposed one (and their log-probabilities)
                        more = [next(it) for _ in range(k)]
                        result.verified[i] = [int(tok)] + [int(t) for _, t in more]
                        if lps is not None and lps[j] is not None:
                            result.verified_logprobs[i] = [lps[j]] + [lps[jj] for jj, _ in more]
        if self.after_step is not None:
            self.after_step()
        return result

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """The model over one step's flat batch; the hidden states [T, hidden]."""
        if inputs.block_copies:
            kv_cache.copy_blocks(self.attn, inputs.block_copies)
        self.attn.prepare(inputs.block_tables, inputs.num_computed, inputs.num_tokens)
        if self.states is not None:
            self.states.prepare(inputs.state_slots, inputs.state_starts, inputs.state_counts, inputs.state_restores,
                                inputs.state_saves, inputs.state_verify, inputs.state_copies)
        input_ids = torch.tensor(inputs.input_ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(inputs.positions, dtype=torch.long, device=self.device)
        return self.model(input_ids, positions, self.attn)

    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """fp32 logits [len(rows), vocab] of the given flat rows (an all-gather in a TP instance)."""
        if rows[-1] - rows[0] == len(rows) - 1:  # increasing rows, contiguous: a view, no copy
            return self.model.compute_logits(hidden[rows[0]:rows[-1] + 1])
        return self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.long, device=self.device)])

    @torch.inference_mode()
    def follow(self, inputs: StepInputs) -> None:
        """A rank > 0 of a tensor-parallel instance: the step rank 0 broadcast, every collective
        in the same order, results dropped (rank 0 samples)."""
        hidden = self.forward(inputs)
        for rows in inputs.logit_rows:
            self.logits(hidden, rows)
        if self.after_step is not None:
            self.after_step()

    # Logits elements per LM-head call for prompt log-probabilities: [rows, vocab] fp32 logits
    # stay at 128 MiB whatever the prefill chunk (a 150k vocabulary: ~220 rows a call).
    PROMPT_LOGITS_ELEMS = 1 << 25

    def prompt_chunk_rows(self) -> int:
        return max(1, self.PROMPT_LOGITS_ELEMS // max(1, self.vocab_size))


def pool_part(seq: Sequence, rows: torch.Tensor, p0: int) -> np.ndarray | None:
    """A pooling request's part of one chunk (``rows``: the final hidden states of its positions
    p0, p0 + 1, ...), as float32: their sum (mean pooling; the engine adds the chunks and divides),
    the first position's (CLS, in the chunk at position 0), the last position's (last-token, in the
    chunk that ends the prompt); None where the chunk holds no pooled position."""
    kind = seq.params.pooling
    if kind == "score":  # the logits of the last row: the runner adds them (score_part)
        return None
    if kind == "mean":
        return rows.float().sum(0).cpu().numpy()
    if kind == "cls":
        return rows[0].float().cpu().numpy() if p0 == 0 else None
    return rows[-1].float().cpu().numpy() if p0 + len(rows) == seq.num_tokens else None


def score_part(seq: Sequence, logits: torch.Tensor) -> np.ndarray:
    """A score request's vector: the fp32 logits of its prompt's last position at its
    ``score_tokens`` (a decoder reranker's "no", "yes"), or all of them (a classification head)."""
    ids = seq.params.score_tokens
    return (logits[list(ids)] if ids else logits).float().cpu().numpy()


class DraftRow:
    """Row ``j`` (1..k) of a sequence verifying proposed tokens, as the sampler reads a request
    (workers/engine/sampler.py ``Row``): its history is the sequence's followed by the first ``j``
    proposed tokens, and its draw index is the one the non-speculative step at that position
    would use, so penalties, seeds and log-probabilities are those of that step."""

    __slots__ = ("params", "token_ids", "num_output")

    def __init__(self, seq: Sequence, draft: list[int], j: int) -> None:
        self.params = seq.params
        self.token_ids = np.concatenate([seq.token_ids, np.asarray(draft[:j], dtype=np.int64)])
        self.num_output = seq.num_output + j


def sample_masks(batch: ScheduledBatch, sampled_idx: list[int]) -> tuple[list[int], "object", "object"]:
    """The sampler's ``masks`` argument: (row of each constrained sequence among the sampled ones,
    their masks, the same as additive -inf/0 rows), waiting for the mask thread if it is still computing them."""
    rows, job = batch.masks
    pos: dict[int, int] = {}
    for j, b in enumerate(sampled_idx):
        pos.setdefault(b, j)  # a sequence verifying proposed tokens: its first row
    bits = job.wait()
    out_rows, additive = [pos[b] for b in rows], job.additive
    if batch.draft_masks:  # the rows after its proposed tokens follow its first
        extra = [(pos[b] + 1 + j, m) for b, ms in batch.draft_masks.items() for j, m in enumerate(ms)]
        out_rows += [r for r, _ in extra]
        more = np.stack([m for _, m in extra])
        bits = np.concatenate([bits, more])
        if additive is not None:
            banned = np.unpackbits((~more).view(np.uint8), axis=1, bitorder="little").view(bool)
            add = np.zeros(banned.shape, dtype=np.float32)
            np.putmask(add, banned, np.float32(-np.inf))
            additive = np.concatenate([additive, add])
    return out_rows, bits, additive


class NullRunner:
    """No model: every step costs ``step_ms`` plus ``token_us`` per computed token and emits
    token ids cycling through the vocabulary (never EOS), so requests run their full length
    (unless one is in the request's ``stop_token_ids``: the engine stops it as for a model).

    Log-probabilities are those of a model that predicts the uniform distribution: every token,
    sampled or prompt, gets ``-log(vocab_size)``, and the k alternatives are the sampled id and
    the ids after it (mod the vocabulary), all at that value. Deterministic, cheap, and shaped
    as a real model's (one value per id, k pairs best first), for serving-stack tests.

    A constrained row (structured output) takes the first token its mask allows at or after the id
    it would have emitted, so the constraint holds and its cost (the masks, jump-forward) is measured."""

    POOL_DIM = 8  # a pooling request's vector: the pooled one-hot rows of its token ids mod 8

    def __init__(self, vocab_size: int = 32000, step_ms: float = 0.0, token_us: float = 0.0):
        self.vocab_size = vocab_size
        self.eos_token_ids: frozenset[int] = frozenset()
        self.step_ms = step_ms
        self.token_us = token_us
        self._ids = itertools.cycle(range(3, vocab_size))

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        cost = self.step_ms / 1000.0 + self.token_us * sum(batch.num_tokens) / 1e6
        if cost > 0:
            time.sleep(cost)
        out = RunnerOutput([next(self._ids) if seq.num_computed + n == seq.num_tokens else None
                            for seq, n in zip(batch.seqs, batch.num_tokens)])
        if batch.masks is not None:
            rows, job = batch.masks
            for i, row in zip(rows, job.wait()):
                out[i] = first_allowed(row, out[i], self.vocab_size)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            if seq.params.pooling:  # hidden states of no model: each position's token id as 8 counts
                out[i] = None
                ids = np.asarray(seq.tokens[seq.num_computed:seq.num_computed + n]) % self.POOL_DIM
                rows = torch.from_numpy(np.eye(self.POOL_DIM, dtype=np.float32)[ids])
                out.pooled[i] = (seq.num_computed, pool_part(seq, rows, seq.num_computed))
                if seq.params.pooling == "score" and seq.num_computed + n == seq.num_tokens:  # no logits: zeros
                    out.pooled[i] = (seq.num_computed, np.zeros(len(seq.params.score_tokens) or 1, np.float32))
        lp = -math.log(self.vocab_size)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            p = seq.params
            if not p.prompt_logprobs and p.logprobs < 0:
                continue
            if p.prompt_logprobs:
                lo = max(seq.num_computed, len(seq.prompt_logprobs))
                hi = min(seq.num_computed + n, seq.prompt_len - 1)
                if lo < hi:
                    out.prompt_logprobs[i] = (lo, [lp] * (hi - lo))
            tok = out[i]
            if p.logprobs >= 0 and tok is not None:
                k = min(p.logprobs, MAX_TOP_LOGPROBS, self.vocab_size)
                out.logprobs[i] = (lp, [((tok + j) % self.vocab_size, lp) for j in range(k)])
        return out
