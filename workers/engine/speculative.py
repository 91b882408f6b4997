"""Speculative decoding without a draft model: proposers, verification and back-off.

A proposer guesses the next few tokens of a request from its own history (prompt + output):

* ``ngram`` (vLLM's ``ngram`` / prompt lookup): the longest n-gram (``promptLookupMax`` down to
  ``promptLookupMin`` tokens) that ends the history and occurred before; the tokens that followed
  its latest earlier occurrence are the proposal. Copy-heavy work (rewriting a given file,
  extracting from a given document, echoing JSON) repeats spans of the prompt.
* ``suffix`` (the default; vLLM's ``suffix`` method, SGLang's and MindIE's memory decoding over one
  request): the longest suffix of the history (up to 32 tokens) that occurred earlier in it, then
  the continuation most of its occurrences agree on (``suffix_propose``); the proposal is at most
  the match length + 1 tokens, so a long match (copying) proposes far and a one-token match (just
  re-synchronised after the model left the source) one or two tokens.
* ``memory_decoding`` (MindIE's ``plugin_params``): ``suffix`` that also looks in the prompts and
  outputs of the worker's recent requests (``SuffixMemory``) when the match there is longer.
  MindIE's lookahead (``la``) key is served by ``suffix`` (mindie/config.py).

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
``max_batch`` (the verify rows would compete with other requests' rows for the cores; the proposer
is then not called at all), and per request how far: the n-gram proposer follows the recent accepted
run and pauses (doubling) on low acceptance; the suffix proposer keeps the tokens whose chance of
acceptance (the request's recent rate) pays for the rows: a proposal is cut to the length that
gives the step the most expected tokens per unit of time, each row costing the backend's figure for
the model (``worth_keeping``, ``Controller.row_cost``; ``ROW_COST`` by default), a long match priced
at ``STRONG_RATE`` acceptance.
A constrained request's proposal is cut where its grammar refuses it (workers/engine/constraints.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

METHODS = ("suffix", "ngram", "memory_decoding")


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
    # suffix: recent accepted proposed tokens and rejections (a verify step that rejected one),
    # decayed; their ratio estimates the chance that a proposed token is accepted
    hits: float = 2.0
    misses: float = 1.0


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


def _match_lengths(corpus: np.ndarray, ends: np.ndarray, tail: np.ndarray, max_depth: int) -> np.ndarray:
    """For each end position e of ``corpus`` (corpus[e] == tail[-1]), how many tokens of ``tail``
    (read backwards) the window ending at e equals, up to ``max_depth``: one gather of the
    [ends, depth] windows and one comparison (a handful of numpy calls whatever the sizes)."""
    d = min(max_depth, len(tail))
    idx = ends[:, None] - np.arange(d)
    win = corpus[np.maximum(idx, 0)]
    eq = (win == tail[len(tail) - d:][::-1]) & (idx >= 0)
    return np.cumprod(eq, axis=1).sum(axis=1)


def _follow(corpus: np.ndarray, ends: np.ndarray, k: int, min_prob: float) -> list[int]:
    """Up to ``k`` tokens after the windows ending at ``ends`` (ascending): at each position the
    most frequent next token among the windows that still agree with what was taken (ties: the
    latest window), stopping where that token's share falls under ``min_prob`` or no window
    continues (a negative id in ``corpus`` separates documents and ends a continuation). The
    continuations are gathered once; the walk is plain Python over a few short lists (numpy's
    per-call overhead would dominate at these sizes)."""
    n = len(corpus)
    idx = ends[:, None] + 1 + np.arange(k)
    rows = np.where(idx < n, corpus[np.minimum(idx, n - 1)], -1).tolist()
    out: list[int] = []
    for j in range(k):
        rows = [r for r in rows if r[j] >= 0]
        if not rows:
            break
        first = rows[0][j]
        if all(r[j] == first for r in rows):
            t = first
        else:
            counts: dict[int, int] = {}
            for r in rows:
                counts[r[j]] = counts.get(r[j], 0) + 1
            best = max(counts.values())
            if best < min_prob * len(rows):
                break
            t = next(r[j] for r in reversed(rows) if counts[r[j]] == best)  # the latest window
            rows = [r for r in rows if r[j] == t]
        out.append(t)
    return out


#: The latest occurrences of the last token a suffix match is looked for at (a bound on the
#: proposer's work per step whatever the history's length; recent occurrences are the likely ones).
MAX_OCCURRENCES = 256


def suffix_propose(tokens: np.ndarray, k: int, max_depth: int = 32, min_match: int = 1,
                   min_prob: float = 0.5, memory: "SuffixMemory | None" = None) -> tuple[list[int], int]:
    """Suffix decoding (vLLM's ``suffix`` method, SGLang's and MindIE's memory decoding): find the
    longest suffix of ``tokens`` (up to ``max_depth``) that occurred earlier in ``tokens`` (or, when
    longer there, in ``memory``: recent requests), then follow what came after its occurrences,
    the most frequent continuation first (``_follow``). The proposal is at most match length + 1
    tokens (a long match is a confident one: vLLM's ``max_spec_factor`` 1, plus one) and ``k``.
    Returns (proposal, match length). A proposal that reaches the history's end continues the loop
    it found (period = distance to the match), as ``ngram_propose`` does."""
    L = len(tokens)
    if k <= 0 or L < 2:
        return [], 0
    last = tokens[L - 1]
    ends = np.flatnonzero(tokens[:L - 1] == last)[-MAX_OCCURRENCES:]
    M = 0
    if ends.size:
        m = _match_lengths(tokens, ends, tokens, max_depth)
        M = int(m.max())
        ends = ends[m == M]
    if memory is not None and memory.size:
        mem_ends, mem_m = memory.matches(tokens, max_depth)
        if mem_m > M and mem_m >= min_match:
            return _follow(memory.corpus, mem_ends, min(k, mem_m + 1), min_prob), mem_m
    if M < min_match:
        return [], M
    k = min(k, M + 1)
    out = _follow(tokens, ends, k, min_prob)
    e = int(ends[-1])
    period = L - 1 - e
    if len(out) < k and len(out) == period and out == tokens[e + 1:].tolist():
        # the latest match's continuation ran to the history's end: a loop, continued
        while len(out) < k:
            j = len(out)
            out.append(out[j - period] if j >= period else int(tokens[e + 1 + j]))
    return out, M


class SuffixMemory:
    """Recent requests' prompts and outputs (MindIE's memory decoding across requests; vLLM
    suffix decoding's global tree): their tokens in one array, documents separated by -1, at most
    ``capacity`` tokens (the oldest documents dropped). ``matches`` finds a history's longest
    suffix in it."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self.docs: list[np.ndarray] = []
        self.corpus = np.empty(0, dtype=np.int64)

    @property
    def size(self) -> int:
        return len(self.corpus)

    def add(self, tokens: np.ndarray) -> None:
        doc = np.asarray(tokens, dtype=np.int64)[-self.capacity:]
        self.docs.append(doc)
        total = sum(len(d) + 1 for d in self.docs)
        while total > self.capacity and len(self.docs) > 1:
            total -= len(self.docs.pop(0)) + 1
        self.corpus = np.concatenate([np.append(d, -1) for d in self.docs])

    def clear(self) -> None:
        self.docs.clear()
        self.corpus = np.empty(0, dtype=np.int64)

    def matches(self, tokens: np.ndarray, max_depth: int) -> tuple[np.ndarray, int]:
        """The end positions in the corpus of ``tokens``' longest suffix found there, and its length."""
        ends = np.flatnonzero(self.corpus == tokens[-1])[-MAX_OCCURRENCES:]
        if ends.size == 0:
            return ends, 0
        m = _match_lengths(self.corpus, ends, tokens, max_depth)
        M = int(m.max())
        return ends[m == M], M


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


#: What one proposed token's row costs, as a fraction of a decode step, at concurrency 1 on a CPU
#: (SmolLM2-135M on the 2-core EPYC: 1 row -> 5 rows took the step from 143 to 179 ms, ~6-10 %
#: a row; mindie-bench speculative). The suffix proposer keeps the tokens whose chance of being
#: accepted pays for its row (``worth_keeping``). The figure moves with the products: a backend
#: gives the engine its model's where it differs (``Backend.spec_row_cost``: the interleaved GGUF
#: products' rows, compute-bound from two rows, cost 7-34 % a row by build: gguf_linear.X16_ROW_COST).
ROW_COST = 0.1


def worth_keeping(p: float, k: int, rows: int, tokens: float, row_cost: float) -> int:
    """How many of ``k`` proposed tokens, each accepted with chance ``p``, to keep in a step of
    ``rows`` rows that expects ``tokens`` tokens, where each row beyond the first costs ``row_cost``
    of a one-row step: the j that maximises the step's expected tokens per unit of time,
    (tokens + p + ... + p^j) / (1 + row_cost * (rows + j - 1)). Alone in its step (rows = tokens
    = 1) the first token is worth its row when p > row_cost; in a step of several requests a row
    must win its share of theirs (at speculationMaxBatch 8, copying's high rates, not free text's)."""
    best_j, best_rate, gain, pj = 0, tokens / (1 + row_cost * (rows - 1)), 0.0, 1.0
    for j in range(1, k + 1):
        pj *= p
        gain += pj
        rate = (tokens + gain) / (1 + row_cost * (rows + j - 1))
        if rate > best_rate:
            best_j, best_rate = j, rate
    return best_j


#: A suffix match at least this long is proposed even while its request backs off: long matches
#: are the copying this is for (their proposals are accepted ~70 % on the copy-heavy benchmarks),
#: short ones the guesses that free text rejects. Its length is priced at STRONG_RATE.
STRONG_MATCH = 8
#: The acceptance a long match's proposal is priced at, whatever the request's recent rate: a
#: copy that resumed tends to go on (worth_keeping then keeps ~9 tokens at a 10 % row, ~6 at 25 %).
STRONG_RATE = 0.9
SUFFIX_DEPTH = 32  # the longest suffix looked up (vLLM's suffix_decoding_max_tree_depth is 24)


@dataclass
class Controller:
    """Who speculates this step, and how far (the engine asks ``propose`` once per step)."""

    method: str = "suffix"  # "" = off
    num_tokens: int = 4  # most proposed tokens per request and step (speculationGamma)
    lookup_min: int = 2
    lookup_max: int = 5
    max_batch: int = 8  # no speculation in steps with more running requests than this
    min_acceptance: float = 0.3  # below this recent acceptance a request backs off
    # a step's proposed rows lengthen it at most this many times (its cost modelled with row_cost
    # against the step without them), so a stream's gap between tokens stays bounded; 0 = unbounded
    max_stretch: float = 2.0
    # step totals, for /metrics (vLLM's spec_decode counters) and the worker's status
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # memory_decoding: recent requests' tokens, proposals across requests
    memory: SuffixMemory | None = None
    # what a proposed row costs, as a fraction of a one-row step (the backend's figure for the model)
    row_cost: float = ROW_COST
    # the step being proposed for (begin_step; without it each proposal is priced alone): its rows
    # and expected tokens so far
    _rows: int = 0
    _tokens: float = 0.0
    _in_step: bool = False
    _decoding: int = 0

    def __post_init__(self) -> None:
        if self.method not in ("",) + METHODS:
            raise ValueError(f"unknown speculative decoding method {self.method!r} (known: {', '.join(METHODS)})")
        self.accepted_per_pos = [0] * max(self.num_tokens, 0)
        if self.method == "memory_decoding" and self.memory is None:
            self.memory = SuffixMemory()

    @property
    def enabled(self) -> bool:
        return bool(self.method) and self.num_tokens > 0

    def describe(self) -> str:
        """One line for the start log: the method and its limits, or off."""
        if not self.enabled:
            return "off"
        if self.method == "ngram":
            how = (f", n-grams of {self.lookup_min}-{self.lookup_max} tokens, in steps of up to {self.max_batch} "
                   f"decoding requests, a request pauses below {self.min_acceptance:.0%} recent acceptance")
        else:
            how = (f", in steps of up to {self.max_batch} decoding requests, a proposal cut to the tokens its "
                   f"request's recent acceptance makes worth its rows ({self.row_cost:.0%} of a step a row, in "
                   f"the step's expected tokens per second; a match of {STRONG_MATCH} tokens or longer priced at "
                   f"{STRONG_RATE:.0%} acceptance)")
        if self.max_stretch > 0:
            how += f", a step at most {self.max_stretch:g}x as long as without its proposals"
        return f"{self.method}, up to {self.num_tokens} proposed tokens per request and step{how}"

    def begin_step(self, decoding: int) -> None:
        """Proposals for a step of ``decoding`` decoding requests follow (each one row so far)."""
        self._rows, self._tokens, self._in_step, self._decoding = decoding, float(decoding), True, decoding

    def rows_left(self) -> int:
        """How many proposed rows the step may still take under ``max_stretch``: a step of d
        decoding requests costs 1 + row_cost * (d - 1) one-row steps, with its proposals at most
        max_stretch times that. A verify step emits its tokens at once, so without the bound one
        long proposal is one long gap in its stream (ITL p99) for tokens that mostly come anyway."""
        if self.max_stretch <= 0 or self.row_cost <= 0:  # unbounded, or rows priced as free
            return self.num_tokens
        d, rows = (max(self._decoding, 1), max(self._rows, 1)) if self._in_step else (1, 1)
        most = 1 + int((self.max_stretch * (1 + self.row_cost * (d - 1)) - 1) / self.row_cost + 1e-9)
        return max(most - rows, 0)

    def propose(self, seq, room: int) -> list[int]:
        """A proposal for ``seq`` (a decoding request), at most ``room`` tokens."""
        st: SpecStats = seq.spec_stats
        if self.method == "ngram":
            if st.skip > 0:
                st.skip -= 1
                return []
            # As many tokens as recent verify steps accepted, plus one and a half: a fully accepted
            # proposal grows the next one, a short run shrinks it (each proposed token is a row the
            # step computes; on a CPU a small model's rows are not free).
            k = min(self.num_tokens, room, self.rows_left(), max(1, math.ceil(1.5 * st.run + 1)))
            if k <= 0:
                return []
            draft = ngram_propose(seq.token_ids, self.lookup_min, self.lookup_max, k)
            if self._in_step:
                self._rows += len(draft)
            return draft
        # suffix, memory_decoding: the proposal's length follows its match's (suffix_propose)
        k = min(self.num_tokens, room, self.rows_left())
        if k <= 0:
            return []
        draft, match = suffix_propose(seq.token_ids, k, SUFFIX_DEPTH, memory=self.memory)
        if draft:
            # Worth its rows? With each proposed token accepted with chance p (the request's
            # recent rate; after a long match, copying resumed, at least STRONG_RATE) the j-th
            # one is emitted with chance p^j and costs row_cost of a step: keep the length that
            # gives the step the most expected tokens per unit of time (worth_keeping; alone, the
            # first token pays when p > row_cost, and in a step with other requests a row must
            # win its share of their tokens too). While none is proposed the evidence fades back
            # to the prior, so a paused request tries again.
            p = st.hits / (st.hits + st.misses)
            if match >= STRONG_MATCH:
                p = max(p, STRONG_RATE)
            rows, tokens = (max(self._rows, 1), max(self._tokens, 1.0)) if self._in_step else (1, 1.0)
            draft = draft[:worth_keeping(p, len(draft), rows, tokens, self.row_cost)]
            if not draft:
                st.hits = 0.9 * st.hits + 0.1 * 2.0
                st.misses = 0.9 * st.misses + 0.1 * 1.0
            elif self._in_step:  # the step's rows and expected tokens, for the next proposal's price
                self._rows += len(draft)
                self._tokens += sum(p ** (j + 1) for j in range(len(draft)))
        return draft

    def finished(self, seq) -> None:
        """A request ended: memory_decoding remembers its prompt and output."""
        if self.memory is not None:
            self.memory.add(seq.token_ids)

    def record(self, seq, drafted: int, accepted: int) -> None:
        """A verify step of ``seq``: ``drafted`` tokens proposed, ``accepted`` of them accepted."""
        st: SpecStats = seq.spec_stats
        st.drafts += 1
        st.draft_tokens += drafted
        st.accepted_tokens += accepted
        st.hits = 0.8 * st.hits + accepted
        st.misses = 0.8 * st.misses + (accepted < drafted)
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
