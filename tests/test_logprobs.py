"""Stop token ids, log-probabilities, prompt log-probabilities and OpenAI's presence / frequency
penalties in the engine (issue 14 item 4), checked against transformers' logits on tiny random
models: the values a request gets are the log-softmax of the distribution its token was drawn
from, in a batch with requests that do not ask, through chunked prefill, the prefix cache and
preemption; and they reach the wire through a real device worker (null model)."""
from __future__ import annotations

import asyncio
import math
import random
import signal
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import torch

from mindie.contract import wire as P
from mindie.contract.errors import FINISH_EOS, FINISH_LENGTH, FINISH_STOP_TOKEN
from mindie.contract.spec import EngineConfig
from mindie.contract.wire import SamplingParams, Submit
from workers.engine.engine import Engine
from workers.engine.model_runner import NullRunner
from workers.engine.sampler import Sampler
from workers.engine.sequence import Sequence

transformers = pytest.importorskip("transformers")
from transformers import RepetitionPenaltyLogitsProcessor  # noqa: E402

from tests.test_engine import make_engine  # noqa: E402
from tests.test_models import _make_hf  # noqa: E402

VOCAB = 160  # tests/test_models.py's tiny models
TOL = 2e-4  # fp32: our logits are within 1e-4 of transformers' (tests/test_models.py)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("hf_lp")
    return {case: _make_hf(case, root) for case in ("llama3", "qwen2")}


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None  # from the first output
    later_prompt_logprobs: int = 0  # outputs after the first that carried any
    frames: int = 0
    reason: str = ""


def run(engine: Engine, reqs: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Result]:
    for rid, (ids, params) in reqs.items():
        engine.add(Submit(rid, "fe", ids, params))
    res = {rid: Result() for rid in reqs}
    while engine.has_work():
        for o in engine.step():
            r = res[o.seq.request_id]
            assert len(o.logprobs) in (0, len(o.token_ids)) and len(o.top_logprobs) in (0, len(o.token_ids))
            r.tokens += o.token_ids
            r.logprobs += o.logprobs
            r.top += o.top_logprobs
            if r.frames == 0:
                r.prompt_logprobs = o.prompt_logprobs
            elif o.prompt_logprobs:
                r.later_prompt_logprobs += 1
            r.frames += 1
            r.reason = o.finish_reason or r.reason
    assert engine.check_no_leaks()
    return res


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """transformers' fp32 logits [len(ids), V] of the whole sequence."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def processed(logits: torch.Tensor, params: SamplingParams, history: list[int], generated: list[int]) -> torch.Tensor:
    """The reference of the distribution the sampler draws from, on one row [V]: transformers'
    repetition penalty over prompt + generated, OpenAI's presence / frequency over the generated
    ids, the temperature for sampling requests; then log_softmax."""
    x = logits.clone()[None]
    if params.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(torch.tensor([history]), x)
    counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=x.shape[1]).float()
    x = x - params.presence_penalty * (counts > 0).float() - params.frequency_penalty * counts
    if params.do_sample and params.temperature > 0:
        x = x / params.temperature
    return torch.log_softmax(x[0], dim=-1)


def check_token_logprobs(hf, prompt: list[int], r: Result, params: SamplingParams) -> None:
    """Every step's value and top-k equal the reference computed from transformers' logits."""
    assert len(r.logprobs) == len(r.tokens) > 0
    k = params.logprobs
    assert len(r.top) == (len(r.tokens) if k > 0 else 0)
    full = hf_logits(hf, prompt + r.tokens[:-1])
    for t, tok in enumerate(r.tokens):
        ref = processed(full[len(prompt) - 1 + t], params, prompt + r.tokens[:t], r.tokens[:t])
        assert abs(r.logprobs[t] - ref[tok].item()) <= TOL, (t, r.logprobs[t], ref[tok].item())
        if not params.do_sample:
            assert tok == int(ref.argmax())  # greedy on the penalised logits
        if k > 0:
            rv, ri = ref.topk(k)
            ids = [i for i, _ in r.top[t]]
            vals = [v for _, v in r.top[t]]
            assert vals == sorted(vals, reverse=True)  # best first
            assert torch.allclose(torch.tensor(vals), rv, atol=TOL, rtol=0), (t, vals, rv)
            assert ids == ri.tolist(), (t, ids, ri.tolist())


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


# ----------------------------------------------------------------------------- token logprobs


@pytest.mark.parametrize("case", ["llama3", "qwen2"])
def test_greedy_logprobs_equal_transformers_in_a_mixed_batch(hf_models, case):
    hf, path = hf_models[case]
    ask5 = SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=5)
    ask0 = SamplingParams(max_new_tokens=7, ignore_eos=True, logprobs=0)
    ask20 = SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=20)
    plain = SamplingParams(max_new_tokens=9, ignore_eos=True)
    sampled = SamplingParams(do_sample=True, temperature=0.8, top_k=30, seed=7, max_new_tokens=9, ignore_eos=True)
    reqs = {"a5": (prompt(11, 1), ask5), "b0": (prompt(23, 2), ask0), "c": (prompt(17, 3), plain),
            "d": (prompt(6, 4), sampled), "e20": (prompt(30, 5), ask20)}
    eng = make_engine(str(path), num_blocks=64, max_prefill_tokens=20)
    res = run(eng, reqs)
    for rid in ("a5", "b0", "e20"):
        check_token_logprobs(hf, reqs[rid][0], res[rid], reqs[rid][1])
    assert len(res["e20"].top[0]) == 20
    for rid in ("c", "d"):  # those that do not ask get nothing, and the same tokens as alone
        assert res[rid].logprobs == [] and res[rid].top == [] and res[rid].prompt_logprobs == []
        alone = run(make_engine(str(path), num_blocks=64), {rid: reqs[rid]})[rid]
        assert res[rid].tokens == alone.tokens


@pytest.mark.parametrize("case", ["llama3", "qwen2"])
def test_logprobs_are_of_the_processed_distribution(hf_models, case):
    """With temperature, repetition, presence and frequency penalties: the values are those of
    the distribution after the penalties and the temperature (reference from transformers'
    logits), for sampled and greedy requests; top_k does not truncate them."""
    hf, path = hf_models[case]
    hot = SamplingParams(do_sample=True, temperature=0.6, top_k=40, repetition_penalty=1.3, presence_penalty=0.5,
                         frequency_penalty=0.3, seed=11, max_new_tokens=12, ignore_eos=True, logprobs=3)
    greedy = SamplingParams(repetition_penalty=1.2, presence_penalty=0.8, frequency_penalty=0.4,
                            max_new_tokens=12, ignore_eos=True, logprobs=4)
    warm = SamplingParams(do_sample=True, temperature=1.7, top_p=0.9, seed=3, max_new_tokens=12, ignore_eos=True,
                          logprobs=0)
    reqs = {"hot": (prompt(14, 6), hot), "greedy": (prompt(9, 7), greedy), "warm": (prompt(21, 8), warm),
            "plain": (prompt(12, 9), SamplingParams(max_new_tokens=5, ignore_eos=True))}
    res = run(make_engine(str(path), num_blocks=64), reqs)
    for rid in ("hot", "greedy", "warm"):
        check_token_logprobs(hf, reqs[rid][0], res[rid], reqs[rid][1])
    # The temperature matters: the values differ from the untempered log-softmax.
    full = hf_logits(hf, reqs["warm"][0] + res["warm"].tokens[:1])
    raw = torch.log_softmax(full[len(reqs["warm"][0]) - 1], -1)[res["warm"].tokens[0]].item()
    assert abs(raw - res["warm"].logprobs[0]) > 0.01


def test_sampler_logprobs_rows_and_dtype():
    """Sampler level: only asking rows get values, bf16 logits are processed in fp32, and the
    chosen token's value is the log-softmax at temperature 1 for greedy rows."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    rows = [Sequence("r", "f", 1, [i], SamplingParams(logprobs=k), 4) for i, k in enumerate([-1, 0, 2, -1])]
    toks, lps = Sampler().sample_with_logprobs(logits.clone(), rows)
    assert lps[0] is None and lps[3] is None
    ref = torch.log_softmax(logits, -1)
    assert toks.tolist() == logits.argmax(-1).tolist()
    assert lps[1] == (pytest.approx(ref[1, toks[1]].item(), abs=1e-6), [])
    assert [i for i, _ in lps[2][1]] == ref[2].topk(2).indices.tolist()
    tb, lpb = Sampler().sample_with_logprobs(logits.to(torch.bfloat16), rows)
    refb = torch.log_softmax(logits.to(torch.bfloat16).float(), -1)
    assert lpb[1][0] == pytest.approx(refb[1, tb[1]].item(), abs=1e-6)
    # __call__ (what requests without logprobs go through) is unchanged
    assert Sampler()(logits.clone(), rows).tolist() == toks.tolist()


# ----------------------------------------------------------------------------- penalties


def test_presence_frequency_penalty_exact_and_over_generated_ids_only():
    V = 12
    logits = torch.linspace(-2.0, 3.0, V).repeat(3, 1)
    # prompt [1, 2, 2], generated [2, 5, 5, 5, 40 (outside the logits)]
    r0 = Sequence("r", "f", 3, [1, 2, 2, 2, 5, 5, 5, 40], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), 9)
    r1 = Sequence("r", "f", 3, [1, 2, 2], SamplingParams(presence_penalty=2.0), 9)  # nothing generated yet
    r2 = Sequence("r", "f", 2, [7, 7, 9], SamplingParams(frequency_penalty=-1.0), 9)  # negative: encourages
    x = logits.clone()
    Sampler()(x, [r0, r1, r2])
    want = logits.clone()
    want[0, 2] -= 0.5 + 0.25 * 1
    want[0, 5] -= 0.5 + 0.25 * 3
    want[2, 9] += 1.0
    torch.testing.assert_close(x, want, rtol=0, atol=0)


@pytest.mark.parametrize("pen", [dict(presence_penalty=1.5), dict(frequency_penalty=0.7),
                                 dict(presence_penalty=0.4, frequency_penalty=0.4, repetition_penalty=1.2)],
                         ids=["presence", "frequency", "all"])
def test_penalties_change_greedy_output_as_the_reference_says(hf_models, pen):
    hf, path = hf_models["llama3"]
    p = prompt(8, 21)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, **pen)
    ids = list(p)
    for _ in range(24):
        logits = hf_logits(hf, ids)[-1]
        ids.append(int(processed(logits, params, ids, ids[len(p):]).argmax()))
    expected = ids[len(p):]
    eng = make_engine(str(path), num_blocks=64)
    res = run(eng, {"pen": (p, params), "plain": (p, SamplingParams(max_new_tokens=24, ignore_eos=True))})
    assert res["pen"].tokens == expected
    assert res["plain"].tokens != expected  # the penalty changed the greedy continuation


# ----------------------------------------------------------------------------- prompt logprobs


def reference_prompt_logprobs(hf, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf_logits(hf, ids)[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.mark.parametrize("case", ["llama3", "qwen2"])
def test_prompt_logprobs_through_chunked_prefill(hf_models, case):
    hf, path = hf_models[case]
    long = prompt(75, 31)  # chunks of 16 (the budget is shared with the other requests)
    reqs = {"long": (long, SamplingParams(max_new_tokens=4, ignore_eos=True, prompt_logprobs=True, logprobs=1)),
            "short": (prompt(9, 32), SamplingParams(max_new_tokens=6, ignore_eos=True, prompt_logprobs=True)),
            "one": ([5], SamplingParams(max_new_tokens=2, ignore_eos=True, prompt_logprobs=True)),
            "other": (prompt(40, 33), SamplingParams(max_new_tokens=6, ignore_eos=True))}
    eng = make_engine(str(path), num_blocks=64, max_prefill_tokens=16)
    res = run(eng, reqs)
    for rid in ("long", "short"):
        ids = reqs[rid][0]
        got = res[rid].prompt_logprobs
        assert got is not None and len(got) == len(ids) - 1
        torch.testing.assert_close(torch.tensor(got), reference_prompt_logprobs(hf, ids), atol=TOL, rtol=0)
        assert res[rid].later_prompt_logprobs == 0  # on the first frame only
    assert res["one"].prompt_logprobs == []  # the first token has none
    assert res["other"].prompt_logprobs == []
    check_token_logprobs(hf, long, res["long"], reqs["long"][1])


def test_prompt_logprobs_with_the_prefix_cache_holding_the_prompt(hf_models):
    """The cache holds the first blocks of the prompt: a request asking for prompt logprobs
    recomputes them (their logits are needed), one that does not still reuses them."""
    hf, path = hf_models["qwen2"]
    base = prompt(50, 41)
    eng = make_engine(str(path), num_blocks=64, max_prefill_tokens=24)
    run(eng, {"warm": (base + [7, 8, 9], SamplingParams(max_new_tokens=2, ignore_eos=True))})
    hits = eng.blocks.prefix_hits
    ids = base + [11, 12]
    res = run(eng, {"lp": (ids, SamplingParams(max_new_tokens=3, ignore_eos=True, prompt_logprobs=True))})
    assert eng.blocks.prefix_hits == hits  # nothing reused for the positions it needs
    got = torch.tensor(res["lp"].prompt_logprobs)
    torch.testing.assert_close(got, reference_prompt_logprobs(hf, ids), atol=TOL, rtol=0)
    plain = run(eng, {"p": (ids, SamplingParams(max_new_tokens=3, ignore_eos=True))})
    assert eng.blocks.prefix_hits == hits + 3  # 50 shared tokens: three full blocks of 16
    assert plain["p"].tokens == res["lp"].tokens


def test_prompt_logprobs_survive_preemption(hf_models, monkeypatch):
    """A tiny cache preempts requests part-way through their prompts; the prompt logprobs are
    still complete and exact (positions already known are kept, the rest recomputed)."""
    hf, path = hf_models["llama3"]
    ps = [prompt(n, 50 + n) for n in (60, 45, 70, 38)]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, prompt_logprobs=True, logprobs=0)
    # one token a step (spec_method ""): the schedule that preempts a request mid-prompt assumes it
    # (speculation with preemption: tests/test_speculative.py)
    eng = make_engine(str(path), num_blocks=14, max_prefill_tokens=24, spec_method="")
    mid_prompt: list[int] = []  # prompt logprobs known when a request was preempted before its first token
    preempt = eng.scheduler._preempt

    def spy(seq: Sequence) -> None:
        if seq.num_output == 0:
            mid_prompt.append(len(seq.prompt_logprobs))
        preempt(seq)

    monkeypatch.setattr(eng.scheduler, "_preempt", spy)
    res = run(eng, {f"r{i}": (p, params) for i, p in enumerate(ps)})
    assert any(0 < n for n in mid_prompt), mid_prompt
    for i, p in enumerate(ps):
        r = res[f"r{i}"]
        ref = reference_prompt_logprobs(hf, p)
        torch.testing.assert_close(torch.tensor(r.prompt_logprobs), ref, atol=TOL, rtol=0)
        check_token_logprobs(hf, p, r, params)


# ----------------------------------------------------------------------------- stop token ids


def test_stop_token_ids_end_the_request_with_the_id_included(hf_models):
    hf, path = hf_models["llama3"]
    eng = make_engine(str(path), num_blocks=64)
    p = prompt(10, 61)
    greedy = run(eng, {"g": (p, SamplingParams(max_new_tokens=16, ignore_eos=True))})["g"].tokens
    k = next(k for k in range(2, 16) if greedy[k] not in greedy[:k])  # first occurrence at k
    unseen = next(t for t in range(3, VOCAB) if t not in greedy)
    res = run(eng, {
        "stop": (p, SamplingParams(max_new_tokens=16, ignore_eos=True, stop_token_ids=[unseen, greedy[k]])),
        "never": (p, SamplingParams(max_new_tokens=16, ignore_eos=True, stop_token_ids=[unseen])),
        "last": (p, SamplingParams(max_new_tokens=k + 1, stop_token_ids=[greedy[k]])),
    })
    assert (res["stop"].tokens, res["stop"].reason) == (greedy[:k + 1], FINISH_STOP_TOKEN)
    assert (res["never"].tokens, res["never"].reason) == (greedy, FINISH_LENGTH)
    assert (res["last"].tokens, res["last"].reason) == (greedy[:k + 1], FINISH_STOP_TOKEN)  # beats length


def test_stop_token_and_eos_precedence():
    """EOS (unless ignore_eos) wins over a stop id; with ignore_eos the stop id still stops."""
    runner = NullRunner(vocab_size=50)  # emits 3, 4, 5, ...
    runner.eos_token_ids = frozenset({5})
    eng = Engine(runner, EngineConfig(block_size=4, max_seq_len=64), 32)
    res = run(eng, {"eos": ([1, 2], SamplingParams(max_new_tokens=10, stop_token_ids=[5]))})
    assert (res["eos"].tokens, res["eos"].reason) == ([3, 4, 5], FINISH_EOS)
    runner = NullRunner(vocab_size=50)
    runner.eos_token_ids = frozenset({5})
    eng = Engine(runner, EngineConfig(block_size=4, max_seq_len=64), 32)
    res = run(eng, {"ign": ([1, 2], SamplingParams(max_new_tokens=10, ignore_eos=True, stop_token_ids=[5]))})
    assert (res["ign"].tokens, res["ign"].reason) == ([3, 4, 5], FINISH_STOP_TOKEN)


# ----------------------------------------------------------------------------- the null runner


def test_null_runner_logprobs_are_a_uniform_model():
    V = 100
    eng = Engine(NullRunner(vocab_size=V), EngineConfig(block_size=4, max_seq_len=64, max_prefill_tokens=5), 32)
    res = run(eng, {"a": (list(range(1, 13)), SamplingParams(max_new_tokens=4, logprobs=3, prompt_logprobs=True,
                                                              ignore_eos=True)),
                    "b": ([1, 2], SamplingParams(max_new_tokens=3))})
    lp = -math.log(V)
    a = res["a"]
    assert a.prompt_logprobs == [lp] * 11 and a.logprobs == [lp] * 4
    assert a.top == [[(t, lp), ((t + 1) % V, lp), ((t + 2) % V, lp)] for t in a.tokens]
    assert res["b"].logprobs == [] and res["b"].prompt_logprobs == []


# ----------------------------------------------------------------------------- on the wire


@pytest.fixture
def null_worker(tmp_path, demo_model):
    from tests.harness import ROOT, free_port, short_run_dir, write_config, write_plan
    cfg_path = write_config(tmp_path / "config.json", port=free_port(), run_dir=short_run_dir(),
                            model_path=demo_model, workers=1)
    path, dep = write_plan(cfg_path, null_model=True, null_step_ms=1)
    proc = subprocess.Popen([sys.executable, "-m", "workers.supervisor", "--deployment", path], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield dep
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)


@pytest.mark.timeout(120)
def test_frames_carry_logprobs_through_a_device_worker(null_worker):
    from tests.test_device_workers import _connected

    async def frames(c, ids, params) -> list[P.TokenFrame]:
        stream = c.submit(ids, params)
        out: list[P.TokenFrame] = []
        while not (out and out[-1].finish_reason):
            got = await stream.get(30.0)
            assert got, "request timed out"
            out += got
        return out

    async def main():
        async with _connected(null_worker) as c:
            fs = await frames(c, [5, 6, 7, 8], SamplingParams(max_new_tokens=3, logprobs=2, prompt_logprobs=True))
            assert all(f.error is None for f in fs)
            ids = [t for f in fs for t in f.token_ids]
            assert len(ids) == 3 and fs[-1].finish_reason == FINISH_LENGTH
            lps = [v for f in fs for v in f.logprobs]
            tops = [v for f in fs for v in f.top_logprobs]
            assert len(lps) == 3 and all(v < 0 for v in lps)
            assert [len(t) for t in tops] == [2, 2, 2] and [t[0][0] for t in tops] == ids
            assert len(fs[0].prompt_logprobs) == 3 and all(not f.prompt_logprobs for f in fs[1:])
            first = ids[0]  # the null model counts up: stop at the token after next
            fs = await frames(c, [5, 6], SamplingParams(max_new_tokens=50, stop_token_ids=[first + 4]))
            ids = [t for f in fs for t in f.token_ids]
            assert fs[-1].finish_reason == FINISH_STOP_TOKEN and ids[-1] == first + 4
            assert all(not f.logprobs and not f.top_logprobs and not f.prompt_logprobs for f in fs)

    asyncio.run(main())
