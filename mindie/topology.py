"""Where config.json becomes device workers: one ``WorkerSpec`` per npuDeviceIds entry.

The one place config keys turn into engine settings (``mindie.contract.spec``); the result is
written to the run directory, where the supervisor and the front ends read it. Torch-free.
"""
from __future__ import annotations

import os

import ipaddress

from mindie.config import (NGRAM_DEFAULT_TOKENS, SPEC_MAX_TOKENS, SUFFIX_DEFAULT_TOKENS, Config, kv_tcp_host,
                           speculation_plugin)
from mindie.contract.spec import (CpuTuning, Deployment, EngineConfig, LoraModule, WorkerSpec, kv_endpoint,
                                  kv_tcp_endpoint, worker_endpoints)

CGROUP_V2_CPU_MAX = "/sys/fs/cgroup/cpu.max"
CGROUP_V1_QUOTA = ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us")


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def usable_cores(read=_read, affinity: set[int] | None = None) -> int:
    """Cores this process may really use: the CPUs it may run on (``sched_getaffinity``, not
    ``os.cpu_count()``, which counts the host's) and the cgroup's CPU quota (v2 ``cpu.max``
    "quota period", "max" = none; v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, -1 = none),
    whichever is smaller; a fractional quota rounds down; at least 1."""
    if affinity is None:
        try:
            affinity = os.sched_getaffinity(0)
        except (AttributeError, OSError):
            affinity = set(range(os.cpu_count() or 1))
    cores = len(affinity) or (os.cpu_count() or 1)
    quota = period = None
    text = read(CGROUP_V2_CPU_MAX)
    if text is not None:
        parts = text.split()
        if len(parts) >= 1 and parts[0] != "max":
            try:
                quota, period = int(parts[0]), int(parts[1]) if len(parts) > 1 else 100000
            except ValueError:
                pass
    else:
        for qpath in CGROUP_V1_QUOTA:
            q = read(qpath)
            p = read(qpath.replace("cfs_quota_us", "cfs_period_us"))
            if q is None or p is None:
                continue
            try:
                quota, period = int(q.strip()), int(p.strip())
            except ValueError:
                continue
            break
    if quota is not None and period and quota > 0 and period > 0:
        cores = min(cores, quota // period)
    return max(1, cores)


def cpu_tuning(config: Config) -> CpuTuning:
    """BackendConfig.cpuTuning as the engine's CpuTuning (the same fields, snake_case)."""
    t = config.backend.cpu_tuning
    return CpuTuning(**{f: getattr(t, f) for f in CpuTuning.__struct_fields__})


def engine_config(config: Config, *, null_model: bool = False) -> EngineConfig:
    """The engine settings of ``config``; the device-dependent ones still None (workers.prepare)."""
    backend = config.backend
    deploy = backend.model_deploy
    sched = backend.schedule
    return EngineConfig(
        block_size=sched.cache_block_size, max_seq_len=deploy.max_seq_len, max_batch_size=sched.max_batch_size,
        max_prefill_batch_size=sched.max_prefill_batch_size, max_prefill_tokens=sched.max_prefill_tokens,
        enable_prefix_cache=sched.enable_prefix_cache, prefill_chunk_tokens=sched.prefill_chunk_tokens,
        decode_hold_ms=sched.decode_hold_ms, decode_hold_wave=sched.decode_hold_wave,
        token_timeout_s=float(config.server.token_timeout), jump_forward=sched.jump_forward,
        batch_invariant=sched.batch_invariant,
        # The null model sleeps through its steps like an accelerator: overlap unless told not to.
        # None (here and in cpu below) = the device's default, settled by workers.prepare.
        overlap=sched.overlap_steps if sched.overlap_steps is not None else (True if null_model else None),
        tp_start_timeout_s=backend.tp_start_timeout_s, tp_collective_timeout_s=backend.tp_collective_timeout_s,
        gc_freeze=backend.gc_freeze, cpu=cpu_tuning(config), **speculation(config))


def speculation(config: Config) -> dict:
    """EngineConfig's speculative decoding fields: memory_decoding or lookahead where
    ModelConfig.plugin_params says so (decoding_length tokens; lookahead: the suffix proposer),
    else ScheduleConfig.speculationMethod (suffix: speculationGamma tokens or 16; ngram: or 6);
    off with ScheduleConfig.speculativeDecoding false."""
    deploy, sched = config.backend.model_deploy, config.backend.schedule
    plugin = speculation_plugin(deploy.models[0].plugin_params)
    if plugin:
        method, tokens = plugin[0], plugin[1]
    else:
        method = sched.speculation_method
        default = SUFFIX_DEFAULT_TOKENS if method == "suffix" else NGRAM_DEFAULT_TOKENS
        tokens = min(deploy.speculation_gamma or default, SPEC_MAX_TOKENS)
    return dict(spec_method=method if sched.speculative_decoding else "", spec_tokens=tokens,
                spec_lookup_min=sched.prompt_lookup_min, spec_lookup_max=sched.prompt_lookup_max,
                spec_max_batch=sched.speculation_max_batch, spec_min_acceptance=sched.speculation_min_acceptance,
                spec_max_stretch=sched.speculation_max_stretch)


def build_deployment(config: Config, *, null_model: bool = False, null_step_ms: float = 0.0,
                     log_level: str = "INFO") -> Deployment:
    """The launch plan of ``config`` (values as load_config applied them)."""
    backend = config.backend
    deploy = backend.model_deploy
    model = deploy.models[0]
    groups = backend.npu_device_ids
    n = len(groups)
    engine = engine_config(config, null_model=null_model)
    # On CPU each worker process (each rank of a tensor-parallel instance) gets its share of the
    # cores; idle workers lend theirs only when the split is automatic and each is one process
    # (the ranks of an instance step together: nothing to lend between them).
    world = len(groups[0])
    threads = backend.cpu_threads_per_worker or max(1, usable_cores() // (n * world))
    share = not backend.cpu_threads_per_worker and n > 1 and world == 1
    run_dir = config.server.run_dir
    workers = []
    # Every worker host serves every npuDeviceIds entry; this host's supervisor starts those of
    # workerHost only. With workerHosts a worker's id names its host (every host's config lists
    # the same workerHosts, so every plan agrees); without it the ids are w0, w1, ... as always.
    hosts = backend.worker_hosts or [backend.worker_host]
    # KV transfer endpoints (workers/pd_transfer.py): ipc in the run directory unless tcp only, and
    # tcp on interCommPort + index with inferMode dmi.
    kv_host = kv_tcp_host(config.server)
    kv_host = ipaddress.ip_address(kv_host).compressed if kv_host else ""
    kv_ipc = not (kv_host and config.server.kv_transfer_tcp_only)
    for host in hosts:
        for index, ids in enumerate(groups):
            job, pub = worker_endpoints(run_dir, index, host, backend.worker_port)
            workers.append(WorkerSpec(
                worker_id=f"w{index}@{host}" if backend.worker_hosts else f"w{index}", job_endpoint=job,
                pub_endpoint=pub,
                curve_key_dir=backend.worker_curve_key_dir if host else "",
                insecure_tcp=backend.worker_insecure_tcp, device_type=backend.device_type,
                device_ids=list(ids), model_path=model.model_weight_path, model_name=model.model_name,
                dtype=model.dtype, cpu_mem_gb=float(model.cpu_mem_size), npu_mem_gb=float(model.npu_mem_size),
                threads=threads, core_share_file=os.path.join(run_dir, "cores.busy") if share else "",
                worker_index=index, num_workers=n, null_model=null_model, null_step_ms=null_step_ms,
                watermark_gamma=config.server.watermark_gamma, watermark_delta=config.server.watermark_delta,
                log_level=log_level, engine=engine, quantize=model.quantize or "",
                moe_parallel=model.moe_parallel, remote=host != backend.worker_host,
                lora_modules=[LoraModule(name=m.name, path=m.path, base_model_name=m.base_model_name)
                              for m in deploy.lora_modules],
                max_loras=deploy.max_loras, max_lora_rank=deploy.max_lora_rank,
                kv_endpoint=kv_endpoint(run_dir, index) if host == backend.worker_host and kv_ipc else "",
                kv_tcp_endpoint=kv_tcp_endpoint(kv_host, config.server.inter_comm_port, index)
                if host == backend.worker_host and kv_host else "",
                kv_curve_key_dir=backend.worker_curve_key_dir,
                kv_lease_ms=config.server.kv_transfer_lease_ms, kv_wait_ms=config.server.kv_transfer_timeout_ms,
                kv_failure_policy=config.server.kv_load_failure_policy))
    return Deployment(run_dir=run_dir, workers=workers)
