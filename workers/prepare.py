"""Device-side launch step: settle what only the device side knows, in the launch plan.

    python -m workers.prepare <runDir>/deployment.json

Run by scripts/launch.sh after ``mindie.ops.launch_plan`` wrote the plan and before anything starts:
resolves ``deviceType: auto`` (npu, else cuda, else cpu), makes the built-in demo model when no
weights are configured (random weights, real tokenizer; about 4 s, once), serves a GGUF file
through its model view (workers/models/gguf_view.py: config and tokenizer from its metadata,
made once per file with transformers' converter, which is imported only then), and fills the
device-dependent defaults of the engine settings (step overlap, prefill chunk, decode hold, the
CPU's native bf16 and fused-decode rows: ``settle_engine``), once: nothing downstream re-defaults
them. Rewrites the file in place; prints ``MINDIE_MODEL_DIR=...``
for the launcher (a GGUF file's model view).

Refuses, with exit status 2 and a message naming the file or key, what a device worker of this
host would refuse at start, so that no worker is started to fail (``check_model``): a model
directory that is not there, a config.json that does not parse to a supported model
(workers/models/config.py: unsupported model_type or architectures named), weight files that are
missing, unreadable, truncated, or lack a tensor the model needs in its shape and a dtype the
loader takes (workers/models/checkpoint.py: the loader's own check, headers only), a
tensor-parallel split the model does not allow, a ``LoraModules`` adapter the workers would refuse
(workers/models/lora_adapter.py), and on an accelerator a device that is not there
or a ``quantize`` key the backend has no kernel for (``workers.engine.assembly.start_refusal``).
The tokenizer is the front ends' and is checked on their side (mindie/ops/launch_plan.py). What only a
running worker finds out (memory, a port another program holds) is the supervisor's to stop on
(workers/supervisor.py, ``START_ATTEMPTS``).

Imports torch only where it needs it (device detection for ``auto``, an accelerator's checks,
the shard plan of a tensor-parallel instance): a CPU plan with its device and model settled runs
torch-free, as the supervisor does. Those imports are lazy for that reason.
"""
from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import time
from pathlib import Path

import msgspec

from mindie.contract.spec import (  # noqa: F401  (the defaults' functions, as before)
    Deployment, WorkerSpec, cpu_flags, decode_hold_default, overlap_default, prefill_chunk_default, read_deployment,
    settle_engine, write_deployment)
from workers.models.checkpoint import ModelLoadError, check_checkpoint
from workers.models.config import ModelArgs, ModelConfigError
from workers.models.default_model import DefaultModelMissing, default_model_file
from workers.models.lora_adapter import AdapterError, check_adapter
from workers.models.demo import ensure_demo_model
from workers.models.gguf_paths import GgufError, find_gguf
from workers.supervisor import visibility_env

log = logging.getLogger("workers.prepare")


def settle(spec: WorkerSpec, device_type: str, model_dir: str, flags: str | None = None) -> WorkerSpec:
    """``spec`` with the device, the model directory and every device-dependent default of its
    engine settled (overlap, prefill chunk, decode hold; this host's CPU: native bf16, the fused
    decode step's rows; ``mindie.contract.spec.settle_engine``). ``flags``: a /proc/cpuinfo
    "flags" line (default: this host's)."""
    engine = settle_engine(spec.engine, device_type, cpu_flags() if flags is None else flags)
    return msgspec.structs.replace(spec, device_type=device_type, model_path=model_dir, engine=engine)


def settle_deployment(dep: Deployment) -> Deployment:
    first = dep.workers[0]
    device_type = first.device_type
    if device_type == "auto":
        from workers.backends import detect  # lazy: imports torch (see the module docstring)
        device_type = detect()
        log.info("deviceType auto -> %s", device_type)
    model_dir = first.model_path
    demo = not model_dir and os.environ.get("MINDIE_DEMO_MODEL") == "1"
    default = not model_dir and not demo
    if demo:
        model_dir = str(ensure_demo_model())
        log.info("--demo-model: serving the built-in demo model at %s (random weights, its output is gibberish)",
                 model_dir)
    elif default:
        try:
            gguf = default_model_file()
        except DefaultModelMissing as e:
            raise SystemExit(f"{WEIGHT_PATH_KEY}: {e}") from None
        log.info("no modelWeightPath configured: serving the default model, %s (%s)", first.model_name, gguf)
        model_dir = _gguf_view(gguf)
    elif not os.path.exists(model_dir):
        raise SystemExit(f"{WEIGHT_PATH_KEY}: {model_dir} does not exist (a Hugging Face model directory or a "
                         ".gguf file is expected)")
    elif gguf := _gguf_file(model_dir):
        model_dir = _gguf_view(gguf)
    elif not os.path.isdir(model_dir):
        raise SystemExit(f"{WEIGHT_PATH_KEY}: {model_dir} is not a directory nor a GGUF file (a Hugging Face model "
                         "directory or a .gguf file is expected)")
    elif not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise SystemExit(f"{WEIGHT_PATH_KEY}: {model_dir} has no config.json and no .gguf file (a Hugging Face model "
                         "directory or a .gguf file is expected)")
    models = [settle_deployment(Deployment(run_dir=dep.run_dir, workers=g)).workers for g in dep.models]
    return msgspec.structs.replace(dep, workers=[settle(s, device_type, model_dir) for s in dep.workers],
                                   demo_model=demo, default_model=default, models=models)


WEIGHT_PATH_KEY = "BackendConfig.ModelDeployConfig.ModelConfig[0].modelWeightPath"


def _gguf_file(path: str) -> Path | None:
    """The GGUF file ``modelWeightPath`` names (the file, or the one in a folder without
    config.json), None for anything else; SystemExit for a folder of several."""
    try:
        return find_gguf(path)
    except GgufError as e:
        raise SystemExit(f"{WEIGHT_PATH_KEY}: {path} {e}") from None


def _gguf_view(gguf: Path) -> str:
    """The model view of ``gguf`` (workers/models/gguf_view.py: made once, then reused), the
    directory every process reads as the model's; SystemExit saying why the file cannot be served
    (unreadable, truncated, an unsupported architecture, a tokenizer transformers cannot convert)."""
    try:
        from workers.models.gguf_view import ensure_view  # reads the file: gguf and numpy, for GGUF files only
        view = ensure_view(gguf)
    except GgufError as e:
        raise SystemExit(f"{WEIGHT_PATH_KEY}: {gguf}: {e}") from None
    except OSError as e:  # the cache folder
        raise SystemExit(f"{WEIGHT_PATH_KEY}: {gguf}: cannot make its model view: {e} (MINDIE_CACHE_DIR must be a "
                         "writable folder)") from None
    log.info("modelWeightPath %s is a GGUF file: served through its model view %s", gguf, view)
    return str(view)


def check_deployment(dep: Deployment, role: str = "all") -> None:
    """``check_model`` for the workers this host starts (settled ``dep``): none on a front-end
    host (``role`` "frontends", launch.sh --frontends-only: the weights need not be there), and
    the null model loads nothing."""
    for group in dep.groups:  # every model's workers (several models: mindie/model_plan.py)
        local = [s for s in group if not s.remote and not s.null_model]
        if local and role != "frontends":
            check_model(local, group[0].model_path)


def check_model(specs: list[WorkerSpec], model_dir: str) -> None:
    """Refuse (SystemExit with the message) what the workers of ``specs`` (settled, this host's)
    would refuse at start, without loading a weight; one log line says what was checked."""
    t0 = time.perf_counter()
    try:
        args = ModelArgs.from_dir(model_dir)
    except ModelConfigError as e:
        raise SystemExit(f"{WEIGHT_PATH_KEY}: {model_dir} cannot be served: {e}") from None
    for spec in specs:
        check_tensor_parallel(spec, args)
    try:
        checkpoint = check_checkpoint(model_dir, args)
    except (ModelLoadError, ModelConfigError) as e:  # ModelConfigError: a quantization_config it does not serve
        raise SystemExit(f"{WEIGHT_PATH_KEY}: {model_dir} cannot be served: {e}") from None
    device = check_device(specs)
    adapters = check_lora_modules(specs[0], args)
    log.info("model check: %s is %s (%d layers, vocab %d), %d weight file(s) with the %d tensors it needs, "
             "%.1f MiB, headers only%s%s; in %.2f s", model_dir, args.arch, args.num_hidden_layers, args.vocab_size,
             len(checkpoint.files), checkpoint.tensors, checkpoint.nbytes / 2**20, device, adapters,
             time.perf_counter() - t0)


def check_lora_modules(spec: WorkerSpec, args: ModelArgs) -> str:
    """``LoraModules``: each adapter folder checked for this model (workers/models/lora_adapter.py,
    adapter_config.json and the safetensors header); SystemExit naming the entry. Returns a note
    for the log line."""
    for i, m in enumerate(spec.lora_modules):
        try:
            plan = check_adapter(m.path, args, spec.max_lora_rank)
        except AdapterError as e:
            raise SystemExit(f"BackendConfig.ModelDeployConfig.LoraModules[{i}] ({m.name}): {m.path} cannot be "
                             f"served: {e}") from None
        log.info("LoRA adapter %s: %s (%s)", m.name, plan.path, plan.describe())
    return f", {len(spec.lora_modules)} LoRA adapter(s)" if spec.lora_modules else ""


def check_device(specs: list[WorkerSpec]) -> str:
    """An accelerator's start refusals (``workers.engine.assembly.start_refusal``: no such device,
    no int8 kernel for ``quantize``) and, when this process sees every device, npuDeviceIds past
    the last one; SystemExit naming the key. Returns a note for the log line ("" on the CPU)."""
    first = specs[0]
    if first.device_type == "cpu":
        return ""  # the CPU backend refuses nothing at start (it has int8 kernels): no torch import here
    from workers.engine.assembly import start_refusal  # lazy: imports torch (see the module docstring)
    from workers.backends import get_backend
    for spec in specs:
        if why := start_refusal(spec):
            raise SystemExit(why)
    count = get_backend(first.device_type).device_count()
    var = next(iter(visibility_env(first.device_type, [])), "")
    if count is None or os.environ.get(var):
        return f", {first.device_type} available"  # a restricted view: the physical ids cannot be checked
    top = max(i for s in specs for i in s.device_ids)
    if top >= count:
        raise SystemExit(f"BackendConfig.npuDeviceIds: device {top} does not exist: this host has {count} "
                         f"{first.device_type} device(s), 0 to {count - 1}")
    return f", {count} {first.device_type} device(s)"


def check_tensor_parallel(spec: WorkerSpec, args: ModelArgs) -> None:
    """npuDeviceIds entries of several devices: the model must split that many ways (exits
    naming worldSize otherwise, before any process starts)."""
    world = len(spec.device_ids)
    if world <= 1 or spec.null_model:
        return
    from workers.models.sharding import plan_shard  # lazy: imports torch (see the module docstring)
    try:
        plan_shard(args, 0, world, spec.moe_parallel)
    except ModelConfigError as e:
        raise SystemExit(str(e)) from None
    log.info("tensor parallel: each npuDeviceIds entry is one instance of %d ranks (one process per device)", world)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Settle the device side of a launch plan (deployment.json): "
                                             "'auto' device, demo model, device defaults; refuse a model this "
                                             "host's workers cannot load. Run by scripts/launch.sh.")
    ap.add_argument("deployment", help="path of deployment.json (written by python -m mindie.ops.launch_plan)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=(os.environ.get("MINDIE_LOG_LEVEL") or "INFO").upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [launch] %(message)s")
    try:
        dep = settle_deployment(read_deployment(args.deployment))
        check_deployment(dep, os.environ.get("MINDIE_ROLE") or "all")
    except SystemExit as e:
        print(f"config error: {e.code}", file=sys.stderr)
        raise SystemExit(2)
    write_deployment(dep, args.deployment)
    print(f"MINDIE_MODEL_DIR={shlex.quote(dep.model_dir)}")


if __name__ == "__main__":
    main()
