"""Mixtures of experts (workers/models/moe.py): Qwen2-MoE (shared expert and its sigmoid gate),
Qwen3-MoE and Mixtral, on tiny random transformers checkpoints (tests/tiny_hf.py, fp32,
save_pretrained).

- config.json: decoder_sparse_step / mlp_only_layers pick the sparse layers, norm_topk_prob,
  num_experts_per_tok, moe_intermediate_size, shared_expert_intermediate_size, Mixtral's
  num_local_experts, sliding windows; bad values refused naming the key.
- Logits equal transformers' (fp32, within 1e-4) on a flat batch of prompts, for every family,
  with dense layers mixed in and Mixtral's sliding window shorter than the prompts.
- The grouped expert step touches only the activated experts (every other expert's weights set
  to NaN leave the output finite) and equals a per-token reference.
- w8a16: expert weights in int8 compute what their dequantised values do.
- Tensor parallelism over gloo, both moeParallel modes (expert TP and expert parallelism): greedy
  and seeded-sampled tokens equal one process; each rank reads only its experts.
- The real launch script: greedy /infer_token and chat equal transformers' generate, logprobs
  within tests/test_logprobs.py's tolerance; the load log names the experts and top-k.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.harness import demo_server, run_tp_instance
from tests.test_logprobs import TOL
from tests.tiny_hf import QWEN3_CHAT_TEMPLATE, save_chat_model, save_random_model
from tests.reference_attention import DenseCausalAttention
from workers.backends.int8 import Int8Kernel, Int8Linear, copy_dequantized_into, quantize_model
from workers.models.config import ModelArgs, ModelConfigError
from workers.models.loader import load_model
from workers.models.moe import MoeShard, SparseMoE

transformers = pytest.importorskip("transformers")

from tests.test_model_families import bf16_check, engine_check, int8_check  # noqa: E402

BASE = dict(vocab_size=151, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # shared expert with its sigmoid gate; layer 1 dense (mlp_only_layers), top-k not renormalised
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48, mlp_only_layers=[1],
                                         norm_topk_prob=False)),
    # q/k norms; every second layer sparse (decoder_sparse_step 2), top-k renormalised
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                         head_dim=16, decoder_sparse_step=2, norm_topk_prob=True)),
    # block_sparse_moe.experts.{e}.w1/w3/w2; a sliding window shorter than the prompts
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=12)),
}


def _make(case: str, root: Path) -> Path:
    cls, extra = CASES[case]
    save_random_model(cls, {**BASE, **extra}, root / case)
    return root / case


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {case: _make(case, root) for case in CASES}


def _logits(model: torch.nn.Module, prompts: list[list[int]]) -> torch.Tensor:
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.no_grad():
        return model.compute_logits(model(ids, pos, DenseCausalAttention.from_lengths([len(p) for p in prompts])))


PROMPTS = [list(range(3, 40)), [7, 9, 11, 13], list(range(100, 150, 2))]


# ----------------------------------------------------------------------------- config


def test_config_reads_the_moe_keys(models: dict[str, Path]) -> None:
    q2 = ModelArgs.from_dir(models["qwen2_moe"])
    assert q2.arch == "qwen2" and q2.model_type == "qwen2_moe" and q2.attention_bias and not q2.o_proj_bias
    assert q2.moe is not None and q2.moe.sparse_layers == (True, False, True)
    assert (q2.moe.num_experts, q2.moe.top_k, q2.moe.moe_intermediate_size, q2.moe.norm_topk_prob) == (8, 2, 32, False)
    assert q2.moe.shared_expert_intermediate_size == 48 and q2.moe.shared_expert_gate
    q3 = ModelArgs.from_dir(models["qwen3_moe"])
    assert q3.qk_norm and q3.moe is not None and q3.moe.sparse_layers == (False, True, False)
    assert q3.moe.num_experts == 8 and q3.moe.top_k == 3 and q3.moe.norm_topk_prob
    assert q3.moe.shared_expert_intermediate_size == 0
    mx = ModelArgs.from_dir(models["mixtral"])
    assert mx.arch == "mistral" and mx.moe is not None and mx.moe.names == "mixtral"
    assert mx.moe.num_experts == 8 and mx.moe.moe_intermediate_size == 96 and mx.moe.norm_topk_prob
    assert mx.layer_windows == (12, 12, 12)


def test_config_moe_variants_and_refusals() -> None:
    base = {**BASE, "model_type": "qwen3_moe", "moe_intermediate_size": 32, "num_experts": 8,
            "num_experts_per_tok": 2}
    # real Qwen3-MoE checkpoints say num_experts; a sliding window applies to every layer when enabled
    a = ModelArgs.from_dict({**base, "use_sliding_window": True, "sliding_window": 16})
    assert a.layer_windows == (16, 16, 16) and a.moe is not None
    assert ModelArgs.from_dict({**base, "sliding_window": 16}).layer_windows == (None,) * 3
    assert ModelArgs.from_dict({**base, "num_experts": 0}).moe is None  # no experts: a dense model
    assert ModelArgs.from_dict({**base, "mlp_only_layers": [0, 1, 2]}).moe is None
    for patch, key in (({"num_experts_per_tok": 9}, "num_experts_per_tok"), ({"moe_intermediate_size": 0},
                       "moe_intermediate_size"), ({"mlp_only_layers": "1"}, "mlp_only_layers"),
                       ({"decoder_sparse_step": 0}, "decoder_sparse_step"), ({"norm_topk_prob": "yes"}, "norm_topk_prob")):
        with pytest.raises(ModelConfigError, match=key):
            ModelArgs.from_dict({**base, **patch})
    mx = {**BASE, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
    assert ModelArgs.from_dict(mx).moe.num_experts == 4  # type: ignore[union-attr]
    with pytest.raises(ModelConfigError, match="num_local_experts"):
        ModelArgs.from_dict({**mx, "num_local_experts": -1})
    # Qwen2-MoE without layer_types: transformers' default windows (odd layers below max_window_layers)
    q2 = {**BASE, "model_type": "qwen2_moe", "moe_intermediate_size": 32, "num_experts": 4,
          "num_experts_per_tok": 2, "shared_expert_intermediate_size": 32, "use_sliding_window": True,
          "sliding_window": 8, "max_window_layers": 2}
    assert ModelArgs.from_dict(q2).layer_windows == (8, None, None)


# ----------------------------------------------------------------------------- logits


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_fp32(models: dict[str, Path], case: str) -> None:
    path = models[case]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours, _ = load_model(path)
    got = _logits(ours, PROMPTS)
    with torch.no_grad():
        want = torch.cat([hf(torch.tensor([p])).logits[0] for p in PROMPTS])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert sum(isinstance(l.mlp, SparseMoE) for l in ours.layers) == sum(ours.args.moe.sparse_layers)


@pytest.mark.parametrize("tokens", [1, 5])  # 1: the single-sequence decode path (no sorting)
def test_only_activated_experts_are_read(tokens: int) -> None:
    torch.manual_seed(0)
    moe = SparseMoE(32, 8, 2, 16, torch.float32, shared_inter=0)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(tokens, 32)
    weights, ids = moe.gate(x)
    used = set(ids.flatten().tolist())
    ref = torch.zeros_like(x)
    for t in range(tokens):  # per token, per choice: the textbook sum
        for j in range(2):
            e = int(ids[t, j])
            h = x[t:t + 1]
            g, u = (h @ moe.w13[e].T).split(16, dim=-1)
            ref[t] += weights[t, j] * ((torch.nn.functional.silu(g) * u) @ moe.w2[e].T)[0]
    with torch.no_grad():
        for e in set(range(8)) - used:  # an expert nobody picked must not be read at all
            moe.w13[e].fill_(float("nan"))
            moe.w2[e].fill_(float("nan"))
    got = moe.experts_forward(x, weights, ids)
    assert len(used) < 8 and torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_expert_parallel_ranks_sum_to_the_whole() -> None:
    torch.manual_seed(1)
    whole = SparseMoE(32, 8, 3, 16, torch.float32, shared_inter=24, shared_gate=True)
    for p in whole.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(7, 32)
    want = whole(x)
    for mode in ("ep", "tp"):
        total = torch.zeros_like(want)
        for rank in range(2):
            s = MoeShard.plan(8, 16, 24, rank, 2, mode)
            part = SparseMoE(32, 8, 3, 16, torch.float32, shared_inter=24, shared_gate=True, shard=s)
            with torch.no_grad():
                part.gate.weight.copy_(whole.gate.weight)
                part.shared_expert_gate.weight.copy_(whole.shared_expert_gate.weight)
                e, i = slice(s.expert0, s.expert0 + s.experts), slice(s.inter0, s.inter0 + s.inter)
                gate, up = whole.w13[e].split(16, dim=1)
                part.w13.copy_(torch.cat([gate[:, i], up[:, i]], dim=1))
                part.w2.copy_(whole.w2[e][:, :, i])
                sh = slice(s.shared0, s.shared0 + s.shared_inter)
                sg, su = whole.shared_expert.gate_up_proj.weight.split(24)
                part.shared_expert.gate_up_proj.weight.copy_(torch.cat([sg[sh], su[sh]]))
                part.shared_expert.down_proj.weight.copy_(whole.shared_expert.down_proj.weight[:, sh])
                total += part(x)
        torch.testing.assert_close(total, want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="not a multiple of 3"):
        MoeShard.plan(8, 16, 0, 0, 3, "ep")


@pytest.mark.parametrize("case", ["qwen2_moe", "mixtral"])
def test_int8_experts_compute_their_dequantised_weights(models: dict[str, Path], case: str) -> None:
    q, _ = load_model(models[case])
    n = quantize_model(q, Int8Kernel())
    moe = next(l.mlp for l in q.layers if isinstance(l.mlp, SparseMoE))
    assert moe.int8 and isinstance(moe.lin13[0], Int8Linear) and moe.w13.numel() == 0  # the bf16/fp32 stacks are gone
    assert n >= 2 * 8 * sum(q.args.moe.sparse_layers)
    ref, _ = load_model(models[case])
    copy_dequantized_into(ref, q)
    torch.testing.assert_close(_logits(q, PROMPTS), _logits(ref, PROMPTS), atol=1e-4, rtol=0)
    # and close to the unquantised model (a near tie in the router may pick another expert: mean, not max)
    full, _ = load_model(models[case])
    assert (_logits(q, PROMPTS) - _logits(full, PROMPTS)).abs().mean() < 0.05


@pytest.mark.parametrize("case", list(CASES))
def test_engine_greedy_equals_transformers_chunked_preempted_speculated_and_cached(models: dict[str, Path],
                                                                                    case: str) -> None:
    """tests/test_model_families.py's engine check: chunks of 20, preemption, drafts verified, a prefix hit."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(models[case], dtype=torch.float32).eval()
    engine_check(hf, models[case], vocab=BASE["vocab_size"])


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_within_transformers_bf16_error(models: dict[str, Path], case: str) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(models[case], dtype=torch.float32).eval()
    bf16_check(hf, models[case], vocab=BASE["vocab_size"])


@pytest.mark.parametrize("case", ["qwen3_moe"])  # qwen2_moe and mixtral: test_int8_experts_compute_their_dequantised_weights
def test_int8_w8a16_through_the_assembly(models: dict[str, Path], case: str) -> None:
    int8_check(models[case], vocab=BASE["vocab_size"])


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_bf16_close_to_fp32(models: dict[str, Path], case: str) -> None:
    full, _ = load_model(models[case])
    half, _ = load_model(models[case], torch.bfloat16)
    a, b = _logits(full, PROMPTS), _logits(half, PROMPTS)
    assert (a - b).abs().mean() < 0.05
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


# ----------------------------------------------------------------------------- tensor / expert parallel


def _requests() -> list[dict]:
    prompts = [[5, 6, 7, 8, 9], list(range(10, 90)), [3] * 17]
    reqs = [{"id": f"g{i}", "prompt": p, "params": {"max_new_tokens": 16, "ignore_eos": True}}
            for i, p in enumerate(prompts)]
    reqs += [{"id": "s0", "prompt": prompts[1], "params": {"max_new_tokens": 16, "ignore_eos": True,
                                                          "do_sample": True, "temperature": 0.9, "seed": 7}}]
    return reqs


def _run(model: Path, world: int, tmp: Path, mode: str = "tp") -> dict:
    """tests/tp_instance.py's result, moeParallel ``mode``. One process's result (meaningless
    ``mode`` "tp") is the reference of both of qwen2_moe's modes, and both models' come from one
    process."""
    return run_tp_instance(model, world, tmp, _requests(), {"TP_TEST_MOE_PARALLEL": mode},
                           [model.parent / c for c in ("qwen2_moe", "mixtral")])


@pytest.mark.parametrize("case,mode", [("qwen2_moe", "ep"), ("qwen2_moe", "tp"), ("mixtral", "ep")])
def test_tensor_parallel_moe_generates_what_one_process_does(models: dict[str, Path], case: str, mode: str,
                                                             tmp_path: Path) -> None:
    one = _run(models[case], 1, tmp_path)
    two = _run(models[case], 2, tmp_path, mode)
    assert two["tokens"] == one["tokens"]
    # each rank holds about half of the experts' bytes
    assert two["param_bytes"] < 0.75 * one["param_bytes"]
    held = "experts 0..3," if mode == "ep" else "experts 0..7, intermediate columns 0..15"
    assert f"rank 0 holds {held}" in two["log"], two["log"][-3000:]


# ----------------------------------------------------------------------------- the real server


def _greedy(hf: Any, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, top_k=None, top_p=None,
                          temperature=None)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory: pytest.TempPathFactory):
    """One launch of the real server for every family's chat model and for qwen2_moe's again in bf16
    with int8 experts (``q``): the models of one server (docs/design.md, "Several models": a worker
    each, all loaded at start), one start instead of four. Yields (server, chat model paths)."""
    root = tmp_path_factory.mktemp("moe-srv")
    paths = {case: save_chat_model(root / f"chat-{case}", QWEN3_CHAT_TEMPLATE, cls_name=cls, config=dict(extra))
             for case, (cls, extra) in CASES.items()}
    entries = [{"modelName": case, "modelWeightPath": str(path), "cpuMemSize": 0.02} for case, path in paths.items()]
    entries.append({"modelName": "q", "modelWeightPath": str(paths["qwen2_moe"]), "cpuMemSize": 0.02,
                    "dtype": "bfloat16", "quantize": "w8a16"})
    with demo_server(root, entries[0]["modelWeightPath"], model=entries[0], more_models=entries[1:]) as srv:
        yield srv, paths


def test_server_expert_parallel_instance_and_int8_experts(moe_server, tmp_path: Path) -> None:
    """The real launch script: an instance of two ranks with moeParallel "ep" (each loads half of
    the experts) answers greedy /infer_token as transformers does; a bf16 worker with int8 experts
    (quantize w8a16, model ``q`` of ``moe_server``) serves and says what it quantised."""
    from tests.harness import Server, free_port, short_run_dir, write_config

    shared, paths = moe_server
    path = paths["qwen2_moe"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    port = free_port()
    cfg = write_config(tmp_path / "config.json", port=port, run_dir=short_run_dir(), workers=1, model_path=str(path),
                       model={"worldSize": 2, "moeParallel": "ep"})
    data = json.loads(cfg.read_text())
    data["BackendConfig"]["npuDeviceIds"] = [[0, 1]]
    cfg.write_text(json.dumps(data, indent=2))
    srv = Server(cfg, port)
    try:
        srv.wait_ready(180)
        for ids in ([5, 6, 7, 8, 9], list(range(20, 60))):
            r = httpx.post(srv.url + "/infer_token", json={"input_id": ids, "stream": False, "parameters": {
                "max_new_tokens": 10, "do_sample": False, "details": True, "ignore_eos": True}}, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["details"]["generated_token_ids"] == _greedy(hf, ids, 10), ids
        log = srv.tail(600)
        assert "rank 1 holds experts 4..7" in log, log[-3000:]
    finally:
        srv.stop()
    r = httpx.post(shared.url + "/infer_token", json={"input_id": [5, 6, 7], "model": "q", "stream": False,
                                                      "parameters": {"max_new_tokens": 6, "do_sample": False,
                                                                     "details": True, "ignore_eos": True}}, timeout=120)
    assert r.status_code == 200 and len(r.json()["details"]["generated_token_ids"]) == 6, r.text
    log = shared.tail(3000)
    # 1 sparse layer x (8 experts x 2 + shared expert 2) + 2 layers x (qkv, o) + dense MLP 2 + tied head
    # (only q quantises among the server's models)
    assert "quantised 25 linear layers to int8" in log, log[-3000:]


@pytest.mark.parametrize("case", list(CASES))
def test_server_infer_token_and_chat_equal_transformers(moe_server, case: str) -> None:
    srv, paths = moe_server
    path = paths[case]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    n = 12
    for ids in ([5, 6, 7, 8, 9], list(range(20, 60))):
        r = httpx.post(srv.url + "/infer_token", json={"input_id": ids, "model": case, "stream": False, "parameters": {
            "max_new_tokens": n, "do_sample": False, "details": True, "ignore_eos": True}}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["details"]["generated_token_ids"] == _greedy(hf, ids, n), ids
    messages = [{"role": "user", "content": "Which experts answer this?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    want = _greedy(hf, ids, n)
    r = httpx.post(srv.url + "/v1/chat/completions", json={
        "model": case, "messages": messages, "max_tokens": n, "temperature": 0, "logprobs": True,
        "skip_special_tokens": False}, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if tok.eos_token_id in want:
        want = want[:want.index(tok.eos_token_id)]
    assert choice["message"]["content"] == tok.decode(want, skip_special_tokens=True)
    # the logprob of each chosen token, against transformers' log-softmax over the same context
    with torch.no_grad():
        full = torch.tensor([ids + want])
        ref = torch.log_softmax(hf(full).logits[0].float(), -1)
    lps = [t["logprob"] for t in choice["logprobs"]["content"]]
    assert len(lps) >= len(want)
    for j, tid in enumerate(want):
        assert abs(lps[j] - ref[len(ids) + j - 1, tid].item()) <= TOL, (j, lps[j])
    # the load log of this model's worker (the server's models each log theirs, naming the model type)
    log = srv.tail(3000)
    experts = f"mixture of experts ({case}): 8 experts, top-{CASES[case][1]['num_experts_per_tok']}"
    assert experts in log, log[-3000:]


# ----------------------------------------------------------------------------- the NPU path, on CPU


def _fake_torch_npu(calls: list[str]) -> Any:
    """torch_npu's MoE ops as pure-torch references asserting their documented contracts
    (workers/backends/npu_moe.py's docstring)."""
    import types
    mod = types.ModuleType("torch_npu")

    def gating(x, finished, k):
        calls.append("gating")
        assert finished is None and x.dim() == 2
        y, idx = torch.topk(torch.softmax(x.float(), -1), k, dim=-1)
        t = x.shape[0]
        return y.to(x.dtype), idx.int(), torch.arange(t * k, dtype=torch.int32).view(k, t).t()

    def init_routing(x, row_idx, expert_idx, active_num):
        calls.append("init_routing")
        assert row_idx.dtype == expert_idx.dtype == torch.int32 and active_num == x.shape[0]
        t, k = expert_idx.shape
        assert torch.equal(row_idx, torch.arange(t * k, dtype=torch.int32).view(k, t).t())
        src = row_idx.t().reshape(-1).long()  # j * T + t, in that order
        experts = expert_idx.t().reshape(-1)
        order = torch.argsort(experts, stable=True)
        dst = torch.empty_like(order)
        dst[order] = torch.arange(t * k)
        return x[src[order] % t], dst.int(), experts[order].int()

    def expert_tokens(sorted_ids, n):
        calls.append("expert_tokens")
        return torch.cumsum(torch.bincount(sorted_ids.long(), minlength=n), 0)

    def grouped_matmul(xs, ws, *, antiquant_scale=None, group_list, split_item, group_type, group_list_type):
        calls.append("grouped_matmul")
        assert split_item == 2 and group_type == 0 and group_list_type == 0 and len(xs) == len(ws) == 1
        x, w = xs[0], ws[0]
        out = x.new_empty(x.shape[0], w.shape[2])
        start = 0
        for e, end in enumerate(group_list.tolist()):
            we = w[e].to(x.dtype) if antiquant_scale is None else w[e].to(x.dtype) * antiquant_scale[0][e]
            out[start:end] = x[start:end] @ we
            start = end
        return [out]

    def swiglu(x, dim):
        calls.append("swiglu")
        g, u = x.chunk(2, dim=dim)
        return torch.nn.functional.silu(g) * u

    def finalize(rows, skip1, skip2, bias, scales, src_to_dst, export_for_source_row):
        calls.append("finalize")
        assert skip1 is None and skip2 is None and bias is None
        t, k = scales.shape
        out = torch.zeros(t, rows.shape[1], dtype=rows.dtype)
        for j in range(k):
            out += scales[:, j, None] * rows[src_to_dst[j * t:(j + 1) * t].long()]
        return out

    def weight_quant_bmm(x, weight, antiquant_scale):
        return x @ (weight.to(x.dtype) * antiquant_scale)

    mod.npu_moe_gating_top_k_softmax = gating
    mod.npu_moe_init_routing = init_routing
    mod.npu_moe_compute_expert_tokens = expert_tokens
    mod.npu_grouped_matmul = grouped_matmul
    mod.npu_swiglu = swiglu
    mod.npu_moe_finalize_routing = finalize
    mod.npu_weight_quant_batchmatmul = weight_quant_bmm
    return mod


@pytest.mark.parametrize("int8", [False, True])
def test_npu_moe_ops_agree_with_the_cpu_reference(int8: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.backends import npu_moe
    from workers.backends.int8 import Int8Linear, NpuInt8Kernel

    calls: list[str] = []
    fake = _fake_torch_npu(calls)
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    torch.manual_seed(3)
    dtype = torch.bfloat16 if int8 else torch.float32
    model = torch.nn.Module()
    model.moe = SparseMoE(32, 6, 2, 16, dtype, norm_topk_prob=True, shared_inter=8, shared_gate=True)
    for p in model.moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    if int8:
        model.moe.quantize_experts(lambda w: Int8Linear(w, None, NpuInt8Kernel()))
    x = torch.randn(9, 32, dtype=dtype)
    with torch.no_grad():
        want = model.moe(x)
        assert npu_moe.attach(model, fake) == 1
        got = model.moe(x)
    assert calls == ["gating", "init_routing", "expert_tokens", "grouped_matmul", "swiglu", "grouped_matmul",
                     "finalize"]
    torch.testing.assert_close(got, want, atol=2e-2 if int8 else 1e-5, rtol=0)
    # an expert-parallel shard keeps the reference path
    model.moe = SparseMoE(32, 6, 2, 16, dtype, shard=MoeShard.plan(6, 16, 0, 0, 2, "ep"))
    assert npu_moe.attach(model, fake) == 0


# ----------------------------------------------------------------------------- the moeParallel key


def test_moe_parallel_key_reaches_the_worker_and_is_checked_at_launch(models: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    import msgspec

    from mindie.config import ConfigError, load_config
    from mindie.contract.spec import decode_spec, encode_spec
    from mindie.topology import build_deployment
    from workers.prepare import check_tensor_parallel

    def deploy(model_cfg: dict):
        data = {"ServerConfig": {"runDir": str(tmp_path / "run")},
                "BackendConfig": {"deviceType": "cpu", "npuDeviceIds": [[0, 1, 2]],
                                  "ModelDeployConfig": {"ModelConfig": [model_cfg]}}}
        (tmp_path / "config.json").write_text(json.dumps(data))
        return build_deployment(load_config(str(tmp_path / "config.json"), env={}).config)

    assert deploy({}).workers[0].moe_parallel == "tp"  # the documented default
    spec = deploy({"moeParallel": "ep"}).workers[0]
    assert decode_spec(encode_spec(spec)).moe_parallel == "ep"
    with pytest.raises(ConfigError, match=r"ModelConfig\[0\]\.moeParallel"):
        deploy({"moeParallel": "dp"})
    # four ranks cannot split 6 experts (ep) nor an expert intermediate size of 30 (tp): refused
    # at launch naming the key; two can
    import dataclasses
    args = ModelArgs.from_dir(models["qwen3_moe"])
    odd = dataclasses.replace(args, moe=dataclasses.replace(args.moe, num_experts=6, moe_intermediate_size=30))
    for mode, what in (("ep", "6 experts"), ("tp", "intermediate size 30")):
        with pytest.raises(SystemExit, match=rf"moeParallel '{mode}'.*{what}"):
            check_tensor_parallel(msgspec.structs.replace(spec, moe_parallel=mode, device_ids=[0, 1, 2, 3]), odd)
        check_tensor_parallel(msgspec.structs.replace(spec, moe_parallel=mode, device_ids=[0, 1]), odd)


@pytest.mark.parametrize("int8", [False, True])
def test_cpu_backend_rewrites_keep_the_logits(models: dict[str, Path], int8: bool) -> None:
    """The CPU backend's rewrites (workers/backends/cpu_specialise.py): experts as oneDNN-packed
    linears, or int8 experts on the C kernels' products, compute what the plain model does."""
    from workers.backends.cpu_specialise import specialise_cpu_model
    from workers.backends.int8 import CpuInt8Kernel

    for case in ("qwen2_moe", "mixtral"):
        model, _ = load_model(models[case])
        ref, _ = load_model(models[case])
        if int8:
            quantize_model(model, CpuInt8Kernel())
            copy_dequantized_into(ref, model)
        specialise_cpu_model(model)
        moe = next(l.mlp for l in model.layers if isinstance(l.mlp, SparseMoE))
        assert moe.experts_kind == ("int8" if int8 else "packed") and moe.w13.numel() == 0
        torch.testing.assert_close(_logits(model, PROMPTS), _logits(ref, PROMPTS), atol=1e-4, rtol=0)


def test_moe_bench_script_runs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """mindie_bench/lab/moe.py on a tiny shape: one token activates top_k experts per layer, and
    the roofline counts those, not all of them. Its main() in this process (torch and transformers
    already imported here; ``python -m`` only calls it): a process of its own cost ~3 CPU-s of imports."""
    from mindie_bench.lab import moe as bench

    out = tmp_path / "moe.json"
    bench.main(["--dir", str(tmp_path), "--experts", "8", "--top-k", "2", "--hidden", "256", "--inter", "64",
                "--layers", "2", "--vocab", "300", "--concurrency", "1,4", "--repeat", "1", "--steps", "2",
                "--hf-tokens", "3", "--context", "16", "--bw-mib", "16", "--threads", "1", "--json", str(out)])
    rows = {r["batch"]: r for r in json.loads(out.read_text())["results"]}
    assert rows[1]["active_experts_per_layer"] == 2
    assert 2 <= rows[4]["active_experts_per_layer"] <= 8
    assert rows[1]["experts_mb"] == pytest.approx(rows[1]["all_experts_mb"] / 4, abs=0.011)  # MB, 2 decimals
    assert rows[1]["engine_tok_s"] > 0 and rows[1]["transformers_tok_s"] > 0 and rows[1]["roofline_tok_s"] > 0
    assert "transformers tok/s" in capsys.readouterr().out


def test_lora_adapters_are_refused_on_a_mixture_of_experts(models: dict[str, Path], tmp_path: Path) -> None:
    from workers.models.lora_adapter import AdapterError, check_adapter
    (tmp_path / "adapter").mkdir()
    with pytest.raises(AdapterError, match="not served on a mixture of experts \\(qwen3_moe"):
        check_adapter(tmp_path / "adapter", ModelArgs.from_dir(models["qwen3_moe"]))
