"""Device-side launch step: settle what only the device side knows, in the launch plan.

    python -m workers.prepare <runDir>/deployment.json

Run by scripts/launch.sh after ``mindie.prepare`` wrote the plan and before anything starts:
resolves ``deviceType: auto`` (npu, else cuda, else cpu), makes the built-in demo model when no
weights are configured (random weights, real tokenizer; about 4 s, once), and fills the
device's step-overlap and prefill-chunk defaults. Rewrites the file in place; prints ``MINDIE_MODEL_DIR=...``
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

from mindie.contract.spec import Deployment, WorkerSpec, read_deployment, write_deployment
from workers.models.config import ModelArgs, ModelConfigError
from workers.models.demo import ensure_demo_model

log = logging.getLogger("workers.prepare")


def overlap_default(device_type: str) -> bool:
    """An accelerator computes while the host thread is free, so overlapping the worker loop's
    I/O with the step hides it; on CPU both share the cores and overlap measured neutral
    (docs/performance.md): off."""
    return device_type in ("cuda", "npu")


def prefill_chunk_default(device_type: str) -> int:
    """Prompt tokens per step while several requests have work. On CPU a step's time grows with
    its tokens from a few dozen up: 256-token chunks gave a wave of 32 prompts a p50 TTFT of
    88-96 ms against 278-295 ms in one step, p99 and output tokens/s unchanged; once decode steps
    got faster (the fused decode step, faster attention) 128 beat 256 on output tokens/s, TTFT
    p50 and the p99 gap between tokens, and 64 on TTFT p99 (64 has the smaller gap between
    tokens; docs/performance.md, "TTFT under load").
    Accelerators need bigger steps to be efficient: 2048 (vLLM's default token budget)."""
    return 128 if device_type == "cpu" else 2048


def decode_hold_default(device_type: str) -> int:
    """How long (ms) steps that complete prompts may hold the running requests' decodes. On CPU a
    decode row costs a step about what a prompt row does, so the decodes of a wave's first
    requests slow every later prompt of the wave: holding them up to 400 ms brought the p99 TTFT
    of 32 concurrent requests of 128 output tokens from 396-413 to 340-346 ms and their p99 gap
    between tokens from 30-31 to 18-20 ms (with 32 output tokens that gap's p99 rises to 203-222
    ms: docs/performance.md, "Prefill first"). On accelerators decode rows are nearly free beside
    a prompt chunk: 0."""
    return 400 if device_type == "cpu" else 0


def settle(spec: WorkerSpec, device_type: str, model_dir: str) -> WorkerSpec:
    """``spec`` with the device, the model directory and the overlap, prefill-chunk and
    decode-hold defaults filled in."""
    engine = spec.engine
    if engine.overlap is None:
        engine = msgspec.structs.replace(engine, overlap=overlap_default(device_type))
    if engine.prefill_chunk_tokens is None:
        engine = msgspec.structs.replace(engine, prefill_chunk_tokens=prefill_chunk_default(device_type))
    if engine.decode_hold_ms is None:
        engine = msgspec.structs.replace(engine, decode_hold_ms=decode_hold_default(device_type))
    return msgspec.structs.replace(spec, device_type=device_type, model_path=model_dir, engine=engine)


def settle_deployment(dep: Deployment) -> Deployment:
    first = dep.workers[0]
    device_type = first.device_type
    if device_type == "auto":
        from workers.backends import detect  # lazy: imports torch (see the module docstring)
        device_type = detect()
        log.info("deviceType auto -> %s", device_type)
    model_dir = first.model_path
    if not model_dir:
        model_dir = str(ensure_demo_model())
        log.info("no modelWeightPath configured: serving the built-in demo model at %s "
                 "(random weights, its output is gibberish)", model_dir)
    elif not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise SystemExit(f"BackendConfig.ModelDeployConfig.ModelConfig[0].modelWeightPath: {model_dir} has no "
                         "config.json (a Hugging Face model directory is expected)")
    check_tensor_parallel(first, model_dir)
    return msgspec.structs.replace(dep, workers=[settle(s, device_type, model_dir) for s in dep.workers])


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
                                             "'auto' device, demo model, overlap default. Run by scripts/launch.sh.")
    ap.add_argument("deployment", help="path of deployment.json (written by python -m mindie.prepare)")
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
