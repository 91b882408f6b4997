"""GLM-4-MoE (issue 53, item 4) against transformers 5.25's Glm4MoeForCausalLM on tiny random fp32
checkpoints built here:

- config: its keys (partial rotary in the NeoX layout, use_qk_norm, q/k/v biases without an o bias,
  first_k_dense_replace, shared experts, DeepSeek-V3's routing keys) read; errors naming the key;
  tensor parallelism refused naming the family;
- logits over the paged KV cache (a prompt in two chunks, then one decode at a time) equal
  transformers' cached forward within 1e-4: grouped routing with a random correction bias,
  routed_scaling_factor and q/k norms; and ungrouped routing without renormalisation, two dense
  layers, partial rotary 0.75 and tied embeddings, its checkpoint holding an MTP layer (skipped);
- bf16 within transformers' own bf16 error; int8 w8a16 equal to the dequantised weights;
- engine: greedy through chunked prefill, a cache small enough to preempt, speculation and a
  prefix-cache hit equals transformers' greedy continuation.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_model_families import bf16_check, engine_check, hf_cached_logits, int8_check, paged_logits
from tests.tiny_hf import random_model
from workers.models.config import ModelArgs, ModelConfigError
from workers.models.glm4_moe import Glm4MoeLM
from workers.models.loader import load_model
from workers.models.moe import SparseMoE
from workers.models.sharding import plan_shard

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(900)

VOCAB = 160  # test_model_families.VOCAB: engine_check draws its prompts below it
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CASES: dict[str, dict[str, Any]] = {
    # GLM-4.5's choices: q/k/v biases, 4 groups keeping 2, scaled weights, q/k norms, partial rotary 0.5
    "grouped": dict(attention_bias=True, use_qk_norm=True, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                    first_k_dense_replace=1, n_shared_experts=2),
    # one group, weights not renormalised, two dense layers, 12 of 16 dims rotated, tied embeddings
    "plain": dict(norm_topk_prob=False, first_k_dense_replace=2, num_experts_per_tok=3, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.75}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    from safetensors.torch import load_file, save_file
    root = tmp_path_factory.mktemp("glm4_moe")
    out = {}
    for case, extra in CASES.items():
        hf = random_model("Glm4MoeConfig", {**BASE, **extra})
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():  # the correction bias is a buffer (random_model draws parameters): make it count
            for layer in hf.model.layers:
                if hasattr(layer.mlp, "gate"):
                    layer.mlp.gate.e_score_correction_bias.copy_(torch.rand(8, generator=g) - 0.5)
        hf.save_pretrained(root / case)
        if case == "plain":  # an MTP layer (model.layers.{num_hidden_layers}), as GLM-4.5 ships one
            t = load_file(str(root / case / "model.safetensors"))
            t["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
            t["model.layers.3.enorm.weight"] = torch.ones(64)
            save_file(t, str(root / case / "model.safetensors"), metadata={"format": "pt"})
        out[case] = (hf, root / case)
    return out


# -- config -------------------------------------------------------------------------------------------


def test_config_reads_the_glm4_moe_keys(models) -> None:
    a = ModelArgs.from_dir(models["grouped"][1])
    g = a.glm4_moe
    assert a.arch == "glm4_moe" and g is not None and a.moe is not None and a.variant is None
    assert (g.rope.rotary_dim, g.rope.rope_interleaved, g.rope.sandwich_norms) == (8, False, False)
    assert a.qk_norm and a.attention_bias and not a.o_proj_bias
    assert (g.n_group, g.topk_group, g.routed_scaling_factor, g.norm_topk_prob) == (4, 2, 2.5, True)
    assert a.moe.sparse_layers == (False, True, True) and a.moe.shared_expert_intermediate_size == 64
    p = ModelArgs.from_dir(models["plain"][1])
    assert p.glm4_moe is not None and p.moe is not None
    assert (p.glm4_moe.rope.rotary_dim, p.rope_theta, p.qk_norm, p.attention_bias) == (12, 5000.0, False, False)
    assert p.moe.sparse_layers == (False, False, True) and not p.glm4_moe.norm_topk_prob
    assert p.tie_word_embeddings and p.moe.top_k == 3


@pytest.mark.parametrize("patch,key", [
    ({"n_group": 3}, "n_group"),  # does not divide 8 experts
    ({"n_group": 2, "topk_group": 3}, "topk_group"),
    ({"routed_scaling_factor": -1}, "routed_scaling_factor"),
    ({"use_qk_norm": "yes"}, "use_qk_norm"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
    ({"sliding_window": 8}, "sliding_window"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
])
def test_config_errors_name_the_key(patch: dict, key: str) -> None:
    with pytest.raises(ModelConfigError, match=re.escape(key)):
        ModelArgs.from_dict({**BASE, "model_type": "glm4_moe", **patch})


def test_tensor_parallel_refused_naming_the_family(models) -> None:
    args = ModelArgs.from_dir(models["grouped"][1])
    with pytest.raises(ModelConfigError, match="worldSize.*not supported for GLM-4-MoE"):
        plan_shard(args, 0, 2)
    assert plan_shard(args, 0, 1).heads == 4


# -- logits ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_through_the_paged_cache(models, case: str, caplog) -> None:
    hf, path = models[case]
    with caplog.at_level("INFO", logger="workers.models"):
        model, _ = load_model(path, torch.float32)
    assert isinstance(model, Glm4MoeLM)
    if case == "plain":
        assert "2 tensors not loaded" in caplog.text and "multi-token-prediction" in caplog.text
    sparse = [(mine.mlp, theirs.mlp) for mine, theirs in zip(model.layers, hf.model.layers)
              if isinstance(mine.mlp, SparseMoE)]
    assert len(sparse) == sum(ModelArgs.from_dir(path).moe.sparse_layers)
    for mine, theirs in sparse:  # the random correction bias reached the router
        assert torch.equal(mine.gate.e_score_correction_bias, theirs.gate.e_score_correction_bias)
    ids = torch.randint(3, VOCAB, (48,), generator=torch.Generator().manual_seed(1))
    ours = paged_logits(model, ids, [17, 19])
    want = hf_cached_logits(hf, ids.tolist(), 36)
    assert (ours - want).abs().max().item() < 1e-4


# -- engine ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_engine_greedy_equals_transformers_chunked_preempted_and_cached(models, case: str) -> None:
    """tests/test_model_families.py's check (5 prompts up to 60 tokens, chunks of 20, 6 blocks of 16:
    preemption; speculation drafting; then the 60-token prompt again: 3 prefix-cache blocks hit)."""
    engine_check(*models[case])


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_within_transformers_bf16_error(models, case: str) -> None:
    bf16_check(*models[case])


@pytest.mark.parametrize("case", list(CASES))
def test_int8_w8a16_equals_the_dequantised_weights(models, case: str) -> None:
    """Every linear int8, the routed experts' stacked weights included (the router stays fp32)."""
    int8_check(models[case][1])


# -- the real server -----------------------------------------------------------------------------------


@pytest.mark.server
def test_server_infer_token_and_chat_equal_transformers(tmp_path: Path) -> None:
    """The launch script on a tiny GLM-4.5-shaped chat model (the grouped case's routing, q/k norms
    and biases): /infer_token (a prompt in chunks of 16, then again: a prefix-cache hit) and the
    OpenAI chat route equal transformers' greedy output (tests/test_gemma.py's check)."""
    from tests.test_gemma import CHAT_TEMPLATE, served_greedy_equals_transformers
    from tests.tiny_hf import save_chat_model

    cfg = {k: v for k, v in BASE.items() if k not in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    path = save_chat_model(tmp_path / "tiny-glm4-moe", CHAT_TEMPLATE, cls_name="Glm4MoeConfig",
                           config={**cfg, **CASES["grouped"]})
    (tmp_path / "srv").mkdir()
    tail = served_greedy_equals_transformers(tmp_path / "srv", path, "Which experts answer?")
    assert "glm4_moe" in tail, tail[-2000:]
