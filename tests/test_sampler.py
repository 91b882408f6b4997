"""Sampler and watermark, black box through ``Sampler.__call__`` on engine ``Sequence``s: TGI
semantics checked against transformers' processors (exactly where the result is exact, by draw
statistics where it is random), seeded determinism, watermark detection."""
from __future__ import annotations

import copy
import io
import json
import math
import os
import subprocess
import sys
import zlib
from pathlib import Path

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
                          TopPLogitsWarper, TypicalLogitsWarper)

from mindie.contract.wire import SamplingParams
from workers.engine import watermark as wm
from workers.engine.sampler import Sampler, draw_uniforms
from workers.engine.sequence import Sequence

ROOT = Path(__file__).resolve().parents[1]


def sp(**kw: object) -> SamplingParams:
    return SamplingParams(**kw)  # type: ignore[arg-type]


def seq(params: SamplingParams, ids: list[int], prompt_len: int | None = None) -> Sequence:
    """A request as the engine holds it: ``ids`` = prompt (+ generated, with ``prompt_len``)."""
    return Sequence(request_id="r", frontend_id="f", prompt_len=len(ids) if prompt_len is None else prompt_len,
                    tokens=list(ids), params=params, max_new_tokens=params.max_new_tokens)


def seq_copies(params: list[SamplingParams], ids: list[int], prompt_lens: list[int] | None = None) -> list[Sequence]:
    """``seq(params[i], ids)`` for each i (with ``prompt_lens[i]`` where given): shallow copies of one
    Sequence, sharing its token buffer (the sampler only reads it; the engine appends after the
    call). Thousands of constructions (a token buffer and seven default containers each) cost these
    draw tests about as much CPU as the sampler's own work; what the sampler sees is the same."""
    template = seq(params[0], ids)
    out = []
    for i, p in enumerate(params):
        c = copy.copy(template)
        c.params = p
        if prompt_lens is not None:
            c.prompt_len = prompt_lens[i]
        out.append(c)
    return out


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


def references(logits: torch.Tensor, p: SamplingParams, ids: list[int]) -> list[torch.Tensor]:
    """transformers' distribution for one row [1, V], plus those with the active top_p /
    typical_p thresholds moved by -+1e-5 when their support differs: a token within float
    rounding of the line may fall on either side."""
    out: list[torch.Tensor] = []
    for d in (0.0, -1e-5, 1e-5):
        tp = p.top_p + d if p.top_p < 1.0 else 1.0
        ty = min(p.typical_p + d, 1.0) if p.typical_p < 1.0 else 1.0
        probs = torch.softmax(reference_scores(logits, p, ids, tp, ty), -1)[0]
        if not any(torch.equal(probs > 0, o > 0) for o in out):
            out.append(probs)
    return out


def draw_many(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams], ids: list[list[int]],
              n: list[int], seed0: int = 0) -> list[torch.Tensor]:
    """One sampler call: row r of ``logits`` repeated n[r] times, as n[r] requests with
    ``params[r]`` and distinct seeds (from ``seed0`` on) at their first draw. Returns the tokens
    of each row."""
    rows = [c for r, p in enumerate(params) for c in seq_copies(
        [msgspec.structs.replace(p, seed=seed0 + r * 1_000_003 + s) for s in range(n[r])], ids[r])]
    big = torch.cat([logits[r:r + 1].expand(n[r], -1) for r in range(len(params))]).contiguous()
    return list(sampler(big, rows).split(n))


# --------------------------------------------------------------------------------------------
# Draw statistics
# --------------------------------------------------------------------------------------------


def _chi2_upper(df: int, z: float = 4.26) -> float:
    """Chi-square quantile by Wilson-Hilferty; z = 4.26 ~ p = 1e-5 (a false alarm is very rare)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _poisson_tail(k: int, lam: float) -> float:
    """P(X >= k) for X ~ Poisson(lam)."""
    term, cdf = math.exp(-lam), 0.0
    for i in range(k):
        cdf += term
        term *= lam / (i + 1)
    return max(0.0, 1.0 - cdf)


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float]:
    """Pearson's statistic of ``counts`` against ``probs`` and its degrees of freedom; bins
    expecting < 8 draws are pooled, and when the pool too expects < 8 it is left out of the
    statistic and judged alone: the last value is the Poisson probability of its count or more."""
    exp = probs.double() * float(counts.sum())
    big = exp >= 8
    obs_b, exp_b = counts[big].double(), exp[big]
    stat = float(((obs_b - exp_b) ** 2 / exp_b).sum())
    df = int(big.sum()) - 1
    rest_o, rest_e = float(counts[~big].sum()), float(exp[~big].sum())
    if rest_e >= 8:
        return stat + (rest_o - rest_e) ** 2 / rest_e, df + 1, 1.0
    return stat, df, _poisson_tail(round(rest_o), rest_e)


def _fits(counts: torch.Tensor, probs: torch.Tensor) -> str:
    """'' if ``counts`` are plausible draws from ``probs`` (false alarm rate ~1e-5), else why not."""
    if outside := int(counts[probs == 0].sum()):
        return f"{outside} draws of probability 0"
    stat, df, tail = _chi2(counts, probs)
    if df >= 1 and stat > _chi2_upper(df):
        return f"chi2 {stat:.1f} > {_chi2_upper(df):.1f} (df {df})"
    if tail < 1e-5:
        return f"too many draws of the unlikely tokens (p = {tail:.1e})"
    return ""


def check_draws(toks: torch.Tensor, refs: list[torch.Tensor]) -> torch.Tensor:
    """The drawn tokens follow one of ``refs``: every token inside its support (probability > 0)
    and the frequencies within the statistic's bound. Returns that reference."""
    counts = torch.bincount(toks, minlength=refs[0].numel())
    why = [_fits(counts, ref) for ref in refs]
    if "" not in why:
        pytest.fail(f"{len(toks)} draws do not follow the reference: {why}")
    return refs[why.index("")]


def _biased(ref: torch.Tensor) -> torch.Tensor:
    """``ref`` with its most likely token 25% more likely and the second 25% less (renormalised)."""
    b = ref.clone()
    top = ref.argsort(descending=True)[:2]
    b[top[0]] *= 1.25
    b[top[1]] *= 0.75
    return b / b.sum()


def assert_check_is_sharp(toks: torch.Tensor, ref: torch.Tensor) -> None:
    """The check above would have failed had the draws followed ``ref`` off by 25% in its two
    most likely tokens."""
    assert _fits(torch.bincount(toks, minlength=ref.numel()), _biased(ref))


def draws_needed(ref: torch.Tensor) -> int | None:
    """The fewest draws (of 2000 .. 16000) with which a 25% error in the two most likely tokens
    fails the check with a wide margin (3 standard deviations of the noncentral statistic);
    None when 16000 are not enough (a near-uniform or a near-one-token distribution)."""
    if int((ref > 0).sum()) < 2:
        return None
    for n in (2000, 4000, 8000, 16000):
        lam, df, _ = _chi2(ref * n, _biased(ref))  # the statistic's mean excess if counts were exact
        if df >= 1 and df + lam - 3 * math.sqrt(2 * (df + 2 * lam)) > _chi2_upper(df):
            return n
    return None


# --------------------------------------------------------------------------------------------
# Equivalence with transformers
# --------------------------------------------------------------------------------------------

V = 64

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
    "k_p": dict(top_k=20, top_p=0.7),
    "penalty_only": dict(repetition_penalty=1.8),
    "reward": dict(repetition_penalty=0.6, temperature=0.9),
}


def assert_matches_reference(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams],
                             ids: list[list[int]]) -> None:
    """Row by row, in one batch: the sampler's draws follow transformers' distribution, and,
    wherever 16000 draws can show it, the check would have caught a 25% error in the two most
    likely tokens."""
    refs = [references(logits[r:r + 1], p, ids[r]) for r, p in enumerate(params)]
    needed = [draws_needed(rs[0]) for rs in refs]
    toks = draw_many(sampler, logits, params, ids, [n or 8000 for n in needed])
    for r, p in enumerate(params):
        ref = check_draws(toks[r], refs[r])
        if needed[r]:
            assert_check_is_sharp(toks[r], ref)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_distribution_matches_transformers(name: str, scale: float) -> None:
    rows = 2
    logits = randn(rows, V, seed=zlib.crc32(name.encode()) % 1000, scale=scale)
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in torch.randint(1, 60, (rows,), generator=g)]
    params = [sp(do_sample=True, **CASES[name])] * rows
    assert_matches_reference(Sampler(), logits, params, ids)


@given(seed=st.integers(0, 10_000), k=st.sampled_from([0, 1, 3, 20, 63, 150]),
       p=st.sampled_from([1.0, 0.95, 0.5, 0.2]), t=st.sampled_from([1.0, 0.3, 2.0]),
       ty=st.sampled_from([1.0, 1.0, 0.8]), scale=st.sampled_from([0.5, 2.0, 6.0]),
       candidates=st.sampled_from([2, 8, 32, V]))
@settings(max_examples=30, deadline=None, derandomize=True)
def test_routes_match_transformers(seed: int, k: int, p: float, t: float, ty: float, scale: float,
                                   candidates: int) -> None:
    """Random parameter mixes through both routes (small windows force the dense fallback)."""
    logits = randn(1, V, seed, scale)
    params = [sp(do_sample=True, top_k=k, top_p=p, temperature=t, typical_p=ty)]
    assert_matches_reference(Sampler(candidates=candidates), logits, params, [[0]])


def test_top_k_keeps_ties_with_kth_value() -> None:
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.5], [5.0, 4.0, 4.0, 1.0, 1.0, 0.0]])
    params = [sp(do_sample=True, top_k=2), sp(do_sample=True, top_k=2, top_p=0.999)]
    toks = draw_many(Sampler(), logits, params, [[0], [0]], [4000, 4000])
    assert set(toks[0].tolist()) == {0, 1, 2, 3}  # every kept token shows up in 4000 draws
    assert set(toks[1].tolist()) == {0, 1, 2}
    for r, p in enumerate(params):
        check_draws(toks[r], references(logits[r:r + 1], p, [0]))


def test_top_p_keeps_most_likely_token() -> None:
    logits = torch.tensor([[0.0, 9.0, 1.0, 2.0]])
    toks = draw_many(Sampler(), logits, [sp(do_sample=True, top_p=0.01)], [[0]], [500])[0]
    assert toks.tolist() == [1] * 500


def _two_sample_chi2(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """Homogeneity of two equal-size samples' token counts (bins with < 16 draws pooled)."""
    big = (a + b) >= 16
    stat = float(((a[big] - b[big]).double() ** 2 / (a[big] + b[big]).double()).sum())
    df = int(big.sum()) - 1
    ra, rb = float(a[~big].sum()), float(b[~big].sum())
    if ra + rb >= 16:
        stat += (ra - rb) ** 2 / (ra + rb)
        df += 1
    return stat, df


def test_candidate_and_dense_routes_agree_with_ties() -> None:
    """Rounded logits give many ties; window size must not change the kept set or the draw."""
    logits = torch.round(randn(8, 500, 11, 3.0) * 2) / 2
    params = [sp(do_sample=True, top_p=0.83, seed=i, top_k=[0, 0, 20, 3][i % 4]) for i in range(8)]
    toks = [Sampler(candidates=c)(logits.clone(), [seq(p, [1]) for p in params]).tolist() for c in (64, 100, 300)]
    assert toks[0] == toks[1] == toks[2]
    # Window 2 sends top_p rows (and top_k rows with a tie at the k-th value) to the dense route;
    # the full window keeps them on the candidate route: same distribution, other draws.
    n = 6000
    rows = [0, 2, 3]
    dense = draw_many(Sampler(candidates=2), logits[rows], [params[r] for r in rows], [[1]] * 3, [n] * 3)
    cand = draw_many(Sampler(candidates=500), logits[rows], [params[r] for r in rows], [[1]] * 3, [n] * 3,
                     seed0=10**9)  # independent draws
    for j in range(len(rows)):
        a, b = torch.bincount(dense[j], minlength=500), torch.bincount(cand[j], minlength=500)
        stat, df = _two_sample_chi2(a, b)
        assert df >= 1 and stat < _chi2_upper(df), (rows[j], stat, df)


def test_repetition_penalty_matches_transformers_and_covers_prompt_and_output() -> None:
    """Exact on greedy rows: the logits after the call are transformers' penalised logits (the
    sampler applies penalties in place) and the token is their argmax."""
    logits = randn(4, V, 3, 2.0)
    ids = [[1, 2, 3, 3, 63], [10, 20], [0, 5, 7, 9, 11, 13, 40, 17], [42]]
    pens = [1.3, 2.0, 0.7, 1.0]
    rows = [seq(sp(repetition_penalty=p), i) for p, i in zip(pens, ids)]
    rows[1].tokens.append(int(logits[1].argmax()))  # a generated token is penalised too
    ids[1].append(int(logits[1].argmax()))
    x = logits.clone()
    toks = Sampler()(x, rows)
    for r, p in enumerate(pens):
        ref = RepetitionPenaltyLogitsProcessor(p)(torch.tensor([ids[r]]), logits[r:r + 1].clone())
        torch.testing.assert_close(x[r], ref[0])
        assert toks[r].item() == ref.argmax().item()
    assert toks[1].item() != logits[1].argmax().item()  # the penalty changed the argmax


def test_repetition_penalty_ignores_ids_outside_logits() -> None:
    logits = randn(1, 10, 4)
    x = logits.clone()
    Sampler()(x, [seq(sp(repetition_penalty=2.0), [3, 12, 15])])
    expect = logits.clone()
    expect[0, 3] = expect[0, 3] / 2 if expect[0, 3] > 0 else expect[0, 3] * 2
    torch.testing.assert_close(x, expect)


# --------------------------------------------------------------------------------------------
# Greedy
# --------------------------------------------------------------------------------------------


def test_greedy_is_argmax_alone_and_mixed() -> None:
    logits = randn(16, 3000, 9, 3.0)
    s = Sampler()
    all_greedy = [seq(sp(seed=i), [i]) for i in range(16)]
    assert torch.equal(s(logits.clone(), all_greedy), logits.argmax(-1))
    mixed = [seq(sp(seed=i) if i % 2 else sp(do_sample=True, top_k=5, seed=i), [i]) for i in range(16)]
    out = s(logits.clone(), mixed)
    assert torch.equal(out[1::2], logits.argmax(-1)[1::2])
    assert not torch.equal(out[0::2], logits.argmax(-1)[0::2])  # the sampled rows do sample
    # temperature <= 0 with do_sample means greedy (OpenAI-style temperature 0)
    z = [seq(sp(do_sample=True, temperature=0.0, seed=i), [i]) for i in range(16)]
    assert torch.equal(s(logits.clone(), z), logits.argmax(-1))


def test_greedy_bf16_logits() -> None:
    logits = randn(4, 1000, 2, 3.0).to(torch.bfloat16)
    out = Sampler()(logits, [seq(sp(), [1]) for _ in range(4)])
    assert torch.equal(out, logits.float().argmax(-1))


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
    tgt = seq(sp(**target), [5, 6, 7])
    rest = [seq(p, [1, 2, 3, 4]) for p in others]
    g_noise = torch.Generator().manual_seed(len(others) * 7 + position)
    for step in range(steps):
        row = randn(1, vocab, 1000 + step, 2.5)
        logits = torch.randn(len(others) + 1, vocab, generator=g_noise) * 3
        logits[position] = row[0]
        batch = rest[:position] + [tgt] + rest[position:]
        for s, t in zip(batch, sampler(logits, batch).tolist()):
            s.tokens.append(t)  # as the engine does
    return tgt.output_ids


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
from mindie.contract.wire import SamplingParams
from workers.engine.sampler import Sampler
from workers.engine.sequence import Sequence
result = []
for i, kw in enumerate(TARGETS):
    s = Sequence("r", "f", 3, [5, 6, 7], SamplingParams(**kw), 10)
    for step in range(10):
        logits = torch.randn(1, 2000, generator=torch.Generator().manual_seed(1000 + step)) * 2.5
        s.tokens.append(int(Sampler()(logits, [s])[0]))
    result.append(s.tokens.tolist())
"""


def test_same_seed_same_tokens_across_processes() -> None:
    here: dict = {"TARGETS": TARGETS}
    exec(RESTART_SNIPPET, here)
    code = f"import json\nTARGETS = {TARGETS!r}\n{RESTART_SNIPPET}\nprint(json.dumps(result))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "123"})
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == here["result"]


def test_sequence_recreated_each_step_gives_the_same_tokens() -> None:
    """The draw index is the number of generated tokens, so a request rebuilt from its token
    list (every step here; after a preemption in the engine) draws the same tokens."""
    target = TARGETS[0]
    kept = _run_target(target, 0, [])
    tokens = [5, 6, 7]
    sampler = Sampler()
    for step in range(12):
        logits = randn(1, 2000, 1000 + step, 2.5)
        tokens = tokens + [int(sampler(logits, [seq(sp(**target), tokens, prompt_len=3)])[0])]
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


@pytest.mark.parametrize("params,scale", [
    (dict(temperature=0.9), 1.0),            # dense route, 1000 = 3 chunks of 256 + a tail of 232
    (dict(top_k=20, temperature=1.2), 1.0),  # candidate route
    (dict(top_p=0.9), 3.0),                  # candidate route, p only (nucleus inside the window)
    (dict(top_p=0.97), 0.5),                 # first window too small -> the wider one
    (dict(typical_p=0.9, top_k=300), 1.0),   # dense route
])
@pytest.mark.parametrize("vary", ["seed", "step"])
def test_sampled_frequencies_follow_distribution(params: dict, scale: float, vary: str) -> None:
    n, vocab = 12_000, 1000
    logits = randn(1, vocab, 77, scale)
    p = sp(do_sample=True, **params)
    if vary == "seed":  # n requests with seeds 0..n-1 at their first step
        rows = seq_copies([msgspec.structs.replace(p, seed=s) for s in range(n)], [3])
    else:  # one seed at steps 0..n-1: only the draw index (tokens generated) matters, so a
        # negative prompt_len stands for t generated tokens without storing them
        rows = seq_copies([msgspec.structs.replace(p, seed=42)] * n, [3], prompt_lens=[1 - t for t in range(n)])
    assert [r.num_output for r in rows[:3]] == ([0, 0, 0] if vary == "seed" else [0, 1, 2])
    toks = Sampler()(logits.expand(n, vocab).clone(), rows)
    check_draws(toks, references(logits, p, [3]))


def test_chi2_check_catches_a_biased_draw() -> None:
    """The statistic above is sharp enough: a distribution off by 25% in two tokens fails."""
    n, vocab = 12_000, 1000
    logits = randn(1, vocab, 77, 1.0)
    p = sp(do_sample=True, top_k=20)
    toks = draw_many(Sampler(), logits, [p], [[3]], [n])[0]
    ref = check_draws(toks, references(logits, p, [3]))
    with pytest.raises(pytest.fail.Exception):
        check_draws(toks, [_biased(ref)])


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
    s = seq(params, [17])
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        logits = torch.randn(1, vocab, generator=g) * 2.0
        s.tokens.append(int(sampler(logits, [s])[0]))
    return s.tokens.tolist()


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
# The token history (one per request: the Sequence's)
# --------------------------------------------------------------------------------------------


def test_sequence_history() -> None:
    s = seq(sp(max_new_tokens=2), [1, 2, 3])
    assert s.num_output == 0 and s.tokens[-1] == 3 and s.output_ids == []
    for t in range(40):  # grows past the capacity reserved for max_new_tokens
        s.tokens.append(t)
    assert s.num_output == 40 and s.num_tokens == 43
    assert s.tokens == [1, 2, 3] + list(range(40)) and list(s.tokens) == s.tokens.tolist()
    assert s.output_ids == list(range(40)) and s.tokens[2:5] == [3, 0, 1]
    assert isinstance(s.tokens[4], int) and all(type(t) is int for t in s.tokens[:3])
    v = s.token_ids
    assert v.dtype.name == "int64" and v.tolist() == s.tokens.tolist()
    assert tuple(s.tokens[0:3]) == (1, 2, 3) and hash(tuple(s.tokens[0:3])) == hash((1, 2, 3))  # prefix cache
    # the sampler sees what the engine appended: the penalty now covers token 7 -> not the argmax
    logits = torch.zeros(1, 50)
    logits[0, 7], logits[0, 8] = 2.0, 1.5
    r = seq(sp(repetition_penalty=2.0), [1])
    assert Sampler()(logits.clone(), [r]).item() == 7
    r.tokens.append(7)
    assert Sampler()(logits.clone(), [r]).item() == 8


def test_argmax_rows_matches_torch_on_ties_nan_inf_and_views() -> None:
    """The sampler's CPU argmax (numpy's) returns what torch's does: the first maximum, a NaN
    counting as the maximum, on rows of any stride; other devices and dtypes keep torch's."""
    from workers.engine.sampler import argmax_rows
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 4096, generator=g)
    x[0, 7] = float("nan")
    x[0, 9] = float("nan")
    x[1] = float("-inf")
    x[2, 3] = x[2].max() + 1
    x[2, 500] = x[2, 3]  # a tie: the first wins
    x[3, 100] = float("inf")
    x[3, 200] = float("inf")
    x[4] = float("nan")
    x[5] = 0.0
    for t in (x, x[:, ::3], x[1:6], x.t().contiguous().t()):
        got = argmax_rows(t)
        assert got.dtype == torch.long and torch.equal(got, t.argmax(-1)), (got, t.argmax(-1))
    assert argmax_rows(x)[:6].tolist() == [7, 0, 3, 100, 0, 0]
    h = x.to(torch.bfloat16)  # not fp32: torch's own
    assert torch.equal(argmax_rows(h), h.argmax(-1))
    assert torch.equal(argmax_rows(x[0]), x[0].argmax(-1))  # 1-D: torch's own
    assert argmax_rows(x[:0]).shape == (0,)
