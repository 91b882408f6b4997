"""The fused decode step (workers/backends/cpu_decode.py, cpu_kernels.c ``decode_layers``): the
whole decoder stack of a small decode step in one C call must compute what the eager path does,
take only the steps it covers, and stay out of the way for models it does not cover.

On a CPU with AVX512-BF16 dot products and no AMX (where oneDNN's bf16 inner product uses the
same instruction and order), bf16 results are bit-identical to the eager path; elsewhere (the
AVX2 build: tests/test_cpu_isa.py runs this file against it) and in fp32 (torch's vectorised
exp inside SiLU differs from the C library's in the last bit) they agree within rounding."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import torch.nn.functional as F

from tests.harness import demo_server
from tests.tiny_hf import save_random_model, save_random_models
from mindie.contract.spec import cpu_flags
from workers import settings
from workers.kernels import cpu_kernels
from workers.backends.cpu import CpuBackend
from workers.backends.cpu_decode import attach
from workers.backends.cpu_linear import KernelLinear
from workers.kernels.cpu_layout import pack, pack_scales
from workers.backends.int8 import CpuInt8Kernel, dequantize, quantize_model, quantize_weight
from workers.models.loader import load_model

pytest.importorskip("transformers")

LIB = cpu_kernels.load()
pytestmark = pytest.mark.skipif(LIB is None, reason=f"C kernels unavailable: {cpu_kernels.unavailable_reason()}")
FLAGS = cpu_flags().split()
# Where the eager path's bf16 products are oneDNN's AVX512-BF16 kernels, the fused step is exact.
BF16_EXACT = LIB is not None and LIB.has_dpbf16 and "amx_bf16" not in FLAGS

BASE = dict(vocab_size=203, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # Biases everywhere, an intermediate size that is neither a multiple of 16 nor even (padding of
    # the packed N and of the K pairs of the down projection).
    "llama_bias": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True, intermediate_size=101)),
    "qwen2_tied": ("Qwen2Config", dict(tie_word_embeddings=True)),  # q/k/v bias, tied head
    "kv1": ("LlamaConfig", dict(num_key_value_heads=1)),  # 4 query heads share one KV head
    "mistral_window": ("MistralConfig", dict(sliding_window=8)),  # contexts beyond the window
    "qwen3_qk_norm": ("Qwen3Config", dict(head_dim=16)),  # per-head q/k norms before rope
    # Gemma 3: (1 + w) norms around both blocks, GeGLU, q/k norms, the scaled embedding, a softmax
    # scale of its own, sliding layers with their own rope base, global ones with a scaled rope
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=8, sliding_window_pattern=2,
                                        query_pre_attn_scalar=24, pad_token_id=0,
                                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                            "rope_theta": 1e6},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 1e4}})),
    # Gemma 2: no q/k norms, one rope, soft-capped attention scores (a cap that bites: these weights'
    # scores spread about +-1.4) and logits
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24, pad_token_id=0,
                                    attn_logit_softcapping=1.5, final_logit_softcapping=5.0)),
    # mixtures of experts: the step stops at each layer's feed-forward norm, the layer's own
    # module (router, experts; Qwen2-MoE's gated shared expert) adds its mixture, the step resumes
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48)),
    # GPT-OSS: the attention's sink logits in the step's C attention, its experts between calls;
    # sliding and full layers alternating, YaRN rope, q/k/v and o biases
    "gpt_oss": ("GptOssConfig", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
                                     sliding_window=8)),
    # GLM-4-MoE: rope on the first half of each head only (NeoX halves), q/k norms, a dense first
    # layer, DeepSeek-V3's grouped sigmoid router and a shared expert between the step's calls
    "glm4_moe": ("Glm4MoeConfig", dict(head_dim=16, attention_bias=True, use_qk_norm=True, moe_intermediate_size=32,
                                       n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                       first_k_dense_replace=1, n_group=2, topk_group=1, norm_topk_prob=True,
                                       routed_scaling_factor=2.0)),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_random_models(tmp_path_factory.mktemp("fused"), CASES, BASE)


def _prepared(path: Path, dtype: torch.dtype):
    model, _ = load_model(path, dtype)
    CpuBackend().prepare_model(model)
    return model


def _attention(model, dtype: torch.dtype, blocks: int = 64 * 16, block_size: int = 4):
    a = model.args
    return CpuBackend().attention_class()(a.num_hidden_layers, blocks, block_size, a.num_key_value_heads, a.head_dim,
                                          dtype, torch.device("cpu"))


def _decode_run(model, dtype: torch.dtype, fused: bool, prompts: list[list[int]], steps: int,
                forced: list[torch.Tensor] | None = None):
    """Prefill ``prompts`` (eager: the fused step takes decodes only), then ``steps`` greedy decode
    steps of all of them together; the hidden states of every decode step, the final caches, the
    kernel calls and the tokens fed to each step. ``forced``: feed these tokens instead of the
    run's own greedy choices (so two runs that round differently see the same inputs: a near tie
    in the logits would otherwise send them down different sequences)."""
    fd = model.fast_decode
    attn = _attention(model, dtype)
    per = 16  # blocks per sequence (4 tokens each)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
    hidden, calls0, fed = [], fd.calls, []
    with torch.inference_mode():
        model.fast_decode = None
        attn.prepare(tables, [0] * len(prompts), [len(p) for p in prompts])
        h = model(torch.tensor([t for p in prompts for t in p]), torch.cat([torch.arange(len(p)) for p in prompts]),
                  attn)
        ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        nxt = model.compute_logits(h[ends]).argmax(-1)
        pos = [len(p) for p in prompts]
        model.fast_decode = fd if fused else None
        for i in range(steps):
            if forced is not None:
                nxt = forced[i]
            fed.append(nxt)
            attn.prepare(tables, pos, [1] * len(prompts))
            h = model(nxt, torch.tensor(pos), attn)
            hidden.append(h.float().clone())
            nxt = model.compute_logits(h).argmax(-1)
            pos = [p + 1 for p in pos]
    model.fast_decode = fd
    return hidden, [c.clone() for c in attn.k_cache + attn.v_cache], fd.calls - calls0, fed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_step_computes_what_eager_does(models, case, dtype):
    model = _prepared(models[case], dtype)
    assert model.fast_decode is not None
    top = model.fast_decode.max_rows  # 64 on AVX-512 and AVX2+FMA builds, 4 on others
    # prompts of 2-20 tokens, so the sequences' contexts differ
    prompts = [[(7 * i + j) % 150 + 3 for j in range(2 + (5 * i) % 19)] for i in range(top)]
    for batch in sorted({1, 3, min(8, top), min(16, top), top}):
        exact = dtype == torch.bfloat16 and BF16_EXACT
        eager_h, eager_kv, eager_calls, fed = _decode_run(model, dtype, False, prompts[:batch], 12)
        # Bit-exact: both runs choose their own tokens (and must agree). Otherwise both see the eager
        # run's tokens: rounding within tolerance may flip a near tie between two tokens.
        fused_h, fused_kv, fused_calls, _ = _decode_run(model, dtype, True, prompts[:batch], 12,
                                                        None if exact else fed)
        assert (eager_calls, fused_calls) == (0, 12)  # every decode step took the kernel, and only then
        if exact:
            assert all(torch.equal(a, b) for a, b in zip(eager_h, fused_h)), case
            assert all(torch.equal(a, b) for a, b in zip(eager_kv, fused_kv)), case
        else:
            # Gemma's residual stream runs larger (its (1 + w) norms scale by 1.5-2.5 here): one bf16
            # rounding that went the other way in a product (those of builds without avx512_bf16 are
            # not the eager path's bits) moves a small output past 2e-2 (Gemma 2: 0.025 at 0.16)
            tol = (4e-2 if case.startswith("gemma") else 2e-2) if dtype == torch.bfloat16 else 1e-5
            for a, b in zip(eager_h, fused_h):
                torch.testing.assert_close(b, a, rtol=tol, atol=tol)
            for a, b in zip(eager_kv, fused_kv):
                torch.testing.assert_close(b.float(), a.float(), rtol=tol, atol=tol)


@pytest.mark.skipif(LIB is None or not LIB.has_w16a32 or not hasattr(LIB, "kernels_tile_rows"),
                    reason="the tiled bf16 products are in AVX2 builds and AVX-512 ones without avx512_bf16 only")
@pytest.mark.parametrize("case", ["llama_bias", "qwen2_tied"])
def test_fused_step_gives_the_same_bits_with_the_tiled_products(models, case):
    """AVX2 builds compute bf16 products from a few rows on in register tiles (cpu_kernels.c
    ``bf16_group_tiles8`` in the step, ``bf16_tiles8`` in the eager prompt's linears) in the row
    path's summation order: decode steps with them on and off give the same hidden states and caches."""
    model = _prepared(models[case], torch.bfloat16)
    top = model.fast_decode.max_rows
    prompts = [[(5 * i + j) % 150 + 3 for j in range(3 + (7 * i) % 17)] for i in range(top)]
    before = LIB.kernels_tile_rows(0)
    try:
        for batch in sorted({3, 5, 16, top}):
            LIB.kernels_tile_rows(1 << 40)
            rows_h, rows_kv, rows_calls, fed = _decode_run(model, torch.bfloat16, True, prompts[:batch], 6)
            LIB.kernels_tile_rows(1)
            tiled_h, tiled_kv, tiled_calls, _ = _decode_run(model, torch.bfloat16, True, prompts[:batch], 6, fed)
            assert rows_calls == tiled_calls == 6
            assert all(torch.equal(a, b) for a, b in zip(rows_h, tiled_h)), (case, batch)
            assert all(torch.equal(a, b) for a, b in zip(rows_kv, tiled_kv)), (case, batch)
    finally:
        LIB.kernels_tile_rows(before)


@pytest.mark.skipif(LIB is None or not getattr(LIB, "has_w16a32", False),
                    reason="fp32 rows over bf16 weights are in AVX2 builds only")
@pytest.mark.parametrize("case", ["llama_bias", "qwen2_tied", "mistral_window"])
def test_fp32_model_over_bf16_weights_takes_the_fused_step(models, case):
    """A GGUF file's fp32 model on an AVX2 CPU keeps its linears' weights in bf16
    (cpu_linear.bf16_weight_linears): the fused step reads those same tensors (no copy), computes
    in fp32 over them (decode_layers' code 2) and agrees with the eager path, whose products are the
    same kernels' (linear_rows dt 2), within fp32 rounding (SiLU's exp differs in the last bit)."""
    model, _ = load_model(models[case], torch.float32)
    backend = CpuBackend()
    backend.bf16_weights = True
    backend.prepare_model(model)
    fd = model.fast_decode
    assert fd is not None and fd.code == 2 and fd.dtype == torch.float32
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, KernelLinear) and qkv.packed.dtype == torch.bfloat16
    assert fd.weights[0]["qkv_w"].data_ptr() == qkv.packed.data_ptr()  # shared, not copied
    top = fd.max_rows
    prompts = [[(3 * i + j) % 150 + 3 for j in range(2 + (7 * i) % 23)] for i in range(top)]
    for batch in sorted({1, 3, 8, top}):
        eager_h, eager_kv, eager_calls, fed = _decode_run(model, torch.float32, False, prompts[:batch], 10)
        fused_h, fused_kv, fused_calls, _ = _decode_run(model, torch.float32, True, prompts[:batch], 10, fed)
        assert (eager_calls, fused_calls) == (0, 10)
        for a, b in zip(eager_h, fused_h):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        for a, b in zip(eager_kv, fused_kv):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n, k", [(64, 64), (101, 112), (203, 64), (48, 101), (1024, 512), (512, 1376)])
def test_packed_products_against_a_float64_reference(dtype, n, k):
    """The kernel's products (``linear_rows``, the same code as the step's) over the packed layout,
    with and without bias, 1-16 rows: within the output type's rounding of the exact sum."""
    torch.manual_seed(n * 7 + k)
    w = (torch.randn(n, k) * 0.1).to(dtype)
    b = (torch.randn(n) * 0.1).to(dtype)
    pw = pack(w)
    for m in (1, 2, 5, 8, 16):
        x = torch.randn(m, k).to(dtype)
        for bias in (None, b):
            out = torch.empty(m, n, dtype=dtype)
            assert LIB.linear_rows(1 if dtype == torch.bfloat16 else 0, x.data_ptr(), m, k, pw.data_ptr(), None, n,
                                   None if bias is None else bias.data_ptr(), out.data_ptr()) == 0
            exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
            eps = torch.finfo(dtype).eps
            # one rounding of the output plus fp32 accumulation error
            bound = exact.abs() * eps + (x.double().abs() @ w.double().abs().T) * k * 2 ** -23 + 1e-30
            assert ((out.double() - exact).abs() <= bound).all(), (m, bias is None)
            if dtype == torch.bfloat16 and BF16_EXACT and m == 1:
                assert torch.equal(out, F.linear(x, w, bias)), (n, k)  # oneDNN's order at one row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n, k", [(101, 112), (203, 64), (1024, 512)])
def test_int8_products_against_the_dequantised_weights(dtype, n, k):
    """w8a16: the products over an int8 copy with per-channel scales equal x @ dequantised(W)^T
    up to the output's rounding (the same reference as tests/test_int8.py)."""
    torch.manual_seed(n + k)
    q, scale = quantize_weight(torch.randn(n, k) * 0.1)
    ref_w = dequantize(q, scale.to(dtype)).double()
    pq, ps = pack(q), pack_scales(scale.to(dtype))
    for m in (1, 3, 8, 16):
        x = torch.randn(m, k).to(dtype)
        out = torch.empty(m, n, dtype=dtype)
        assert LIB.linear_rows(1 if dtype == torch.bfloat16 else 0, x.data_ptr(), m, k, pq.data_ptr(), ps.data_ptr(), n,
                               None, out.data_ptr()) == 0
        exact = x.double() @ ref_w.T
        bound = exact.abs() * torch.finfo(dtype).eps + (x.double().abs() @ ref_w.abs().T) * k * 2 ** -23 + 1e-30
        assert ((out.double() - exact).abs() <= bound).all(), m


@pytest.mark.parametrize("case", ["llama_bias", "qwen2_tied"])
def test_int8_model_takes_the_fused_step_and_agrees_with_eager(models, case):
    """A w8a16 model: the fused step reads the int8 copy (scales applied to fp32 sums, one rounding
    where the eager path rounds after the scale and again after the bias): within bf16 rounding."""
    model, _ = load_model(models[case], torch.bfloat16)
    quantize_model(model, CpuInt8Kernel())
    CpuBackend().prepare_model(model)
    assert model.fast_decode is not None and model.fast_decode.weights[0]["qkv_s"] is not None
    prompts = [[5, 6, 7], list(range(10, 31)), [9] * 6]
    eager_h, _, _, fed = _decode_run(model, torch.bfloat16, False, prompts, 6)
    fused_h, _, calls, _ = _decode_run(model, torch.bfloat16, True, prompts, 6, fed)
    assert calls == 6
    for a, b in zip(eager_h, fused_h):
        torch.testing.assert_close(b, a, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("n, k", [(101, 112), (203, 64), (512, 101)])
def test_cpu_int8_linears_run_on_the_kernel_layout(dtype, n, k):
    """CpuInt8Kernel keeps the int8 weight in the kernels' layout: up to 32 rows through
    linear_rows, above that dequantised into a matrix for oneDNN; both equal x @ dequantised(W)^T
    up to the output's rounding, and the [N, K] view gives back the quantised matrix."""
    torch.manual_seed(n * 3 + k)
    w = torch.randn(n, k) * 0.1
    q, scale = quantize_weight(w)
    kern = CpuInt8Kernel()
    packed = kern.pack(q, scale, dtype, torch.device("cpu"))
    assert packed["q"].shape == (-(-n // 16), k, 16) and packed["scale16"].dtype == torch.float32
    assert torch.equal(kern.plain(packed), q)
    ref_w = dequantize(q, scale.to(dtype)).double()
    for m in (1, 5, 16, 17, 32, 33, 70):
        x = torch.randn(m, k).to(dtype)
        out = kern.mm(x, packed)
        assert out.shape == (m, n) and out.dtype == dtype
        exact = x.double() @ ref_w.T
        # the kernel rounds once; the dequantised path rounds the product, then the scaled value
        bound = 2 * exact.abs() * torch.finfo(dtype).eps + (x.double().abs() @ ref_w.abs().T) * k * 2 ** -23 + 1e-30
        assert ((out.double() - exact).abs() <= bound).all(), m


def test_int8_model_shares_its_layers_with_the_fused_step(models):
    """The fused step reads the int8 layers' own tensors (no second copy), so the worker's weight
    bytes count them once."""
    from workers.backends.int8 import Int8Linear, weight_bytes
    model, _ = load_model(models["kv1"], torch.bfloat16)  # intermediate 112: gate/up split on a block edge
    quantize_model(model, CpuInt8Kernel())
    before = weight_bytes(model)
    CpuBackend().prepare_model(model)
    fused = model.fast_decode
    assert fused is not None
    owned = {t.untyped_storage().data_ptr() for t in model.buffers()}
    for layer in fused.weights:
        for name in ("qkv", "o", "gate", "up", "down"):
            assert layer[f"{name}_w"].untyped_storage().data_ptr() in owned, name
    int8_bytes = sum(m.q.numel() + m.scale16.numel() * 4 for m in model.modules() if isinstance(m, Int8Linear))
    assert weight_bytes(model) - before < int8_bytes / 4  # no copy of the layers was added


@pytest.mark.skipif(LIB is None or not (getattr(LIB, "amx_rows", 0) or LIB.has_dpbf16),
                    reason="no AMX-BF16 tiles or AVX512-BF16 dot products here")
def test_bf16_model_beyond_the_budget_shares_its_layers_with_the_fused_step(models, monkeypatch, caplog):
    """On AMX and AVX512-BF16 CPUs a bf16 model whose fused-step copy would exceed the budget
    (cpuTuning.fusedDecodeMb, 0.01 MiB here) keeps one copy of its linears' weights, in the
    kernels' layout (KernelLinear: AMX tiles or AVX512-BF16 products for prompts), and the fused
    step reads those tensors instead of a copy: a model of any size decodes in one C call."""
    from workers.backends.cpu_linear import KernelLinear
    monkeypatch.setattr(settings, "_engine", settings.with_cpu(fused_decode_mb=0.01))
    with caplog.at_level(logging.INFO, logger="workers.backends"):
        model = _prepared(models["kv1"], torch.bfloat16)  # intermediate 112: gate/up split on a block edge
    fused = model.fast_decode
    assert fused is not None
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert "the linears keep their one copy in its layout" in said
    assert ("AMX tiles" if getattr(LIB, "amx_rows", 0) else "AVX512-BF16 products") in said
    assert "reads the layers' own weights, no copy" in said
    owned = {m.packed.untyped_storage().data_ptr() for m in model.modules() if isinstance(m, KernelLinear)}
    assert len(owned) >= 4 * len(model.layers)  # qkv, o, gate_up, down (and an untied head)
    for layer in fused.weights:
        for name in ("qkv", "o", "gate", "up", "down"):
            assert layer[f"{name}_w"].untyped_storage().data_ptr() in owned, name
    _, _, calls, _ = _decode_run(model, torch.bfloat16, True, [[5, 6], [7, 8, 9]], 3)
    assert calls == 3


@pytest.mark.parametrize("route, budget_mb", [("kernels", 256.0), ("onednn", 0.01)])
def test_amx_model_computes_a_prompt_alike_fresh_after_a_prefix_and_in_chunks(tmp_path, monkeypatch, route, budget_mb):
    """On AMX CPUs a bf16 model whose linears are KernelLinear (AMX tiles: every such model by
    default, cpuTuning.prefillLinears ``kernels``; under ``onednn`` a model beyond
    cpuTuning.fusedDecodeMb) and whose prompt attention takes paged_prefill's AMX tiles gives a
    prompt's rows the same bits fresh, after a prefix-cache hit and in other chunks, and a row's
    logits the same alone and among others (the tied head on the tiles too, by default): each part
    computes a row from that row alone. (oneDNN's products round a row differently with the row
    count: docs/design.md.)"""
    from workers.backends.cpu_linear import KernelLinear
    lib = cpu_kernels.load()
    if lib is None or not getattr(lib, "amx_rows", 0) or not getattr(lib, "prefill_amx", False):
        pytest.skip("no AMX-BF16 tiles here (CPU without amx_bf16, or an AVX2 build)")
    monkeypatch.setattr(settings, "_engine", settings.with_cpu(prefill_linears=route, fused_decode_mb=budget_mb))
    save_random_model("LlamaConfig", {**BASE, "hidden_size": 128, "tie_word_embeddings": True},
                      tmp_path / "m")  # head size 32
    model = _prepared(tmp_path / "m", torch.bfloat16)
    assert sum(isinstance(m, KernelLinear) for m in model.modules()) >= 4 * len(model.layers)
    assert isinstance(model.logits_linear, KernelLinear) == (route == "kernels")
    assert model.fast_decode is not None  # sharing the layers' one copy
    n = 150
    ids = torch.randint(3, BASE["vocab_size"], (n,), generator=torch.Generator().manual_seed(0))
    attn = _attention(model, torch.bfloat16, blocks=64, block_size=16)
    table = list(range(-(-n // 16)))
    calls = lib.kernels_prefill_amx_calls()

    def chunk(a: int, b: int) -> torch.Tensor:
        attn.prepare([table], [a], [b - a])
        return model(ids[a:b], torch.arange(a, b), attn)

    with torch.inference_mode():
        fresh = chunk(0, n)
        for s in (37, 96, n - 3):
            assert torch.equal(chunk(s, n), fresh[s:]), s
        assert torch.equal(torch.cat([chunk(0, 50), chunk(50, 101), chunk(101, n)]), fresh)
        if route == "kernels":
            logits = model.compute_logits(fresh)
            for r in (0, 77, n - 1):
                assert torch.equal(model.compute_logits(fresh[r:r + 1]), logits[r:r + 1]), r
    assert lib.kernels_prefill_amx_calls() - calls == 7 * model.args.num_hidden_layers


def test_prefill_linears_route_picks_the_products_and_refuses_other_values(tmp_path, monkeypatch):
    """cpuTuning.prefillLinears: ``onednn`` keeps a model within cpuTuning.fusedDecodeMb on
    oneDNN's packed products (the fused decode step with a copy of its own); ``kernels`` (the
    default) moves its linears and tied head to the C kernels' tiles on AMX CPUs and leaves them
    to oneDNN elsewhere; any other value is refused, naming the key."""
    from workers.backends import cpu_linear
    from workers.backends.cpu_linear import KernelLinear, PackedLinear
    save_random_model("LlamaConfig", {**BASE, "hidden_size": 128, "tie_word_embeddings": True}, tmp_path / "m")
    lib = cpu_kernels.load()
    amx = lib is not None and getattr(lib, "amx_rows", 0) > 0
    for route in ("onednn", "kernels"):
        monkeypatch.setattr(settings, "_engine", settings.with_cpu(prefill_linears=route))
        model = _prepared(tmp_path / "m", torch.bfloat16)
        kernel = sum(isinstance(m, KernelLinear) for m in model.modules())
        packed = sum(isinstance(m, PackedLinear) for m in model.modules())
        if route == "kernels" and amx:
            assert (kernel, packed) == (4 * len(model.layers) + 1, 0), route  # and the tied head
        elif cpu_linear._pack(torch.zeros(16, 16, dtype=torch.bfloat16)) is not None:  # oneDNN packs bf16 here
            assert kernel == 0 and packed == 4 * len(model.layers), route
        assert model.fast_decode is not None, route
    monkeypatch.setattr(settings, "_engine", settings.with_cpu(prefill_linears="mkl"))
    with pytest.raises(ValueError, match="cpuTuning.prefillLinears"):
        _prepared(tmp_path / "m", torch.bfloat16)


def test_large_steps_and_prefills_keep_the_eager_path(models, monkeypatch):
    monkeypatch.setattr(settings, "_engine", settings.with_cpu(fused_decode_rows=2))  # cpuTuning.fusedDecodeRows
    model = _prepared(models["llama_bias"], torch.bfloat16)
    assert model.fast_decode.max_rows == 2
    _, _, calls, _ = _decode_run(model, torch.bfloat16, True, [[5, 6], [7, 8], [9, 10]], 3)
    assert calls == 0  # 3 sequences > 2 rows: eager
    _, _, calls, _ = _decode_run(model, torch.bfloat16, True, [[5, 6], [7, 8]], 3)
    assert calls == 3
    # A step mixing a prefill chunk with decodes is not the kernel's.
    attn = _attention(model, torch.bfloat16)
    with torch.inference_mode():
        attn.prepare([[0, 1], [2, 3]], [0, 0], [3, 1])
        model(torch.tensor([5, 6, 7, 8]), torch.tensor([0, 1, 2, 0]), attn)
    assert model.fast_decode.calls == 3


def test_models_and_settings_it_does_not_cover(models, tmp_path, monkeypatch, caplog):
    def attached(path: Path, dtype=torch.bfloat16) -> bool:
        model, _ = load_model(path, dtype)
        return attach(model) is not None

    with caplog.at_level(logging.INFO, logger="workers.backends"):
        assert not attached(models["kv1"], torch.float16)
        # cpuTuning (the plan's values; their overrides and range checks: tests/test_engine_settings.py)
        monkeypatch.setattr(settings, "_engine", settings.with_cpu(fused_decode_mb=0.01))
        assert not attached(models["kv1"], torch.float32)  # bf16 on AMX CPUs shares instead (test below)
        monkeypatch.setattr(settings, "_engine", settings.with_cpu(fused_decode_mb=256.0))
        assert attached(models["kv1"])
        for name, bad in (("fused_decode_rows", "abc"), ("fused_decode_rows", 65),
                          ("fused_decode_mb", float("nan")), ("fused_decode_mb", -1.0)):
            with monkeypatch.context() as m:
                m.setattr(settings, "_engine", settings.with_cpu(**{name: bad}))
                assert not attached(models["kv1"])  # a bad value: logged, the eager path serves
        monkeypatch.setattr(settings, "_engine", settings.with_cpu(fused_decode=False))
        assert not attached(models["kv1"])
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert "torch.float16 (fp32 and bf16 only)" in said
    assert "exceed cpuTuning.fusedDecodeMb" in said
    assert "cpuTuning.fusedDecodeRows must be an integer from 0 to 64, got 'abc'" in said
    assert "cpuTuning.fusedDecodeMb must be a number of MiB >= 0, got nan" in said
    assert f"fused decode kernel on for decode steps of up to {64 if LIB.has_avx512 or LIB.has_avx2 else 4} sequences" in said


def _greedy(url: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    import concurrent.futures as cf

    def one(p: list[int]) -> list[int]:
        r = httpx.post(url + "/infer_token", json={"input_id": p, "stream": False,
                                                    "parameters": {"max_new_tokens": n, "ignore_eos": True,
                                                                   "details": True}}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["details"]["generated_token_ids"]

    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(one, prompts))


def test_server_generates_the_same_tokens_with_and_without_it(tmp_path, demo_model):
    """The real server (launch script, worker) on the demo model in bf16: greedy continuations of
    concurrent requests with the fused step equal those with MINDIE_CPU_FUSED_DECODE=0, and the
    worker says it is on."""
    prompts = [[5, 6, 7], list(range(20, 60)), [9] * 12, [300, 301]]
    runs = {}
    for label, env in (("fused", {}), ("eager", {"MINDIE_CPU_FUSED_DECODE": "0"})):
        (tmp_path / label).mkdir()
        with demo_server(tmp_path / label, demo_model, env=env, model={"dtype": "bfloat16"}) as srv:
            runs[label] = _greedy(srv.url, prompts, 40)
            log = srv.tail(400)
        assert ("fused decode kernel on" in log) == (label == "fused"), log[-3000:]
    assert all(len(t) == 40 for t in runs["fused"])
    if BF16_EXACT:
        assert runs["fused"] == runs["eager"]
    else:  # the same up to a last-bit difference somewhere in a long continuation
        same = sum(a == b for f, e in zip(runs["fused"], runs["eager"]) for a, b in zip(f, e))
        assert same >= 0.9 * 40 * len(prompts)


def test_prompt_products_benchmark_times_both_routes(tmp_path, capsys):
    """``mindie-bench prompt-products`` (the figures of docs/performance.md, "Prompt products on
    AMX"): one row per case with both sides' step times and their ratio, on any CPU (without AMX
    both sides run the same products, and it says so); the settings it changed are restored."""
    from mindie_bench.lab import prompt_products
    save_random_model("LlamaConfig", {**BASE, "hidden_size": 128, "tie_word_embeddings": True}, tmp_path / "m")
    before = settings.engine()
    assert prompt_products.main(["--model", str(tmp_path / "m"), "--cases", "2x40,3x1", "--pairs", "1",
                                 "--context", "9"]) == 0
    assert settings.engine() == before
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip().startswith(("2x40", "3x1"))}
    assert set(rows) == {"2x40", "3x1"}
    for onednn, kernels, ratio in ((float(v) for v in row) for row in rows.values()):
        assert onednn > 0 and kernels > 0
        # printed to 0.01: the ratio of the times as printed, within their rounding
        assert (kernels - 0.005) / (onednn + 0.005) - 0.005 <= ratio <= (kernels + 0.005) / (onednn - 0.005) + 0.005
    lib = cpu_kernels.load()
    assert ("both sides run the same products" in out) == (lib is None or not getattr(lib, "amx_rows", 0))
