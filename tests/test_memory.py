"""Flat memory (issue 13, item 4): the real server (scripts/launch.sh, two CPU device workers, one
front end) under 40 s of steady mixed load, every process sampled by mindie_bench/lab/soak.py.

The bound (7 %) is looser than the soak's 3 % over 10 minutes because the baseline here is taken
after 10 s instead of 90 s. The row-count buckets of the packed linears (about 3 MiB each for the
demo model's five weight shapes, per thread count) used to be met during the load, at its own
pace on a shared machine: the worst worker grew 1.6-9.7 % (six runs), a flaky test. Those
primitives are a bounded cache, not a leak, so this test has the workers create them all at
start (``MINDIE_CPU_PREWARM_GFLOP=150``: ``cpu_linear.prewarm``, off by default for its memory
and start time) and then measures what is left to grow: worst worker 0.68, 2.34, -0.20 % (three
runs of the former 60 s form, baseline at 25 s, 2026-12-01). Without bucketing (the tree
before issue 13's fix, same test) the workers grew 9.8 % and 24.4 % in 35 s, from a heap
already twice as large (docs/reliability.md, "Flat memory").

The load lasts 40 s with the baseline at 10 s (it was 60 s and 25 s: a third less CPU for a
test that keeps both cores busy throughout): with the primitives pre-warmed the workers' heap
(RSS outside the KV cache) is at its plateau within 5 s of load (samples of 2026-12-07, even on
a host at a load average of 12), so the earlier baseline measures the same plateau, and the
window that a leak must grow in is 30 s instead of 35 s (a leak that grows with the requests
served shows 6/7 of its former growth; new row counts, the defect above, are met most often early
in a load, which the window now includes); worst worker -0.51 % (2026-12-07). The KV cache
(0.25 GiB per worker) fills during the window; it is not part of the heap the bound applies to,
and the checks below still see it mapped, resident and within cpuMemSize.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.harness import ROOT

MAX_GROWTH_PCT = 7.0
CPU_MEM_GIB = 0.25


def test_rss_flat_under_mixed_load(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "mindie_bench.lab.soak", "--seconds", "40", "--warmup", "10",
         "--interval", "2.5", "--max-growth", str(MAX_GROWTH_PCT), "--cpu-mem-gib", str(CPU_MEM_GIB),
         "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=420,
        env={**os.environ, "MINDIE_CPU_PREWARM_GFLOP": "150"})
    report = proc.stdout + proc.stderr
    assert out.exists(), report
    res = json.loads(out.read_text())
    assert proc.returncode == 0, report

    roles = sorted(r["role"] for r in res["rows"])
    assert roles == ["front end", "gunicorn master", "launcher", "supervisor", "worker w0", "worker w1"], report
    for name, st in res["load"].items():
        assert st["completed"] > 0 and st["failed"] == 0, (name, st)
    cpu_mem = int(CPU_MEM_GIB * (1 << 30))
    for row in res["rows"]:
        assert row["growth_pct"] <= MAX_GROWTH_PCT, row
        if row["role"].startswith("worker"):
            # The KV cache is found (a shared anonymous mapping), it filled under this load, and
            # it is never mapped or resident beyond cpuMemSize.
            assert 0 < row["kv_size"] <= cpu_mem, row
            assert 0 < row["kv_rss_peak"] <= row["kv_size"], row


def test_row_buckets_bounded_and_exact():
    """The packed linears run at a bounded set of row counts (the cause of the creep: one oneDNN
    primitive per distinct count), and padding changes no output bit."""
    import torch

    from workers.backends.cpu_linear import EXACT_ROWS, FINE_ROWS, _packed_linear, _pack, bucket_rows

    sizes = {bucket_rows(m) for m in range(1, 8193)}
    assert len(sizes) == 68
    for m in range(1, 8193):
        b = bucket_rows(m)
        assert b >= m and b in sizes
        assert b == m if m <= EXACT_ROWS else (b - m) / m < (0.125 if m <= FINE_ROWS else 0.25)
    for dtype in (torch.float32, torch.bfloat16):
        packed = _pack(torch.randn(300, 96, dtype=dtype))
        if packed is None:
            continue
        for m in (17, 33, 100, 257, 700):
            x = torch.randn(m, 96, dtype=dtype)
            plain = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            out = _packed_linear(x, packed, None, 300)
            assert out.shape == (m, 300) and torch.equal(out, plain), (dtype, m)


def test_prewarm_says_what_it_did(caplog):
    """Off (the default budget 0): one line saying so, not "pre-warmed ... 0 primitives"; on: the count."""
    import torch
    from torch import nn

    from workers.backends.cpu_linear import PackedLinear, _pack, prewarm
    packed = _pack(torch.randn(64, 32))
    if packed is None:
        pytest.skip("oneDNN cannot pack on this CPU")
    model = nn.Sequential(PackedLinear(nn.Linear(32, 64), packed))
    with caplog.at_level("INFO", logger="workers.backends"):
        assert prewarm(model, [1], max_rows=4, max_head_rows=1, budget_gflop=0)["primitives"] == 0
        assert prewarm(model, [1], max_rows=4, max_head_rows=1, budget_gflop=1)["primitives"] > 0
    said = [r.getMessage() for r in caplog.records if "oneDNN linears" in r.getMessage()]
    assert said[0] == "oneDNN linears not pre-warmed (cpuTuning.prewarmGflop 0): 1 shapes' primitives are created on first use"
    assert said[1].startswith("oneDNN linears pre-warmed: 1 shapes x 1 thread counts [1], row buckets up to 4"), said
