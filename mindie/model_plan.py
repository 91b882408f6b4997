"""The launch plan of several models: one worker group per ``ModelConfig`` entry.

``mindie.topology.build_deployment`` plans the first entry as always; each further entry gets a
plan of its own, built the same way from the config with that entry first (so everything that
reads ``ModelConfig[0]`` reads that model's weights, dtype, quantisation, chat template), and then
moved onto endpoints of its own: worker ``m<k>w<i>``, sockets ``w<k*n+i>-*.ipc`` (tcp ports
``workerPort + 2*(k*n+i)``). The CPU thread budget is split over the models that may be resident
at once (``maxLoadedModels``), each model's KV budget is its own entry's ``cpuMemSize`` /
``npuMemSize`` (docs/design.md, "Several models"). Torch-free (the launcher's step).
"""
from __future__ import annotations

import logging

import msgspec

from mindie.config import Config
from mindie.contract.spec import Deployment, WorkerSpec, kv_endpoint, worker_endpoints
from mindie.topology import build_deployment, usable_cores

log = logging.getLogger("mindie.model_plan")

MODELS_SOCKET = "models.ipc"


def config_for(config: Config, k: int) -> Config:
    """``config`` with ``ModelConfig[k]`` first (the others after it, in order); LoRA modules
    stay the first model's."""
    deploy = config.backend.model_deploy
    models = [deploy.models[k]] + [m for i, m in enumerate(deploy.models) if i != k]
    new_deploy = msgspec.structs.replace(deploy, models=models,
                                         lora_modules=deploy.lora_modules if k == 0 else [])
    return msgspec.structs.replace(config, backend=msgspec.structs.replace(config.backend, model_deploy=new_deploy))


def resident_models(config: Config) -> int:
    """How many models may be loaded at once (maxLoadedModels, 0 = all of them)."""
    n = len(config.backend.model_deploy.models)
    cap = config.backend.model_deploy.max_loaded_models
    return min(cap, n) if cap else n


def _moved(spec: WorkerSpec, k: int, config: Config, threads: int) -> WorkerSpec:
    """``spec`` (worker ``i`` of a one-model plan) as worker ``i`` of model ``k``: the first
    model's keep their ids and endpoints; the CPU threads are the split's, core lending is off
    (its table counts the workers of one model)."""
    if k == 0:
        return msgspec.structs.replace(spec, threads=threads, core_share_file="")
    index = k * spec.num_workers + spec.worker_index
    host = ""
    if spec.job_endpoint.startswith("tcp://"):
        host = spec.job_endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    job, pub = worker_endpoints(config.server.run_dir, index, host, config.backend.worker_port)
    return msgspec.structs.replace(
        spec, worker_id=f"m{k}w{spec.worker_index}", job_endpoint=job, pub_endpoint=pub,
        kv_endpoint=kv_endpoint(config.server.run_dir, index) if spec.kv_endpoint else "",
        kv_tcp_endpoint="", threads=threads, core_share_file="")


def build_many(config: Config, **kwargs) -> Deployment:
    """The launch plan of ``config``: ``build_deployment``'s for one model; with several (or with
    ``enableSleepMode``), every model's worker group (``Deployment.models``: those after the
    first) and the model host's settings (``models_endpoint`` set: the model host serves them)."""
    dep = build_deployment(config, **kwargs)
    deploy = config.backend.model_deploy
    if len(deploy.models) == 1 and not deploy.enable_sleep_mode:
        return dep
    resident = resident_models(config)
    b = config.backend
    world = max(1, len(b.npu_device_ids[0]))
    n = len(b.npu_device_ids)
    # Each resident model's workers share the cores: cores / (resident models x workers x ranks).
    threads = b.cpu_threads_per_worker or max(1, usable_cores() // (resident * n * world))
    groups = [[_moved(s, k, config, threads) for s in build_deployment(config_for(config, k), **kwargs).workers]
              for k in range(len(deploy.models))]
    log.info("%d models, at most %d loaded at once (maxLoadedModels): each worker %d CPU threads; KV per worker: %s",
             len(groups), resident, threads,
             ", ".join(f"{g[0].model_name} {g[0].cpu_mem_gb:g} GiB (CPU) / {g[0].npu_mem_gb:g} GB (accelerator)"
                       for g in groups))
    return msgspec.structs.replace(dep, workers=groups[0], models=groups[1:], max_loaded_models=resident,
                                   keep_alive_s=float(deploy.keep_alive),
                                   max_loaded_mem_gb=float(deploy.max_loaded_mem_size),
                                   models_endpoint=f"ipc://{config.server.run_dir}/{MODELS_SOCKET}")
