"""Tiny GGUF files for the tests, written with the ``gguf`` package the way llama.cpp's converter
(convert_hf_to_gguf.py) writes a Hugging Face model: its metadata keys, its tensor names (the
gguf package's own table), q/k permuted for the llama architecture, 1-D tensors in F32, the
tokenizer as metadata (a byte-level BPE as ``gpt2``, or a SentencePiece-style vocabulary as
``llama``).

Tensor types: those ``gguf.quants`` can write (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) are
quantised from the model's weights. The K-quants (Q4_K, Q5_K, Q6_K) have no Python quantiser:
their tensors are random blocks (random bytes, with the fp16 super-block scales set so that the
values stay small), which the reference (transformers loading the same file) and the server
dequantise alike.
"""
from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import numpy as np
import torch

import gguf
from gguf import GGMLQuantizationType as Q

from tests.tiny_hf import random_model

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
PLAIN_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")
CORPUS = ("The quick brown fox jumps over the lazy dog. Hello, world! What is deep learning? "
          "def main():\n    return 42\n  indented   spaces\tand tabs. Numbers 12345 and 67.89; "
          "über café naïve — 你好世界 こんにちは 🙂🚀 ") * 20
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
HYBRID = ("qwen3next", "qwen35", "qwen35moe")  # Gated DeltaNet files
# Where each K-quant keeps its fp16 super-block scale(s) in a block, and a value that keeps the
# dequantised weights under ~0.1 (ggml's block_q4_K / block_q5_K: d, dmin first; block_q6_K: d last).
_K_SCALES = {Q.Q4_K: ((0, 1e-4), (2, 1e-4)), Q.Q5_K: ((0, 5e-5), (2, 5e-5)), Q.Q6_K: ((208, 2e-5),)}


def byte_level_tokenizer(vocab_size: int = 300):
    """A byte-level BPE (GPT-2 style) trained on ``CORPUS``; ids 0-2 are <|endoftext|>,
    <|im_start|>, <|im_end|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    return tok


def gpt2_vocab(tok) -> dict[str, Any]:
    """The metadata llama.cpp writes for a byte-level BPE tokenizer."""
    import json
    model = json.loads(tok.to_str())["model"]
    vocab = tok.get_vocab()
    tokens = [""] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [gguf.TokenType.CONTROL if t.startswith("<|") and t.endswith("|>") else gguf.TokenType.NORMAL
             for t in tokens]
    return {"model": "gpt2", "pre": "gpt-2", "tokens": tokens, "types": types, "merges": merges, "bos": 1, "eos": 2,
            "pad": 0, "unk": None, "add_bos": False, "template": CHATML}


def spm_vocab() -> dict[str, Any]:
    """A SentencePiece-style vocabulary (``llama`` tokenizer: <unk> <s> </s>, 256 byte tokens,
    pieces with scores, no merges: transformers derives them), as Llama 2 and Mistral files have."""
    pieces = ["\u2581"] + list(string.ascii_lowercase + string.ascii_uppercase + string.digits + ".,!?'():;-")
    merged = ["\u2581t", "he", "\u2581th", "\u2581the", "in", "er", "an", "\u2581a", "\u2581w", "or", "en", "on", "re",
              "at", "\u2581s", "\u2581o", "ou", "it", "is", "\u2581i", "\u2581is", "ing", "\u2581in", "ll", "\u2581h",
              "\u2581he", "\u2581hel", "lo", "\u2581hello", "\u2581d", "ee", "\u2581de", "\u2581dee", "\u2581deep"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + pieces + merged
    scores = [0.0] * 259 + [-1000.0 - i for i in range(len(pieces))] + [-float(i) for i in range(len(merged))]
    types = ([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
             + [gguf.TokenType.NORMAL] * (len(pieces) + len(merged)))
    return {"model": "llama", "pre": "default", "tokens": tokens, "types": types, "scores": scores, "bos": 1, "eos": 2,
            "pad": None, "unk": 0, "add_bos": True, "template": PLAIN_TEMPLATE}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: Hugging Face's rope row order -> llama.cpp's."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_k_blocks(qtype: Q, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random blocks for a matrix (or a stack of them: experts) of ``shape``, as bytes per row."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block, size), dtype=np.uint8)
    for offset, value in _K_SCALES[qtype]:
        raw[..., offset:offset + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
    return raw.reshape(*shape[:-1], -1)


def _llama3_factors(dim: int, theta: float, rope: dict[str, Any]) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` of a Llama 3.1 rope scaling (convert_hf_to_gguf.py,
    ``LlamaModel.generate_extra_tensors``): one divisor per rotary frequency."""
    import math
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def _variant_metadata(w: gguf.GGUFWriter, cfg: Any, arch: str, head_dim: int) -> None:
    """What convert_hf_to_gguf.py's Phi3MiniModel / Glm4Model add: the rotary dims; Phi-3's sliding
    window (0: none), original context length, and LongRoPE's attention factor and factor tensors."""
    import math
    rope = dict(cfg.rope_parameters or {})
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.5 if arch == "glm4" else 1.0)))
    if arch != "phi3":
        return
    w.add_sliding_window(cfg.sliding_window or 0)
    orig = cfg.original_max_position_embeddings
    w.add_rope_scaling_orig_ctx_len(orig)
    if rope.get("long_factor"):
        scale = cfg.max_position_embeddings / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))


def _moe_metadata(w: gguf.GGUFWriter, cfg: Any, arch: str, head_dim: int, mtp: int) -> None:
    """What convert_hf_to_gguf.py's Qwen2MoeModel / Qwen3MoeModel / Glm4MoeModel add."""
    w.add_expert_count(next(getattr(cfg, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                            if getattr(cfg, k, None)))
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch != "glm4moe":
        return
    w.add_rope_dimension_count(int(head_dim * dict(cfg.rope_parameters or {}).get("partial_rotary_factor", 0.5)))
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_weights_norm(cfg.norm_topk_prob)
    if mtp:
        w.add_nextn_predict_layers(mtp)


def _moe_tensors(hf: str, data: np.ndarray, names: Any, fuse: bool) -> list[tuple[str, np.ndarray]]:
    """(llama.cpp name, values) of one tensor of a transformers MoE model: the fused
    ``experts.gate_up_proj`` [E, 2I, H] as ``ffn_gate_exps`` and ``ffn_up_exps`` (``fuse``:
    ``ffn_gate_up_exps``, the converter's --fuse-gate-up-exps), ``experts.down_proj`` as
    ``ffn_down_exps``, the [1, H] shared expert gate squeezed, the correction bias as
    ``exp_probs_b.bias``; [] for any other tensor."""
    if hf.endswith(".experts.gate_up_proj"):
        bid = hf.split(".")[2]
        if fuse:
            return [(f"blk.{bid}.ffn_gate_up_exps.weight", data)]
        inter = data.shape[1] // 2
        base = hf.removesuffix("gate_up_proj")
        return [(f"{names.get_name(base + 'gate_proj')}.weight", data[:, :inter]),
                (f"{names.get_name(base + 'up_proj')}.weight", data[:, inter:])]
    if hf.endswith(".experts.down_proj"):
        return [(f"{names.get_name(hf)}.weight", data)]
    if hf.endswith(".shared_expert_gate.weight"):
        return [(f"{names.get_name(hf.removesuffix('.weight'))}.weight", data.reshape(-1))]
    if hf.endswith(".e_score_correction_bias"):
        return [(f"{names.get_name(hf.removesuffix('_bias'))}.bias", data)]
    return []


def _hybrid_metadata(w: gguf.GGUFWriter, cfg: Any, head_dim: int, mtp: int) -> None:
    """What convert_hf_to_gguf.py's Qwen3NextModel adds (with Qwen2MoeModel's expert keys)."""
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    w.add_full_attention_interval(getattr(cfg, "full_attention_interval", 4))
    w.add_rope_dimension_count(int(head_dim * dict(cfg.rope_parameters or {}).get("partial_rotary_factor", 0.25)))
    if mtp:
        w.add_nextn_predict_layers(mtp)


def _v_reorder(hf: str, cfg: Any) -> tuple[int, np.ndarray] | None:
    """(axis, index) of the value-head reorder Qwen3.5's converter applies to the tensor ``hf``
    (``_LinearAttentionVReorderBase``: grouped by key head -> tiled; the file's entry i along the
    axis is the checkpoint's ``index[i]``); None for a tensor it keeps."""
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    name = hf.partition(".linear_attn.")[2]
    if not name or nk == nv:
        return None

    def tiled(n_heads_dim: int, base: int = 0) -> np.ndarray:  # _reorder_v_heads on an arange
        d = n_heads_dim // nv
        return base + np.arange(n_heads_dim).reshape(nk, nv // nk, d).transpose(1, 0, 2).reshape(-1)

    qk, value = 2 * nk * cfg.linear_key_head_dim, nv * cfg.linear_value_head_dim
    if name in ("in_proj_qkv.weight", "conv1d.weight"):  # only the v rows (channels)
        return 0, np.concatenate([np.arange(qk), tiled(value, qk)])
    if name == "in_proj_z.weight":
        return 0, tiled(value)
    if name in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
        return 0, tiled(nv)
    if name == "out_proj.weight":
        return 1, tiled(value)
    return None


def _hybrid_tensors(hf: str, data: np.ndarray, names: Any, cfg: Any) -> list[tuple[str, np.ndarray]]:
    """(llama.cpp name, values) of a Qwen3-Next tensor as Qwen3NextModel.modify_tensors rewrites it:
    in_proj_qkvz split into attn_qkv (q, k, v of every key head in turn) and attn_gate (z),
    A_log as -exp(A_log), dt_bias as ssm_dt.bias, conv1d squeezed, the (1 + w) norms stored as
    1 + w; [] for a tensor it keeps."""
    layer = hf.split(".")[2] if hf.startswith("model.layers.") else ""
    name = hf.partition(".linear_attn.")[2]
    if name == "in_proj_qkvz.weight":
        nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        rv = cfg.linear_num_value_heads // nk * cfg.linear_value_head_dim
        heads = data.T.reshape(cfg.hidden_size, nk, 2 * dk + 2 * rv)
        q, k, v, z = np.split(heads, [dk, 2 * dk, 2 * dk + rv], axis=-1)
        flat = [x.reshape(cfg.hidden_size, -1) for x in (q, k, v, z)]
        return [(f"blk.{layer}.attn_qkv.weight", np.ascontiguousarray(np.concatenate(flat[:3], -1).T)),
                (f"blk.{layer}.attn_gate.weight", np.ascontiguousarray(flat[3].T))]
    if name == "A_log":
        return [(f"blk.{layer}.ssm_a", -np.exp(data))]
    if name == "dt_bias":
        return [(f"blk.{layer}.ssm_dt.bias", data)]
    if name == "conv1d.weight":
        return [(f"blk.{layer}.ssm_conv1d.weight", data.squeeze(1))]
    if hf.endswith("norm.weight") and name != "norm.weight":
        return [(f"{names.get_name(hf.removesuffix('.weight'))}.weight", data + 1)]
    return []


def write_gguf(path: Path, model: torch.nn.Module, arch: str, vocab: dict[str, Any], *, name: str = "tiny",
               types: dict[str, Q] | None = None, default: Q = Q.F32, seed: int = 0, mtp: int = 0,
               fuse_gate_up_exps: bool = False, sync: bool = False) -> Path:
    """``model`` (a transformers causal LM) as a GGUF file of architecture ``arch`` (llama, qwen2,
    qwen3, phi3, glm4, qwen2moe, qwen3moe, glm4moe, qwen3next, qwen35, qwen35moe; Mistral: "llama" with a name saying mistral,
    as llama.cpp writes it). ``types``: the type of each 2-D or stacked tensor by its llama.cpp
    kind ("token_embd", "output", "attn_q", "ffn_gate_exps", ...), else ``default``. ``mtp``:
    that many extra multi-token-prediction blocks (GLM-4-MoE, the hybrid Qwens; a few of their tensors, random).
    ``sync``: the model's parameters are set to what the file holds (its dequantised values), so
    that transformers on the model computes what the file says (for architectures transformers'
    GGUF loader does not read)."""
    cfg = model.config
    types = types or {}
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(cfg.num_hidden_layers + mtp)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    theta = float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"])
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch == "llama":
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(head_dim)
    if arch in ("phi3", "glm4"):
        _variant_metadata(w, cfg, arch, head_dim)
    if arch in ("qwen2moe", "qwen3moe", "glm4moe", "qwen3next", "qwen35moe"):
        _moe_metadata(w, cfg, "qwen2moe" if arch in HYBRID else arch, head_dim, mtp)
    if arch in HYBRID:
        _hybrid_metadata(w, cfg, head_dim, mtp)
    if arch in ("qwen35", "qwen35moe"):  # _Qwen35MRopeMixin; add_recurrent_layers from layer_types
        w.add_rope_dimension_sections([11, 11, 10, 0])
        w.add_array(f"{arch}.attention.recurrent_layers",
                    [t == "linear_attention" for t in cfg.layer_types] + [False] * mtp)
    if head_dim != cfg.hidden_size // cfg.num_attention_heads or arch in ("qwen3", "qwen3moe", "qwen35", "qwen35moe"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model(vocab["model"])
    w.add_tokenizer_pre(vocab["pre"])
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    if "scores" in vocab:
        w.add_token_scores(vocab["scores"])
    if "merges" in vocab:
        w.add_token_merges(vocab["merges"])
    w.add_bos_token_id(vocab["bos"])
    w.add_eos_token_id(vocab["eos"])
    if vocab.get("unk") is not None:
        w.add_unk_token_id(vocab["unk"])
    if vocab.get("pad") is not None:
        w.add_pad_token_id(vocab["pad"])
    w.add_add_bos_token(vocab["add_bos"])
    w.add_chat_template(vocab["template"])

    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_factors(head_dim, theta, rope))

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers + mtp)
    state = model.state_dict()
    tensors: list[tuple[str, str, np.ndarray]] = []  # (HF name, llama.cpp name, values)
    unorder: dict[str, tuple[int, np.ndarray]] = {}  # llama.cpp name -> the value-head reorder it holds
    for hf, t in state.items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = t.detach().float().numpy()
        moe = _moe_tensors(hf, data, names, fuse_gate_up_exps)
        if moe:
            tensors += [(hf, gname, part) for gname, part in moe]
            continue
        order = _v_reorder(hf, cfg) if arch in ("qwen35", "qwen35moe") else None
        if order is not None:
            data = np.take(data, order[1], axis=order[0])
        rewritten = _hybrid_tensors(hf, data, names, cfg) if arch in HYBRID else []
        if rewritten:  # values or row order rewritten: not synced back (the test rounds them itself)
            tensors += [("", gname, part) for gname, part in rewritten]
            continue
        base, _, suffix = hf.rpartition(".")
        gname = f"{names.get_name(base)}.{suffix}"
        if order is not None:
            unorder[gname] = order
        if arch == "llama" and (".attn_q." in gname or ".attn_k." in gname):
            data = _permute(data, cfg.num_attention_heads if ".attn_q." in gname else cfg.num_key_value_heads)
        tensors.append((hf, gname, data))
    for i in range(cfg.num_hidden_layers, cfg.num_hidden_layers + mtp):  # what llama.cpp's nextn blocks hold
        h = cfg.hidden_size
        tensors += [("", f"blk.{i}.nextn.eh_proj.weight", rng.normal(0, 0.08, (h, 2 * h)).astype(np.float32)),
                    ("", f"blk.{i}.nextn.enorm.weight", np.ones(h, np.float32)),
                    ("", f"blk.{i}.attn_norm.weight", np.ones(h, np.float32))]
    stored: dict[str, list[np.ndarray]] = {}
    for hf, gname, data in tensors:
        kind = gname.split(".")[-2] if gname.startswith("blk.") else gname.split(".")[0]
        qtype = types.get(kind, default) if data.ndim >= 2 else Q.F32
        if qtype == Q.F32:
            raw = np.ascontiguousarray(data, dtype=np.float32)
            w.add_tensor(gname, raw)
        elif qtype == Q.F16:
            raw = data.astype(np.float16)
            w.add_tensor(gname, raw)
        elif qtype in K_QUANTS:
            raw = _random_k_blocks(qtype, data.shape, rng)
            w.add_tensor(gname, raw, raw_dtype=qtype)
        else:
            raw = gguf.quants.quantize(np.ascontiguousarray(data), qtype)
            w.add_tensor(gname, raw, raw_dtype=qtype)
        if sync and hf:
            values = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32)
            if gname in unorder:  # back in the checkpoint's head order
                axis, idx = unorder[gname]
                values = np.take(values, np.argsort(idx), axis=axis)
            stored.setdefault(hf, []).append(values)
    if sync:
        _sync(model, state, stored, arch)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _sync(model: torch.nn.Module, state: dict, stored: dict[str, list[np.ndarray]], arch: str) -> None:
    """Set ``model``'s tensors to the file's dequantised values (the writer's pieces put back)."""
    assert arch != "llama", "q/k would need their rope order undone"
    with torch.no_grad():
        for hf, pieces in stored.items():
            t = state[hf]
            values = np.concatenate(pieces, axis=1) if hf.endswith(".experts.gate_up_proj") else pieces[0]
            t.copy_(torch.from_numpy(values.reshape(t.shape)))


def tiny_model(cls_name: str, vocab_size: int, **config: Any) -> torch.nn.Module:
    """A seeded random transformers model (norms and biases randomised too: mapping mistakes show)."""
    base = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                eos_token_id=2)
    return random_model(cls_name, {**base, **config})
