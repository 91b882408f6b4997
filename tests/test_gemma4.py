"""Gemma 4 (text) against transformers 5.25's Gemma4ForCausalLM (issue 53, item 2), on tiny random
fp32 checkpoints built here:

- config: Gemma 4's keys read (per-layer-type head_dim and KV heads, from ``global_head_dim`` /
  ``num_global_key_value_heads`` or the ``per_layer_config`` transformers saves, attention_k_eq_v,
  per-layer-type rope, KV sharing, per-layer inputs, double-wide MLP), a
  Gemma4ForConditionalGeneration config's text part, refusals naming the key;
- logits: our decoder over the split paged cache (portable torch and the CPU kernels' class; a
  prompt in two chunks, then decodes) equals transformers' with a prompt longer than the sliding
  window, with and without KV sharing / k_eq_v / per-layer inputs, with the MoE block (an expert
  no token picked never read); the window and the partial rope
  proven to matter; a multimodal checkpoint's ``model.language_model.*`` names (towers skipped);
- the cache: KV-shared layers own no cache tensors, each geometry its own tensors;
- engine: greedy through chunked prefill, a small cache (preemption), a prefix-cache hit and
  speculative drafts equals transformers' greedy (with and without the MoE block);
- the real launch script on a tiny Gemma 4 chat model: /infer_token and chat equal transformers.
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.reference_attention import logits_over_cache
from tests.tiny_hf import random_model, save_chat_model
from workers.attention import split_attention
from workers.attention.cpu import CpuPagedAttention
from workers.attention.paged import PagedAttention
from workers.models.config import ModelArgs, ModelConfigError
from workers.models.loader import load_model

transformers = pytest.importorskip("transformers")

from tests.test_gemma import (CHAT_TEMPLATE, edits_change_logits, engine_greedy_equals_transformers,  # noqa: E402
                              served_greedy_equals_transformers)

pytestmark = pytest.mark.timeout(900)

VOCAB = 160
WINDOW = 8
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, global_head_dim=32, max_position_embeddings=512, bos_token_id=1,
            eos_token_id=2, pad_token_id=0, sliding_window=WINDOW, final_logit_softcapping=5.0,
            layer_types=["sliding_attention", "full_attention"] * 3)
CASES: dict[str, dict[str, Any]] = {
    # everything: k_eq_v with one global KV head, per-layer inputs, the last two layers KV-shared
    # (double-wide MLPs), proportional rope on the full layers (the default rope_parameters)
    "e2b": dict(attention_k_eq_v=True, num_global_key_value_heads=1, hidden_size_per_layer_input=8,
                vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2, use_double_wide_mlp=True),
    # the plain layout: own v_proj everywhere, no per-layer inputs, no sharing, every layer writes
    "dense": dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0, attention_bias=True,
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                      "rope_theta": 1e6}}),
    # the MoE block beside every MLP (router on the residual, GeGLU experts, three more norms)
    "moe": dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24,
                hidden_size_per_layer_input=0, num_kv_shared_layers=1),
}
PROMPT_LEN = 30  # longer than the window


def _random(config: dict[str, Any], seed: int = 0):
    """transformers' model with random weights and random layer scalars (ones would hide them);
    router scales large enough that the routing is no near-tie (the default init's 0.08 is)."""
    hf = random_model("Gemma4TextConfig", config, seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("router.scale", "router.per_expert_scale")):
                p.uniform_(1.0, 3.0)
        for name, b in hf.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    return hf


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    root = tmp_path_factory.mktemp("gemma4")
    out = {}
    for case, extra in CASES.items():
        hf = _random({**BASE, **extra})
        hf.save_pretrained(root / case, safe_serialization=True)
        out[case] = (hf, root / case)
    return out


# -- config ----------------------------------------------------------------------------------------


def test_config_reads_gemma4_keys(models) -> None:
    a = ModelArgs.from_dir(models["e2b"][1])  # as transformers 5.25 saves it: per_layer_config
    g = a.gemma4
    assert a.arch == "gemma4" and a.tie_word_embeddings and a.layer_windows == (WINDOW, None) * 3
    assert g.head_dims == (16, 32) * 3 and g.kv_heads == (2, 1) * 3 and g.k_eq_v == (False, True) * 3
    assert g.kv_source == (0, 1, 2, 3, 2, 3) and g.intermediate == (112,) * 4 + (224,) * 2
    assert (g.ple_dim, g.ple_vocab, g.final_logit_softcapping) == (8, VOCAB, 5.0)
    full = g.ropes["full_attention"]
    assert (full.rope_type, full.theta, full.partial_rotary_factor) == ("proportional", 1e6, 0.25)
    # a Hub config of the multimodal layout: global_head_dim / num_global_key_value_heads in text_config
    text = {k: v for k, v in BASE.items() if k != "eos_token_id"}
    mm = ModelArgs.from_dict({"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
                              "text_config": dict(text, attention_k_eq_v=True, num_global_key_value_heads=1),
                              "vision_config": {}, "audio_config": {}, "eos_token_id": [1, 106]})
    assert mm.arch == "gemma4" and mm.model_type == "gemma4_text" and mm.eos_token_ids == [1, 106]
    assert mm.gemma4.head_dims == g.head_dims and mm.gemma4.kv_heads == g.kv_heads
    assert mm.gemma4.ple_dim == 256  # transformers' default


@pytest.mark.parametrize("patch, key", [
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 5, "moe_intermediate_size": 8}, "top_k_experts"),
    ({"enable_moe_block": True, "top_k_experts": 2, "moe_intermediate_size": 8}, "num_experts"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ({"hidden_activation": "silu"}, "hidden_activation"),
    ({"layer_types": ["sliding_attention"]}, "layer_types"),
    ({"num_kv_shared_layers": 6}, "num_kv_shared_layers"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
     "rope_parameters.sliding_attention.rope_type"),
])
def test_config_errors_name_the_key(models, tmp_path: Path, patch: dict, key: str) -> None:
    cfg = json.loads((models["dense"][1] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **patch}))
    with pytest.raises(ModelConfigError, match=key.replace(".", r"\.")):
        ModelArgs.from_dir(tmp_path)


# -- logits over the paged cache ---------------------------------------------------------------------


def _paged_logits(model, ids: torch.Tensor, chunks: list[int], base=PagedAttention) -> torch.Tensor:
    attn = split_attention(base, model.kv_layout[1])(0, 32, 4, 0, 0, torch.float32, torch.device("cpu"))
    return logits_over_cache(model, attn, ids, chunks, list(range(31, -1, -1)))  # blocks out of order


@pytest.mark.parametrize("base", [PagedAttention, CpuPagedAttention], ids=["portable", "cpu"])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(models, case: str, base) -> None:
    hf, path = models[case]
    model, _ = load_model(path, torch.float32)
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (PROMPT_LEN + 10,))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (_paged_logits(model, ids, [PROMPT_LEN - 11, 11], base) - ref).abs().max().item() <= 1e-4
    if base is not PagedAttention:
        return
    # the window and the partial rotary share each change the answer: neither is idle
    rope = copy.deepcopy(hf.config.rope_parameters)
    rope["full_attention"]["partial_rotary_factor"] = 1.0
    edits_change_logits(hf, ids, ref, [("window", dict(sliding_window=10_000)), ("rope", dict(rope_parameters=rope))])


@pytest.mark.parametrize("case", ["e2b", "moe"])
def test_logits_bf16_within_transformers_bf16_error(models, case: str) -> None:
    """bf16 weights, activations and cache against the fp32 truth: never much worse than
    transformers' own bf16 run on the same weights."""
    hf, path = models[case]
    model, _ = load_model(path, torch.bfloat16)
    ids = torch.randint(3, VOCAB, (PROMPT_LEN + 6,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        truth = hf(ids[None]).logits[0]
        hf_half = copy.deepcopy(hf).to(torch.bfloat16)(ids[None]).logits[0].float()
    attn = split_attention(PagedAttention, model.kv_layout[1])(0, 32, 4, 0, 0, torch.bfloat16, torch.device("cpu"))
    out = logits_over_cache(model, attn, ids, [PROMPT_LEN], list(range(31, -1, -1)))
    err, hf_err = (out - truth).abs().max().item(), (hf_half - truth).abs().max().item()
    assert err <= 1.5 * hf_err + 1e-3, (err, hf_err)


def test_cache_geometries_and_shared_layers_own_no_blocks(models) -> None:
    """e2b: 4 writing layers (2 sliding [2 heads x 16], 2 full [1 head x 32]); the 2 shared layers
    read their sources' tensors and add no bytes per token."""
    model, _ = load_model(models["e2b"][1], torch.float32)
    assert model.kv_layout == ("per_kind", ((2, 2, 16), (2, 1, 32))) and model.kv_layers == 4
    assert [layer.self_attn.cache_index for layer in model.layers] == [0, 2, 1, 3, 1, 3]
    cls = split_attention(PagedAttention, model.kv_layout[1])
    assert cls.bytes_per_slot(0, 0, 0, torch.float32) == 4 * 2 * (2 * 2 * 16 + 2 * 1 * 32)
    attn = cls(0, 8, 4, 0, 0, torch.float32, torch.device("cpu"))
    assert [tuple(t.shape) for t in attn.k_cache] == [(8, 2, 4, 16)] * 2 + [(8, 1, 4, 32)] * 2


def test_multimodal_checkpoint_names(models, tmp_path: Path, caplog) -> None:
    """A Gemma4ForConditionalGeneration checkpoint: the decoder under model.language_model., tower
    tensors beside it (skipped, counted), the shared layers' k/v tensors transformers ignores."""
    hf, path = models["e2b"]
    cfg = json.loads((path / "config.json").read_text())
    outer = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
             "text_config": {**cfg, "model_type": "gemma4_text"}, "vision_config": {"hidden_size": 8},
             "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(outer))
    tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in load_file(path / "model.safetensors").items()}
    tensors["model.vision_tower.encoder.weight"] = torch.zeros(4, 4)
    tensors["model.embed_vision.embedding_projection.weight"] = torch.zeros(4, 4)
    tensors["model.language_model.layers.4.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, tmp_path / "model.safetensors")
    import logging
    with caplog.at_level(logging.INFO, logger="workers.models"):
        model, _ = load_model(tmp_path, torch.float32)
    assert any("2 tensors of the vision/audio towers not loaded" in r.getMessage() for r in caplog.records)
    ids = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (_paged_logits(model, ids, [13]) - ref).abs().max().item() <= 1e-4


def test_tensor_parallel_and_lora_refused(models) -> None:
    from workers.models.gemma4 import Gemma4LM
    from workers.models.sharding import TensorParallel

    args = ModelArgs.from_dir(models["e2b"][1])
    with pytest.raises(ValueError, match="tensor parallelism is not supported for Gemma 4"):
        Gemma4LM(args, torch.float32, 64, tp=object.__new__(TensorParallel))
    assert Gemma4LM.lora_refusal == "LoRA adapters are not served for Gemma 4 models"


@pytest.mark.parametrize("case", list(CASES))
def test_int8_w8a16_equals_the_dequantised_weights(models, case: str) -> None:
    """Every linear int8, the MoE block's experts and the per-layer input projections included
    (tests/test_model_families.py's check over this file's cache geometries)."""
    from tests.test_model_families import int8_check
    int8_check(models[case][1], lambda m, ids, chunks, cls: _paged_logits(m, ids, chunks, base=cls))


# -- engine ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["e2b", "moe"])
def test_engine_greedy_equals_transformers_under_pressure(models, case: str) -> None:
    engine_greedy_equals_transformers(*models[case])


# -- the real server -----------------------------------------------------------------------------------


def test_server_infer_token_and_chat_equal_transformers(tmp_path_factory, tmp_path: Path) -> None:
    """The launch script on a tiny Gemma 4 chat model (every feature of the e2b case): prompts longer
    than its window through /infer_token (chunked, a prefix-cache hit) and the OpenAI chat route
    equal transformers."""
    path = tmp_path_factory.mktemp("gemma4_chat") / "tiny-gemma4"
    cfg = {k: v for k, v in BASE.items() if k not in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    save_chat_model(path, CHAT_TEMPLATE, cls_name="Gemma4TextConfig",
                    config=dict(cfg, **{**CASES["e2b"], "vocab_size_per_layer_input": 33000}))
    tail = served_greedy_equals_transformers(tmp_path, path, "Which layers share their keys and values?")
    # 4 writing layers of 6: 2 sliding (2 KV heads x 16) + 2 full (1 x 32)
    assert "gemma4" in tail and re.search(r"KV cache: \d+ bytes per token \(K and V of 2x2x16 \+ 2x1x32 layers", tail)


def test_moe_block_reads_only_picked_experts(models) -> None:
    """One token routes to top_k = 2 of 4 experts per layer: the others' weights NaN change nothing
    (an expert no token picked is never touched: moe.py's experts_forward), the logits still
    transformers'."""
    hf, path = models["moe"]
    model, _ = load_model(path, torch.float32)
    ids = torch.tensor([17])
    picked: list[set[int]] = []
    hooks = [layer.moe.gate.register_forward_hook(lambda m, i, o: picked.append(set(o[1].reshape(-1).tolist())))
             for layer in model.layers]
    first = _paged_logits(model, ids, [1])
    for hk in hooks:
        hk.remove()
    with torch.no_grad():
        for layer, used in zip(model.layers, picked):
            for e in sorted(set(range(4)) - used):
                layer.moe.w13[e].fill_(float("nan"))
                layer.moe.w2[e].fill_(float("nan"))
        ref = hf(ids[None]).logits[0]
    got = _paged_logits(model, ids, [1])
    assert all(len(u) == 2 for u in picked) and torch.equal(got, first)
    assert (got - ref).abs().max().item() <= 1e-4


def test_speculation_verifies_drafts_over_shared_layers(models) -> None:
    """A prompt that repeats itself: the speculator (suffix lookup, on by default) drafts, and the
    verified rows (several query rows per sequence, KV-shared layers reading their source's rows of
    the same step) keep greedy equal to transformers'."""
    from mindie.contract.wire import SamplingParams
    from tests.test_deepseek import hf_greedy
    from tests.test_engine import make_engine, run

    hf, path = models["e2b"]
    prompt = [7, 8, 9, 10, 11] * 8
    eng = make_engine(str(path), num_blocks=32)
    got = run(eng, {"s": (prompt, SamplingParams(max_new_tokens=16, ignore_eos=True))})["s"][0]
    assert got == hf_greedy(hf, prompt, 16)
    assert eng.speculator.draft_tokens > 0 and eng.check_no_leaks()
