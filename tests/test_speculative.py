"""Speculative decoding (workers/engine/speculative.py) in-process: the proposers and the rejection
sampler alone, then the engine on real models with speculation on and off: greedy outputs, their
log-probabilities, seeded draws, stop ids, lengths, preemption and the prefix cache exactly as
without it, and sampled outputs distributed as without it (a chi-square test)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from mindie.contract.wire import SamplingParams
from tests.lazy_modules import lazy_module
from tests.test_engine import make_engine, run
from tests.tiny_hf import random_model
from workers.engine.speculative import (ROW_COST, STRONG_MATCH, Controller, SpecStats, SuffixMemory, accepted_prefix,
                                        ngram_propose, rejection_sample, suffix_propose, worth_keeping)

stats = lazy_module("scipy.stats")  # setup.cfg [test]; imported where a test uses it (tests/lazy_modules.py)



# -- the proposers and the sampler alone --------------------------------------------------------

def test_ngram_proposes_after_the_latest_longest_match() -> None:
    t = np.array([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 1, 2, 3, 4])
    # suffix 4-gram [1,2,3,4] occurred at 0: proposal follows it
    assert ngram_propose(t, 2, 4, 3) == [5, 9, 2]
    # with at most 3-grams, [2,3,4] latest earlier occurrence is at 6..8: then 7, 8
    assert ngram_propose(t, 2, 3, 3) == [7, 8, 1]
    assert ngram_propose(np.array([5, 6, 7, 8]), 1, 3, 4) == []  # nothing repeats
    assert ngram_propose(np.array([5, 6, 5]), 1, 3, 4) == [6, 5, 6, 5]  # a loop is continued
    assert ngram_propose(np.array([1, 2, 3, 1, 2, 3, 1, 2]), 2, 3, 7) == [3, 1, 2, 3, 1, 2, 3]
    assert ngram_propose(np.array([5, 6, 5]), 2, 3, 4) == []  # too short a match
    assert ngram_propose(t, 2, 4, 0) == []


def test_suffix_proposer_follows_the_longest_match_and_its_most_frequent_continuation() -> None:
    t = np.array([1, 2, 3, 9, 8, 1, 2, 3, 9, 8, 7, 4, 2, 3, 5, 2, 3])
    # the suffix [2, 3] occurred 3 times; [1, 2, 3] never ends the history: the longest match is 2
    # tokens, followed by 9 twice and 5 once: 9 (2 of 3 >= min_prob 0.5), then 8 (both), then the
    # windows disagree (1 and 7, half each: the latest, 7)
    assert suffix_propose(t, 16) == ([9, 8, 7], 2)  # match length 2: at most 3 tokens
    assert suffix_propose(t, 2) == ([9, 8], 2)
    assert suffix_propose(t, 16, min_match=3) == ([], 2)
    assert suffix_propose(t, 16, min_prob=0.9) == ([], 2)  # 9 is 2 of 3 only
    t2 = np.array([5, 1, 2, 3, 4, 6, 1, 2, 3, 4, 7, 0, 2, 3, 4])
    # longest match [2, 3, 4] (3 tokens) twice: 6 once, 7 once: a tie, the latest window wins
    assert suffix_propose(t2, 16)[0][:1] == [7]
    assert suffix_propose(np.array([5, 6, 7, 8]), 4) == ([], 0)  # nothing repeats
    # a loop reaching the history's end is continued with its period
    assert suffix_propose(np.array([1, 2, 3, 1, 2, 3, 1, 2]), 16) == ([3, 1, 2, 3, 1, 2], 5)
    assert suffix_propose(t, 0) == ([], 0)


def test_suffix_memory_proposes_from_recent_requests() -> None:
    mem = SuffixMemory(capacity=40)
    mem.add(np.array([10, 11, 12, 13, 14, 15]))
    hist = np.array([7, 8, 11, 12, 13])  # nothing repeats in the history itself
    assert suffix_propose(hist, 16) == ([], 0)
    assert suffix_propose(hist, 16, memory=mem) == ([14, 15], 3)  # ends at the document's end
    for i in range(10):  # older documents drop out past the capacity
        mem.add(np.array([20 + i] * 5))
    assert mem.size <= 40 and suffix_propose(hist, 16, memory=mem) == ([], 0)
    mem.clear()
    assert mem.size == 0


def test_accepted_prefix() -> None:
    assert accepted_prefix([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 1]) == 3
    assert accepted_prefix([5], [4, 5]) == 0


def test_sample_and_compare_is_the_rejection_sampler() -> None:
    """For a one-token draft d, emitting a draw from p (accepted when it equals d) has the law of
    the textbook rejection step (accept with p(d), else draw from p without d): the emitted tokens'
    frequencies, and the acceptance counts, of both are the same distribution (chi-square, fixed
    seed; the test fails wrongly with probability 0.1 % at the threshold used)."""
    rng = np.random.default_rng(7)
    p = rng.dirichlet(np.ones(8) * 0.7)
    d = int(np.argsort(p)[-2])  # a likely but not the likeliest token
    n = 20000
    textbook = np.zeros(9, dtype=np.int64)  # token counts, then the acceptances
    compare = np.zeros(9, dtype=np.int64)
    cdf = np.cumsum(p)
    for _ in range(n):
        ok, tok = rejection_sample(p, d, rng.random(), rng.random())
        textbook[tok] += 1
        textbook[8] += ok
        tok2 = int(min(np.searchsorted(cdf, rng.random(), side="right"), 7))
        compare[tok2] += 1
        compare[8] += tok2 == d
    assert textbook[8] == textbook[d] and compare[8] == compare[d]
    # both against p itself
    for counts in (textbook[:8], compare[:8]):
        assert stats.chisquare(counts, p * n).pvalue > 1e-3
    assert abs(textbook[8] / n - p[d]) < 4 * (p[d] * (1 - p[d]) / n) ** 0.5
    # a wrong resampling (keeping d's mass on rejection) is caught by the same test
    wrong = np.zeros(8, dtype=np.int64)
    for _ in range(n):
        if rng.random() < p[d]:
            wrong[d] += 1
        else:
            wrong[int(min(np.searchsorted(cdf, rng.random(), side="right"), 7))] += 1
    assert stats.chisquare(wrong, p * n).pvalue < 1e-3


def test_controller_backs_off_on_low_acceptance() -> None:
    c = Controller("ngram", num_tokens=4, min_acceptance=0.3)

    class S:
        spec_stats = SpecStats()
        token_ids = np.array([1, 2, 3, 1, 2, 3, 1, 2])
    s = S()
    assert c.propose(s, 10) == [3, 1, 2, 3]
    for _ in range(4):
        c.record(s, 3, 0)
    assert s.spec_stats.skip > 0 and c.propose(s, 10) == []  # backing off
    assert (c.drafts, c.draft_tokens, c.accepted_tokens) == (4, 12, 0)
    with pytest.raises(ValueError):
        Controller("lookahead")


def test_suffix_controller_keeps_what_pays_for_its_rows() -> None:
    """A suffix proposal keeps the tokens whose chance of acceptance (the request's recent rate)
    beats a row's cost: all of them at first, fewer after rejections, none after many (so free
    text pays nothing), but a match of STRONG_MATCH tokens or more (copying resumed) whole; while
    nothing is proposed the rate fades back to its prior and proposals come back."""
    c = Controller("suffix", num_tokens=16)

    class S:
        spec_stats = SpecStats()
        token_ids = np.array([1, 2, 3, 4, 9, 1, 2])
    s = S()
    assert c.propose(s, 10) == [3, 4, 9]  # match [1, 2]: 3 tokens
    for _ in range(8):
        c.record(s, 3, 0)
    assert s.spec_stats.hits / (s.spec_stats.hits + s.spec_stats.misses) < ROW_COST and c.propose(s, 10) == []
    span = list(range(20, 20 + STRONG_MATCH + 4))
    strong = S()
    strong.spec_stats = s.spec_stats
    strong.token_ids = np.array(span + [5] + span[:STRONG_MATCH])
    # (match length + 1 tokens; past the history's end the loop it found goes on)
    assert c.propose(strong, 16) == (span[STRONG_MATCH:] + [5] + span)[:STRONG_MATCH + 1]
    for _ in range(60):
        c.propose(s, 10)
    assert c.propose(s, 10)[:1] == [3]  # tried again (its first token: the rate is just above the cost)
    assert c.drafts == 8 and c.draft_tokens == 24 and c.accepted_tokens == 0


def test_a_proposed_row_must_win_its_share_of_the_step() -> None:
    """worth_keeping prices rows in the step's expected tokens per unit of time: alone, a token is
    worth its row when its chance beats the row's cost; in a step of 8 requests free text's rates
    (p = 0.5) keep nothing where copying's (0.9) still keeps some; cheaper rows keep more."""
    assert worth_keeping(0.5, 8, 1, 1.0, 0.25) == 1  # (1 + .5) / 1.25 beats 1; (1.75) / 1.5 does not beat that
    assert worth_keeping(0.2, 8, 1, 1.0, 0.25) == 0  # below the row's cost
    assert worth_keeping(0.5, 8, 8, 8.0, 0.25) == 0
    assert worth_keeping(0.9, 8, 8, 8.0, 0.25) >= 1
    assert worth_keeping(0.8, 16, 1, 1.0, 0.1) > worth_keeping(0.8, 16, 1, 1.0, 0.25) >= 2
    c = Controller("suffix", num_tokens=16, row_cost=0.25)

    class S:
        spec_stats = SpecStats(hits=1.0, misses=1.0)  # p = 0.5
        token_ids = np.array([1, 2, 3, 4, 9, 1, 2])
    assert c.propose(S(), 10) == [3]  # alone: one token's row pays
    c.begin_step(8)  # the same request among 7 others
    assert c.propose(S(), 10) == []


def test_a_step_is_stretched_at_most_max_stretch_times() -> None:
    """A long copy (a strong match, priced at STRONG_RATE) would be proposed whole; max_stretch
    bounds the step's modelled cost to that many times the step without proposals, so the stream's
    gap between tokens stays bounded: alone at a 25 % row and 2x, 4 rows beyond its own; in a step
    of 4 requests (1.75 one-row steps, bound 3.5) 7 rows among them all; 0, or a bound above what
    the pricing keeps, cuts nothing."""
    span = list(range(100, 140))

    class S:
        def __init__(self) -> None:
            self.spec_stats = SpecStats(hits=9.0, misses=1.0)
            self.token_ids = np.array(span + span[:20])

    free = Controller("suffix", num_tokens=16, row_cost=0.25, max_stretch=0)
    priced = free.propose(S(), 16)  # as long as the pricing keeps (p = 0.9: 6 tokens)
    assert len(priced) > 4
    c = Controller("suffix", num_tokens=16, row_cost=0.25, max_stretch=2.0)
    assert c.propose(S(), 16) == span[20:24]
    c.begin_step(4)
    got = [c.propose(S(), 16) for _ in range(4)]
    assert sum(map(len, got)) == 7 and got[0] == span[20:20 + len(got[0])], got
    wide = Controller("suffix", num_tokens=16, row_cost=0.25, max_stretch=3.0)
    assert wide.propose(S(), 16) == priced  # a bound of 8 rows above what the pricing keeps: no cut
    assert "a step at most 2x as long as without its proposals" in c.describe()


# -- the engine, speculation on and off -----------------------------------------------------------

def _repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat spans (copy-heavy), so the proposers hit."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        span = [rng.randrange(3, 32000) for _ in range(rng.randrange(8, 30))]
        out.append([rng.randrange(3, 32000) for _ in range(rng.randrange(1, 12))] + span * rng.randrange(2, 4)
                   + span[:rng.randrange(1, len(span))])
    return out


PARAMS = [
    SamplingParams(max_new_tokens=40, ignore_eos=True),
    SamplingParams(max_new_tokens=33, ignore_eos=True, repetition_penalty=1.2),
    SamplingParams(max_new_tokens=30, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.3),
    SamplingParams(max_new_tokens=37, ignore_eos=True, logprobs=3),
    SamplingParams(max_new_tokens=3, ignore_eos=True),
    SamplingParams(max_new_tokens=45, ignore_eos=True, do_sample=True, temperature=0.7, top_k=20, seed=11),
    SamplingParams(max_new_tokens=45, ignore_eos=True, do_sample=True, temperature=0.9, top_p=0.8, seed=5,
                   logprobs=2),
]


def _run_lp(engine, reqs):
    """run() plus every output's log-probabilities."""
    for rid, (ids, params) in reqs.items():
        from mindie.contract.wire import Submit
        engine.add(Submit(rid, "fe", ids, params))
    toks = {rid: [] for rid in reqs}
    lps = {rid: [] for rid in reqs}
    tops = {rid: [] for rid in reqs}
    reasons = {}
    for _ in range(100000):
        if not engine.has_work():
            break
        for o in engine.step():
            toks[o.seq.request_id].extend(o.token_ids)
            lps[o.seq.request_id].extend(o.logprobs)
            tops[o.seq.request_id].extend(o.top_logprobs)
            if o.finish_reason:
                reasons[o.seq.request_id] = o.finish_reason
    return toks, lps, tops, reasons


@pytest.fixture(scope="module")
def reqs() -> dict:
    ps = _repetitive_prompts(len(PARAMS) * 3)
    return {f"r{i}": (p, PARAMS[i % len(PARAMS)]) for i, p in enumerate(ps)}


@pytest.fixture(scope="module")
def plain(demo_model, reqs):
    eng = make_engine(demo_model, spec_method="")
    out = _run_lp(eng, reqs)
    assert eng.speculator.drafts == 0 and eng.check_no_leaks()
    return out


@pytest.mark.parametrize("variant", ["suffix", "ngram", "memory_decoding", "suffix-preempt", "ngram-preempt",
                                     "suffix-overlap", "suffix-chunked", "ngram-chunked"])
def test_same_outputs_with_and_without_speculation(demo_model, reqs, plain, variant):
    method = variant.split("-")[0]
    cfg = dict(spec_method=method, spec_max_batch=64)
    if variant.endswith("preempt"):
        cfg.update(num_blocks=14)  # 14 blocks of 16: requests preempt each other
    if variant.endswith("overlap"):
        cfg.update(overlap=True)
    if variant.endswith("chunked"):
        cfg.update(max_prefill_tokens=24, spec_tokens=7)
    eng = make_engine(demo_model, **cfg)
    toks, lps, tops, reasons = _run_lp(eng, reqs)
    try:
        assert eng.check_no_leaks()
    finally:
        eng.close()
    assert eng.speculator.accepted_tokens > 50 and eng.speculator.draft_tokens > eng.speculator.accepted_tokens, \
        "speculation must have run, with acceptances and rejections"
    if variant.endswith("preempt"):
        assert eng.scheduler.num_preemptions > 0
    assert toks == plain[0]
    assert reasons == plain[3]
    for rid in reqs:
        assert len(lps[rid]) == len(plain[1][rid])
        np.testing.assert_allclose(lps[rid], plain[1][rid], rtol=1e-4, atol=1e-4)
        assert [[t for t, _ in top] for top in tops[rid]] == [[t for t, _ in top] for top in plain[2][rid]]


class CycleRunner:
    """A model that continues every sequence with ``(last - 2) % 10 + 3`` (3, 4, .., 12, 3, ..): its proposals are
    all accepted once the cycle is in the history. Verifies drafts as ModelRunner does."""

    verifies_drafts = True
    vocab_size = 100
    eos_token_ids = frozenset()

    def execute(self, batch):
        from workers.engine.engine import RunnerOutput
        out = RunnerOutput([None] * len(batch.seqs))
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            draft = batch.drafts[i] if batch.drafts is not None else []
            if seq.num_computed + n - len(draft) != seq.num_tokens:
                continue
            hist = [seq.tokens[-1]] + list(draft)
            toks = [(t - 2) % 10 + 3 for t in hist]
            out[i] = toks[0]
            if draft:
                out.verified[i] = toks
        return out


def _cycle_engine(method: str, k: int = 8):
    from mindie.contract.spec import EngineConfig
    from workers.engine.engine import Engine
    cfg = EngineConfig(block_size=4, spec_method=method, spec_tokens=k)
    return Engine(CycleRunner(), cfg, 64)


def _cycle(last: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        last = (last - 2) % 10 + 3
        out.append(last)
    return out


def test_stop_ids_eos_and_length_inside_accepted_proposals():
    """A stop id, EOS or the length reached inside an accepted run of proposed tokens ends the
    output there: never a token past it; the KV of the rest is dropped (no leaked blocks)."""
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12] * 2 + [3, 4]
    cycle = _cycle(4, 100)  # 5, 6, ..., 12, 3, 4, ...
    cases = {
        "stop": (SamplingParams(max_new_tokens=60, ignore_eos=True, stop_token_ids=[4]), cycle[:10]),
        "len": (SamplingParams(max_new_tokens=17, ignore_eos=True), cycle[:17]),
        "len2": (SamplingParams(max_new_tokens=2, ignore_eos=True), cycle[:2]),
        "eos": (SamplingParams(max_new_tokens=60), cycle[:6]),  # 10 is EOS below
        "eos-ignored": (SamplingParams(max_new_tokens=23, ignore_eos=True), cycle[:23]),
    }
    for method in ("", "ngram", "suffix", "memory_decoding"):
        eng = _cycle_engine(method)
        eng.runner.eos_token_ids = frozenset({10})
        out = run(eng, {k: (prompt, p) for k, (p, _) in cases.items()})
        assert eng.check_no_leaks()
        for k, (_, want) in cases.items():
            assert out[k][0] == want, (method, k)
        assert out["eos"][1] == "eos_token" and out["stop"][1] == "stop_token" and out["len"][1] == "length"
        if method:  # whole runs accepted: the stops fell inside them
            assert eng.speculator.accepted_tokens > 30 and eng.speculator.accepted_tokens == eng.speculator.draft_tokens
            assert eng.steps < 30


def test_prefix_cache_holds_no_rejected_tokens(demo_model):
    """Blocks registered in the prefix cache hold computed tokens only: every registered block's
    ids are its request's tokens at those positions, and a later request reusing them continues
    exactly as one computed from scratch."""
    ps = _repetitive_prompts(6, seed=9)
    params = SamplingParams(max_new_tokens=50, ignore_eos=True, repetition_penalty=1.1)
    eng = make_engine(demo_model, spec_method="ngram", spec_tokens=6)
    out = run(eng, {f"p{i}": (p, params) for i, p in enumerate(ps)})
    assert eng.speculator.draft_tokens > eng.speculator.accepted_tokens > 0
    follow = {f"f{i}": (p + out[f"p{i}"][0][:40], SamplingParams(max_new_tokens=20, ignore_eos=True))
              for i, p in enumerate(ps)}
    hits0 = eng.blocks.prefix_hits
    again = run(eng, follow)
    assert eng.blocks.prefix_hits > hits0
    fresh = make_engine(demo_model, spec_method="", enable_prefix_cache=False)
    assert again == run(fresh, follow)


def _tiny_model(path, head_scale: float = 6.0) -> str:
    """A 12-token Llama whose LM head is scaled up: confident next-token distributions (a few
    likely tokens), so sampled proposals are often accepted and often not."""
    import torch
    model = random_model("LlamaConfig", dict(vocab_size=12, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, bos_token_id=0,
                                             eos_token_id=1, max_position_embeddings=512, tie_word_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_sampled_distribution_kept(tmp_path, method):
    """Sampled outputs keep their distribution: on a 12-token model where the proposers hit often,
    the joint frequencies of the tokens at output positions 2..5 over 600 seeds with speculation
    match 600 other seeds without it (chi-square on a contingency table; threshold p < 1e-3, so the
    test fails wrongly one run in a thousand; the seeds are fixed, so it is deterministic). And
    the same seed draws the same tokens either way."""
    model = _tiny_model(tmp_path / "tiny")
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5]
    n = 600

    def sample(method: str, seeds) -> tuple[dict, Controller]:
        eng = make_engine(model, spec_method=method, spec_max_batch=512, spec_lookup_min=1, num_blocks=1024)
        # rows priced free: hundreds of requests per step speculate (worth_keeping would price
        # them out of so large a step), which is the volume the distribution checks need
        eng.speculator.row_cost = 0.0
        reqs = {f"s{s}": (prompt, SamplingParams(max_new_tokens=6, ignore_eos=True, do_sample=True, temperature=1.0,
                                                  seed=s)) for s in seeds}
        out = run(eng, reqs)
        assert eng.check_no_leaks()
        return {s: out[f"s{s}"][0] for s in seeds}, eng.speculator

    spec, ctl = sample(method, range(n))
    # accepted often, rejected often (hundreds of each: the suffix proposer keeps fewer tokens once rejected)
    assert ctl.accepted_tokens > n // 2 and ctl.draft_tokens - ctl.accepted_tokens > n
    plain_same, _ = sample("", range(n))
    assert spec == plain_same  # seeded: identical
    plain, _ = sample("", range(n, 2 * n))
    for pos in range(2, 6):
        a = np.bincount([o[pos] for o in spec.values()], minlength=12)
        b = np.bincount([o[pos] for o in plain.values()], minlength=12)
        keep = (a + b) > 0
        p = stats.chi2_contingency(np.stack([a[keep], b[keep]])).pvalue
        assert p > 1e-3, (pos, a, b)


def test_speculation_max_batch_backs_off_under_load():
    """No proposal in a step with more running requests than speculationMaxBatch; proposals again
    once fewer run (the same outputs either way)."""
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12] * 2 + [3, 4]
    reqs = {f"r{i}": (prompt, SamplingParams(max_new_tokens=12 + 4 * i, ignore_eos=True)) for i in range(6)}
    outs = {}
    for mb in (0, 3, 64):
        from mindie.contract.spec import EngineConfig
        from workers.engine.engine import Engine
        eng = Engine(CycleRunner(), EngineConfig(block_size=4, spec_tokens=4, spec_max_batch=mb), 256)
        seen = []
        orig = eng.speculator.propose

        def propose(seq, room, eng=eng, orig=orig, seen=seen):
            seen.append(eng.scheduler.num_running)
            return orig(seq, room)
        eng.speculator.propose = propose
        outs[mb] = run(eng, reqs)
        assert eng.check_no_leaks()
        if mb == 0:
            assert not seen and eng.speculator.drafts == 0
        else:
            assert seen and max(seen) <= mb and eng.speculator.accepted_tokens > 0
    assert outs[0] == outs[3] == outs[64]


def test_constrained_requests_speculate_exactly(demo_model):
    """Structured output with speculation: proposals are cut at the first token the grammar refuses,
    each verify row is sampled under the mask after the proposed tokens before it, and the matcher
    advances over the emitted ones: the same tokens and log-probabilities as without speculation
    (greedy and seeded, JSON schema and regex, with jump-forward), and proposals were accepted."""
    from tests.test_constrained import _free_and_constrained, constrained_engine
    from mindie.contract.wire import Submit
    free, cons = _free_and_constrained()
    from mindie.contract.wire import Constraint
    words = Constraint("regex", "[a-z ]{20,60}")  # the demo model's repetitive text fits it: proposals hit
    cons = {**cons, "c-words": ([5, 6, 10], SamplingParams(max_new_tokens=50, constraint=words)),
            "c-words-pen": ([5, 6, 11], SamplingParams(max_new_tokens=50, constraint=words, repetition_penalty=1.1,
                                                       logprobs=2))}
    reqs = {**free, **cons, **{f"{k}-again": ([9, 9] + v[0], v[1]) for k, v in cons.items()}}

    def go(method):
        eng = constrained_engine(demo_model, spec_method=method, spec_lookup_min=1, spec_max_batch=64)
        for rid, (ids, params) in reqs.items():
            eng.add(Submit(rid, "fe", ids, params))
        out = {rid: ([], "", []) for rid in reqs}
        drafted = {rid: [0, 0] for rid in reqs}
        for _ in range(10000):
            if not (eng.has_work() or eng.grammar_busy):
                break
            for o in eng.step():
                ids, _, lps = out[o.seq.request_id]
                ids.extend(o.token_ids)
                lps.extend(o.logprobs)
                drafted[o.seq.request_id][0] += o.spec_draft
                drafted[o.seq.request_id][1] += o.spec_accepted
                if o.finish_reason or o.error:
                    out[o.seq.request_id] = (ids, o.error or o.finish_reason, lps)
        assert eng.check_no_leaks()
        eng.close()
        return out, drafted

    plain, _ = go("")
    for method in ("ngram", "suffix"):
        spec, drafted = go(method)
        assert {k: v[:2] for k, v in spec.items()} == {k: v[:2] for k, v in plain.items()}, method
        for k in spec:
            np.testing.assert_allclose(spec[k][2], plain[k][2], atol=2e-4)
        cons_drafted = sum(drafted[k][0] for k in reqs if k.startswith("c-"))
        cons_accepted = sum(drafted[k][1] for k in reqs if k.startswith("c-"))
        assert cons_accepted > 10 and cons_drafted >= cons_accepted, (method, drafted)


def test_spec_counters_on_metrics_are_summed_over_workers():
    """vLLM's spec_decode counters from the workers' heartbeats: sums, per-position by label."""
    from mindie.contract import wire as P
    from mindie.server.metrics import worker_families

    def hb(w, drafts, draft_tokens, accepted, per_pos):
        return P.Heartbeat(w, "a", "cpu:0", 1, "m", 0, 0, 10, 10, spec_drafts=drafts, spec_draft_tokens=draft_tokens,
                           spec_accepted_tokens=accepted, spec_accepted_per_pos=per_pos)
    fams = {f.name: f for f in worker_families("m", [hb("w0", 3, 12, 7, [3, 2, 2]), hb("w1", 1, 4, 1, [1])],
                                               (0.0, 0.0), 0, 0)}
    assert fams["vllm:spec_decode_num_drafts"].samples[0].value == 4
    assert fams["vllm:spec_decode_num_draft_tokens"].samples[0].value == 16
    assert fams["vllm:spec_decode_num_accepted_tokens"].samples[0].value == 8
    per = {s.labels["position"]: s.value for s in fams["vllm:spec_decode_num_accepted_tokens_per_pos"].samples}
    assert per == {"0": 4, "1": 2, "2": 2}


@pytest.mark.parametrize("overrides, said", [
    ({}, "speculative decoding: suffix, up to 8 proposed tokens per request and step, in steps of up to 8 "
         "decoding requests, a proposal cut to the tokens its request's recent acceptance makes worth its rows "
         "(10% of a step a row, in the step's expected tokens per second; a match of 8 tokens or longer priced at 90% "
         "acceptance), a step at most 2x as long as without its proposals"),
    ({"spec_method": "ngram", "spec_lookup_min": 1}, "speculative decoding: ngram, up to 8 proposed tokens per "
     "request and step, n-grams of 1-5 tokens, in steps of up to 8 decoding requests, a request pauses below "
     "30% recent acceptance, a step at most 2x as long as without its proposals"),
    ({"spec_method": ""}, "speculative decoding: off (ScheduleConfig.speculativeDecoding: false)"),
    ({"spec_max_batch": 0}, "speculative decoding: off (ScheduleConfig.speculationMaxBatch: 0)"),
])
def test_the_engine_says_once_at_start_what_it_speculates(caplog, overrides, said) -> None:
    from mindie.contract.spec import EngineConfig
    from workers.engine.engine import Engine
    with caplog.at_level("INFO", logger="workers.engine"):
        Engine(CycleRunner(), EngineConfig(block_size=4, spec_tokens=8, **overrides), 64)
    assert [r.getMessage() for r in caplog.records if "speculative decoding" in r.getMessage()] == [said]
