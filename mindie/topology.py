"""Where the device workers live: one per BackendConfig.npuDeviceIds entry.

Shared by the supervisor (which starts them) and the front ends (which connect to them),
so both derive the same ipc endpoints from the config and the run directory. Torch-free.
"""
from __future__ import annotations

import os

from mindie.client import WorkerEndpoint
from mindie.config import Config, default_run_dir
from workers.spec import WorkerSpec


def run_dir_for(config: Config, run_dir: str | None = None) -> str:
    return run_dir or os.environ.get("MINDIE_RUN_DIR") or config.ServerConfig.runDir or \
        default_run_dir(config.ServerConfig.port)


def worker_endpoints(config: Config, run_dir: str | None = None) -> list[WorkerEndpoint]:
    rd = run_dir_for(config, run_dir)
    return [WorkerEndpoint(f"w{i}", f"ipc://{rd}/w{i}-jobs.ipc", f"ipc://{rd}/w{i}-frames.ipc")
            for i in range(len(config.BackendConfig.npuDeviceIds))]


def model_dir(config: Config) -> str:
    """The checkpoint directory; the launcher resolves the demo model into MINDIE_MODEL_DIR."""
    return config.BackendConfig.ModelDeployConfig.ModelConfig[0].modelWeightPath or \
        os.environ.get("MINDIE_MODEL_DIR", "")


def visibility_env(device_type: str, device_ids: list[int]) -> dict[str, str]:
    """Environment that makes ``device_ids`` the only devices a worker process sees."""
    ids = ",".join(str(i) for i in device_ids)
    if device_type == "npu":
        return {"ASCEND_RT_VISIBLE_DEVICES": ids}
    if device_type == "cuda":
        return {"CUDA_VISIBLE_DEVICES": ids}
    return {}


def overlap_default(device_type: str, null_model: bool = False) -> bool:
    """Whether steps overlap with the worker loop's I/O when ScheduleConfig.overlapSteps is null.

    An accelerator computes while the host thread is free, so the loop's work is hidden; the
    null model sleeps through its step time like one. On CPU the compute thread and the loop
    share the cores and overlap measured neutral (docs/performance.md): off."""
    return null_model or device_type in ("cuda", "npu")


def worker_specs(config: Config, run_dir: str | None = None, null_model: bool = False,
                 null_step_ms: float = 0.0) -> list[tuple[WorkerSpec, dict[str, str]]]:
    """One (spec, extra environment) per device worker."""
    backend = config.BackendConfig
    deploy = backend.ModelDeployConfig
    sched = backend.ScheduleConfig
    model = deploy.ModelConfig[0]
    device_type = backend.deviceType
    n = len(backend.npuDeviceIds)
    threads = backend.cpuThreadsPerWorker or max(1, (os.cpu_count() or 1) // n)
    # Idle workers lend their cores only when the split is automatic.
    share = device_type == "cpu" and not backend.cpuThreadsPerWorker and n > 1
    kv_gb = float(model.cpuMemSize) if device_type == "cpu" else float(max(0, model.npuMemSize))
    out = []
    rd = run_dir_for(config, run_dir)
    for index, (ep, ids) in enumerate(zip(worker_endpoints(config, run_dir), backend.npuDeviceIds)):
        spec = WorkerSpec(
            worker_id=ep.worker_id, job_endpoint=ep.job_endpoint, pub_endpoint=ep.pub_endpoint,
            device_type=device_type, device_ids=list(ids), model_path=model_dir(config),
            model_name=model.modelName, dtype=model.dtype, kv_cache_gb=kv_gb, block_size=sched.cacheBlockSize,
            max_seq_len=deploy.maxSeqLen, max_iter_times=sched.maxIterTimes, max_batch_size=sched.maxBatchSize,
            max_prefill_batch_size=sched.maxPrefillBatchSize, max_prefill_tokens=sched.maxPrefillTokens,
            enable_prefix_cache=sched.enablePrefixCache,
            overlap=overlap_default(device_type, null_model) if sched.overlapSteps is None else sched.overlapSteps,
            threads=threads if device_type == "cpu" else 0,
            null_model=null_model, null_step_ms=null_step_ms,
            core_share_file=f"{rd}/cores.busy" if share else "", worker_index=index, num_workers=n,
            watermark_gamma=config.ServerConfig.watermarkGamma, watermark_delta=config.ServerConfig.watermarkDelta,
            log_level=os.environ.get("MINDIE_LOG_LEVEL", "INFO").upper())
        out.append((spec, visibility_env(device_type, list(ids))))
    return out
