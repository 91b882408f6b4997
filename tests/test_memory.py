"""Flat memory (issue 13, item 4): the real server (scripts/launch.sh, two CPU device workers, one
front end) under a minute of steady mixed load, every process sampled by scripts/soak.py.

The bound is looser than the soak's 3 % over 10 minutes, because here the baseline is taken after
25 s instead of 90 s: the first prefills of sizes not seen yet may still add a few cache entries
(about 2-3 MiB per new (row bucket, thread count) for the demo model's five weight shapes) while
the two bounded oneDNN caches fill, and on a shared machine the load reaches them at its own pace.
Without the fix (MINDIE_CPU_LINEAR_BUCKETS=0 and the default cache capacities) the workers grew
by more than that within these 35 s (docs/reliability.md, "Flat memory").
"""
from __future__ import annotations

import json
import subprocess
import sys

from tests.harness import ROOT

MAX_GROWTH_PCT = 6.0
CPU_MEM_GIB = 0.25


def test_rss_flat_under_mixed_load(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "soak.py"), "--seconds", "60", "--warmup", "25",
         "--interval", "2.5", "--max-growth", str(MAX_GROWTH_PCT), "--cpu-mem-gib", str(CPU_MEM_GIB),
         "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=420)
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
