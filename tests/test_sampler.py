"""Sampler and watermark: TGI semantics checked against transformers' processors, seeded
determinism, draw statistics, watermark detection."""
from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
                          TopPLogitsWarper, TypicalLogitsWarper)

from mindie.protocol import SamplingParams
from workers.engine import watermark as wm
from workers.engine.sampler import Sampler, SamplingState, draw_uniforms

ROOT = Path(__file__).resolve().parents[1]


def sp(**kw: object) -> SamplingParams:
    return SamplingParams(**kw)  # type: ignore[arg-type]


def randn(rows: int, vocab: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def reference_scores(logits: torch.Tensor, p: SamplingParams, ids: list[int] | None = None,
                     top_p: float | None = None, typical_p: float | None = None) -> torch.Tensor:
    """transformers' processors in TGI's order on one row [1, V]."""
    x = logits.clone()
    if p.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([ids]), x)
    if p.temperature != 1.0:
        x = TemperatureLogitsWarper(p.temperature)(None, x)
    if p.top_k > 0:
        x = TopKLogitsWarper(p.top_k)(None, x)
    tp = p.top_p if top_p is None else top_p
    if tp < 1.0:
        x = TopPLogitsWarper(tp)(None, x)
    ty = p.typical_p if typical_p is None else typical_p
    if ty < 1.0:
        x = TypicalLogitsWarper(ty)(None, x)
    return x


def assert_matches_reference(got: torch.Tensor, logits: torch.Tensor, params: list[SamplingParams],
                             ids: list[list[int]]) -> None:
    """Row by row: the sampler's distribution equals transformers'. Where a token sits within
    float rounding of the top_p / typical_p line, either side is accepted: the support must lie
    between the references computed with the mass thresholds moved by +-1e-5."""
    eps = 1e-5
    for r, p in enumerate(params):
        ref = torch.softmax(reference_scores(logits[r:r + 1], p, ids[r]), -1)[0]
        lo = torch.softmax(reference_scores(logits[r:r + 1], p, ids[r], p.top_p - eps, p.typical_p - eps), -1)[0]
        hi = torch.softmax(reference_scores(logits[r:r + 1], p, ids[r], min(p.top_p + eps, 1.0),
                                            min(p.typical_p + eps, 1.0)), -1)[0]
        g = got[r]
        for cand in (ref, lo, hi):
            if torch.equal(g > 0, cand > 0):
                torch.testing.assert_close(g, cand, atol=2e-6, rtol=2e-4)
                break
        else:
            pytest.fail(f"row {r} {p}: support {(g > 0).sum()} tokens, reference {(ref > 0).sum()}")


# --------------------------------------------------------------------------------------------
# Equivalence with transformers
# --------------------------------------------------------------------------------------------

V = 500


def _states(params: list[SamplingParams], ids: list[list[int]]) -> list[SamplingState]:
    return [SamplingState(p, i) for p, i in zip(params, ids)]


CASES = {
    "temperature": dict(temperature=0.6),
    "hot": dict(temperature=1.7),
    "top_k": dict(top_k=7),
    "top_k_T": dict(top_k=30, temperature=0.5),
    "top_k_huge": dict(top_k=10_000),
    "top_p": dict(top_p=0.85),
    "top_p_small": dict(top_p=0.05),
    "top_p_T": dict(top_p=0.6, temperature=0.4),
    "typical": dict(typical_p=0.7),
    "all": dict(temperature=0.8, top_k=40, top_p=0.9, typical_p=0.95, repetition_penalty=1.3),
    "k_p": dict(top_k=100, top_p=0.7),
    "penalty_only": dict(repetition_penalty=1.8),
    "reward": dict(repetition_penalty=0.6, temperature=0.9),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_distribution_matches_transformers(name: str, scale: float) -> None:
    rows = 6
    logits = randn(rows, V, seed=zlib.crc32(name.encode()) % 1000, scale=scale)
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in torch.randint(1, 60, (rows,), generator=g)]
    params = [sp(do_sample=True, seed=i, **CASES[name]) for i in range(rows)]
    got = Sampler().distribution(logits.clone(), _states(params, ids))
    assert_matches_reference(got, logits, params, ids)


@given(seed=st.integers(0, 10_000), k=st.sampled_from([0, 1, 3, 50, 499, 600]),
       p=st.sampled_from([1.0, 0.95, 0.5, 0.2]), t=st.sampled_from([1.0, 0.3, 2.0]),
       ty=st.sampled_from([1.0, 1.0, 0.8]), scale=st.sampled_from([0.5, 2.0, 6.0]),
       candidates=st.sampled_from([2, 16, 128, V]))
@settings(max_examples=60, deadline=None, derandomize=True)
def test_routes_match_transformers(seed: int, k: int, p: float, t: float, ty: float, scale: float,
                                   candidates: int) -> None:
    """Random parameter mixes through both routes (small windows force the dense fallback)."""
    logits = randn(3, V, seed, scale)
    params = [sp(do_sample=True, top_k=k, top_p=p, temperature=t, typical_p=ty, seed=i) for i in range(3)]
    ids = [[0]] * 3
    got = Sampler(candidates=candidates).distribution(logits.clone(), _states(params, ids))
    assert_matches_reference(got, logits, params, ids)


def test_top_k_keeps_ties_with_kth_value() -> None:
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.5], [5.0, 4.0, 4.0, 1.0, 1.0, 0.0]])
    params = [sp(do_sample=True, top_k=2), sp(do_sample=True, top_k=2, top_p=0.999)]
    got = Sampler().distribution(logits.clone(), _states(params, [[0], [0]]))
    assert (got[0] > 0).tolist() == [True, True, True, True, False, False]
    assert (got[1] > 0).tolist() == [True, True, True, False, False, False]
    ref = torch.softmax(TopKLogitsWarper(2)(None, logits.clone()), -1)
    torch.testing.assert_close(got[0], ref[0])


def test_top_p_keeps_most_likely_token() -> None:
    logits = torch.tensor([[0.0, 9.0, 1.0, 2.0]])
    got = Sampler().distribution(logits.clone(), _states([sp(do_sample=True, top_p=0.01)], [[0]]))
    assert got[0].tolist() == [0.0, 1.0, 0.0, 0.0]


def test_candidate_and_dense_routes_agree_with_ties() -> None:
    """Rounded logits give many ties; window size must not change the kept set or the draw."""
    logits = torch.round(randn(8, V, 11, 3.0) * 2) / 2
    params = [sp(do_sample=True, top_p=0.83, seed=i, top_k=[0, 0, 20, 3][i % 4]) for i in range(8)]
    outs = [Sampler(candidates=c).distribution(logits.clone(), _states(params, [[1]] * 8)) for c in (2, 64, V)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=1e-6, rtol=1e-5)
    toks = [Sampler(candidates=c)(logits.clone(), _states(params, [[1]] * 8)).tolist() for c in (64, 100, 300)]
    assert toks[0] == toks[1] == toks[2]


def test_repetition_penalty_matches_transformers_and_covers_prompt_and_output() -> None:
    logits = randn(4, V, 3, 2.0)
    ids = [[1, 2, 3, 3, 499], [10, 20], [0, 5, 7, 9, 11, 13, 400, 17], [42]]
    pens = [1.3, 2.0, 0.7, 1.0]
    params = [sp(repetition_penalty=p) for p in pens]
    states = _states(params, ids)
    states[1].append(int(logits[1].argmax()))  # a generated token is penalised too
    ids[1].append(int(logits[1].argmax()))
    got = Sampler().distribution(logits.clone(), [SamplingState(sp(do_sample=True, repetition_penalty=p), i)
                                                  for p, i in zip(pens, ids)])
    for r, p in enumerate(pens):
        ref = RepetitionPenaltyLogitsProcessor(p)(torch.tensor([ids[r]]), logits[r:r + 1].clone())
        torch.testing.assert_close(got[r], torch.softmax(ref, -1)[0])
    toks = Sampler()(logits.clone(), states)  # greedy rows: argmax after the penalty
    for r, p in enumerate(pens):
        ref = RepetitionPenaltyLogitsProcessor(p)(torch.tensor([ids[r]]), logits[r:r + 1].clone())
        assert toks[r].item() == ref.argmax().item()


def test_repetition_penalty_ignores_ids_outside_logits() -> None:
    logits = randn(1, 10, 4)
    x = logits.clone()
    Sampler()(x, [SamplingState(sp(repetition_penalty=2.0), [3, 12, 15])])
    expect = logits.clone()
    expect[0, 3] = expect[0, 3] / 2 if expect[0, 3] > 0 else expect[0, 3] * 2
    torch.testing.assert_close(x, expect)


# --------------------------------------------------------------------------------------------
# Greedy
# --------------------------------------------------------------------------------------------


def test_greedy_is_argmax_alone_and_mixed() -> None:
    logits = randn(16, 3000, 9, 3.0)
    s = Sampler()
    all_greedy = [SamplingState(sp(seed=i), [i]) for i in range(16)]
    assert torch.equal(s(logits.clone(), all_greedy), logits.argmax(-1))
    mixed = [SamplingState(sp(seed=i) if i % 2 else sp(do_sample=True, top_k=5, seed=i), [i]) for i in range(16)]
    out = s(logits.clone(), mixed)
    assert torch.equal(out[1::2], logits.argmax(-1)[1::2])
    # temperature <= 0 with do_sample means greedy (OpenAI-style temperature 0)
    z = [SamplingState(sp(do_sample=True, temperature=0.0, seed=i), [i]) for i in range(16)]
    assert torch.equal(s(logits.clone(), z), logits.argmax(-1))


def test_greedy_bf16_logits() -> None:
    logits = randn(4, 1000, 2, 3.0).to(torch.bfloat16)
    out = Sampler()(logits, [SamplingState(sp(), [1]) for _ in range(4)])
    assert torch.equal(out, logits.float().argmax(-1))


def test_logprobs_are_those_of_the_final_distribution() -> None:
    logits = randn(6, 800, 21, 2.0)
    params = [sp(), sp(do_sample=True, top_k=5, seed=1), sp(do_sample=True, top_p=0.7, seed=2),
              sp(do_sample=True, temperature=0.5, seed=3), sp(do_sample=True, typical_p=0.6, seed=4),
              sp(repetition_penalty=1.5)]
    states = _states(params, [[1, 2]] * 6)
    s = Sampler()
    out = s.sample(logits.clone(), states, want_logprobs=True)
    dist = s.distribution(logits.clone(), [SamplingState(p if p.do_sample else sp(do_sample=True,
                                           repetition_penalty=p.repetition_penalty), [1, 2]) for p in params])
    for r in range(6):
        tok = out.tokens[r].item()
        assert dist[r, tok] > 0
        torch.testing.assert_close(out.logprobs[r], dist[r, tok].log(), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# Seeds
# --------------------------------------------------------------------------------------------

TARGETS = [
    dict(do_sample=True, temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.1, seed=1234),
    dict(do_sample=True, top_p=0.9, seed=99),
    dict(do_sample=True, temperature=1.3, seed=2**63 - 1),
    dict(do_sample=True, typical_p=0.8, watermark=True, seed=5),
]


def _run_target(target: dict, position: int, others: list[SamplingParams], steps: int = 12,
                vocab: int = 2000, sampler: Sampler | None = None) -> list[int]:
    """Generate ``steps`` tokens for ``target`` at row ``position`` among ``others``; the target
    row sees the same logits in every configuration, the other rows random ones."""
    sampler = sampler or Sampler()
    tgt = SamplingState(sp(**target), [5, 6, 7])
    rest = [SamplingState(p, [1, 2, 3, 4]) for p in others]
    g_noise = torch.Generator().manual_seed(len(others) * 7 + position)
    out = []
    for step in range(steps):
        row = randn(1, vocab, 1000 + step, 2.5)
        logits = torch.randn(len(others) + 1, vocab, generator=g_noise) * 3
        logits[position] = row[0]
        batch = rest[:position] + [tgt] + rest[position:]
        toks = sampler(logits, batch).tolist()
        for s, t in zip(batch, toks):
            s.append(t)
        out.append(toks[position])
    return out


OTHERS = [sp(), sp(do_sample=True, top_k=1000, seed=3), sp(do_sample=True, top_p=0.5, seed=4),
          sp(do_sample=True, typical_p=0.3, seed=5), sp(watermark=True, repetition_penalty=1.5),
          sp(do_sample=True, temperature=0.1, top_k=2, seed=1234), sp(do_sample=True, seed=1234)]


@pytest.mark.parametrize("target", TARGETS)
def test_same_seed_same_tokens_whatever_the_batch(target: dict) -> None:
    alone = _run_target(target, 0, [])
    assert _run_target(target, 3, OTHERS) == alone
    assert _run_target(target, 7, OTHERS[::-1]) == alone
    assert _run_target(target, 1, OTHERS[2:5]) == alone
    assert _run_target(target, 0, OTHERS, sampler=Sampler(max_candidate_k=50)) == alone
    assert len(set(alone)) > 1


RESTART_SNIPPET = """
import torch
from mindie.protocol import SamplingParams
from workers.engine.sampler import Sampler, SamplingState
result = []
for i, kw in enumerate(TARGETS):
    state = SamplingState(SamplingParams(**kw), [5, 6, 7])
    for step in range(10):
        logits = torch.randn(1, 2000, generator=torch.Generator().manual_seed(1000 + step)) * 2.5
        state.append(int(Sampler()(logits, [state])[0]))
    result.append(state.token_ids.tolist())
"""


def test_same_seed_same_tokens_across_processes() -> None:
    here: dict = {"TARGETS": TARGETS}
    exec(RESTART_SNIPPET, here)
    code = f"import json\nTARGETS = {TARGETS!r}\n{RESTART_SNIPPET}\nprint(json.dumps(result))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "123"})
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == here["result"]


def test_state_recreated_each_step_gives_the_same_tokens() -> None:
    """The draw index is len(tokens) - prompt_len, so an engine may also rebuild the state from
    its token list every step (or after a preemption) without changing the output."""
    target = TARGETS[0]
    kept = _run_target(target, 0, [])
    tokens = [5, 6, 7]
    sampler = Sampler()
    for step in range(12):
        logits = randn(1, 2000, 1000 + step, 2.5)
        state = SamplingState(sp(**target), tokens, prompt_len=3)
        tokens = tokens + [int(sampler(logits, [state])[0])]
    assert tokens[3:] == kept


def test_different_seeds_differ() -> None:
    seqs = {tuple(_run_target(dict(do_sample=True, top_p=0.95, seed=s), 0, [], steps=6)) for s in range(16)}
    assert len(seqs) >= 14
    firsts = {_run_target(dict(do_sample=True, seed=s), 0, [], steps=1)[0] for s in range(40)}
    assert len(firsts) >= 10


def test_uniforms_depend_on_seed_and_step_only() -> None:
    assert draw_uniforms(7, 3) == draw_uniforms(7, 3)
    us = [draw_uniforms(s, t) for s in range(50) for t in range(50)]
    assert len(set(us)) == len(us)
    flat = [x for pair in us for x in pair]
    assert all(0.0 <= x < 1.0 for x in flat)
    assert abs(sum(flat) / len(flat) - 0.5) < 0.02
    corr = sum((a - 0.5) * (b - 0.5) for a, b in us) / len(us) / (1 / 12)
    assert abs(corr) < 0.06


# --------------------------------------------------------------------------------------------
# Draw statistics
# --------------------------------------------------------------------------------------------


def _chi2_upper(df: int, z: float = 4.26) -> float:
    """Chi-square quantile by Wilson-Hilferty; z = 4.26 ~ p = 1e-5 (a false alarm is very rare)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts: torch.Tensor, probs: torch.Tensor, n: int) -> tuple[float, int]:
    exp = probs.double() * n
    big = exp >= 8
    obs_b, exp_b = counts[big].double(), exp[big]
    stat = float(((obs_b - exp_b) ** 2 / exp_b).sum())
    df = int(big.sum()) - 1
    rest_e = float(exp[~big].sum())
    if rest_e >= 8:
        stat += (float(counts[~big].sum()) - rest_e) ** 2 / rest_e
        df += 1
    assert float(counts[probs == 0].sum()) == 0, "drew a token of probability 0"
    return stat, df


@pytest.mark.parametrize("params,scale", [
    (dict(temperature=0.9), 1.0),            # dense route, 1000 = 3 chunks of 256 + a tail of 232
    (dict(top_k=20, temperature=1.2), 1.0),  # candidate route
    (dict(top_p=0.9), 3.0),                  # candidate route, p only (nucleus inside the window)
    (dict(top_p=0.97), 0.5),                 # window too small -> dense fallback
    (dict(typical_p=0.9, top_k=300), 1.0),   # dense route
])
@pytest.mark.parametrize("vary", ["seed", "step"])
def test_sampled_frequencies_follow_distribution(params: dict, scale: float, vary: str) -> None:
    n, vocab = 12_000, 1000
    logits = randn(1, vocab, 77, scale)
    if vary == "seed":  # n requests with seeds 0..n-1 at their first step
        states = [SamplingState(sp(do_sample=True, seed=s, **params), [3]) for s in range(n)]
    else:  # one seed at steps 0..n-1 (a request that already generated `step` tokens)
        # num_generated = len(ids) - prompt_len; only the draw index matters here
        states = [SamplingState(sp(do_sample=True, seed=42, **params), [3], prompt_len=1 - t) for t in range(n)]
    s = Sampler()
    probs = s.distribution(logits.clone(), states[:1])[0]
    toks = s(logits.expand(n, vocab).clone(), states)
    counts = torch.bincount(toks, minlength=vocab)
    stat, df = _chi2(counts, probs, n)
    assert df >= 5
    assert stat < _chi2_upper(df), (stat, df)


def test_chi2_check_catches_a_biased_draw() -> None:
    """The statistic above is sharp enough: a distribution off by 25% in two tokens fails."""
    n, vocab = 12_000, 1000
    logits = randn(1, vocab, 77, 1.0)
    states = [SamplingState(sp(do_sample=True, top_k=20, seed=s), [3]) for s in range(n)]
    s = Sampler()
    probs = s.distribution(logits.clone(), states[:1])[0]
    toks = s(logits.expand(n, vocab).clone(), states)
    biased = probs.clone()
    top = probs.argsort(descending=True)[:2]
    biased[top[0]] *= 1.25
    biased[top[1]] *= 0.75
    biased /= biased.sum()
    stat, df = _chi2(torch.bincount(toks, minlength=vocab), biased, n)
    assert stat > _chi2_upper(df)


# --------------------------------------------------------------------------------------------
# Watermark
# --------------------------------------------------------------------------------------------


def test_green_lists_torch_equals_python() -> None:
    proc = wm.WatermarkLogitsProcessor(wm.WatermarkConfig(gamma=0.3))
    g = torch.Generator().manual_seed(0)
    prev = torch.cat([torch.tensor([0, 1, 2**20]), torch.randint(0, 200_000, (5,), generator=g)])
    mask = proc.green_mask(prev, 3000)
    for r, p in enumerate(prev.tolist()):
        for t in torch.randint(0, 3000, (60,), generator=g).tolist() + [0, 2999]:
            assert bool(mask[r, t]) == wm.is_green(p, t, 0.3)


@pytest.mark.parametrize("gamma", [0.5, 0.25])
def test_green_lists_have_gamma_fraction_and_vary_with_prev(gamma: float) -> None:
    proc = wm.WatermarkLogitsProcessor(wm.WatermarkConfig(gamma=gamma))
    mask = proc.green_mask(torch.arange(0, 4000, 97), 32000).float()
    assert torch.all((mask.mean(1) - gamma).abs() < 0.015)
    overlap = (mask[0] * mask[1]).mean().item()
    assert abs(overlap - gamma * gamma) < 0.02  # independent lists for different previous tokens


def _generate(params: SamplingParams, steps: int = 200, vocab: int = 5000, gamma: float = 0.5,
              seed: int = 0) -> list[int]:
    sampler = Sampler(wm.WatermarkConfig(gamma=gamma, delta=2.0))
    state = SamplingState(params, [17])
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        logits = torch.randn(1, vocab, generator=g) * 2.0
        state.append(int(sampler(logits, [state])[0]))
    return state.token_ids.tolist()


@pytest.mark.parametrize("gamma", [0.5, 0.25])
def test_watermark_detectable(gamma: float) -> None:
    for seed in range(3):
        ids = _generate(sp(do_sample=True, watermark=True, seed=seed), gamma=gamma, seed=seed)
        z, green, total = wm.detect(ids, 5000, gamma)
        assert total == 200 and z > 4, (z, green)
        plain = _generate(sp(do_sample=True, seed=seed), gamma=gamma, seed=seed)
        z0, _, _ = wm.detect(plain, 5000, gamma)
        assert abs(z0) < 3, z0
    greedy = _generate(sp(watermark=True), gamma=gamma)
    assert wm.detect(greedy, 5000, gamma)[0] > 4


def test_detect_edge_cases() -> None:
    assert wm.detect([], 10) == (0.0, 0, 0)
    assert wm.detect([5], 10) == (0.0, 0, 0)
    with pytest.raises(ValueError):
        wm.detect([1, 10], 10)
    with pytest.raises(ValueError):
        wm.detect([1, 2], 10, gamma=1.0)


def test_detector_cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    ids = _generate(sp(do_sample=True, watermark=True, seed=1), steps=120)
    assert wm.main([json.dumps(ids), "--vocab-size", "5000", "--gamma", "0.5", "--delta", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    z, green, total = wm.detect(ids, 5000, 0.5)
    assert out["z_score"] == pytest.approx(z) and out["green"] == green and out["total"] == total
    assert out["watermarked"] is True
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(ids)))
    assert wm.main([]) == 0
    assert json.loads(capsys.readouterr().out)["green"] == green
    assert wm.main(["[1, 2, \"x\"]"]) == 2
    with pytest.raises(SystemExit) as e:
        wm.main(["--help"])
    assert e.value.code == 0
    assert "--vocab-size" in capsys.readouterr().out


def test_detector_script() -> None:
    ids = _generate(sp(do_sample=True, watermark=True, seed=2), steps=80)
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "watermark_detect.py"), "--gamma", "0.5"],
                         input=json.dumps(ids), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["z_score"] == pytest.approx(wm.detect(ids, None, 0.5)[0])


# --------------------------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------------------------


def test_state_history() -> None:
    s = SamplingState(sp(max_new_tokens=2), [1, 2, 3])
    assert s.num_generated == 0 and s.last_token == 3
    for t in range(40):  # grows past the initial capacity
        s.append(t)
    assert s.num_generated == 40 and s.token_ids.tolist() == [1, 2, 3] + list(range(40))
    s2 = SamplingState(sp(), [1, 2, 3])
    s2.sync([1, 2, 3, 9, 8])
    assert s2.token_ids.tolist() == [1, 2, 3, 9, 8] and s2.num_generated == 2
