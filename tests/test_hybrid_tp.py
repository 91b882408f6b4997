"""Tensor parallelism of the hybrid models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE: workers/models/qwen3_next.py,
sharding.py) on tiny random fp32 transformers checkpoints (tests/tiny_hf.py), over gloo on the CPU.

- The shard plan: each rank's Gated DeltaNet key heads with their value heads; a linear head count
  that does not divide refused naming its keys.
- Each rank loads its slices only (Qwen3.5's in_proj_qkv and every convolution in three row ranges,
  Qwen3-Next's per-key-head groups in one), and the ranks' slices put back together are the
  checkpoint.
- A 2-rank instance (tests/tp_instance.py: one process per rank, the real engine) generates greedy
  what transformers does and, greedy and seeded sampling, what one process does: chunked prompts
  beside decodes; one KV head replicated (Qwen3.5 dense); experts split (Qwen3.5-MoE,
  moeParallel "tp") or whole per rank (Qwen3-Next, "ep"); the state pool of each rank half of one
  process's (the load log).
- The real launch script with worldSize 2: concurrent /infer_token requests and the OpenAI chat
  route equal transformers.
"""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.harness import Server, free_port, run_tp_instance, short_run_dir, write_config
from tests.tiny_hf import QWEN3_CHAT_TEMPLATE, save_chat_model, save_random_model
from workers.models.config import ModelArgs, ModelConfigError
from workers.models.loader import load_model, parameter_bytes
from workers.models.sharding import TensorParallel, plan_shard

transformers = pytest.importorskip("transformers")

from tests.test_hybrid import BASE, MOE, VOCAB, hf_greedy  # noqa: E402

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # one KV head for two ranks: each keeps a copy (the full-attention layers as the Llama family's)
    "qwen3_5": ("Qwen3_5TextConfig", {"num_key_value_heads": 1}),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", MOE),
    "qwen3_next": ("Qwen3NextConfig", MOE),  # fused in_proj_qkvz / in_proj_ba grouped by key head
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    root = tmp_path_factory.mktemp("hybrid-tp")
    return {case: (save_random_model(cls, {**BASE, **extra}, root / case), root / case)
            for case, (cls, extra) in CASES.items()}


def _cfg(models, case: str) -> dict:
    return json.loads((models[case][1] / "config.json").read_text())


def test_shard_plan_splits_linear_heads_and_refuses_what_does_not_divide(models) -> None:
    args = ModelArgs.from_dir(models["qwen3_5"][1])
    hy = plan_shard(args, 1, 2).local_args(args).hybrid
    assert (hy.num_k_heads, hy.num_v_heads, hy.head_k_dim, hy.head_v_dim) == (1, 2, 8, 8)
    assert hy.layer_types == args.hybrid.layer_types and hy.conv_dim == args.hybrid.conv_dim // 2
    with pytest.raises(ModelConfigError, match=r"ModelConfig\[0\]\.worldSize: 4 ranks cannot split the Gated "
                                               r"DeltaNet layers: linear_num_key_heads 2 \(linear_num_value_heads "
                                               r"4\) is not a multiple of 4"):
        plan_shard(args, 0, 4)
    wide = ModelArgs.from_dict({**_cfg(models, "qwen3_next"), "linear_num_key_heads": 4, "linear_num_value_heads": 8,
                                "num_key_value_heads": 4})
    s = plan_shard(wide, 3, 4)
    local = s.local_args(wide)
    assert (local.hybrid.num_k_heads, local.hybrid.num_v_heads, local.num_attention_heads, s.head0) == (1, 2, 1, 3)


@pytest.mark.parametrize("case", ["qwen3_5", "qwen3_next"])
def test_each_rank_loads_its_heads(models, case: str) -> None:
    """About half the parameter bytes on each rank, and the ranks' slices put back together are the
    checkpoint's tensors: the [q | k | v] rows of in_proj_qkv and the convolution, z / b / a,
    A_log, dt_bias, out_proj's input columns, the gated attention's q+gate heads and o_proj's
    columns, the replicated KV head."""
    path = models[case][1]
    args = ModelArgs.from_dir(path)
    full, _ = load_model(path, torch.float32)
    ranks = [load_model(path, torch.float32, tp=TensorParallel(plan_shard(args, r, 2)))[0] for r in range(2)]
    for m in ranks:
        assert 0.45 < parameter_bytes(m) / parameter_bytes(full) < 0.56
    hy = args.hybrid

    def qkv_parts(t: torch.Tensor, kd: int) -> list[torch.Tensor]:
        return [t[:kd], t[kd:2 * kd], t[2 * kd:]]

    for i in range(args.num_hidden_layers):
        f, parts = full.layers[i], [m.layers[i] for m in ranks]
        if f.linear_attn is not None:
            fl, pl = f.linear_attn, [p.linear_attn for p in parts]
            kd = hy.key_dim // 2
            qkv = {"conv1d": lambda m: m.conv_weight}
            if hy.layout == "split":
                qkv["in_proj_qkv"] = lambda m: m.in_proj_qkv.weight
            for name, get in qkv.items():  # each rank's q, then k, then v heads
                got = [torch.cat(x) for x in zip(*(qkv_parts(get(p), kd) for p in pl))]
                assert torch.equal(torch.cat(got), get(fl)), name
            names = (["in_proj_z", "in_proj_b", "in_proj_a"] if hy.layout == "split" else ["in_proj_qkvz", "in_proj_ba"])
            for n in names:
                assert torch.equal(torch.cat([getattr(p, n).weight for p in pl]), getattr(fl, n).weight), n
            for n in ("A_log", "dt_bias"):
                assert torch.equal(torch.cat([getattr(p, n) for p in pl]), getattr(fl, n)), n
            assert torch.equal(torch.cat([p.out_proj.weight for p in pl], dim=1), fl.out_proj.weight)
            assert all(torch.equal(p.norm.weight, fl.norm.weight) for p in pl)
        else:
            fa, pa = f.self_attn, [p.self_attn for p in parts]
            assert torch.equal(torch.cat([p.q_proj.weight for p in pa]), fa.q_proj.weight)
            assert torch.equal(torch.cat([p.o_proj.weight for p in pa], dim=1), fa.o_proj.weight)
            kv = [p.k_proj.weight for p in pa]
            assert (torch.cat(kv) if args.num_key_value_heads >= 2 else kv[0]).equal(fa.k_proj.weight)
            assert args.num_key_value_heads >= 2 or torch.equal(kv[1], fa.k_proj.weight)  # replicated


def _run(path: Path, world: int, tmp: Path, requests: list[dict], moe_mode: str = "tp") -> dict:
    """tests/tp_instance.py's result and its log; ``moe_mode``: moeParallel. Every case's
    single-worker reference comes from one process."""
    return run_tp_instance(path, world, tmp, requests, {"TP_TEST_MOE_PARALLEL": moe_mode},
                           [path.parent / c for c in CASES], timeout=600)


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_generate_what_transformers_and_one_process_do(models, case: str, tmp_path: Path) -> None:
    hf, path = models[case]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 80, 23)]  # 80: chunks of 64
    n = 8
    reqs = [{"id": f"g{i}", "prompt": p, "params": {"max_new_tokens": n, "ignore_eos": True}}
            for i, p in enumerate(prompts)]
    reqs += [{"id": f"s{i}", "prompt": p, "params": {"max_new_tokens": n, "ignore_eos": True, "do_sample": True,
                                                    "temperature": 0.9, "top_k": 40, "seed": 11 + i}}
             for i, p in enumerate(prompts)]
    # Qwen3-Next's experts whole on each rank (moeParallel "ep"), Qwen3.5-MoE's split ("tp")
    mode = "ep" if case == "qwen3_next" else "tp"
    one, two = _run(path, 1, tmp_path, reqs), _run(path, 2, tmp_path, reqs, mode)
    assert [two["tokens"][f"g{i}"] for i in range(len(prompts))] == [hf_greedy(hf, p, n) for p in prompts]
    assert two["tokens"] == one["tokens"]
    assert any(one["tokens"][f"g{i}"] != one["tokens"][f"s{i}"] for i in range(len(prompts)))
    assert two["param_bytes"] < 0.6 * one["param_bytes"]
    full = sum(ModelArgs.from_dir(path).hybrid.state_bytes(4))
    for r in range(2):  # each rank's state pool holds its heads' states: half of one process's
        assert re.search(rf"tensor-parallel rank {r}/2: Gated DeltaNet key heads {r}\.\.{r}, value heads "
                         rf"{2 * r}\.\.{2 * r + 1}, .*state pool {full // 2} bytes per sequence per rank",
                         two["log"]), two["log"][-3000:]
        assert f"[rank {r}] workers.engine: state pool: 16 slots (maxBatchSize) x {full // 2} bytes" in two["log"]
    if case == "qwen3_next":
        assert "rank 1 holds experts 2..3" in two["log"], two["log"][-3000:]


@pytest.mark.timeout(600)
def test_server_of_a_two_rank_instance_equals_transformers(tmp_path: Path) -> None:
    """The real launch script: a Qwen3.5 instance of two ranks (npuDeviceIds [[0, 1]], worldSize 2)
    answers concurrent /infer_token requests (prompts beside decodes, each in its own state slot on
    both ranks) and the OpenAI chat route (its client package) as transformers does."""
    import openai

    path = save_chat_model(tmp_path / "chat-qwen3_5", QWEN3_CHAT_TEMPLATE, cls_name="Qwen3_5TextConfig",
                           config=dict(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                                       linear_key_head_dim=16, linear_value_head_dim=16))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    port = free_port()
    cfg = write_config(tmp_path / "config.json", port=port, run_dir=short_run_dir(), workers=1, model_path=str(path),
                       model={"modelName": "hybrid", "worldSize": 2}, backend={"npuDeviceIds": [[0, 1]]},
                       schedule={"maxBatchSize": 4, "maxPrefillBatchSize": 4})
    srv = Server(cfg, port)
    n = 10
    prompts = [[5, 6, 7, 8, 9], list(range(20, 90)), list(range(200, 230)), [7] * 12]

    def infer(ids: list[int]) -> list[int]:
        r = httpx.post(srv.url + "/infer_token", json={"input_id": ids, "stream": False, "parameters": {
            "max_new_tokens": n, "do_sample": False, "details": True, "ignore_eos": True}}, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["details"]["generated_token_ids"]

    try:
        srv.wait_ready(180)
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(infer, prompts))
        assert got == [hf_greedy(hf, p, n) for p in prompts]
        messages = [{"role": "user", "content": "How are the heads of a Gated DeltaNet layer split?"}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        want = hf_greedy(hf, list(ids), n)
        want = want[:want.index(tok.eos_token_id)] if tok.eos_token_id in want else want
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
        answer = client.chat.completions.create(model="hybrid", messages=messages, max_tokens=n, temperature=0)
        assert answer.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
        log = srv.tail(600)
        # per rank: 3 linear layers x (conv (2*16+32) x 3 x 4 + recurrent 2 x 16 x 16 x 4)
        per_rank = 3 * ((2 * 16 + 32) * 3 * 4 + 2 * 16 * 16 * 4)
        assert f"state pool {per_rank} bytes per sequence per rank" in log, log[-3000:]
        assert "tensor-parallel rank 1/2: Gated DeltaNet key heads 1..1, value heads 2..3" in log, log[-3000:]
    finally:
        assert srv.stop() == 0, srv.tail()
