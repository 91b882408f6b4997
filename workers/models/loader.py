"""Load a Hugging Face Llama-family checkpoint (`config.json` + `*.safetensors`) into DecoderLM.

Which tensors a checkpoint must hold, and their checks, are workers/models/checkpoint.py's (shared
with the launch step, which refuses a checkpoint before any worker starts); this module maps each
of them into the model and reads it. A GGUF model view (workers/models/gguf_view.py) is read the
same way, its tensors from the GGUF file (workers/models/gguf_loader.py)."""

from __future__ import annotations

import math
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
from safetensors import safe_open

from .checkpoint import ModelLoadError, check_checkpoint, expected_tensors, safetensors_files
from .config import ModelArgs, ModelConfigError
from .gguf_paths import GgufError
from . import deepseek, gemma, gemma4, glm4_moe, gpt_oss, qwen3_next, variant
from .llama import DecoderLM
from .moe import SparseMoE, slots as moe_slots
from .moe_names import NAMES as MOE_NAMES
from .sharding import WORLD_SIZE_KEY, Shard, TensorParallel
from .w8a8 import load_int8_linears

if TYPE_CHECKING:  # gguf_loader imports gguf and numpy: only a GGUF model's load pays for them
    from .gguf_loader import GgufTarget, Int8Target

__all__ = ["load_model", "ModelConfigError", "ModelLoadError", "parameter_bytes", "safetensors_files"]

log = logging.getLogger("workers.models")


class Slot(NamedTuple):
    """Where one checkpoint tensor goes: rows ``start .. start + rows`` of ``param`` receive the
    checkpoint's slice ``src_start .. src_start + rows`` along ``dim`` (None: the whole tensor).
    ``zero``: not read, the rows are zeroed (a row-parallel bias off rank 0: the all-reduce must
    add it once)."""

    param: torch.Tensor
    start: int
    rows: int
    dim: int | None = None
    src_start: int = 0
    zero: bool = False


def _param_slots(model: DecoderLM, shard: Shard | None = None) -> dict[str, Slot]:
    """HF tensor name -> its Slot, for every name of ``checkpoint.expected_tensors`` (checked by
    ``load_model``).

    Fused projections take several HF tensors: q/k/v go into row ranges of qkv_proj, gate/up into
    gate_up_proj. Every row of every model parameter is covered by exactly one entry. With a
    tensor-parallel ``shard`` each entry takes only this rank's slice (workers/models/sharding.py).
    """
    a = model.args
    if a.deepseek is not None:  # MLA and DeepSeek's experts: workers/models/deepseek.py
        return deepseek.param_slots(model, Slot, shard)
    if a.hybrid is not None:  # Gated DeltaNet and gated attention layers: workers/models/qwen3_next.py
        return qwen3_next.param_slots(model, Slot, shard)
    if a.gemma4 is not None:  # per-layer geometries, KV sharing, per-layer inputs: workers/models/gemma4.py
        return gemma4.param_slots(model, Slot)
    d, hid = a.head_dim, a.hidden_size
    slots: dict[str, Slot] = {}

    def whole(name: str, p: torch.Tensor) -> None:
        slots[name] = Slot(p, 0, p.shape[0])

    def column(lin: torch.nn.Module, parts: list[tuple[str, int, int, int]]) -> None:
        """Output rows: (HF name, first row here, rows, first row in the checkpoint)."""
        for proj, start, n, src in parts:
            slots[f"{proj}.weight"] = Slot(lin.weight, start, n, 0 if shard else None, src)
            if lin.bias is not None:
                slots[f"{proj}.bias"] = Slot(lin.bias, start, n, 0 if shard else None, src)

    def row(name: str, lin: torch.nn.Module) -> None:
        """Input columns split across ranks (o, down); the bias is rank 0's."""
        n_in = lin.weight.shape[1]
        slots[f"{name}.weight"] = Slot(lin.weight, 0, hid, 1 if shard else None, shard.rank * n_in if shard else 0)
        if lin.bias is not None:
            slots[f"{name}.bias"] = Slot(lin.bias, 0, hid, zero=bool(shard and shard.rank))

    def vocab(name: str, p: torch.Tensor) -> None:
        if shard is None:
            whole(name, p)
        else:  # the padding rows past the vocabulary stay zero (zeroed before loading)
            slots[name] = Slot(p, 0, shard.vocab_rows, 0, shard.vocab0)

    vocab("model.embed_tokens.weight", model.embed_tokens.weight)
    whole("model.norm.weight", model.norm.weight)
    if a.num_labels:  # a sequence-classification head (one device: no shard)
        whole("score.weight", model.lm_head.weight)
    elif model.lm_head is not None:
        vocab("lm_head.weight", model.lm_head.weight)
    heads = shard.heads if shard else a.num_attention_heads
    kvh = shard.kv_heads if shard else a.num_key_value_heads
    q0 = shard.head0 * d if shard else 0
    kv0 = shard.kv_head0 * d if shard else 0
    inter = shard.inter if shard else a.intermediate_size
    i0 = shard.rank * inter if shard else 0
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        att = layer.self_attn
        q, kv = heads * d, kvh * d
        column(att.qkv_proj, [(f"{pre}self_attn.q_proj", 0, q, q0),
                              (f"{pre}self_attn.k_proj", q, kv, kv0),
                              (f"{pre}self_attn.v_proj", q + kv, kv, kv0)])
        row(f"{pre}self_attn.o_proj", att.o_proj)
        if att.q_norm is not None and att.k_norm is not None:
            whole(f"{pre}self_attn.q_norm.weight", att.q_norm.weight)
            whole(f"{pre}self_attn.k_norm.weight", att.k_norm.weight)
        if a.gpt_oss is not None:  # router, experts and sinks (workers/models/gpt_oss.py)
            slots.update(gpt_oss.layer_slots(layer, pre, Slot))
        elif isinstance(layer.mlp, SparseMoE):  # routed experts, router, shared expert (workers/models/moe.py)
            assert a.moe is not None
            slots.update(moe_slots(layer.mlp, pre, MOE_NAMES[a.moe.names], Slot, shard is not None))
        else:
            column(layer.mlp.gate_up_proj, [(f"{pre}mlp.gate_proj", 0, inter, i0),
                                            (f"{pre}mlp.up_proj", inter, inter, i0)])
            row(f"{pre}mlp.down_proj", layer.mlp.down_proj)
        whole(f"{pre}input_layernorm.weight", layer.input_layernorm.weight)
        whole(f"{pre}post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
    if a.variant is not None:  # fused checkpoint tensors, GLM-4's extra norms (workers/models/variant.py)
        return variant.param_slots(model, slots, Slot, shard)
    if a.gemma is not None:  # the norms around Gemma's feed-forward
        slots.update(gemma.norm_slots(model, Slot))
    if a.glm4_moe is not None:  # its routers' correction biases (workers/models/glm4_moe.py)
        slots.update(glm4_moe.router_slots(model, Slot))
    return slots


def _read(f, name: str, slot: Slot) -> torch.Tensor:
    """The part of checkpoint tensor ``name`` that ``slot`` takes (only that part is read)."""
    sl = f.get_slice(name)
    if slot.dim is None:
        return sl[:]
    a = slot.src_start
    if slot.dim == 0:
        return sl[a:a + slot.rows]
    return sl[:, a:a + slot.param.shape[1]]  # a row-parallel weight: this rank's input columns


def load_model(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    *,
    max_positions: int | None = None,
    args: ModelArgs | None = None,
    tp: TensorParallel | None = None,
    int8: Int8Target | None = None,
    gguf_native: GgufTarget | None = None,
    w8a8: GgufTarget | None = None,
) -> tuple[DecoderLM, ModelArgs]:
    """Build a DecoderLM from a Hugging Face model directory and load its safetensors weights.

    dtype None uses the checkpoint's `torch_dtype` (float32 when it does not say). `args`: the
    directory's ModelArgs when the caller has read them already. `max_positions` caps the rope
    table (see DecoderLM). `tp`: one rank of a tensor-parallel instance, which reads only its
    shard of each tensor (workers/models/sharding.py). Raises ModelConfigError for a bad
    config.json, and ModelLoadError for weight files that ``checkpoint.check_checkpoint`` refuses
    (missing, unexpected or mis-shaped tensors, unreadable or truncated files) before anything
    is allocated. ``int8`` (``quantize: w8a16``; workers/backends/int8.py ``Int8Target``): a GGUF
    model's linears are quantised while they are read (``model.int8_at_load`` set); a safetensors
    checkpoint ignores it (the caller quantises after the load). ``gguf_native``
    (workers/backends/gguf_linear.py ``NativeTarget``): a GGUF model's linears keep the file's
    blocks. ``w8a8`` (the same target): a compressed-tensors W8A8 checkpoint's int8 linears
    become Q8_0 blocks (workers/models/w8a8.py); without it such a checkpoint is refused.
    Returns the model in eval mode and its ModelArgs.
    """
    path = Path(path)
    t0 = time.monotonic()
    args = args or ModelArgs.from_dir(path)
    if dtype is None:
        dtype = getattr(torch, args.torch_dtype or "float32")
    device = torch.device(device)
    # Every header checked before anything is allocated or read (workers/models/checkpoint.py).
    checkpoint = check_checkpoint(path, args)
    expected = expected_tensors(args)
    log.info(
        "loading %s model from %s: %d layers, hidden %d, vocab %d, %s on %s, %s%s",
        args.arch, next(iter(checkpoint.files)) if checkpoint.gguf else path, args.num_hidden_layers,
        args.hidden_size, args.vocab_size, str(dtype).removeprefix("torch."), device,
        "GGUF" if checkpoint.gguf else f"{len(checkpoint.files)} shard(s)", describe_moe(args, tp),
    )

    # Allocate straight on the target device. DecoderLM skips random init, so this is just
    # uninitialised storage that the checkpoint overwrites below (no meta device: its empty_like
    # drags in sympy and costs ~0.5 s on first use).
    model_cls = (deepseek.DeepseekLM if args.deepseek is not None else gpt_oss.GptOssLM if args.gpt_oss is not None
                 else variant.VariantLM if args.variant is not None
                 else glm4_moe.Glm4MoeLM if args.glm4_moe is not None
                 else gemma.GemmaLM if args.gemma is not None
                 else gemma4.Gemma4LM if args.gemma4 is not None
                 else qwen3_next.HybridLM if args.hybrid is not None
                 else DecoderLM)
    with torch.device(device):
        model = model_cls(args, dtype=dtype, max_positions=max_positions, tp=tp)
    model.eval().requires_grad_(False)
    model.rope.to_device(device)
    if checkpoint.skipped_mtp:
        log.info("multi-token-prediction head (num_nextn_predict_layers %d): %d tensors not loaded (not served)",
                 (args.deepseek or args.glm4_moe).num_nextn_predict_layers  # type: ignore[union-attr]
                 if args.deepseek or args.glm4_moe else 0, checkpoint.skipped_mtp)
    if checkpoint.skipped_towers:
        log.info("%d tensors of the vision/audio towers not loaded (text only)", checkpoint.skipped_towers)
    shard = tp.shard if tp is not None else None
    if shard is not None:
        with torch.no_grad():  # the vocabulary padding rows of the last rank
            model.embed_tokens.weight.zero_()
            if model.lm_head is not None:
                model.lm_head.weight.zero_()

    slots = _param_slots(model, shard)
    if slots.keys() != expected.keys():  # the model and checkpoint.py disagree: a bug, not a checkpoint's fault
        raise RuntimeError(f"loader and checkpoint.expected_tensors disagree on {sorted(slots.keys() ^ expected.keys())}")
    if checkpoint.gguf and any(isinstance(s, list) for s in slots.values()):
        raise ModelConfigError(f"{WORLD_SIZE_KEY}: tensor parallelism of a hybrid model is not supported from a "
                               "GGUF file; use worldSize 1 or its safetensors checkpoint")
    if checkpoint.gguf:
        (file, entries), = checkpoint.files.items()
        from .gguf_file import open_gguf
        from .gguf_loader import load_gguf
        try:
            load_gguf(model, slots, open_gguf(file), entries, shard=shard, int8=int8,
                      native=gguf_native if device.type == "cpu" else None)
        except GgufError as e:
            raise ModelLoadError(f"{file}: {e}") from None
    for n, (file, entries) in enumerate(() if checkpoint.gguf else checkpoint.files.items(), 1):
        t_shard = time.monotonic()
        nbytes = 0
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name, key in entries:
                # a list: several row ranges of one tensor (a hybrid model's [q | k | v] heads of a TP rank)
                for slot in slots[key] if isinstance(slots[key], list) else (slots[key],):
                    with torch.no_grad():
                        if slot.zero:
                            slot.param[slot.start:slot.start + slot.rows].zero_()
                        elif slot.rows:
                            tensor = _read(f, name, slot)
                            # casts to the model dtype and device
                            slot.param[slot.start:slot.start + slot.rows].copy_(tensor)
                            nbytes += tensor.numel() * tensor.element_size()
        log.info(
            "loaded shard %d/%d %s (%.1f MiB) in %.2fs", n, len(checkpoint.files), file.name, nbytes / 2**20,
            time.monotonic() - t_shard,
        )

    if checkpoint.int8:  # a W8A8 checkpoint's int8 linears, into Q8_0 blocks
        if w8a8 is None or tp is not None:
            raise ModelLoadError(f"{path}: a W8A8 (compressed-tensors int8) checkpoint is computed by the CPU's "
                                 "C kernels only, in one process (config.json quantization_config)")
        try:
            count = load_int8_linears(model, slots, checkpoint.int8, w8a8)
        except ValueError as e:
            raise ModelLoadError(f"{path}: {e}") from None
        log.info("W8A8 checkpoint: %d linear layers from int8 weights with per-channel scales, as Q8_0 blocks",
                 count)
    # the checkpoint's count: a GGUF file's or a W8A8 checkpoint's linears live in blocks, not parameters
    log.info("model ready: %.1fM parameters in %.2fs", sum(math.prod(s) for s in expected.values()) / 1e6,
             time.monotonic() - t0)
    if shard is not None:
        mine = parameter_bytes(model)
        full = sum(math.prod(s) for s in expected.values()) * torch.empty((), dtype=dtype).element_size()
        log.info("tensor-parallel rank %d/%d: %.1f MiB of parameters here, %.3f of the whole model's %.1f MiB",
                 shard.rank, shard.world, mine / 2**20, mine / full, full / 2**20)
    return model, args


def describe_moe(args: ModelArgs, tp: TensorParallel | None = None) -> str:
    """The load log's words for a mixture of experts ("" for a dense model)."""
    m = args.moe
    if m is None:
        return ""
    text = (f"; mixture of experts ({args.model_type or args.arch}): {m.num_experts} experts, top-{m.top_k}"
            f"{' renormalised' if m.norm_topk_prob else ''}, expert intermediate {m.moe_intermediate_size}, "
            f"{m.num_sparse_layers}/{len(m.sparse_layers)} sparse layers")
    if m.shared_expert_intermediate_size:
        text += f", shared expert {m.shared_expert_intermediate_size}{' (sigmoid gate)' if m.shared_expert_gate else ''}"
    if tp is not None and tp.shard.moe is not None:
        s = tp.shard.moe
        text += (f"; rank {tp.shard.rank} holds experts {s.expert0}..{s.expert0 + s.experts - 1}, "
                 f"intermediate columns {s.inter0}..{s.inter0 + s.inter - 1} of each")
    return text


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters (what this process holds of the weights)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())

