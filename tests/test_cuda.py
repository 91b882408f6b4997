"""The CUDA path (run by mindie_bench/lab/gpu_check.sh on a machine with a GPU; skipped elsewhere): the
engine's greedy continuations on CUDA equal the CPU's on the same fp32 weights, in the process and served
by the launch script."""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import torch

from mindie.contract import wire as P
from mindie.contract.spec import EngineConfig, WorkerSpec
from tests.harness import Server, free_port, short_run_dir, write_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _greedy(model: str, device: str) -> dict[str, list[int]]:
    from workers.backends import get_backend
    from workers.engine.assembly import load_runner
    from workers.engine.engine import Engine

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


def _served(tmp: Path, model: str, device: str, bodies: list[dict]) -> list[tuple[list[int], list[int]]]:
    """Each body's greedy tokens from the launch script on ``device``: (whole reply, stream)."""
    port = free_port()
    cfg = write_config(tmp / f"config-{device}.json", port=port, run_dir=short_run_dir(), workers=1,
                       model_path=model)
    doc = json.loads(cfg.read_text())
    doc["BackendConfig"]["deviceType"] = device
    cfg.write_text(json.dumps(doc))
    # cuBLAS's TF32 off for this process tree (the backend turns torch's TF32 switch on for speed).
    srv = Server(cfg, port, env={"NVIDIA_TF32_OVERRIDE": "0"})
    out = []
    try:
        srv.wait_ready(300)
        for body in bodies:
            r = httpx.post(srv.url + "/infer_token", content=json.dumps(body), timeout=120)
            assert r.status_code == 200, r.text
            whole = r.json()["details"]["generated_token_ids"]
            with httpx.stream("POST", srv.url + "/infer_token", content=json.dumps(dict(body, stream=True)),
                              timeout=120) as s:
                assert s.status_code == 200
                frames = [json.loads(f) for f in re.findall(rb"data: (\{.*?\})\n\n", s.read(), re.DOTALL)]
            out.append((whole, [f["token"]["id"][0] for f in frames]))
        if device == "cuda":
            assert "cuda (" in srv.tail(400), srv.tail()  # the worker said which device it runs on
    finally:
        srv.stop()
    return out


def test_cuda_served_tokens_equal_the_cpu_servers(tmp_path: Path, demo_model: str) -> None:
    """The real launch script with ``deviceType: cuda`` (supervisor, worker on GPU 0, gunicorn, ZeroMQ):
    whole replies and streams carry the CPU server's greedy tokens (speculative decoding on, its default)."""
    bodies = [{"input_id": ids, "stream": False,
               "parameters": {"max_new_tokens": n, "do_sample": False, "details": True, "ignore_eos": True}}
              for ids, n in (([5, 6, 7], 40), (list(range(100, 190)), 24), ([9] * 30, 48))]
    cpu, cuda = _served(tmp_path, demo_model, "cpu", bodies), _served(tmp_path, demo_model, "cuda", bodies)
    for body, (w, s) in zip(bodies, cuda):
        assert len(w) == body["parameters"]["max_new_tokens"] and w == s
    assert cuda == cpu
