"""Speculative decoding without a draft model: proposers, verification and back-off.

A proposer guesses the next few tokens of a request from its own history (prompt + output):

* ``ngram`` (vLLM's ``ngram`` / prompt lookup): the longest n-gram (``promptLookupMax`` down to
  ``promptLookupMin`` tokens) that ends the history and occurred before; the tokens that followed
  its latest earlier occurrence are the proposal. Copy-heavy work (rewriting a given file,
  extracting from a given document, echoing JSON) repeats spans of the prompt.
* ``memory_decoding`` (MindIE's trie over the history; vLLM's ``suffix``): ``SuffixProposer`` keeps,
  per request, counts of the token that followed every context of 1..``max_depth`` tokens; a
  proposal walks from the longest context of the current history that was seen before, taking the
  most frequent continuation each time, so repeated loops and recurring phrases are followed even
  when the latest occurrence diverged.

The engine (workers/engine/engine.py) verifies a proposal of k tokens in the request's next step:
the sequence contributes 1 + k rows at consecutive positions (the runner lays them out as decode
rows sharing its block table: every attention path writes a step's KV before it reads it), each
row is sampled as the non-speculative step at that position would be (same penalties over the
history up to it, same draw index, so the same seeded uniforms), and the longest prefix of the
proposal equal to the sampled tokens is accepted, plus the token sampled after it.

For a greedy row this is exactly the non-speculative output. For a sampled row it is the
rejection sampler of speculative decoding for a deterministic (one-token) draft: the draft token
d is accepted with probability p(d) (the sampled token equals d), and on rejection the emitted
token is distributed as p with d's mass removed and renormalised (p conditioned on not being d);
so every emitted token is distributed as without speculation (``rejection_sample`` below is the
textbook form, for the unit tests' comparison), and with a seed the very same tokens come out.

``Controller`` decides per step who speculates: nobody when more requests are running than
``max_batch`` (the verify rows would compete with other requests' rows for the cores), and a
request whose recent acceptance is low proposes fewer tokens, then nothing for a while (doubling).
A constrained request's proposal is cut where its grammar refuses it (workers/engine/constraints.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

METHODS = ("ngram", "memory_decoding")


@dataclass
class SpecStats:
    """A request's speculation so far (request log) and its back-off state."""

    drafts: int = 0  # verify steps with a proposal
    draft_tokens: int = 0  # proposed tokens
    accepted_tokens: int = 0  # proposed tokens accepted
    ema: float = 1.0  # recent accepted fraction (starts optimistic)
    run: float = 2.0  # recent accepted tokens per verify step (the proposal length follows it)
    skip: int = 0  # steps left without proposing (back-off)
    backoff: int = 0  # the next back-off length
    suffix: "SuffixProposer | None" = None  # memory_decoding: the request's tree


def ngram_propose(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """vLLM's prompt lookup: the ``k`` tokens after the latest earlier occurrence of the longest
    suffix n-gram of ``tokens`` (n from ``n_max`` down to ``n_min``); [] when none occurred."""
    L = len(tokens)
    if k <= 0 or L < n_min + 1:
        return []
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        pat = tokens[L - n:]
        # ends e of earlier windows tokens[e-n+1 .. e], e <= L - 2 (a continuation follows)
        ends = np.flatnonzero(tokens[n - 1:L - 1] == pat[-1]) + (n - 1)
        for e in ends[::-1]:  # latest first
            s = e - n + 1
            if n == 1 or np.array_equal(tokens[s:e + 1], pat):
                out = tokens[e + 1:e + 1 + k].tolist()
                # A match near the end is a loop of period L - 1 - e (the latest match of a
                # repeating history always is): continue it rather than stop at the history's end.
                period = L - 1 - e
                while len(out) < k:
                    out.append(out[len(out) - period] if len(out) >= period else int(tokens[e + 1 + len(out)]))
                return out
    return []


class SuffixProposer:
    """A request's frequency trie over its history (MindIE's memory decoding): for every context
    of 1..``max_depth`` tokens, how often each token followed it. Updated as tokens arrive
    (``extend``: O(max_depth) dict updates a token); ``propose`` walks the most frequent path."""

    def __init__(self, max_depth: int = 8) -> None:
        self.max_depth = max_depth
        self.next: dict[tuple[int, ...], dict[int, int]] = {}
        self.seen = 0  # tokens of the history already counted
        self.hist: list[int] = []

    def extend(self, tokens: np.ndarray) -> None:
        """Count the tokens of ``tokens`` (the whole history) not counted yet."""
        new = tokens[self.seen:].tolist()
        h = self.hist
        for t in new:
            for d in range(1, min(self.max_depth, len(h)) + 1):
                ctx = tuple(h[-d:])
                c = self.next.get(ctx)
                if c is None:
                    self.next[ctx] = {t: 1}
                else:
                    c[t] = c.get(t, 0) + 1
            h.append(t)
        self.seen = len(tokens)

    def propose(self, k: int, min_depth: int = 1) -> list[int]:
        """Up to ``k`` tokens: from the longest context (at least ``min_depth`` tokens) ending the
        history that has a continuation, the most frequent next token (ties: the one seen first), repeated on the history extended by
        the proposal."""
        h = list(self.hist[-self.max_depth:])
        out: list[int] = []
        while len(out) < k:
            nxt = None
            for d in range(min(self.max_depth, len(h)), min_depth - 1, -1):
                c = self.next.get(tuple(h[-d:]))
                if c:
                    nxt = max(c.items(), key=lambda kv: kv[1])[0]
                    break
            if nxt is None:
                break
            out.append(nxt)
            h.append(nxt)
        return out


def accepted_prefix(draft: list[int], sampled: list[int]) -> int:
    """How many tokens of ``draft`` are accepted: the longest prefix equal to ``sampled`` (the
    token sampled at each of its positions; ``sampled`` has one more, the token after it)."""
    a = 0
    while a < len(draft) and sampled[a] == draft[a]:
        a += 1
    return a


def rejection_sample(probs: np.ndarray, draft: int, u_accept: float, u_resample: float) -> tuple[bool, int]:
    """The textbook speculative-decoding step for a deterministic draft token (q = one-hot at
    ``draft``): accept with probability min(1, p(d) / q(d)) = p(d); on rejection draw from
    max(0, p - q) renormalised, which is p with d's mass removed. Returns (accepted, token). The
    engine gets the same law by sampling p and comparing (the module's docstring); the unit tests
    compare both."""
    p = np.asarray(probs, dtype=np.float64)
    if u_accept < p[draft]:
        return True, draft
    r = p.copy()
    r[draft] = 0.0
    total = r.sum()
    if total <= 0.0:
        return True, draft
    cdf = np.cumsum(r / total)
    return False, int(min(np.searchsorted(cdf, u_resample, side="right"), len(p) - 1))


@dataclass
class Controller:
    """Who speculates this step, and how far (the engine asks ``propose`` once per step)."""

    method: str = "ngram"  # "" = off
    num_tokens: int = 4  # most proposed tokens per request and step (speculationGamma)
    lookup_min: int = 2
    lookup_max: int = 5
    max_batch: int = 8  # no speculation in steps with more running requests than this
    min_acceptance: float = 0.3  # below this recent acceptance a request backs off
    # step totals, for /metrics (vLLM's spec_decode counters) and the worker's status
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.method not in ("",) + METHODS:
            raise ValueError(f"unknown speculative decoding method {self.method!r} (known: {', '.join(METHODS)})")
        self.accepted_per_pos = [0] * max(self.num_tokens, 0)

    @property
    def enabled(self) -> bool:
        return bool(self.method) and self.num_tokens > 0

    def propose(self, seq, room: int) -> list[int]:
        """A proposal for ``seq`` (a decoding, unconstrained request), at most ``room`` tokens."""
        st: SpecStats = seq.spec
        if st.skip > 0:
            st.skip -= 1
            return []
        # As many tokens as recent verify steps accepted, plus one and a half: a fully accepted
        # proposal grows the next one, a short run shrinks it (each proposed token is a row the
        # step computes; on a CPU a small model's rows are not free).
        k = min(self.num_tokens, room, max(1, math.ceil(1.5 * st.run + 1)))
        if k <= 0:
            return []
        if self.method == "ngram":
            return ngram_propose(seq.token_ids, self.lookup_min, self.lookup_max, k)
        if st.suffix is None:
            st.suffix = SuffixProposer()
        st.suffix.extend(seq.token_ids)
        return st.suffix.propose(k, self.lookup_min)

    def record(self, seq, drafted: int, accepted: int) -> None:
        """A verify step of ``seq``: ``drafted`` tokens proposed, ``accepted`` of them accepted."""
        st: SpecStats = seq.spec
        st.drafts += 1
        st.draft_tokens += drafted
        st.accepted_tokens += accepted
        st.ema = 0.7 * st.ema + 0.3 * (accepted / drafted)
        st.run = 0.6 * st.run + 0.4 * accepted
        if st.ema < self.min_acceptance:
            st.backoff = min(max(2 * st.backoff, 4), 64)
            st.skip = st.backoff
            st.ema = self.min_acceptance + 0.2  # a fresh chance after the pause
        elif accepted:
            st.backoff = 0
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        for j in range(min(accepted, len(self.accepted_per_pos))):
            self.accepted_per_pos[j] += 1
