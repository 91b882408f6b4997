"""Engine assembly: the one place a WorkerSpec becomes a runner and an engine, for any rank.

``build(spec, rank, tp_store)`` is called by the worker process (rank 0 of any instance,
workers/worker.py) and by the other ranks of a tensor-parallel instance (workers/tp_rank.py):

1. the backend of ``spec.device_type`` and its per-process setup (threads, device);
2. with ``tp_store``: join the instance's process group as ``rank``;
3. ``load_runner``: config.json read once, the dtype the backend picks, the weights (this
   rank's shard), int8 quantisation, the backend's rewrites (``Backend.prepare_model``; the
   CPU's steps: workers/backends/cpu_specialise.py) and warm-up, the sampler;
4. the KV cache's size (workers/attention/kv_cache.py): whole blocks in the budget; the ranks
   of a group wait for each other's load, then all take the smallest count;
5. the KV cache itself;
6. rank 0: the ``Engine`` (scheduler, block manager) over the runner. Ranks > 0 get no engine:
   they run the steps rank 0 broadcasts.

The null model (``spec.null_model``, rank 0 only) skips 1-5: a ``NullRunner`` and as many
blocks as every slot needs at full length, for bookkeeping only.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import msgspec
import torch

from mindie.contract.spec import EngineConfig, WorkerSpec

from workers.attention import for_layout, kv_cache, split_attention
from workers.backends import get_backend
from workers.backends.base import Backend
from workers.backends import w8a8
from workers.backends.int8 import QUANTIZE_KEY, SCHEMES, Int8Target, quantize_model
from workers.engine import constraints
from workers.engine.engine import Engine
from workers.engine.lora_manager import LoraManager
from workers.engine.model_runner import ModelRunner, NullRunner
from workers.engine.sampler import Sampler
from workers.engine.tp_group import Group, join
from workers.engine.watermark import WatermarkConfig
from workers.models.config import ModelArgs, ModelConfigError
from workers.models.gguf_paths import MARKER as GGUF_MARKER
from workers.models.loader import load_model
from workers.models.sharding import TensorParallel, plan_shard
from workers.models.w8a8_config import checkpoint_scheme

log = logging.getLogger("workers.engine")


@dataclass
class Assembly:
    runner: ModelRunner | NullRunner
    engine: Engine | None  # None on ranks > 0 of a tensor-parallel instance
    group: Group | None  # the instance's process group (tensor parallel), else None
    num_blocks: int
    device: str  # the device as the worker's status describes it ("null" for the null model)


def build(spec: WorkerSpec, rank: int = 0, tp_store: str = "") -> Assembly:
    """The runner, its KV cache and (rank 0) the engine of ``spec``. ``tp_store``: the
    rendezvous file the supervisor made for this start of a tensor-parallel instance
    (``spec.device_ids`` lists its devices); ``rank``: this process's place in it."""
    cfg = spec.engine
    if spec.null_model:
        runner = NullRunner(spec.null_vocab_size, spec.null_step_ms)
        num_blocks = kv_cache.bookkeeping_blocks(cfg.max_batch_size, cfg.max_seq_len, cfg.block_size)
        log.info("null model: no compute, %.2f ms per step, %d blocks", spec.null_step_ms, num_blocks)
        engine = Engine(runner, cfg, num_blocks)
        engine.lora = lora_manager(spec, None, "the null model (launch.sh --null-model) serves no LoRA adapter")
        engine.grammars = grammars(spec.model_path, runner)
        return Assembly(runner, engine, None, num_blocks, "null")

    backend = get_backend(spec.device_type, spec.threads)
    backend.setup()
    group = join(spec.worker_id, rank, len(spec.device_ids), tp_store, spec.device_type) if tp_store else None
    runner = load_runner(spec, backend, group)
    block_bytes = runner.bytes_per_block(cfg.block_size)
    budget = kv_cache.budget_bytes(spec, backend.name, backend.free_memory)
    if runner.state_slots:  # a hybrid model's state pool comes out of the same budget
        budget = state_pool_budget(runner, budget, block_bytes, cfg)
        if runner.state_slots < cfg.max_batch_size:  # the sequences that have a state slot run at once
            cfg = msgspec.structs.replace(cfg, max_batch_size=runner.state_slots)
    num_blocks = kv_cache.blocks_in(budget, block_bytes)
    if group is not None:  # every rank allocates the same blocks (what the smallest memory holds)
        group.wait_all("loaded the model")
        num_blocks = group.min_int(num_blocks)
    runner.allocate_kv(num_blocks, cfg.block_size)
    if rank > 0:
        return Assembly(runner, None, group, num_blocks, backend.describe())
    log.info("KV cache: %d blocks x %d tokens (%.2f GiB, %d token slots) on %s, attention %s", num_blocks,
             cfg.block_size, num_blocks * block_bytes / (1 << 30), num_blocks * cfg.block_size,
             backend.describe(), type(runner.attn).__name__)
    log.info("step overlap %s", "on (model computes on its own thread)" if cfg.overlap else "off")
    log.info("prefill: chunks of %s prompt tokens while others have work; %s",
             cfg.prefill_chunk_tokens if cfg.prefill_chunk_tokens > 0 else cfg.max_prefill_tokens,  # 0 = the budget
             f"steps that complete a prompt hold decodes up to {cfg.decode_hold_ms:g} ms"
             + (", and through the rest of a burst whose first prompts are answered" if cfg.decode_hold_wave else "")
             if cfg.decode_hold_ms
             else "every step decodes every running request")
    device = backend.describe() if group is None else f"{backend.describe()}, tensor parallel x{group.world}"
    engine = Engine(runner, cfg, num_blocks, thread_init=backend.bind_thread)
    engine.lora = lora_manager(spec, runner, lora_refusal(runner.model, group is not None))
    engine.grammars = grammars(spec.model_path, runner)  # rank 0 samples, so it alone masks
    return Assembly(runner, engine, group, num_blocks, device)


def state_pool_budget(runner: ModelRunner, budget: int, block_bytes: int, cfg: EngineConfig) -> int:
    """The KV cache's part of ``budget`` once a hybrid model's state pool is taken out; logs both
    costs per sequence. A large model's state is large (Qwen3.5-0.8B: ~19 MB a sequence), so the
    pool is fitted to the budget instead of refusing the default one: the slots (one per running
    sequence) take at most half of it, as many as fit up to maxBatchSize (fewer: the engine runs
    fewer sequences at once); the prefix checkpoints and the speculative verify rows together at
    most half of what the slots leave, the checkpoints first (a conversation's next turn resumes
    from them), the verify rows only all together (a verify needs a row per proposed token), else
    speculation is off for the model. Each cut is a WARNING naming the keys. ValueError when not
    even one slot and one KV block fit."""
    conv, rec = runner.state_bytes_per_seq()
    row = conv + rec
    wanted = runner.state_slots
    runner.state_slots = max(1, min(wanted, budget // 2 // row))
    if budget - runner.state_slots * row < block_bytes:
        raise ValueError(f"the KV cache budget (cpuMemSize / npuMemSize: {budget} bytes) does not hold one sequence's "
                         f"state of a hybrid model ({row} bytes) and one KV block; raise the memory size")
    if runner.state_slots < wanted:
        log.warning("this hybrid model runs at most %d sequences at once, not %d (maxBatchSize): a sequence's state "
                    "takes %d bytes and the state slots at most half of the budget; raise cpuMemSize / npuMemSize "
                    "for more", runner.state_slots, wanted, row)
    room = (budget - runner.state_slots * row) // 2
    wanted = min(runner.state_checkpoints, runner.state_slots)
    runner.state_checkpoints = min(wanted, room // row)
    if runner.state_checkpoints < wanted:
        log.warning("prefix caching keeps %d state checkpoints, not %d: %d bytes each, at most half of the budget the "
                    "state slots leave; raise cpuMemSize / npuMemSize for more prefix hits",
                    runner.state_checkpoints, wanted, row)
    room -= runner.state_checkpoints * row
    if runner.state_scratch:
        runner.state_scratch = min(cfg.spec_max_batch, runner.state_slots) * cfg.spec_tokens
    if runner.state_scratch * row > room:
        log.warning("speculative decoding off for this model: its %d verify rows (min(speculationMaxBatch, "
                    "maxBatchSize) x speculationGamma) x %d bytes do not fit in half of the budget the state slots "
                    "leave; raise cpuMemSize / npuMemSize or lower speculationGamma / speculationMaxBatch",
                    runner.state_scratch, row)
        runner.state_scratch = 0
    rows = runner.state_slots + runner.state_checkpoints + runner.state_scratch
    pool = rows * row
    log.info("state pool: %d slots (maxBatchSize) x %d bytes per sequence (conv state %d + recurrent state %d, "
             "%d linear-attention layers), + %d prefix-cache checkpoints + %d speculative verify rows of the same "
             "size = %.2f MiB; KV cache %d bytes per token (%d full-attention layers)",
             runner.state_slots, row, conv, rec, len(runner.model.args.hybrid.linear_layers),
             runner.state_checkpoints, runner.state_scratch, pool / 2**20, runner.bytes_per_block(1),
             runner.kv_shape[0])
    return budget - pool


def grammars(model_dir: str, runner: ModelRunner | NullRunner) -> constraints.Grammars | None:
    """The worker's constraint compiler (structured output, workers/engine/constraints.py) over the
    model's tokenizer.json and EOS ids; None (constrained requests refused with a 400) without
    llguidance or a tokenizer.json."""
    if constraints.llguidance is None:
        log.warning("structured output off: llguidance is not installed (constrained requests get a 400)")
        return None
    if not model_dir or not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        log.warning("structured output off: no tokenizer.json in %r (constrained requests get a 400)", model_dir)
        return None
    return constraints.Grammars(model_dir, runner.vocab_size, runner.eos_token_ids)


MLA_LORA_REFUSAL = "LoRA adapters are not served for DeepSeek (multi-head latent attention) models"
GPT_OSS_LORA_REFUSAL = "LoRA adapters are not served for GPT-OSS models (attention sinks, stacked experts)"
HYBRID_LORA_REFUSAL = ("LoRA adapters are not served for hybrid linear-attention models (Qwen3-Next / Qwen3.5): "
                       "their Gated DeltaNet layers take no adapter")
TP_REFUSAL = "LoRA adapters are not served by tensor-parallel instances (npuDeviceIds entries of several devices)"


def lora_refusal(model: torch.nn.Module, tensor_parallel: bool) -> str:
    """Why this model serves no LoRA adapter ("" when it does): each message names LoRA and the
    family (or the tensor-parallel instance) it cannot be combined with. A mixture of experts is
    refused per adapter instead (workers/models/lora_adapter.py: its dense layers could take one)."""
    args = model.args
    return (TP_REFUSAL if tensor_parallel else MLA_LORA_REFUSAL if args.deepseek is not None else
            GPT_OSS_LORA_REFUSAL if args.gpt_oss is not None else HYBRID_LORA_REFUSAL if args.hybrid is not None
            else getattr(model, "lora_refusal", ""))


def lora_manager(spec: WorkerSpec, runner: ModelRunner | None, refusal: str) -> LoraManager:
    """The worker's LoRA adapters (workers/engine/lora_manager.py), ``LoraModules`` read and
    resident (up to ``maxLoras``) before the worker says it is ready. ``refusal``: why this worker
    serves none (a load is answered with it; LoraModules fail the start, which the launch step
    refuses first)."""
    capacity = spec.max_loras or len(spec.lora_modules)
    args = runner.model.args if runner is not None else None
    manager = LoraManager(args, runner.kv_dtype if runner is not None else None,
                          runner.device if runner is not None else "cpu", capacity=capacity,
                          max_rank=spec.max_lora_rank, served_name=spec.model_name, dynamic=spec.max_loras > 0,
                          refusal=refusal)
    if spec.lora_modules and not refusal:
        t0 = time.perf_counter()
        manager.load_static(spec.lora_modules)
        log.info("LoRA adapters: %d loaded from LoraModules in %.2f s (%d resident, maxLoras %d, maxLoraRank %d)",
                 len(spec.lora_modules), time.perf_counter() - t0, len(manager.resident), spec.max_loras,
                 manager.max_rank)
    elif spec.lora_modules:
        log.warning("LoraModules: not loaded: %s", refusal)
    elif spec.max_loras:
        log.info("LoRA adapters: loaded at run time (/v1/load_lora_adapter), %d resident at most, rank up to %d%s",
                 capacity, manager.max_rank, f" ({refusal})" if refusal else "")
    return manager


def start_refusal(spec: WorkerSpec) -> str | None:
    """What a worker of ``spec`` would refuse at start before it reads a weight, found without
    initialising a device (None: nothing), worded with its config key: no such device here
    (``Backend.unavailable``), or a ``quantize`` key the backend has no kernel for. The launch
    step's check (workers/prepare.py)."""
    backend = get_backend(spec.device_type, spec.threads)
    if why := backend.unavailable():
        return f"BackendConfig.deviceType: {why}"
    try:
        quantize = _quantize(spec, _w8a8_checkpoint(spec))
    except ModelConfigError as e:
        return str(e)
    if quantize == w8a8.SCHEME and backend.w8a8_target() is None:
        return _no_w8a8(spec, backend)
    if quantize and quantize != w8a8.SCHEME and backend.int8_kernel() is None:
        return _no_int8(spec, backend)
    return None


def _w8a8_checkpoint(spec: WorkerSpec) -> bool:
    """Whether the model is a compressed-tensors W8A8 checkpoint (its config.json read here);
    ModelConfigError for a quantization_config it does not serve."""
    return bool(spec.model_path) and checkpoint_scheme(spec.model_path) is not None


def _quantize(spec: WorkerSpec, w8a8_checkpoint: bool) -> str:
    """The scheme the worker computes: ``quantize``, or "w8a8" for a compressed-tensors W8A8
    checkpoint (workers/models/w8a8.py; ``_w8a8_checkpoint``); ModelConfigError for a W8A8
    checkpoint with another ``quantize``."""
    if w8a8_checkpoint:
        if spec.quantize not in ("", w8a8.SCHEME):
            raise ModelConfigError(f"{QUANTIZE_KEY} {spec.quantize!r}: the checkpoint is W8A8 already (config.json "
                                   f"quantization_config, compressed-tensors); remove the key or set it to \"w8a8\"")
        return w8a8.SCHEME
    return spec.quantize or ""


def _no_int8(spec: WorkerSpec, backend: Backend) -> str:
    return (f"{QUANTIZE_KEY} {spec.quantize!r}: the {backend.name} backend has no weight-only int8 kernel; remove "
            f"the key (or set it to \"\") to serve the model unquantised")


def _no_w8a8(spec: WorkerSpec, backend: Backend) -> str:
    what = (f"{QUANTIZE_KEY} \"w8a8\"" if spec.quantize else
            "config.json quantization_config (a compressed-tensors W8A8 checkpoint)")
    why = f"the C kernels do not load: {w8a8.unavailable_reason()}" if backend.name == "cpu" else \
        "only the CPU backend's C kernels compute int8 weights with int8 activations"
    return (f"{what}: the {backend.name} backend has no W8A8 int8 kernel ({why}); "
            + ("use \"w8a16\" (weight-only int8) or remove the key" if spec.quantize
               else "serve the unquantised checkpoint"))


def load_runner(spec: WorkerSpec, backend: Backend, group: Group | None = None) -> ModelRunner:
    """The worker's model in one pass: config.json read once, dtype picked by the backend,
    weights loaded and rewritten for the device, sampler wired; no KV cache yet. With ``group``:
    this rank's shard of a tensor-parallel instance (rank 0's runner broadcasts each step to
    the others)."""
    if not spec.model_path:
        raise ValueError("WorkerSpec.model_path is empty: run python -m workers.prepare on the launch plan")
    if spec.engine.batch_invariant and backend.name != "cpu":  # refused before the weights are read
        raise ValueError(f"ScheduleConfig.batchInvariant is implemented for the CPU backend only, not {backend.name} "
                         "(docs/design.md, \"Batch invariance\"); set it to false")
    t0 = time.perf_counter()
    args = ModelArgs.from_dir(spec.model_path)
    # int8 weights (quantize) have their own products; a GGUF file's (a view folder with its
    # marker) are dequantised at load, and the backend may keep them in another dtype than its rows
    gguf = os.path.exists(os.path.join(spec.model_path, GGUF_MARKER))
    w8a8_checkpoint = _w8a8_checkpoint(spec)
    quantize = _quantize(spec, w8a8_checkpoint)
    dtype = backend.resolve_dtype(spec.dtype, args.torch_dtype, plain_weights=not quantize and not gguf,
                                  gguf=gguf and not quantize)
    kernel = q8 = None
    if quantize:
        if quantize not in SCHEMES:
            raise ValueError(f"{QUANTIZE_KEY}: unknown scheme {quantize!r} (supported: {', '.join(SCHEMES)})")
        if quantize == w8a8.SCHEME:  # Q8_0 blocks on the GGUF kernels (workers/backends/w8a8.py)
            q8 = backend.w8a8_target()
            if q8 is None:  # refused before the weights are read
                raise RuntimeError(_no_w8a8(spec, backend))
        else:
            kernel = backend.int8_kernel()
            if kernel is None:  # refused before the weights are read
                raise RuntimeError(_no_int8(spec, backend))
    device = backend.device()
    tp = None
    if group is not None:
        tp = TensorParallel(plan_shard(args, group.rank, group.world, spec.moe_parallel),  # the default (compute) group
                            ordered=bool(spec.engine.batch_invariant))
    # w8a8 of a GGUF file: its blocks on the same kernels, whatever cpuTuning.ggufCompute says
    model, _ = load_model(spec.model_path, dtype, device, max_positions=spec.engine.max_seq_len, args=args, tp=tp,
                          int8=Int8Target(kernel) if kernel is not None else None,
                          gguf_native=(q8 or backend.gguf_target(dtype)) if gguf and kernel is None else None, w8a8=q8)
    # before the backend's rewrites: they keep the int8 layers as they are (a GGUF model's were
    # made while its tensors were read)
    if kernel is not None and not getattr(model, "int8_at_load", False):
        quantize_model(model, kernel)
    if q8 is not None and not gguf:
        if w8a8_checkpoint:  # its int8 linears were read into blocks
            w8a8.loaded(q8, q8.count, "read from the checkpoint's int8 weights and per-channel scales", dtype)
        else:
            w8a8.quantize_model(model, q8, dtype)
    backend.prepare_model(model)
    backend.warm_up(model, spec)
    log.info("loaded %s (%s, %d layers, vocab %d) as %s%s on %s in %.2f s", spec.model_path, args.arch,
             args.num_hidden_layers, args.vocab_size, dtype, f" with {quantize} weights" if quantize else "",
             device, time.perf_counter() - t0)
    local = model.local_args  # a TP rank keeps its own KV heads only
    # a hybrid model caches K and V of its full-attention layers only (model.kv_layers)
    kv_shape = (getattr(model, "kv_layers", args.num_hidden_layers), local.num_key_value_heads, args.head_dim)
    attention_cls = backend.attention_class()
    layout = getattr(model, "kv_layout", None)  # a model with its own cache layout (DeepSeek's latent cache)
    if layout is not None and layout[0] == "per_kind":  # layers of several geometries (Gemma 4): split.py
        attention_cls = split_attention(attention_cls, layout[1])
    elif layout is not None:
        attention_cls, kv_shape = for_layout(layout[0]), layout[1]
    per_token = attention_cls.bytes_per_slot(*kv_shape, dtype)
    if args.deepseek is not None:
        from workers.models.deepseek import kv_bytes_per_token
        _, full = kv_bytes_per_token(args, torch.empty((), dtype=dtype).element_size())
        log.info("KV cache: %d bytes per token (MLA latent: %d layers x (kv_lora_rank %d + qk_rope_head_dim %d)); "
                 "full per-head K/V would take %d (%.1fx)", per_token, args.num_hidden_layers,
                 args.deepseek.kv_lora_rank, args.deepseek.qk_rope_head_dim, full, full / per_token)
    elif layout is not None and layout[0] == "per_kind":
        log.info("KV cache: %d bytes per token (K and V of %s layers x KV heads x head_dim: one cache geometry "
                 "each)", per_token, " + ".join("%dx%dx%d" % g for g in layout[1]))
    else:
        log.info("KV cache: %d bytes per token (%d layers x %d KV heads x head_dim %d, K and V)", per_token, *kv_shape)
    runner = ModelRunner(model, kv_shape, dtype,
                         Sampler(WatermarkConfig(gamma=spec.watermark_gamma, delta=spec.watermark_delta)),
                         args.vocab_size, frozenset(args.eos_token_ids), device, attention_cls=attention_cls,
                         after_step=backend.after_step, group=group if group is not None and group.rank == 0 else None)
    if args.hybrid is not None:  # the state pool: one slot per sequence that may run at once
        cfg = spec.engine
        runner.state_slots = cfg.max_batch_size
        # prefix caching: as many boundary checkpoints as slots; speculation: a state per verify row
        # but each sequence's last (docs/design.md, "Hybrid linear attention")
        runner.state_checkpoints = cfg.max_batch_size if cfg.enable_prefix_cache else 0
        runner.state_scratch = (min(cfg.spec_max_batch, cfg.max_batch_size) * cfg.spec_tokens
                                if cfg.spec_method else 0)
    runner.spec_row_cost = backend.spec_row_cost(model)  # what a speculative row costs (engine.speculator)
    return runner
