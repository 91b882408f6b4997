"""Ranks 1 .. N-1 of a tensor-parallel instance: no sockets, no scheduler, no sampler.

Each builds its shard of the model and the same KV blocks as rank 0 (the same ``build`` as rank
0's: workers/engine/assembly.py), then runs every step rank 0 broadcasts
(workers/engine/tp_group.py) until rank 0 says stop. Whatever goes wrong here
ends the process with a non-zero status: the supervisor then restarts the whole instance.

Run by the supervisor as ``python -m workers.worker --spec '<json>' --rank R --tp-store PATH``.
"""
from __future__ import annotations

import logging
import signal
import time
from typing import Callable

from mindie.runtime.gc_freeze import freeze_heap
from mindie.contract.spec import WorkerSpec
from workers.engine.assembly import build
from workers.engine.tp_group import NOOP, STOP

log = logging.getLogger("workers.tp")


def follow(spec: WorkerSpec, rank: int, store: str, ready: Callable[[], None] | None = None) -> int:
    """Serve as rank ``rank`` until rank 0 stops the instance; the exit status. ``ready``: called
    once the rank serves (its start report, mindie/runtime/start_report.py)."""
    # Blocked in a collective, a Python handler would never run: let SIGTERM end the process
    # (it holds no sockets or files to clean up; rank 0 and the supervisor own those).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    t0 = time.perf_counter()
    built = build(spec, rank, store)  # the same assembly as rank 0's (workers/engine/assembly.py)
    runner, group, num_blocks = built.runner, built.group, built.num_blocks
    freeze_heap(log, f"rank {rank} of instance {spec.worker_id}", spec.engine.gc_freeze)
    log.info("rank %d of instance %s ready in %.2f s (%d KV blocks)", rank, spec.worker_id,
             time.perf_counter() - t0, num_blocks)
    if ready is not None:
        ready()
    steps = 0
    while True:
        inputs = group.recv_step()
        if inputs.kind == STOP:
            log.info("rank %d of instance %s stopped after %d steps", rank, spec.worker_id, steps)
            group.close()
            return 0
        if inputs.kind == NOOP:
            continue
        runner.follow(inputs)
        steps += 1
