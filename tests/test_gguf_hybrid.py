"""GGUF Qwen3-Next and Qwen3.5 (issue 53, item 5): llama.cpp's ``qwen3next`` file, written here as
convert_hf_to_gguf.py's Qwen3NextModel writes it (tests/tiny_gguf.py: ``in_proj_qkvz`` split into
``attn_qkv`` / ``attn_gate``, ``ssm_a`` = -exp(A_log), ``ssm_dt.bias``, the squeezed
``ssm_conv1d``, the (1 + w) norms stored as 1 + w, Qwen2-MoE's stacked experts, an MTP block), against
transformers on the safetensors it was written from (transformers has no GGUF loader for it):

- every weight of the decoder loaded from the file equals the decoder's load of the checkpoint
  (Q8_0 / Q5_1 / Q4_0 tensors: the checkpoint holds their values), A_log and the norms to the
  float rounding of llama.cpp's rewrite and its inverse (within 2e-7);
- logits over the paged cache and the state pool (a prompt in two chunks, then decodes) within
  transformers' 1e-4 (tests/test_hybrid.py), and transformers' greedy continuation;
- ``ggufCompute: native``: the layers read whole keep their blocks, ``in_proj_qkvz`` (pieces of
  two tensors) is dequantised;
- Qwen3.5's files (``qwen35``, ``qwen35moe``: Qwen3_5TextModel / Qwen3_5MoeTextModel) with the
  value heads reordered (grouped by key head -> tiled; 2 key heads, 6 value heads: the reorder is
  not its own inverse) across ``attn_qkv``, the convolution, ``attn_gate``, ``ssm_beta`` /
  ``ssm_alpha``, ``ssm_a`` / ``ssm_dt.bias`` and the columns of ``ssm_out`` (Q8_0 over 16-wide
  heads: the blocks straddle heads), layer types from ``attention.recurrent_layers``: the same
  weight equality, logits and greedy, and the same load without the inverse (``v_order`` as
  stored) differs from the checkpoint.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from tests.test_hybrid import _paged_logits, hf_greedy  # noqa: E402
from tests.tiny_gguf import byte_level_tokenizer, gpt2_vocab, tiny_model, write_gguf  # noqa: E402
from workers.models.gguf_file import open_gguf  # noqa: E402
from workers.models.gguf_view import ensure_view  # noqa: E402
from workers.models.loader import load_model  # noqa: E402

pytestmark = pytest.mark.timeout(600)

CONFIG = dict(num_hidden_layers=4, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=32,
              linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)
TYPES = {"attn_qkv": Q.Q8_0, "attn_gate": Q.Q8_0, "ssm_ba": Q.Q8_0, "ssm_out": Q.Q4_0, "attn_q": Q.Q8_0,
         "ffn_gate_exps": Q.Q8_0, "ffn_up_exps": Q.Q5_1, "ffn_down_exps": Q.Q8_0, "token_embd": Q.Q8_0}
REWRITTEN = ("A_log", "norm.weight")  # the values llama.cpp's converter rewrites (not linear_attn.norm)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(transformers model holding the file's values, the GGUF file, its safetensors folder)."""
    root = tmp_path_factory.mktemp("gguf-hybrid")
    vocab = gpt2_vocab(byte_level_tokenizer())
    hf = tiny_model("Qwen3NextConfig", len(vocab["tokens"]), **CONFIG)
    with torch.no_grad():  # in_proj_qkvz rounded to Q8_0 (the converter only reorders its rows: the file holds these)
        for layer in hf.model.layers:
            if getattr(layer, "linear_attn", None) is not None:
                w = layer.linear_attn.in_proj_qkvz.weight
                w.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), Q.Q8_0), Q.Q8_0)))
    path = write_gguf(root / "qwen3next.gguf", hf, "qwen3next", vocab, sync=True, types=TYPES, mtp=1)
    hf.save_pretrained(root / "st")
    return hf, path, root / "st"


def test_weights_equal_the_checkpoints(written, tmp_path) -> None:
    hf, path, st = written
    names = open_gguf(path).tensors
    assert {"blk.0.attn_qkv.weight", "blk.0.attn_gate.weight", "blk.0.ssm_a", "blk.0.ssm_dt.bias",
            "blk.0.ssm_conv1d.weight", "blk.0.ffn_gate_exps.weight", "blk.3.attn_q.weight",
            "blk.4.nextn.eh_proj.weight"} <= names.keys()  # blk.4: the MTP block (not loaded)
    assert names["blk.0.ssm_conv1d.weight"].shape == (2 * 2 * 32 + 4 * 32, 4)
    _, rewritten = _check_weights(path, st, tmp_path, "qkvz")
    assert len(rewritten) == 3 + 4 * 2 + 2 + 1  # A_log x3, two norms a layer, q/k norms, the final norm


def _check_weights(path: Path, st: Path, tmp_path: Path, layout: str) -> tuple[dict, list[str]]:
    """Every weight loaded from the file against the decoder's load of the checkpoint ``st``:
    equal, or (the values llama.cpp rewrites) within their fp32 round trip; (the checkpoint's
    state, the rewritten names)."""
    ours, args = load_model(ensure_view(path, tmp_path / "cache"), torch.float32)
    mine, ref_args = load_model(st, torch.float32)
    assert args.hybrid == ref_args.hybrid and args.moe == ref_args.moe and args.hybrid.layout == layout
    assert args.arch == ref_args.arch and args.num_hidden_layers == 4
    theirs = dict(mine.state_dict())
    rewritten = []
    for name, t in ours.state_dict().items():
        if name.endswith(REWRITTEN) and not name.endswith("linear_attn.norm.weight"):
            assert (t - theirs[name]).abs().max() <= 2e-7, name
            rewritten.append(name)
        else:
            assert torch.equal(t, theirs[name]), name
    return theirs, rewritten


def test_logits_and_greedy_equal_transformers(written, tmp_path) -> None:
    _check_logits_and_greedy(*written[:2], tmp_path)


def _check_logits_and_greedy(hf, path: Path, tmp_path: Path) -> None:
    """The file's model against transformers on the checkpoint: logits over the paged cache and the
    state pool (a prompt in two chunks, then decodes) within 1e-4, and the greedy continuation."""
    model, _ = load_model(ensure_view(path, tmp_path / "cache"), torch.float32)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 300, (n,), generator=g) for n in (60, 24)]
    with torch.no_grad():
        refs = [hf(s[None]).logits[0] for s in seqs]
    for out, ref in zip(_paged_logits(model, seqs, [[40, 12], [24]]), refs):
        assert (out - ref).abs().max().item() <= 1e-4
    prompt = seqs[1].tolist()
    seq = list(prompt)
    for _ in range(8):  # greedy, the whole sequence through the pool each step
        seq.append(int(_paged_logits(model, [torch.tensor(seq)], [[len(seq)]])[0][-1].argmax()))
    assert seq[len(prompt):] == hf_greedy(hf, prompt, 8)


def test_native_blocks_in_the_hybrid_layers(written, tmp_path) -> None:
    """``ggufCompute: native`` (the default on a CPU without native bf16): the linears read whole
    keep their blocks (``in_proj_ba``, ``out_proj``, attention, every expert), ``in_proj_qkvz``
    (pieces of two tensors) is dequantised. Each block linear computes its dequantised weights' product to the
    int8 activations' error (tests/test_gguf_kernels.py); the logits stay near, an expert choice
    flipped by that error moving a position further (the median position is compared)."""
    from workers.backends.gguf_linear import GgufLinear, NativeTarget
    from workers.kernels import gguf_kernels as gk
    _, path, _ = written
    view = ensure_view(path, tmp_path / "cache")
    ref, _ = load_model(view, torch.float32)
    ours, _ = load_model(view, torch.float32, gguf_native=NativeTarget(gk.load()))
    la = ours.layers[0].linear_attn
    assert isinstance(la.in_proj_ba, GgufLinear) and isinstance(la.out_proj, GgufLinear)
    assert not isinstance(la.in_proj_qkvz, GgufLinear)
    assert torch.equal(la.in_proj_qkvz.weight, ref.layers[0].linear_attn.in_proj_qkvz.weight)
    native = [(n, m) for n, m in ours.named_modules() if isinstance(m, GgufLinear)]
    assert len(native) >= 6  # in_proj_ba and out_proj (Q8_0, Q4_0) of each Gated DeltaNet layer
    experts = [n for n, _ in native if ".lin13." in n or ".lin2." in n]
    assert experts and all(getattr(ours.get_submodule(n.rsplit(".", 2)[0]), "experts_kind", "") == "gguf"
                           for n in experts)  # every expert in its blocks too, against the stacked weights
    for name, m in native:
        if name in experts:
            parent, kind, e = name.rsplit(".", 2)
            weight, bias = getattr(ref.get_submodule(parent), "w13" if kind == "lin13" else "w2")[int(e)], None
        else:
            r = ref.get_submodule(name)
            weight, bias = r.weight, r.bias
        x = torch.randn(5, weight.shape[1], generator=torch.Generator().manual_seed(3))
        want = torch.nn.functional.linear(x, weight, bias)
        assert (m(x) - want).abs().max() < 0.02 * want.abs().max(), name
    seq = [torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(2))]
    got, want = _paged_logits(ours, seq, [[40]])[0], _paged_logits(ref, seq, [[40]])[0]
    assert (got - want).abs().amax(1).median() < 0.05 * (want.max() - want.min())


# layer types off full_attention_interval's pattern: read from attention.recurrent_layers
QWEN35 = dict(num_hidden_layers=4, layer_types=["linear_attention", "linear_attention", "full_attention",
                                                "linear_attention"], head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=6)
QWEN35_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)
QWEN35_TYPES = {"attn_qkv": Q.Q8_0, "attn_gate": Q.Q8_0, "ssm_beta": Q.Q8_0, "ssm_alpha": Q.Q5_1,
                "ssm_out": Q.Q8_0, "attn_q": Q.Q8_0, "ffn_gate": Q.Q4_0, "ffn_gate_exps": Q.Q8_0,
                "ffn_up_exps": Q.Q5_1, "ffn_down_exps": Q.Q8_0, "token_embd": Q.Q8_0}
REORDERED = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_a.weight", "in_proj_b.weight", "conv_weight",
             "A_log", "dt_bias", "out_proj.weight")


@pytest.fixture(scope="module", params=[("qwen35", "Qwen3_5TextConfig", {}),
                                        ("qwen35moe", "Qwen3_5MoeTextConfig", QWEN35_MOE)], ids=lambda p: p[0])
def written35(request, tmp_path_factory):
    """(transformers model holding the file's values, the GGUF file, its safetensors folder) of a
    Qwen3.5 checkpoint written as llama.cpp's converter writes it."""
    arch, cls, extra = request.param
    root = tmp_path_factory.mktemp(arch)
    vocab = gpt2_vocab(byte_level_tokenizer())
    hf = tiny_model(cls, len(vocab["tokens"]), **QWEN35, **extra)
    path = write_gguf(root / f"{arch}.gguf", hf, arch, vocab, sync=True, types=QWEN35_TYPES, mtp=1)
    hf.save_pretrained(root / "st")
    return hf, path, root / "st"


def test_qwen35_weights_equal_the_checkpoints(written35, tmp_path, monkeypatch) -> None:
    _, path, st = written35
    g = open_gguf(path)
    assert {"blk.0.attn_qkv.weight", "blk.0.attn_gate.weight", "blk.0.ssm_beta.weight", "blk.0.ssm_alpha.weight",
            "blk.0.ssm_out.weight", "blk.2.attn_q.weight", "blk.3.ssm_out.weight",
            "blk.4.nextn.eh_proj.weight"} <= g.tensors.keys()
    theirs, rewritten = _check_weights(path, st, tmp_path, "split")
    assert len(rewritten) == 3 + 4 * 2 + 2 + 1
    assert sum(name.endswith(REORDERED) for name in theirs) == 3 * len(REORDERED)
    # the same file read without the inverse reorder: every reordered tensor differs
    monkeypatch.setattr("workers.models.gguf_loader.v_order", lambda g, name: (None, None))
    raw, _ = load_model(ensure_view(path, tmp_path / "cache"), torch.float32)
    for name, t in raw.state_dict().items():
        if name.endswith(REORDERED):
            assert (t - theirs[name]).abs().max() > 1e-3, name


def test_qwen35_logits_and_greedy_equal_transformers(written35, tmp_path) -> None:
    _check_logits_and_greedy(*written35[:2], tmp_path)



def test_qwen35_native_keeps_only_unpermuted_blocks(written35, tmp_path) -> None:
    """``ggufCompute: native``: a tensor whose rows or columns the converter permuted (every Gated
    DeltaNet projection here) is dequantised and put back in order; the attention keeps its blocks."""
    from workers.backends.gguf_linear import GgufLinear, NativeTarget
    from workers.kernels import gguf_kernels as gk
    _, path, _ = written35
    view = ensure_view(path, tmp_path / "cache")
    ref, _ = load_model(view, torch.float32)
    ours, _ = load_model(view, torch.float32, gguf_native=NativeTarget(gk.load()))
    la = ours.layers[0].linear_attn
    for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
        lin = getattr(la, name)
        assert not isinstance(lin, GgufLinear), name
        assert torch.equal(lin.weight, getattr(ref.layers[0].linear_attn, name).weight), name
    assert isinstance(ours.layers[2].self_attn.q_proj, GgufLinear)


def test_qwen35_w8a16_straight_equals_load_then_quantise(written35, tmp_path) -> None:
    """``quantize: w8a16`` read straight to int8: the reordered projections' int8 rows and scales
    are those of the fp32 load (in order) quantised afterwards."""
    from workers.backends.int8 import Int8Kernel, Int8Linear, Int8Target, quantize_model
    kernel = Int8Kernel()
    view = ensure_view(written35[1], tmp_path / "cache")
    ref, _ = load_model(view, torch.float32)
    quantize_model(ref, kernel)
    ours, _ = load_model(view, torch.float32, int8=Int8Target(kernel))
    want = {n: m for n, m in ref.named_modules() if isinstance(m, Int8Linear)}
    got = {n: m for n, m in ours.named_modules() if isinstance(m, Int8Linear)}
    assert got.keys() == want.keys() and "layers.0.linear_attn.out_proj" in got
    for n, m in got.items():
        assert torch.equal(m.q, want[n].q) and torch.equal(m.scale, want[n].scale), n
