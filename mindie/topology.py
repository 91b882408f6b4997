"""Where config.json becomes device workers: one ``WorkerSpec`` per npuDeviceIds entry.

The one place config keys turn into engine settings (``mindie.contract.spec``); the result is
written to the run directory, where the supervisor and the front ends read it. Torch-free.
"""
from __future__ import annotations

import os

from mindie.config import Config
from mindie.contract.spec import Deployment, EngineConfig, WorkerSpec, worker_endpoints


def build_deployment(config: Config, *, null_model: bool = False, null_step_ms: float = 0.0,
                     log_level: str = "INFO") -> Deployment:
    """The launch plan of ``config`` (values as load_config applied them)."""
    backend = config.backend
    deploy = backend.model_deploy
    sched = backend.schedule
    model = deploy.models[0]
    groups = backend.npu_device_ids
    n = len(groups)
    engine = EngineConfig(
        block_size=sched.cache_block_size, max_seq_len=deploy.max_seq_len, max_batch_size=sched.max_batch_size,
        max_prefill_batch_size=sched.max_prefill_batch_size, max_prefill_tokens=sched.max_prefill_tokens,
        enable_prefix_cache=sched.enable_prefix_cache,
        # The null model sleeps through its steps like an accelerator: overlap unless told not to.
        overlap=sched.overlap_steps if sched.overlap_steps is not None else (True if null_model else None))
    # On CPU each worker gets its share of the cores; idle workers lend theirs only when the
    # split is automatic.
    threads = backend.cpu_threads_per_worker or max(1, (os.cpu_count() or 1) // n)
    share = not backend.cpu_threads_per_worker and n > 1
    run_dir = config.server.run_dir
    workers = []
    for index, ids in enumerate(groups):
        job, pub = worker_endpoints(run_dir, index, backend.worker_host, backend.worker_port)
        workers.append(WorkerSpec(
            worker_id=f"w{index}", job_endpoint=job, pub_endpoint=pub,
            curve_key_dir=backend.worker_curve_key_dir if backend.worker_host else "",
            insecure_tcp=backend.worker_insecure_tcp, device_type=backend.device_type,
            device_ids=list(ids), model_path=model.model_weight_path, model_name=model.model_name, dtype=model.dtype,
            cpu_mem_gb=float(model.cpu_mem_size), npu_mem_gb=float(model.npu_mem_size), threads=threads,
            core_share_file=os.path.join(run_dir, "cores.busy") if share else "", worker_index=index,
            num_workers=n, null_model=null_model, null_step_ms=null_step_ms,
            watermark_gamma=config.server.watermark_gamma, watermark_delta=config.server.watermark_delta,
            log_level=log_level, engine=engine))
    return Deployment(run_dir=run_dir, workers=workers)
