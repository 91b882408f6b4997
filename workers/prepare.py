"""Device-side launch step: settle what only the device side knows, in the launch plan.

    python -m workers.prepare <runDir>/deployment.json

Run by scripts/launch.sh after ``mindie.ops.prepare`` wrote the plan and before anything starts:
resolves ``deviceType: auto`` (npu, else cuda, else cpu), makes the built-in demo model when no
weights are configured (random weights, real tokenizer; about 4 s, once), and fills the
device-dependent defaults of the engine settings (step overlap, prefill chunk, decode hold, the
CPU's native bf16 and fused-decode rows: ``settle_engine``), once: nothing downstream re-defaults
them. Rewrites the file in place; prints ``MINDIE_MODEL_DIR=...``
for the launcher. Exit status 2 with a message when the model directory is unusable.

Imports torch only where it needs it (device detection for ``auto``, the shard plan of a
tensor-parallel instance): a plan with its device and model settled runs torch-free, as the
supervisor does. Those two imports are lazy for that reason.
"""
from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys

import msgspec

from mindie.contract.spec import (  # noqa: F401  (the defaults' functions, as before)
    Deployment, WorkerSpec, cpu_flags, decode_hold_default, overlap_default, prefill_chunk_default, read_deployment,
    settle_engine, write_deployment)
from workers.models.config import ModelArgs, ModelConfigError
from workers.models.demo import ensure_demo_model

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
    demo = not model_dir
    if demo:
        model_dir = str(ensure_demo_model())
        log.info("no modelWeightPath configured: serving the built-in demo model at %s "
                 "(random weights, its output is gibberish)", model_dir)
    elif not os.path.exists(model_dir):
        raise SystemExit(f"BackendConfig.ModelDeployConfig.ModelConfig[0].modelWeightPath: {model_dir} does not "
                         "exist (a Hugging Face model directory is expected)")
    elif not os.path.isdir(model_dir):
        raise SystemExit(f"BackendConfig.ModelDeployConfig.ModelConfig[0].modelWeightPath: {model_dir} is not a "
                         "directory (a Hugging Face model directory is expected)")
    elif not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise SystemExit(f"BackendConfig.ModelDeployConfig.ModelConfig[0].modelWeightPath: {model_dir} has no "
                         "config.json (a Hugging Face model directory is expected)")
    check_tensor_parallel(first, model_dir)
    return msgspec.structs.replace(dep, workers=[settle(s, device_type, model_dir) for s in dep.workers],
                                   demo_model=demo)


def check_tensor_parallel(spec: WorkerSpec, model_dir: str) -> None:
    """npuDeviceIds entries of several devices: the model must split that many ways (exits
    naming worldSize otherwise, before any process starts)."""
    world = len(spec.device_ids)
    if world <= 1 or spec.null_model:
        return
    from workers.models.sharding import plan_shard  # lazy: imports torch (see the module docstring)
    try:
        plan_shard(ModelArgs.from_dir(model_dir), 0, world)
    except ModelConfigError as e:
        raise SystemExit(str(e)) from None
    log.info("tensor parallel: each npuDeviceIds entry is one instance of %d ranks (one process per device)", world)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Settle the device side of a launch plan (deployment.json): "
                                             "'auto' device, demo model, device defaults. Run by scripts/launch.sh.")
    ap.add_argument("deployment", help="path of deployment.json (written by python -m mindie.ops.prepare)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=(os.environ.get("MINDIE_LOG_LEVEL") or "INFO").upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [launch] %(message)s")
    try:
        dep = settle_deployment(read_deployment(args.deployment))
    except SystemExit as e:
        print(f"config error: {e.code}", file=sys.stderr)
        raise SystemExit(2)
    write_deployment(dep, args.deployment)
    print(f"MINDIE_MODEL_DIR={shlex.quote(dep.model_dir)}")


if __name__ == "__main__":
    main()
