"""Batch-invariant mode (ScheduleConfig.batchInvariant; workers/backends/cpu_invariant.py): a
sequence's rows come out with the same bits whatever else its steps hold, in process, on tiny
random models of each CPU path (the launch-script proofs: tests/test_batch_invariance_server.py).

One sequence ``A`` is computed alone (its prompt in one step, then one decode per step) and again
inside mixed steps: its prompt cut into chunks beside other prompts and decodes, its next tokens
fed three at once (a speculative verify step) and then as decodes among many others, with the
fused decode step taking the steps it covers; and once more as a preempted sequence is recomputed
(its prompt and generated tokens as one prompt). Every row of ``A`` (the final hidden state and the
logits) must be equal bit for bit. Families: Llama, Qwen2, Mistral, Qwen3, Qwen3-MoE, Gemma 2 and 3,
GPT-OSS, the hybrid Qwen3-Next and Qwen3.5-MoE (Gated DeltaNet: every token one recurrent step, the
state pool's slot per sequence), DeepSeek-V3 and V2 (MLA's latent cache) and GLM-4-MoE. With the mode
off the same drive differs in fp32 (the hybrids' prompts then take the chunked form); in bf16 on a CPU
whose bf16 products are oneDNN's native ones (AVX512-BF16 / AMX). Also: the every-row attention
metadata built with tensor ops equals the decode metadata of the tokens."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from tests.tiny_hf import save_random_models
from workers import settings
from workers.attention import for_layout
from workers.attention.state_cache import StateCache
from workers.backends.cpu import CpuBackend
from workers.backends.cpu_linear import KernelLinear
from workers.kernels import cpu_kernels
from workers.models.loader import load_model

pytest.importorskip("transformers")

LIB = cpu_kernels.load()
pytestmark = pytest.mark.skipif(LIB is None, reason=f"C kernels unavailable: {cpu_kernels.unavailable_reason()}")

BASE = dict(vocab_size=211, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
HYBRID = dict(head_dim=16, layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
HYBRID_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
MLA = dict(num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
           num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=16)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_bias": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True, intermediate_size=101)),
    "qwen2_tied": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "mistral_window": ("MistralConfig", dict(sliding_window=16)),
    "qwen3_norms": ("Qwen3Config", dict(head_dim=16)),  # per-head q/k norms: no fused step
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         decoder_sparse_step=1)),  # router, experts and their SwiGLU
    "gemma2": ("Gemma2Config", dict(head_dim=16, attn_logit_softcapping=3.0, final_logit_softcapping=2.0,
                                    sliding_window=8, query_pre_attn_scalar=24, pad_token_id=0)),  # capped C attention
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=8, sliding_window_pattern=2,
                                        query_pre_attn_scalar=24, pad_token_id=0)),  # GeGLU, q/k norms
    "gpt_oss": ("GptOssConfig", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
                                     sliding_window=12)),  # sinks, router, stacked experts, clamped SwiGLU
    # Gated DeltaNet (the recurrent step for every token, the convolution tap by tap), gated norms and
    # output gates; Qwen3-Next's fused in_proj_qkvz and shared expert with its sigmoid gate
    "qwen3_next": ("Qwen3NextConfig", dict(HYBRID, **HYBRID_MOE)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(HYBRID, **HYBRID_MOE)),
    # MLA (the absorbed decode one row a call), the grouped sigmoid router, shared experts
    "deepseek_v3": ("DeepseekV3Config", dict(MLA, n_group=4, topk_group=2)),
    "deepseek_v2": ("DeepseekV2Config", dict(MLA, q_lora_rank=None, topk_method="greedy")),
    # q/k norms, partial rotary, DeepSeek-V3's router over the correction bias
    "glm4_moe": ("Glm4MoeConfig", dict(head_dim=16, attention_bias=True, use_qk_norm=True, moe_intermediate_size=32,
                                       n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
                                       topk_group=2, first_k_dense_replace=1, pad_token_id=0,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "partial_rotary_factor": 0.5})),
}
BLOCK = 16
PER_SEQ = 16  # blocks per sequence


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_random_models(tmp_path_factory.mktemp("invariant"), CASES, BASE)


def invariant(on: bool) -> None:
    """This process's settings with batchInvariant ``on`` (read when a model is prepared and an
    attention object built)."""
    settings.apply(msgspec.structs.replace(settings.engine(), batch_invariant=on))


@pytest.fixture
def restore_settings():
    before = settings.engine()
    yield
    settings.apply(before)


class Driver:
    """Steps of (sequence, first position, tokens) over one model and cache: each sequence owns
    PER_SEQ blocks. Returns the final hidden rows and logits of every token fed."""

    def __init__(self, path: Path, dtype: torch.dtype, gguf_native: bool = False):
        if gguf_native:  # a GGUF file's linears computed from their blocks (ggufCompute: native)
            from workers.backends.gguf_linear import NativeTarget
            from workers.kernels import gguf_kernels
            self.model, _ = load_model(path, dtype, gguf_native=NativeTarget(gguf_kernels.load()))
        else:
            self.model, _ = load_model(path, dtype)
        CpuBackend().prepare_model(self.model)
        a = self.model.args
        cpu = torch.device("cpu")
        layout = getattr(self.model, "kv_layout", None)
        if layout is not None:  # MLA's latent cache
            kind, (layers, heads, width) = layout
            self.attn = for_layout(kind)(layers, 8 * PER_SEQ, BLOCK, heads, width, dtype, cpu)
        else:
            self.attn = CpuBackend().attention_class()(getattr(self.model, "kv_layers", a.num_hidden_layers),
                                                       8 * PER_SEQ, BLOCK, a.num_key_value_heads, a.head_dim, dtype,
                                                       cpu)
        if (hy := a.hybrid) is not None:  # the state pool: sequence s in slot s
            self.model.states = StateCache(len(hy.linear_layers), 4, hy.conv_dim, hy.conv_kernel - 1, hy.num_v_heads,
                                           hy.head_k_dim, hy.head_v_dim, dtype, cpu)

    def step(self, parts: list[tuple[int, int, list[int]]]) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
        tables = [list(range(s * PER_SEQ, (s + 1) * PER_SEQ)) for s, _, _ in parts]
        self.attn.prepare(tables, [p for _, p, _ in parts], [len(t) for _, _, t in parts])
        if getattr(self.model, "states", None) is not None:
            self.model.states.prepare([s for s, _, _ in parts], [p for _, p, _ in parts], [len(t) for _, _, t in parts])
        ids = torch.tensor([t for _, _, toks in parts for t in toks])
        pos = torch.cat([torch.arange(p, p + len(t)) for _, p, t in parts])
        with torch.inference_mode():
            h = self.model(ids, pos, self.attn)
            logits = self.model.compute_logits(h)
        out, r = {}, 0
        for s, p, toks in parts:
            for i in range(len(toks)):
                out[(s, p + i)] = (h[r].float().clone(), logits[r].float().clone())
                r += 1
        return out


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, BASE["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


A, B, C = 0, 1, 2
PROMPT_A, PROMPT_B, PROMPT_C = _prompt(1, 70), _prompt(2, 90), _prompt(3, 12)


def alone(d: Driver, extra: int = 6) -> tuple[dict, list[int]]:
    """A's prompt in one step, then ``extra`` greedy decodes one per step."""
    rows = d.step([(A, 0, PROMPT_A)])
    toks = [int(rows[(A, len(PROMPT_A) - 1)][1].argmax())]
    for i in range(extra - 1):
        p = len(PROMPT_A) + i
        rows.update(d.step([(A, p, [toks[-1]])]))
        toks.append(int(rows[(A, p)][1].argmax()))
    rows.update(d.step([(A, len(PROMPT_A) + extra - 1, [toks[-1]])]))
    return rows, toks


def mixed(d: Driver, toks: list[int]) -> dict:
    """A among others: its prompt in chunks of 23 and 47 beside B's and C's prompt chunks, its first
    three generated tokens fed at once (a verify step), the rest as decodes beside B and C (the
    fused step: at most 64 rows, all decodes)."""
    n = len(PROMPT_A)
    rows = d.step([(B, 0, PROMPT_B[:40]), (A, 0, PROMPT_A[:23])])
    rows.update(d.step([(C, 0, PROMPT_C), (A, 23, PROMPT_A[23:]), (B, 40, PROMPT_B[40:])]))
    rows.update(d.step([(B, 90, [5]), (A, n, toks[:3]), (C, 12, [7])]))
    for i in range(3, len(toks)):
        rows.update(d.step([(C, 12 + i - 2, [9]), (A, n + i, [toks[i]]), (B, 90 + i - 2, [11])]))
    return rows


def recomputed(d: Driver, toks: list[int]) -> dict:
    """A preempted A: its prompt and the tokens it had generated computed again as one prompt (the
    scheduler's recompute), beside another prompt, then its last token decoded."""
    n, k = len(PROMPT_A), len(toks)
    rows = d.step([(C, 0, PROMPT_C), (A, 0, PROMPT_A + toks[:k - 1])])
    rows.update(d.step([(A, n + k - 1, [toks[-1]]), (C, 12, [9])]))
    return rows


def _compare(first: dict, second: dict) -> list[tuple[int, int]]:
    """The (sequence, position) keys of A where the two drives differ (hidden state or logits)."""
    keys = sorted(k for k in first if k[0] == A)
    assert keys and all(k in second for k in keys)
    return [k for k in keys if not (torch.equal(first[k][0], second[k][0]) and torch.equal(first[k][1], second[k][1]))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_sequence_computes_the_same_bits_alone_and_in_mixed_steps(models, case, dtype, restore_settings):
    invariant(True)
    d = Driver(models[case], dtype)
    linears = [m for m in d.model.modules() if isinstance(m, KernelLinear)]
    assert len(linears) >= 2 * d.model.args.num_hidden_layers  # every product on the C kernels
    assert not any(isinstance(m, torch.nn.Linear) for m in d.model.modules())
    fused = d.model.fast_decode
    calls = fused.calls if fused is not None else 0
    ref, toks = alone(d)
    other = Driver(models[case], dtype)  # a fresh cache: no row of the first drive is read
    assert _compare(ref, mixed(other, toks)) == []
    assert _compare(ref, recomputed(Driver(models[case], dtype), toks)) == []
    if fused is not None:  # the fused step took the steps of at most 64 rows, in both drives
        assert fused.calls > calls and other.model.fast_decode.calls > 0


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Model views of tiny GGUF files covering every block type the kernels read
    (tests/test_gguf_kernels.py MODEL_CASES: Q4_0-Q8_0 in one, the K-quants in the other)."""
    from tests.test_gguf_kernels import MODEL_CASES
    from tests.tiny_gguf import byte_level_tokenizer, gpt2_vocab, tiny_model, write_gguf
    from workers.models.gguf_view import ensure_view
    root = tmp_path_factory.mktemp("invariant-gguf")
    vocab = gpt2_vocab(byte_level_tokenizer())
    out = {}
    for case, (cls, arch, config, options) in MODEL_CASES.items():
        (root / case).mkdir()
        path = write_gguf(root / case / f"{case}.gguf", tiny_model(cls, len(vocab["tokens"]), **config), arch, vocab,
                          **options)
        out[case] = ensure_view(path, root / "cache")
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3"])
def test_a_native_gguf_sequence_computes_the_same_bits_alone_and_in_mixed_steps(gguf_models, case, dtype,
                                                                                 restore_settings):
    """The same drives on a GGUF model whose linears stay in their blocks (``ggufCompute:
    native``): on the AVX-512 VNNI builds the integer products over the blocks interleaved in
    16-row groups at every row count (prompt chunks, verify rows, recompute, and the fused decode
    step's gguf_rows), else mode 2's integer products; either way a row's bits do not depend on
    its step."""
    from workers.backends.gguf_linear import GgufLinear
    from workers.kernels import gguf_kernels
    invariant(True)
    d = Driver(gguf_models[case], dtype, gguf_native=True)
    linears = [m for m in d.model.modules() if isinstance(m, GgufLinear)]
    assert len(linears) == 4 * d.model.args.num_hidden_layers + 1  # and the head
    fused = d.model.fast_decode
    assert fused is not None
    ref, toks = alone(d)
    other = Driver(gguf_models[case], dtype, gguf_native=True)
    assert _compare(ref, mixed(other, toks)) == []
    third = Driver(gguf_models[case], dtype, gguf_native=True)
    assert _compare(ref, recomputed(third, toks)) == []
    assert fused.calls > 0 and other.model.fast_decode.calls > 0
    lib = gguf_kernels.load()
    tiles = lib.tile_bf16 and dtype == torch.bfloat16 and not lib.x16
    path = "tile" if tiles else "int"
    for drive in (d, other, third):
        calls = {k for m in drive.model.modules() if isinstance(m, GgufLinear) for k, v in m.calls.items() if v}
        assert calls == {path}, calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_native_gguf_mixture_computes_the_same_bits_alone_and_in_mixed_steps(tmp_path, dtype, restore_settings):
    """The same drives on a GGUF Qwen3-MoE whose experts stay in their blocks: each mixture layer's
    routed experts in one C call (gguf_kernels.c ``gguf_moe``, workers/backends/gguf_experts.py),
    whose per-token sums do not depend on the other tokens of the step, and the decodes in the fused
    step, which hands each mixture to the layer's module between its calls."""
    from gguf import GGMLQuantizationType as Q
    from tests.tiny_gguf import byte_level_tokenizer, gpt2_vocab, tiny_model, write_gguf
    from workers.backends.gguf_experts import GgufExperts
    from workers.models.gguf_view import ensure_view
    vocab = gpt2_vocab(byte_level_tokenizer())
    hf = tiny_model("Qwen3MoeConfig", len(vocab["tokens"]), head_dim=16, num_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=64, norm_topk_prob=True)
    path = ensure_view(write_gguf(tmp_path / "moe.gguf", hf, "qwen3moe", vocab, default=Q.Q8_0,
                                  types={"ffn_gate_exps": Q.Q4_0, "ffn_up_exps": Q.Q4_1, "ffn_down_exps": Q.Q5_0}),
                       tmp_path / "cache")
    invariant(True)
    d = Driver(path, dtype, gguf_native=True)
    fused = [m.mlp.fused_experts for m in d.model.layers]
    assert all(isinstance(f, GgufExperts) for f in fused) and d.model.fast_decode is not None
    ref, toks = alone(d)
    other = Driver(path, dtype, gguf_native=True)
    assert _compare(ref, mixed(other, toks)) == []
    third = Driver(path, dtype, gguf_native=True)
    assert _compare(ref, recomputed(third, toks)) == []
    # the experts' one call in every step, the fused decode step (stopping at each mixture) in the decodes
    assert all(f.calls > 0 for f in fused) and d.model.fast_decode.calls > 0 and other.model.fast_decode.calls > 0


@pytest.mark.parametrize("case", list(CASES))
def test_without_the_mode_the_same_drive_differs(models, case, restore_settings):
    """The drive above finds what the mode removes: with it off, an fp32 model's decodes alone take
    the fused step's FMAs and its mixed steps oneDNN's products, which sum in another order (on
    any CPU). (In bf16 this tiny drive finds no difference on a Zen 4, whose oneDNN AVX512-BF16
    products sum pairs in the fused step's order; the server test on the default model does.)"""
    invariant(False)
    d = Driver(models[case], torch.float32)
    ref, toks = alone(d)
    assert _compare(ref, mixed(Driver(models[case], torch.float32), toks))


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("starts,counts", [([0], [7]), ([0, 30, 5], [23, 1, 40]), ([17, 0, 64], [3, 0, 1]),
                                          ([0, 0], [1, 2])])
def test_every_row_metadata_is_the_decode_metadata_of_its_tokens(starts, counts, block_size):
    """build_metadata(every_row=True) builds its per-token tables with tensor ops; they must be
    what the decode metadata of the tokens' own positions and tables is (the list form)."""
    from workers.attention.paged import _decode_metadata, build_metadata
    tables = [list(range(100 * i + 40, 100 * i, -1))[:-(-(s + n) // block_size) + i] for i, (s, n) in
              enumerate(zip(starts, counts))]  # out of order, of different lengths
    cpu = torch.device("cpu")
    got = build_metadata(tables, starts, counts, block_size, cpu, every_row=True)
    want = _decode_metadata([t for t, n in zip(tables, counts) for _ in range(n)],
                            [p for s, n in zip(starts, counts) for p in range(s, s + n)], block_size, cpu)
    assert got.num_tokens == want.num_tokens and got.prefill is None
    for a, b in ((got.blocks, want.blocks), (got.offsets, want.offsets), (got.decode.rows, want.decode.rows),
                 (got.decode.tables, want.decode.tables), (got.decode.pos, want.decode.pos)):
        assert a.dtype == b.dtype and torch.equal(a, b)
