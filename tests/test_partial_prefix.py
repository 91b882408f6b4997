"""Partial-block prefix hits (workers/engine/block_manager.py, "Partial blocks"): a prompt whose
shared prefix ends inside a block (a chat's system prompt and template, a repeated question)
takes the cached positions through a block copy at the step's start, and answers exactly as a
cold engine does; the bookkeeping (index, pins, eviction, leaks) checked directly too."""
from __future__ import annotations

import random
import time

import httpx
import pytest

from mindie.contract.wire import SamplingParams, Submit
from tests.harness import demo_server
from tests.lazy_modules import lazy_module
from tests.test_engine import GREEDY, make_engine, run
from workers.engine.block_manager import PARTIAL_GRAIN, BlockManager
from workers.engine.sequence import Sequence

openai = lazy_module("openai")  # imported where a test uses it (tests/lazy_modules.py)

BS = 64  # a block of four grains


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 32000) for _ in range(n)]


def cold(demo_model: str, reqs: dict) -> dict:
    """The same requests on an engine without a prefix cache, one at a time."""
    eng = make_engine(demo_model, block_size=BS, enable_prefix_cache=False)
    return {rid: run(eng, {rid: r})[rid][0] for rid, r in reqs.items()}


@pytest.fixture(scope="module")
def system() -> list[int]:
    return ids(37, seed=1)  # a "system prompt" ending inside the first block


def test_a_shared_prefix_inside_a_block_is_copied_and_answers_as_cold(demo_model, system):
    eng = make_engine(demo_model, block_size=BS)
    reqs = {"a": (system + ids(9, 2), GREEDY), "b": (system + ids(12, 3), GREEDY),
            "c": (system[:20] + ids(30, 4), GREEDY)}
    got = {}
    for rid, r in reqs.items():
        before = eng.blocks.hit_tokens
        got[rid] = run(eng, {rid: r})[rid][0]
        taken = eng.blocks.hit_tokens - before
        # "a" finds nothing; "b" the 37 shared positions (a's block, extended past the 32-token
        # grain token by token); "c" 20 of them (its 16-token grain, extended by 4)
        assert taken == {"a": 0, "b": 37, "c": 20}[rid], (rid, taken)
    assert got == cold(demo_model, reqs)
    assert eng.blocks.prefix_hits == 0  # no full block was ever shared
    assert eng.check_no_leaks()


def test_a_repeated_prompt_takes_all_but_its_last_position(demo_model, system):
    eng = make_engine(demo_model, block_size=BS)
    p = system + ids(8, 5)  # 45 tokens
    first = run(eng, {"a": (p, GREEDY)})["a"][0]
    before = eng.blocks.hit_tokens
    again = run(eng, {"b": (p, GREEDY)})["b"][0]
    assert eng.blocks.hit_tokens - before == len(p) - 1 and again == first
    # A prompt of full blocks plus a tail: the full blocks hashed, the tail copied.
    long = ids(2 * BS + 30, 6)
    run(eng, {"c": (long, GREEDY)})
    hits, before = eng.blocks.prefix_hits, eng.blocks.hit_tokens
    tail = run(eng, {"d": (long[:-3] + [11, 12], GREEDY)})["d"][0]
    assert eng.blocks.prefix_hits - hits == 2 and eng.blocks.hit_tokens - before == len(long) - 3
    assert tail == cold(demo_model, {"d": (long[:-3] + [11, 12], GREEDY)})["d"]
    assert eng.check_no_leaks()


def test_a_running_request_shares_the_block_it_is_filling(demo_model, system):
    eng = make_engine(demo_model, block_size=BS)
    long = SamplingParams(max_new_tokens=40, ignore_eos=True)
    eng.add(Submit("a", "fe", system + ids(5, 7), long, 5))
    out = {"a": [], "b": []}
    for o in eng.step():  # a's prompt is computed; its block (42 positions) is indexed
        out[o.seq.request_id].extend(o.token_ids)
    before = eng.blocks.hit_tokens
    b_prompt = system + ids(6, 8)
    eng.add(Submit("b", "fe", b_prompt, GREEDY, 5))
    while eng.has_work():
        for o in eng.step():
            out[o.seq.request_id].extend(o.token_ids)
    assert eng.blocks.hit_tokens - before == len(system)
    assert eng.blocks.blocks[0].ref_count == 0 and eng.check_no_leaks()
    assert out == cold(demo_model, {"a": (system + ids(5, 7), long), "b": (b_prompt, GREEDY)})


def test_hits_stop_where_prompt_logprobs_are_missing(demo_model, system):
    eng = make_engine(demo_model, block_size=BS)
    run(eng, {"a": (system + ids(9, 9), GREEDY)})
    before = eng.blocks.hit_tokens
    want = SamplingParams(max_new_tokens=4, ignore_eos=True, prompt_logprobs=1)
    run(eng, {"b": (system + ids(9, 10), want)})
    assert eng.blocks.hit_tokens == before  # every position's log-probability is computed
    assert eng.check_no_leaks()


def test_a_source_that_is_the_last_free_block_is_computed_instead(demo_model, system):
    """With one block in all, the cached block would be both the source and the only fresh block:
    the request computes its prompt rather than wait for a second block that never comes."""
    eng = make_engine(demo_model, num_blocks=1, block_size=BS)
    p = system + ids(4, 11)
    first = run(eng, {"a": (p, SamplingParams(max_new_tokens=8, ignore_eos=True))})["a"][0]
    before = eng.blocks.hit_tokens
    again = run(eng, {"b": (p, SamplingParams(max_new_tokens=8, ignore_eos=True))})["b"][0]
    assert again == first and eng.blocks.hit_tokens == before and eng.check_no_leaks()


def _seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, "fe", len(tokens), list(tokens), GREEDY, 8)


def test_index_entries_go_with_evicted_blocks_and_sources_stay_pinned():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = _seq("a", list(range(100, 150)))  # 50 tokens: one partial block
    bm.admit(a, [])
    bm.grow(a, 50)
    a.num_computed = 50
    bm.register_computed(a)
    src = a.block_table[0]
    assert bm.blocks[src].indexed == 48 and len(bm.partial_index) == 48 // PARTIAL_GRAIN
    bm.release(a)
    b = _seq("b", list(range(100, 140)) + [7, 8])
    assert bm.match_partial(b, [], 10 ** 6) == (src, 40)
    bm.admit(b, [], (src, 40))
    assert bm.copies == [(src, b.block_table[0])] and b.num_computed == 40
    assert src not in bm.free  # pinned: no allocation of this step can take it
    copies = bm.take_copies()
    bm.unpin(copies)
    assert src in bm.free and bm.blocks[src].ref_count == 0
    bm.release(b)
    # Two fresh allocations evict the cached blocks, oldest first: their index entries go with them.
    c = _seq("c", list(range(500, 500 + 3 * BS)))
    bm.admit(c, [])
    bm.grow(c, 3 * BS)
    assert not bm.partial_index and bm.match_partial(_seq("d", list(range(100, 150))), [], 10 ** 6) == (-1, 0)


def test_a_short_system_prompt_is_reused_through_the_server(demo_model, tmp_path):
    """The launch script's server (MindIE's 128-token blocks), through the openai client: chat
    requests sharing a system prompt far shorter than a block. The first caches nothing anyone
    had; the second takes the shared positions from the first's block (the prefix-cache hit rate
    turns positive, which whole blocks alone never make it here); a repeat answers the same. Each
    answer's usage says how many prompt tokens came from the cache (enablePromptTokensDetails, and
    the Responses API's always): none, the shared ones, then all but the last of a repeat."""
    system = "You are a careful assistant. Answer in one short sentence, and never use lists."

    def hit_rate(url: str) -> float:
        return next(float(ln.split()[-1]) for ln in httpx.get(url + "/metrics", timeout=10).text.splitlines()
                    if ln.startswith("npu_prefix_cache_hit_rate"))

    with demo_server(tmp_path, demo_model, schedule={"cacheBlockSize": 128},  # MindIE's default
                     server={"enablePromptTokensDetails": True}) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)

        def ask(question: str) -> tuple[str, int, int]:
            r = client.chat.completions.create(model="demo", temperature=0, max_tokens=12, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": question}])
            return r.choices[0].message.content, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens

        first, n, cached = ask("Where is Lyon?")
        assert n < 128 and cached == 0  # the whole prompt inside one block: whole-block caching finds nothing
        time.sleep(1.0)  # a few heartbeats (0.25 s): the rate after the first request alone
        assert hit_rate(srv.url) == 0.0
        second, m, cached = ask("Where is Nantes?")
        assert 16 <= cached < m, cached  # the system prompt's positions, not the question's
        deadline = time.monotonic() + 15  # the rate comes with the worker's next heartbeat
        while hit_rate(srv.url) == 0.0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert hit_rate(srv.url) > 0.0
        assert ask("Where is Nantes?") == (second, m, m - 1)  # all but the last position (its logits)
        assert ask("Where is Lyon?") == (first, n, n - 1)
        for _ in range(2):  # the Responses API's usage always carries the count
            r = client.responses.create(model="demo", input="Where is Rennes?", max_output_tokens=8, temperature=0)
        assert r.usage.input_tokens_details.cached_tokens == r.usage.input_tokens - 1, r.usage

