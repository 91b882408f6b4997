"""Ranks 1 .. N-1 of a tensor-parallel instance: no sockets, no scheduler, no sampler.

Each loads its shard of the model, allocates the same KV blocks as rank 0, then runs every step
rank 0 broadcasts (workers/engine/tp_group.py) until rank 0 says stop. Whatever goes wrong here
ends the process with a non-zero status: the supervisor then restarts the whole instance.

Run by the supervisor as ``python -m workers.worker --spec '<json>' --rank R --tp-store PATH``.
"""
from __future__ import annotations

import logging
import signal
import time

from mindie.contract.spec import WorkerSpec

log = logging.getLogger("workers.tp")


def follow(spec: WorkerSpec, rank: int, store: str) -> int:
    """Serve as rank ``rank`` until rank 0 stops the instance; the exit status."""
    from workers.backends import get_backend
    from workers.engine.model_runner import load_runner
    from workers.engine.tp_group import NOOP, STOP, join

    # Blocked in a collective, a Python handler would never run: let SIGTERM end the process
    # (it holds no sockets or files to clean up; rank 0 and the supervisor own those).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    t0 = time.perf_counter()
    backend = get_backend(spec.device_type, spec.threads)
    backend.setup()
    group = join(spec.worker_id, rank, len(spec.device_ids), store, spec.device_type)
    runner = load_runner(spec, backend, group)
    group.wait_all("loaded the model")
    own = max(1, backend.kv_cache_bytes(spec) // runner.bytes_per_block(spec.engine.block_size))
    num_blocks = group.min_int(own)
    runner.allocate_kv(num_blocks, spec.engine.block_size)
    from mindie.contract.gc_freeze import freeze_heap
    freeze_heap(log, f"rank {rank} of instance {spec.worker_id}", spec.engine.gc_freeze)
    log.info("rank %d of instance %s ready in %.2f s (%d KV blocks)", rank, spec.worker_id,
             time.perf_counter() - t0, num_blocks)
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
