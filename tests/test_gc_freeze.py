"""Start-up objects are frozen out of the garbage collector's full passes (mindie/runtime/gc_freeze.py):
in the real server's device worker and front end, and not with BackendConfig.gcFreeze false
(MINDIE_GC_FREEZE=0, the key's override)."""
from __future__ import annotations

import subprocess
import sys

from tests.harness import ROOT

PROBE = """
import gc, logging, time
from mindie.config import load_config
from mindie.runtime.gc_freeze import freeze_heap
import torch  # a heap like a worker's
n = freeze_heap(logging.getLogger("t"), "probe", load_config().config.backend.gc_freeze)
assert n == gc.get_freeze_count(), (n, gc.get_freeze_count())
t = time.perf_counter(); gc.collect(); full = (time.perf_counter() - t) * 1e3
print(n, full)
"""


def _probe(env: dict) -> tuple[int, float]:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    return int(out[0]), float(out[1])


def test_freeze_takes_the_start_up_heap_out_of_full_collections():
    import os
    frozen, full_ms = _probe({**os.environ, "MINDIE_GC_FREEZE": "1"})
    off, full_off_ms = _probe({**os.environ, "MINDIE_GC_FREEZE": "0"})
    assert frozen > 50_000 and off == 0  # torch alone leaves tens of thousands of objects
    assert full_ms < full_off_ms  # a full collection no longer walks them


def test_server_freezes_worker_and_front_end(demo_servers, demo_model):
    # The session's demo server of the default schedule: its start-up lines, in its whole log.
    log = demo_servers.get(demo_model).tail(1 << 30)
    assert "start-up objects frozen out of the garbage collector's passes" in log
    assert any("worker w0" in line and "frozen out of" in line for line in log.splitlines()), log[-3000:]
    assert any("front end pid" in line and "frozen out of" in line for line in log.splitlines()), log[-3000:]
