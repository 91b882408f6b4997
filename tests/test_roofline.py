"""mindie_bench/lab/roofline.py: the bytes a decode step reads, checked against the model's own tensors,
and a short run of the script on the small demo model (seconds)."""
from __future__ import annotations

import dataclasses
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _roofline():
    from mindie_bench.lab import roofline
    return roofline


def _weights_read_per_step(model: torch.nn.Module) -> int:
    """Independent count: numel x element size of every parameter a decode step reads in full.
    The embedding matrix is read one row per token, unless it is also the (tied) LM head."""
    tied = model.lm_head is None
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if tied or not name.startswith("embed_tokens."))


def _args(demo_model: str, **changes):
    from workers.models.config import ModelArgs
    args = ModelArgs.from_dir(demo_model)
    if "num_hidden_layers" in changes and "layer_windows" not in changes:
        changes["layer_windows"] = ()
    return dataclasses.replace(args, **changes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("changes", [
    {},  # the demo model: Llama, tied embeddings
    {"tie_word_embeddings": False, "attention_bias": True, "o_proj_bias": True, "mlp_bias": True},
    {"qk_norm": True, "num_hidden_layers": 3, "head_dim": 32},  # Qwen3-like; head_dim != hidden / heads
])
def test_weight_bytes_match_the_models_parameters(demo_model, dtype, changes):
    from workers.models.llama import DecoderLM
    rl = _roofline()
    args = _args(demo_model, **changes)
    with torch.device("meta"):
        model = DecoderLM(args, dtype=dtype, max_positions=16)
    elem = torch.empty((), dtype=dtype).element_size()
    assert sum(rl.weight_bytes(args, elem).values()) == _weights_read_per_step(model)
    # The whole step: weights + one embedding row per sequence + each sequence's K and V.
    contexts = [5, 17, 300]
    got = rl.step_bytes(args, elem, contexts)
    rows = len(contexts) * model.embed_tokens.weight[0].numel() * elem
    kv = sum(contexts) * model.args.num_hidden_layers * 2 * args.num_key_value_heads * args.head_dim * elem
    assert got["weights"] == _weights_read_per_step(model)
    assert got["embedding_rows"] == rows
    assert got["kv"] == kv
    assert got["total"] == _weights_read_per_step(model) + rows + kv


def test_kv_bytes_agree_with_the_cache_and_sliding_windows(demo_model):
    from workers.attention.paged import PagedAttention
    rl = _roofline()
    args = _args(demo_model)
    slot = PagedAttention.bytes_per_slot(args.num_hidden_layers, args.num_key_value_heads, args.head_dim,
                                         torch.bfloat16)
    assert rl.kv_bytes(args, 2, [10, 20]) == 30 * slot
    windowed = dataclasses.replace(args, layer_windows=(8,) + (None,) * (args.num_hidden_layers - 1))
    per_layer = slot // args.num_hidden_layers
    assert rl.kv_bytes(windowed, 2, [10, 20]) == 30 * slot - (2 + 12) * per_layer


def test_script_runs_and_prints_the_fraction(demo_model, tmp_path):
    out = tmp_path / "roofline.json"
    proc = subprocess.run(
        [sys.executable, "-m", "mindie_bench.lab.roofline", "--model", demo_model, "--dtype", "float32", "--concurrency", "1,2",
         "--context", "20", "--steps", "3", "--warm", "1", "--repeat", "2", "--bw-mib", "16", "--bw-repeat", "2",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "fraction" in proc.stdout and "roofline tok/s" in proc.stdout and "measured tok/s" in proc.stdout
    assert "bandwidth" in proc.stderr  # progress
    res = json.loads(out.read_text())
    assert res["bandwidth"]["best_gb_s"] > 0
    rows = {r["batch"]: r for r in res["results"]}
    assert set(rows) == {1, 2}
    from workers.models.loader import load_model
    model, _ = load_model(demo_model, torch.float32)
    weights = _weights_read_per_step(model)
    for b, row in rows.items():
        sb = row["bytes_per_step"]
        assert sb["weights"] == weights
        assert row["measured_tok_s"] > 0 and row["roofline_tok_s"] > 0
        assert row["fraction"] == pytest.approx(row["measured_tok_s"] / row["roofline_tok_s"], rel=0.01, abs=1e-3)
        assert row["roofline_tok_s"] == pytest.approx(b * res["bandwidth"]["best_gb_s"] * 1e9 / sb["total"], rel=0.01)
        # prompts of 20 - (1 + 3) // 2 = 18 tokens, then 1 untimed and 3 timed decode steps: the
        # timed steps read 20, 21, 22 positions per sequence (the new token's included).
        assert row["mean_context"] == 21
        assert sb["kv"] == b * 21 * model.args.num_hidden_layers * 2 * model.args.num_key_value_heads * model.args.head_dim * 4
        # paired: each round's median step against that round's best bandwidth sample
        samples = res["bandwidth"]["samples_gb_s"]
        assert row["round_best_gb_s"] == [max(samples[0:2]), max(samples[2:4])]
        assert len(row["fraction_paired_rounds"]) == 2
        assert row["fraction_paired"] == pytest.approx(statistics.median(row["fraction_paired_rounds"]), abs=1e-3)
        for f, step_ms, bw_r in zip(row["fraction_paired_rounds"], row["step_ms_rounds"], row["round_best_gb_s"]):
            assert f == pytest.approx(sb["total"] / (step_ms / 1e3) / (bw_r * 1e9), rel=0.01)
        # the fractions are printed on the batch's line
        line = next(ln for ln in proc.stdout.splitlines() if ln.split()[:1] == [str(b)])
        assert f"{row['fraction']:.3f}" in line and f"{row['fraction_paired']:.3f}" in line


@pytest.mark.parametrize("shared", [0, 48])
def test_moe_counts_the_activated_experts_only(demo_model, shared):
    """A mixture of experts reads its router, its shared expert and the activated experts: all E
    activated = every parameter; top_k activated = that minus the others' bytes."""
    from workers.models.config import MoeArgs
    from workers.models.llama import DecoderLM
    rl = _roofline()
    moe = MoeArgs(num_experts=8, top_k=2, moe_intermediate_size=40, norm_topk_prob=True,
                  sparse_layers=(True, False, True), shared_expert_intermediate_size=shared,
                  shared_expert_gate=bool(shared))
    args = _args(demo_model, num_hidden_layers=3, moe=moe)
    with torch.device("meta"):
        model = DecoderLM(args, dtype=torch.bfloat16, max_positions=16)
    everything = _weights_read_per_step(model)
    assert sum(rl.weight_bytes(args, 2, active=8).values()) == everything
    per_expert = 3 * args.hidden_size * 40 * 2
    assert sum(rl.weight_bytes(args, 2).values()) == everything - 2 * (8 - 2) * per_expert
    assert rl.expected_active_experts(moe, 1) == pytest.approx(2)
    assert rl.expected_active_experts(moe, 64) == pytest.approx(8, abs=1e-3)
    one, many = rl.step_bytes(args, 2, [10]), rl.step_bytes(args, 2, [10] * 32)
    assert one["w_experts"] == 2 * 2 * per_expert and many["w_experts"] > 7.9 * 2 * per_expert


def test_prompts_prefilled_in_several_waves_still_time_pure_decode_steps(demo_model):
    # One 200-token prompt per step (max_prefill_tokens 256): 6 prompts take 6 prefill waves, the
    # first wave decodes 5 steps ahead of the last, and every timed step must still decode all 6
    # (the GPU check's batch 64 failed so: 4 waves of 16).
    roofline = _roofline()
    runner, cfg = roofline.load(demo_model, "float32", 1, 16)
    cfg = msgspec.structs.replace(cfg, max_prefill_tokens=256)
    blocks = roofline.blocks_needed(6, 204, 6, 2, 16)
    runner.allocate_kv(blocks, 16)
    res = roofline.measure_decode(runner, cfg, blocks, 6, 204, 6, 2, random.Random(0))
    assert len(res["step_s"]) == 6 and res["tok_s"] > 0
    # the last wave: its prompt, first token and two warm steps' tokens; the first waves are steps ahead
    ctx = res["contexts"][0]
    assert min(ctx) == 200 + 1 + 2 and max(ctx) - min(ctx) >= 3
