"""Build the ModelRunner of a worker: load weights, pick the dtype, wire the sampler."""
from __future__ import annotations

import logging
import time

import torch

from workers.backends.base import Backend
from workers.engine.model_runner import ModelRunner
from workers.engine.sampler_adapter import make_sample_fn
from workers.spec import WorkerSpec

log = logging.getLogger("workers.model_setup")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, checkpoint_dtype: str | None, backend: Backend) -> torch.dtype:
    """"auto" = the checkpoint's torch_dtype, except float16 on CPU (slow there) -> bfloat16."""
    if name != "auto":
        return DTYPES[name]
    dtype = DTYPES.get(checkpoint_dtype or "", backend.default_dtype())
    if backend.name == "cpu" and dtype is torch.float16:
        dtype = torch.bfloat16
    return dtype


def load_runner(spec: WorkerSpec, backend: Backend) -> tuple[ModelRunner, dict, int]:
    from workers.models.config import ModelArgs
    from workers.models.loader import load_model

    path = spec.model_path
    if not path:
        from workers.models.demo import ensure_demo_model
        path = str(ensure_demo_model())
    args = ModelArgs.from_dir(path)
    dtype = resolve_dtype(spec.dtype, args.torch_dtype, backend)
    device = backend.device()
    t0 = time.perf_counter()
    model, args = load_model(path, dtype, device, max_positions=spec.max_seq_len)
    backend.prepare_model(model)
    log.info("loaded %s (%s, %d layers, vocab %d) as %s on %s in %.2f s", path, args.arch, args.num_hidden_layers,
             args.vocab_size, dtype, device, time.perf_counter() - t0)
    eos = frozenset(args.eos_token_ids)
    sample = make_sample_fn(spec.watermark_gamma, spec.watermark_delta)
    runner = ModelRunner(model, (args.num_hidden_layers, args.num_key_value_heads, args.head_dim), dtype, sample,
                         args.vocab_size, eos, device, attention_cls=backend.attention_class())
    info = {"model_name": spec.model_name, "vocab_size": args.vocab_size}
    return runner, info, runner.bytes_per_block(spec.block_size)
