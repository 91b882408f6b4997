"""GGUF mixtures of experts (issue 53, item 5): llama.cpp's ``qwen2moe``, ``qwen3moe`` and ``glm4moe``
files, written here as convert_hf_to_gguf.py writes them (tests/tiny_gguf.py: stacked experts
``ffn_*_exps``, shared experts ``ffn_*_shexp``, Qwen2-MoE's squeezed ``ffn_gate_inp_shexp``,
GLM-4-MoE's ``exp_probs_b.bias``, its fused ``ffn_gate_up_exps`` and an MTP block), served as
transformers computes them:

- qwen2moe (Q8_0 / Q4_0 / Q5_1 / Q4_1 experts) and qwen3moe (Q4_K / Q5_K / Q6_K experts): logits
  of the decoder loaded from the file equal transformers' own GGUF load of the same file, fp32,
  exactly (the expert sizes are those transformers' GGUF loader assumes: it does not read
  ``expert_feed_forward_length``); a real server on the qwen3moe file: greedy /infer_token and
  OpenAI chat equal transformers' ``generate`` on the file;
- glm4moe (transformers has no GGUF loader for it): every weight equals the decoder loaded from
  the safetensors the file was written from (their values set to the file's), the MTP block left
  out; its logits and greedy continuation those of transformers on that checkpoint;
- ``quantize: w8a16`` straight from the file equals load-then-quantise (experts included, the
  shared expert gate kept exact); ``ggufCompute: native`` keeps the other linears' blocks beside
  the dequantised experts; tensor-parallel ranks hold their experts' slices;
- refusals: Mixtral (``llama`` with experts) named; a stack whose expert count is not the metadata's.
"""
from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from tests.test_gguf import (MESSAGES, PROMPTS, _check_server, _logits, _start, check_tp_slices,  # noqa: E402
                             copy_gguf, greedy, ref_tokenizer, reference)
from tests.tiny_gguf import byte_level_tokenizer, gpt2_vocab, tiny_model, write_gguf  # noqa: E402
from workers.models.gguf_file import open_gguf  # noqa: E402
from workers.models.gguf_paths import GgufError  # noqa: E402
from workers.models.gguf_view import ensure_view  # noqa: E402
from workers.models.loader import load_model  # noqa: E402

pytestmark = pytest.mark.timeout(600)

# case -> (transformers config class, config, write_gguf options). The expert sizes are transformers'
# defaults (Qwen2MoeConfig 1408 / 5632, Qwen3MoeConfig 768), which its GGUF loader assumes.
CASES = {
    "qwen2moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=1408,
                                        shared_expert_intermediate_size=5632),
                 dict(types={"ffn_gate_exps": Q.Q8_0, "ffn_up_exps": Q.Q4_0, "ffn_down_exps": Q.Q5_1,
                             "ffn_gate_shexp": Q.Q4_1, "ffn_gate_inp": Q.F16}, default=Q.Q8_0)),
    "qwen3moe": ("Qwen3MoeConfig", dict(hidden_size=256, intermediate_size=256, num_attention_heads=2,
                                        num_key_value_heads=1, head_dim=128, num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=768, norm_topk_prob=True),
                 dict(types={"ffn_gate_exps": Q.Q4_K, "ffn_up_exps": Q.Q5_K, "ffn_down_exps": Q.Q6_K,
                             "attn_q": Q.Q4_K, "output": Q.Q6_K}, default=Q.Q8_0)),
}
GLM = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=2,
           first_k_dense_replace=1, n_group=4, topk_group=2, num_hidden_layers=3, head_dim=16, attention_bias=True,
           use_qk_norm=True, routed_scaling_factor=2.5, norm_topk_prob=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """transformers' references on one thread (two cores shared with the server under test)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def vocab() -> dict:
    return gpt2_vocab(byte_level_tokenizer())


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf-moe-cache")


@pytest.fixture(scope="module")
def files(tmp_path_factory, vocab) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-moe")
    out = {}
    for case, (cls, config, options) in CASES.items():
        (root / case).mkdir()
        out[case] = write_gguf(root / case / f"{case}.gguf", tiny_model(cls, len(vocab["tokens"]), **config), case,
                               vocab, **options)
    return out


@pytest.fixture(scope="module")
def server(files, cache, tmp_path_factory):
    """A server on the qwen3moe file, started first (it boots while the in-process tests run)."""
    ensure_view(files["qwen3moe"], cache)
    srv = _start(tmp_path_factory.mktemp("moe-server"), files["qwen3moe"], cache, "tiny-qwen3moe")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers_gguf_load(case, files, cache, server) -> None:
    path = files[case]
    g = open_gguf(path)
    kinds = {n.split(".")[2] for n in g.tensors if n.startswith("blk.0.")}
    assert {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_inp"} <= kinds
    assert ({"ffn_gate_shexp", "ffn_gate_inp_shexp"} <= kinds) == (case == "qwen2moe")
    assert set(CASES[case][2]["types"].values()) <= {t.type for t in g.tensors.values()}
    ours, args = load_model(ensure_view(path, cache), torch.float32)
    ref = reference(path)
    assert type(ref).__name__ == f"{CASES[case][0][:-6]}ForCausalLM"
    moe = args.moe
    assert moe is not None and (moe.num_experts, moe.top_k, moe.norm_topk_prob) == (4, 2, case == "qwen3moe")
    assert moe.moe_intermediate_size == ref.config.moe_intermediate_size
    ids = PROMPTS[0] + list(range(40, 60))
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert torch.equal(_logits(ours, ids), expected)


def test_glm4moe_equals_its_checkpoint(tmp_path, vocab, cache) -> None:
    """glm4moe, gate and up fused (``ffn_gate_up_exps``), one MTP block: every parameter equals
    the decoder's load of the safetensors holding the file's values; logits within transformers'
    own 1e-4 (tests/test_glm4_moe.py) and the same greedy continuation."""
    hf = tiny_model("Glm4MoeConfig", len(vocab["tokens"]), **GLM)
    with torch.no_grad():  # a buffer random_model leaves at zero: make the routing bias count
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.rand(8, generator=torch.Generator().manual_seed(3)) - .5)
    path = write_gguf(tmp_path / "glm.gguf", hf, "glm4moe", vocab, mtp=1, fuse_gate_up_exps=True, sync=True,
                      types={"ffn_gate_up_exps": Q.Q8_0, "ffn_down_exps": Q.Q4_0, "attn_q": Q.Q5_0}, default=Q.Q8_0)
    names = open_gguf(path).tensors
    assert "blk.1.ffn_gate_up_exps.weight" in names and "blk.3.nextn.eh_proj.weight" in names
    assert "blk.1.exp_probs_b.bias" in names and "blk.1.ffn_gate_exps.weight" not in names
    hf.save_pretrained(tmp_path / "st")
    ours, args = load_model(ensure_view(path, cache), torch.float32)
    mine, _ = load_model(tmp_path / "st", torch.float32)
    assert args.glm4_moe is not None and args.num_hidden_layers == 3 and args.glm4_moe.num_nextn_predict_layers == 1
    assert args.moe.sparse_layers == (False, True, True) and args.qk_norm and args.attention_bias
    theirs = dict(mine.state_dict())
    for name, t in ours.state_dict().items():
        assert torch.equal(t, theirs[name]), name
    ids = PROMPTS[0] + list(range(40, 60))
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    got = _logits(ours, ids)
    assert (got - want).abs().max() < 1e-4
    seq = list(ids)
    for _ in range(8):
        seq.append(int(_logits(ours, seq)[-1].argmax()))
    assert seq[len(ids):] == greedy(hf, ids, 8)


def test_w8a16_straight_equals_load_then_quantise(files, cache) -> None:
    """Experts quantised per expert after the load, the other linears while read: the int8 values
    of the existing path (load fp32, quantize_model); the shared expert gate kept exact."""
    from workers.backends.int8 import Int8Kernel, Int8Linear, Int8Target, quantize_model
    kernel = Int8Kernel()
    view = ensure_view(files["qwen2moe"], cache)
    ref, _ = load_model(view, torch.float32)
    quantize_model(ref, kernel)
    ours, _ = load_model(view, torch.float32, int8=Int8Target(kernel))
    want = {n: m for n, m in ref.named_modules() if isinstance(m, Int8Linear)}
    got = {n: m for n, m in ours.named_modules() if isinstance(m, Int8Linear)}
    assert ours.int8_at_load and got.keys() == want.keys() and any(".lin13." in n for n in got)
    for n, m in got.items():
        assert torch.equal(m.q, want[n].q) and torch.equal(m.scale, want[n].scale), n
    gate = ours.layers[0].mlp.shared_expert_gate
    assert not isinstance(gate, Int8Linear) and torch.equal(gate.weight, ref.layers[0].mlp.shared_expert_gate.weight)


@pytest.mark.parametrize("case", list(CASES))
def test_native_experts_stay_in_their_blocks(case, files, cache) -> None:
    """``ggufCompute: native``: the attention linears and every expert keep the file's blocks (each
    expert a block linear of its gate and up rows and one of its down rows, the stacked weights
    never filled: the model holds the experts' file bytes, not a dequantised copy); the logits stay
    within the integer products' error of the dequantised model's (tests/test_gguf_kernels.py:
    about 1 % of the spread), and so do the experts' own products."""
    from workers.backends.gguf_linear import GgufLinear, NativeTarget
    from workers.kernels import gguf_kernels as gk
    view = ensure_view(files[case], cache)
    ref, _ = load_model(view, torch.float32)
    ours, _ = load_model(view, torch.float32, gguf_native=NativeTarget(gk.load()))
    assert isinstance(ours.layers[0].self_attn.qkv_proj, GgufLinear)
    g = open_gguf(files[case])
    for n, (a, b) in enumerate(zip(ours.layers, ref.layers)):
        moe = a.mlp
        assert moe.experts_kind == "gguf" and moe.w13.numel() == 0 and moe.w2.numel() == 0
        assert all(isinstance(m, GgufLinear) for m in (*moe.lin13, *moe.lin2)) and len(moe.lin13) == 4
        # the blocks are the file's: as many bytes as its three stacked matrices (the 16-row
        # interleaved layout of the K-quants adds 1.5 %; a dequantised copy would be 3.6-7x)
        stacked = sum(g.tensors[f"blk.{n}.ffn_{k}_exps.weight"].nbytes for k in ("gate", "up", "down"))
        assert stacked <= sum(m.nbytes() for m in (*moe.lin13, *moe.lin2)) <= 1.02 * stacked
        x = torch.randn(5, b.mlp.hidden, generator=torch.Generator().manual_seed(n))
        for e in range(4):
            want = F.linear(x, b.mlp.w13[e])
            got = moe.lin13[e](x)
            assert (got - want).abs().max() < 0.05 * (want.max() - want.min()), (n, e)
    ids = PROMPTS[0] + list(range(40, 60))
    got, want = _logits(ours, ids), _logits(ref, ids)
    assert (got - want).abs().max() < 0.05 * (want.max() - want.min())


@pytest.mark.parametrize("case", list(CASES))
def test_experts_in_one_c_call_equal_the_per_expert_path(case, files, cache) -> None:
    """gguf_kernels.c's ``gguf_moe`` (workers/backends/gguf_experts.py: a layer's routed experts in
    one call) computes what ``experts_forward`` computes over the same GgufLinear experts, bf16
    bit for bit (the same integer products, roundings and per-token order) and fp32 up to the
    SiLU's last bit (which an int8 rounding of the next input can show); a token's result is the same alone and among 1 to 300 others (several passes
    of 128 tokens), in both dtypes; tokens routed elsewhere (ids outside the layer) add nothing."""
    from workers.backends import gguf_experts
    from workers.backends.gguf_linear import NativeTarget
    from workers.kernels import gguf_kernels as gk
    view = ensure_view(files[case], cache)
    for dtype in (torch.bfloat16, torch.float32):
        model, _ = load_model(view, dtype, gguf_native=NativeTarget(gk.load()))
        assert gguf_experts.attach(model) == 2
        moe = model.layers[1].mlp
        fused = moe.fused_experts
        g = torch.Generator().manual_seed(5)
        x = torch.randn(300, moe.hidden, generator=g).to(dtype)
        with torch.no_grad():
            weights, ids = moe.gate(x)
            ids[7, 0] = 99  # another rank's expert: skipped by both
            got = fused(moe, x, weights, ids)
            want = moe.experts_forward(x, weights, ids)
            if dtype == torch.bfloat16:
                assert torch.equal(got, want)
            else:  # fp32: the C SiLU's last bit against torch's moves an int8 rounding of the down
                # projection's input now and then (0.3 % of the values, by up to 1e-3 of the largest)
                assert (got - want).abs().max() <= 2e-3 * want.abs().max()
                assert ((got - want).abs() > 1e-5).float().mean() < 0.02
            for t in (0, 7, 131, 299):
                assert torch.equal(fused(moe, x[t:t + 1], weights[t:t + 1], ids[t:t + 1]), got[t:t + 1]), t
            assert torch.equal(fused(moe, x[:3], weights[:3], ids[:3]), got[:3])
        assert fused.calls == 6


def test_tensor_parallel_ranks_hold_their_experts_slices(files, cache) -> None:
    """Each of two ranks holds its slice of every expert (columns 0..703 / 704..1407 of the
    intermediate, inside the blocks of the stacked tensors) and of the shared expert."""
    check_tp_slices(ensure_view(files["qwen2moe"], cache))


def test_refusals_name_the_architecture_and_tensor(files, tmp_path, cache) -> None:
    with pytest.raises(GgufError, match=r"general\.architecture 'llama' with llama\.expert_count \(Mixtral as "
                                        r"llama\.cpp writes it\) is not served from GGUF yet"):
        ensure_view(copy_gguf(files["qwen2moe"], tmp_path / "mixtral.gguf", arch="llama"), cache)
    down = open_gguf(files["qwen2moe"]).tensors["blk.1.ffn_down_exps.weight"]
    short = copy_gguf(files["qwen2moe"], tmp_path / "short.gguf",
                      tensors={down.name: (np.asarray(down.data)[:-1], down.type)})  # its last expert dropped
    with pytest.raises(GgufError, match=r"tensor blk\.1\.ffn_down_exps\.weight has shape \[3, 64, 1408\]: 3 experts, "
                                        r"the metadata implies 4"):
        ensure_view(short, cache)


def test_server_greedy_equals_transformers(files, server) -> None:
    """A real server on the qwen3moe file (K-quant experts): greedy /infer_token ids and OpenAI
    chat text equal transformers' on the same file (fp32)."""
    server.wait_ready(240)
    path = files["qwen3moe"]
    _check_server(server, "tiny-qwen3moe", reference(path), ref_tokenizer(path), PROMPTS, 12, MESSAGES)
    assert "mixture of experts (qwen3_moe): 4 experts, top-2 renormalised" in server.tail(400)


def test_server_native_experts_decode_greedily(files, cache, tmp_path_factory) -> None:
    """A real server on the qwen3moe file in native GGUF compute (every expert in its blocks, each
    layer's routed experts in one C call: the logs say so): each greedy token it answers is the argmax
    of the in-process native decoder's logits over that prefix, up to a near tie (the server's
    attention kernels and chunked prefill round otherwise than the dense reference attention)."""
    from tests.harness import Server, free_port, short_run_dir, write_config
    from workers.backends.gguf_linear import NativeTarget
    from workers.kernels import gguf_kernels as gk
    path = files["qwen3moe"]
    ensure_view(path, cache)
    tmp = tmp_path_factory.mktemp("moe-native")
    port = free_port()
    cfg = write_config(tmp / "native.json", port=port, run_dir=short_run_dir(), workers=1, model_path=str(path),
                       model={"modelName": "tiny-qwen3moe", "dtype": "float32"})
    srv = Server(cfg, port, env={"MINDIE_CACHE_DIR": str(cache), "MINDIE_CPU_GGUF_COMPUTE": "native"})
    try:
        srv.wait_ready(240)
        tail = srv.tail(400)
        assert "(16 of them the experts of 2 mixture layers)" in tail, tail[-3000:]
        assert "GGUF experts: 2 mixture layers' routed experts in one C call each" in tail, tail[-3000:]
        assert "2 mixture-of-experts layers run their own modules between its calls" in tail, tail[-3000:]
        ours, _ = load_model(ensure_view(path, cache), torch.float32, gguf_native=NativeTarget(gk.load()))
        for prompt in PROMPTS[:2]:
            r = httpx.post(srv.url + "/infer_token", json={"input_id": prompt, "parameters": {
                "max_new_tokens": 10, "ignore_eos": True, "details": True}}, timeout=120)
            assert r.status_code == 200, r.text
            out = r.json()["details"]["generated_token_ids"]
            assert len(out) == 10
            for i, tok in enumerate(out):
                logits = _logits(ours, prompt + out[:i])[-1]
                assert logits[tok] >= logits.max() - 1e-3 * (logits.max() - logits.min()), (prompt, i, tok)
    finally:
        srv.stop()

