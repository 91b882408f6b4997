"""The CUDA path (run by mindie_bench/lab/gpu_check.sh on a machine with a GPU; skipped elsewhere): the
engine's greedy continuations on CUDA equal the CPU's on the same fp32 weights."""
from __future__ import annotations

import pytest
import torch

from mindie.contract import wire as P
from mindie.contract.spec import EngineConfig, WorkerSpec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _greedy(model: str, device: str) -> dict[str, list[int]]:
    from workers.backends import get_backend
    from workers.engine.engine import Engine
    from workers.engine.assembly import load_runner

    cfg = EngineConfig(block_size=16, max_seq_len=512, max_batch_size=8, max_prefill_tokens=64, overlap=False)
    spec = WorkerSpec(worker_id="cuda", job_endpoint="", pub_endpoint="", device_type=device, model_path=model,
                      dtype="float32", engine=cfg)
    backend = get_backend(device, 2)
    backend.setup()
    if device == "cuda":  # the backend turns TF32 on for speed; exactness against the CPU needs it off
        torch.backends.cuda.matmul.allow_tf32 = False
    runner = load_runner(spec, backend)
    runner.allocate_kv(256, cfg.block_size)
    engine = Engine(runner, cfg, 256)
    out: dict[str, list[int]] = {}
    for i, prompt in enumerate([[5, 6, 7], list(range(100, 190)), [9] * 30]):
        engine.add(P.Submit(f"r{i}", "t", prompt, P.SamplingParams(max_new_tokens=32, ignore_eos=True)))
        out[f"r{i}"] = []
    while engine.has_work():
        for o in engine.step():
            out[o.seq.request_id].extend(o.token_ids)
    return out


def test_cuda_engine_greedy_matches_cpu(demo_model: str) -> None:
    cpu, cuda = _greedy(demo_model, "cpu"), _greedy(demo_model, "cuda")
    assert all(len(t) == 32 for t in cuda.values())
    assert cuda == cpu
