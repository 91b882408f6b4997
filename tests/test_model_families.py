"""GLM-4, Phi-3 / Phi-4-mini, SmolLM3 and Granite (issue 53, item 4, and items 5-6 for them) against
transformers 5.25's Glm4ForCausalLM / Phi3ForCausalLM / SmolLM3ForCausalLM / GraniteForCausalLM on
tiny random fp32 checkpoints built here:

- config: each family's keys (partial rotary, LongRoPE factors and attention factor, NoPE layers and
  SmolLM3's sliding layers, Granite's multipliers) read, errors naming the key;
- logits over the paged KV cache (a prompt in two chunks, then one decode step at a time) equal
  transformers' cached forward, Phi-3's decodes crossing original_max_position_embeddings (short
  to long factors); bf16 within transformers' own bf16 error;
- int8 w8a16: logits equal the model holding the dequantised weights;
- engine: greedy through chunked prefill, a cache small enough to preempt, speculation (drafts
  verified) and a prefix-cache hit equals transformers' greedy continuation (``engine_check``,
  ``bf16_check`` and ``int8_check`` are reused by the other families' files);
- tensor parallelism: two gloo ranks of Granite and SmolLM3 generate what transformers does; refused
  for the fused-tensor checkpoints (Phi-3, GLM-4) naming the family;
- GGUF: Phi-3 and GLM-4 written as llama.cpp's converter writes them (F32, Q8_0) load into the same
  config and compute transformers' logits on the weights the file holds;
- the real launch script on a tiny Phi-4-mini-shaped chat model (partial rotary 0.75, LongRoPE):
  /infer_token and the OpenAI chat route equal transformers' greedy output; and one server holding
  six more families as six models (Qwen2, Mistral, GLM-4, SmolLM3, Granite, Gemma 2), each equal too.
"""
from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from mindie.contract.wire import SamplingParams
from tests.harness import demo_server
from tests.served import assert_chat_equals, infer_ids
from tests.tiny_hf import save_chat_model, save_random_model
from tests.reference_attention import logits_over_cache
from workers.attention import PagedAttention
from workers.attention.cpu import CpuPagedAttention
from workers.models.config import ModelArgs, ModelConfigError
from workers.models.loader import load_model
from workers.models.sharding import plan_shard

transformers = pytest.importorskip("transformers")

from tests.test_engine import make_engine, run  # noqa: E402

pytestmark = pytest.mark.timeout(900)

VOCAB = 160
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
ORIG = 64  # Phi-3's original_max_position_embeddings here: the decodes below cross it
LONGROPE = dict(rope_type="longrope", short_factor=[1.0 + 0.1 * i for i in range(6)],
                long_factor=[2.0 + 0.5 * i for i in range(6)])
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # interleaved partial rotary (0.5, Glm4Config's default), q/k/v biases, fused gate_up, sandwich norms
    "glm4": ("Glm4Config", dict(head_dim=16)),
    # Phi-4-mini's shape: fused qkv and gate_up, partial rotary 0.75, LongRoPE (factor 256/64: attention factor)
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.75, original_max_position_embeddings=ORIG,
                                rope_scaling=LONGROPE)),
    # NoPE every 2nd layer, those layers sliding (window 8), q/k/v/o and MLP biases, tied embeddings
    "smollm3": ("SmolLM3Config", dict(no_rope_layer_interval=2, use_sliding_window=True, sliding_window=8,
                                      attention_bias=True, mlp_bias=True)),
    "granite": ("GraniteConfig", dict(embedding_multiplier=12.0, attention_multiplier=0.1, residual_multiplier=0.3,
                                      logits_scaling=4.0, attention_bias=True)),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    root = tmp_path_factory.mktemp("families")
    return {case: (save_random_model(cls, {**BASE, **extra}, root / case), root / case)
            for case, (cls, extra) in CASES.items()}


def hf_cached_logits(hf: Any, ids: list[int], prompt: int) -> torch.Tensor:
    """transformers' logits of every position: the first ``prompt`` tokens in one forward, then one
    token at a time through its own KV cache (how it generates)."""
    with torch.no_grad():
        out = hf(torch.tensor([ids[:prompt]]), use_cache=True)
        rows, cache = [out.logits[0]], out.past_key_values
        for p in range(prompt, len(ids)):
            out = hf(torch.tensor([[ids[p]]]), past_key_values=cache, use_cache=True,
                     position_ids=torch.tensor([[p]]))
            rows.append(out.logits[0])
            cache = out.past_key_values
    return torch.cat(rows).float()


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation through its own cache."""
    ids = list(prompt)
    with torch.no_grad():
        out = hf(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            ids.append(int(out.logits[0, -1].argmax()))
            out = hf(torch.tensor([[ids[-1]]]), past_key_values=out.past_key_values, use_cache=True,
                     position_ids=torch.tensor([[len(ids) - 1]]))
    return ids[len(prompt):]


def paged_logits(model: Any, ids: torch.Tensor, chunks: list[int], dtype: torch.dtype = torch.float32,
                 cls: type = PagedAttention) -> torch.Tensor:
    """Our logits of every position over the paged cache: the prompt in ``chunks``, then decodes."""
    a = model.args
    attn = cls(a.num_hidden_layers, 16, 8, a.num_key_value_heads, a.head_dim, dtype, torch.device("cpu"))
    return logits_over_cache(model, attn, ids, chunks, list(range(15, -1, -1)))  # blocks out of order


# -- config -------------------------------------------------------------------------------------------


def test_config_reads_each_family(models) -> None:
    glm = ModelArgs.from_dir(models["glm4"][1])
    assert glm.arch == "glm4" and glm.variant is not None
    assert (glm.variant.rotary_dim, glm.variant.rope_interleaved, glm.variant.sandwich_norms) == (8, True, True)
    assert glm.attention_bias and not glm.o_proj_bias and glm.variant.fused_gate_up and not glm.variant.fused_qkv
    phi = ModelArgs.from_dir(models["phi3"][1])
    lr = phi.variant.longrope
    assert phi.variant.rotary_dim == 12 and phi.variant.fused_qkv and lr is not None
    assert lr.original_max_position_embeddings == ORIG and lr.long == tuple(LONGROPE["long_factor"])
    assert lr.attention_factor == pytest.approx((1 + torch.log(torch.tensor(4.0)).item() / torch.log(
        torch.tensor(64.0)).item()) ** 0.5)  # factor = max_position_embeddings / original
    smol = ModelArgs.from_dir(models["smollm3"][1])
    assert smol.variant.rope_layers == (True, False, True, False) and smol.layer_windows == (None, 8, None, 8)
    assert smol.mlp_bias and smol.o_proj_bias and smol.tie_word_embeddings
    gr = ModelArgs.from_dir(models["granite"][1]).variant
    assert (gr.embedding_multiplier, gr.attention_multiplier, gr.residual_multiplier, gr.logits_scaling) == (
        12.0, 0.1, 0.3, 4.0)


@pytest.mark.parametrize("family,patch,key", [
    ("phi3", {"partial_rotary_factor": 0.1}, "partial_rotary_factor"),  # 1 rotary dim
    ("phi3", {"rope_scaling": {**LONGROPE, "short_factor": [1.0] * 5}}, "rope_scaling.short_factor"),
    ("glm4", {"rope_parameters": {**LONGROPE, "rope_theta": 1e4}}, "rope_parameters.rope_type"),
    ("smollm3", {"no_rope_layers": [1, 0]}, "no_rope_layers"),
    ("granite", {"attention_multiplier": -1}, "attention_multiplier"),
    ("granite", {"residual_multiplier": "x"}, "residual_multiplier"),
])
def test_config_errors_name_the_key(family: str, patch: dict, key: str) -> None:
    with pytest.raises(ModelConfigError, match=re.escape(key)):
        ModelArgs.from_dict({**BASE, "model_type": family, **patch})


def test_tensor_parallel_refused_for_fused_checkpoints_naming_the_family(models) -> None:
    for case in ("phi3", "glm4"):
        args = ModelArgs.from_dir(models[case][1])
        with pytest.raises(ModelConfigError, match=f"worldSize.*not supported for {case}"):
            plan_shard(args, 0, 2)
        assert plan_shard(args, 0, 1).heads == 4
    assert plan_shard(ModelArgs.from_dir(models["granite"][1]), 1, 2).heads == 2


@pytest.mark.parametrize("case", ["granite", "smollm3"])
def test_tensor_parallel_two_ranks_generate_what_transformers_does(models, case: str, tmp_path: Path) -> None:
    """Granite (q/k/v/o biases on rank 0's o, the multipliers around the all-reduces) and SmolLM3
    (NoPE and sliding layers, tied vocab-parallel embeddings) over two gloo ranks."""
    from tests.harness import run_tp_instance

    hf, path = models[case]
    g = torch.Generator().manual_seed(6)
    ps = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (7, 40)]
    reqs = [{"id": f"g{i}", "prompt": p, "params": {"max_new_tokens": 10, "ignore_eos": True}} for i, p in enumerate(ps)]
    got = run_tp_instance(path, 2, tmp_path, reqs)["tokens"]
    assert got == {f"g{i}": hf_greedy(hf, p, 10) for i, p in enumerate(ps)}


# -- logits ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_through_the_paged_cache(models, case: str) -> None:
    """A 50-token prompt in chunks of 30 and 20, then 40 decodes: positions 64.. are past Phi-3's
    original length (long factors) and past SmolLM3's window."""
    hf, path = models[case]
    model, _ = load_model(path, torch.float32)
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (90,))
    ref = hf_cached_logits(hf, ids.tolist(), 50)
    out = paged_logits(model, ids, [30, 20])
    assert (out - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())
    if case != "phi3":  # transformers' one forward over everything: the same, no rope switch involved
        with torch.no_grad():
            full = hf(ids[None]).logits[0]
        assert (out - full).abs().max().item() <= 1e-4 * max(1.0, full.abs().max().item())


def test_longrope_switch_matters(models) -> None:
    """The long factors change the answer past the original length (else the test proves nothing)."""
    hf, path = models["phi3"]
    model, _ = load_model(path, torch.float32)
    ids = torch.randint(3, VOCAB, (80,), generator=torch.Generator().manual_seed(4))
    ours = paged_logits(model, ids, [50])
    lr = model.args.variant.longrope
    short_only = copy.deepcopy(model)
    short_only.rope.cos, short_only.rope.sin = (t.clone() for t in (model.rope.cos, model.rope.sin))
    from workers.models.variant import VariantRope
    import dataclasses
    args = dataclasses.replace(model.args, variant=dataclasses.replace(
        model.args.variant, longrope=dataclasses.replace(lr, long=lr.short)))
    short_only.rope = VariantRope(args, model.rope.max_positions)
    alt = paged_logits(short_only, ids, [50])
    assert (alt[:ORIG] - ours[:ORIG]).abs().max().item() == 0
    assert (alt[ORIG:] - ours[ORIG:]).abs().max().item() > 1e-3


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_within_transformers_bf16_error(models, case: str) -> None:
    bf16_check(*models[case])


def bf16_check(hf: Any, path: Path, logits: Callable = paged_logits, vocab: int = VOCAB) -> None:
    """Our bf16 logits (the prompt in chunks over the cache, then decodes) are no further from
    transformers' fp32 ones than transformers' own bf16 logits are (x1.5 + 1e-3)."""
    model, _ = load_model(path, torch.bfloat16)
    torch.manual_seed(2)
    ids = torch.randint(3, vocab, (40,))
    with torch.no_grad():
        truth = hf(ids[None]).logits[0]
        hf_half = copy.deepcopy(hf).to(torch.bfloat16)(ids[None]).logits[0].float()
    err = (logits(model, ids, [24], torch.bfloat16).float() - truth).abs().max().item()
    hf_err = (hf_half - truth).abs().max().item()
    assert err <= 1.5 * hf_err + 1e-3, (err, hf_err)


@pytest.mark.parametrize("case", list(CASES))
def test_int8_w8a16_equals_the_dequantised_weights(models, case: str) -> None:
    int8_check(models[case][1])


def int8_check(path: Path, logits: Callable = paged_logits, vocab: int = VOCAB) -> None:
    """quantize w8a16 (every linear int8 per output channel) through the worker's assembly: logits
    equal the fp32 model holding the dequantised weights (within 1e-4 of their range)."""
    from mindie.contract.spec import EngineConfig, WorkerSpec
    from workers.backends.cpu import CpuBackend
    from workers.backends.int8 import Int8Linear, copy_dequantized_into
    from workers.engine.assembly import load_runner

    spec = WorkerSpec(worker_id="t", job_endpoint="", pub_endpoint="", model_path=str(path), dtype="float32",
                      quantize="w8a16", engine=EngineConfig(block_size=16, max_seq_len=256, max_prefill_tokens=256))
    model = load_runner(spec, CpuBackend(1)).model
    assert any(isinstance(m, Int8Linear) for m in model.layers.modules())  # the decoder's linears, not only the head
    ref = copy_dequantized_into(load_model(path, torch.float32)[0], model)
    ids = torch.randint(3, vocab, (70,), generator=torch.Generator().manual_seed(8))
    # the CPU backend's cache: a model it fused a decode step for reads the cache through its pointers
    got, want = logits(model, ids, [40], cls=CpuPagedAttention), logits(ref, ids, [40], cls=CpuPagedAttention)
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())


# -- engine ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_engine_greedy_equals_transformers_chunked_preempted_and_cached(models, case: str) -> None:
    engine_check(*models[case])


def engine_check(hf: Any, path: Path, vocab: int = VOCAB) -> None:
    """Greedy through the engine equals transformers' greedy continuation with every feature on at
    once: prompts cut into chunks of 20, a cache of 6 blocks of 16 for ~240 tokens of work
    (preemption), speculation (suffix lookup, on by default: the last prompt repeats itself, so it
    drafts), then the 60-token prompt again: its 3 full blocks hit the prefix cache."""
    g = torch.Generator().manual_seed(5)
    # prompts up to 60 tokens (Phi-3: within the original length, decodes crossing it)
    ps = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 60, 37, 48)] + [[7, 8, 9, 10, 11] * 8]
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    want = {f"r{i}": hf_greedy(hf, p, 12) for i, p in enumerate(ps)}
    eng = make_engine(str(path), num_blocks=6, max_prefill_tokens=20, max_batch_size=4)
    res = run(eng, {f"r{i}": (p, greedy) for i, p in enumerate(ps)})
    assert {k: v[0] for k, v in res.items()} == want
    assert eng.scheduler.num_preemptions > 0
    assert eng.speculator.draft_tokens > 0  # drafts verified as several query rows after the cached ones
    assert run(eng, {"y": (ps[1], greedy)})["y"][0] == want["r1"]
    hits = eng.blocks.prefix_hits
    assert run(eng, {"x": (ps[1], greedy)})["x"][0] == want["r1"]
    assert eng.blocks.prefix_hits - hits == 3  # the 60-token prompt's 3 full blocks
    assert eng.check_no_leaks()


# -- GGUF (llama.cpp's phi3 and glm4) ----------------------------------------------------------------------


@pytest.mark.parametrize("case", ["phi3", "glm4"])
def test_gguf_as_llama_cpp_writes_it_equals_the_checkpoint(case: str, tmp_path: Path) -> None:
    """The model written as llama.cpp's converter does (F32: the same weights): its metadata read
    back into the same config (rotary dims, LongRoPE tensors and attention factor, GLM-4's biases),
    the fused attn_qkv / ffn_up tensors and GLM-4's post norms loaded, logits through the paged cache
    equal transformers' on the weights the file holds (F32, and Q8_0 dequantised)."""
    from gguf import GGMLQuantizationType as Q

    from tests.tiny_gguf import byte_level_tokenizer, gpt2_vocab, write_gguf
    from workers.models.gguf_view import ensure_view

    tok = byte_level_tokenizer()
    vocab = gpt2_vocab(tok)
    cls, extra = CASES[case]
    n = tok.get_vocab_size()  # llama.cpp's token list is the model's vocabulary
    # intermediate 128: Q8_0 blocks of 32 along every row
    hf = save_random_model(cls, {**BASE, **extra, "vocab_size": n, "intermediate_size": 128}, tmp_path / "hf")
    path = tmp_path / "hf"
    torch.manual_seed(3)
    ids = torch.randint(3, n, (80,))
    errs = {}
    for qtype in (Q.F32, Q.Q8_0):
        # the reference: transformers on the weights the file holds (each matrix through Q8_0 and back)
        hf_q = copy.deepcopy(hf)
        if qtype != Q.F32:
            import gguf
            with torch.no_grad():
                for p in hf_q.parameters():
                    if p.dim() == 2:
                        p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), qtype), qtype)))
        ref = hf_cached_logits(hf_q, ids.tolist(), 40)
        file = write_gguf(tmp_path / f"{case}-{qtype.name}.gguf", hf, case, vocab, default=qtype)
        view = ensure_view(file, tmp_path / "views")
        model, args = load_model(view, torch.float32)
        want = ModelArgs.from_dir(path)
        assert args.variant == dataclasses.replace(want.variant, longrope=args.variant.longrope)
        if case == "phi3":  # the factors went through float32 in the file
            lr, lw = args.variant.longrope, want.variant.longrope
            assert lr.long == pytest.approx(lw.long) and lr.attention_factor == pytest.approx(lw.attention_factor)
        assert (args.attention_bias, args.layer_windows) == (want.attention_bias, want.layer_windows)
        errs[qtype] = (paged_logits(model, ids, [25, 15]) - ref).abs().max().item()
    assert max(errs.values()) <= 1e-4, errs


# -- the real server -----------------------------------------------------------------------------------

CHAT_TEMPLATE = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                 "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


# Families without a launch-script test of their own, served together as the models of one server
# (docs/design.md, "Several models": a worker group each): family -> (config class, keys).
SERVED = {
    "qwen2": ("Qwen2Config", {}),
    "mistral": ("MistralConfig", dict(sliding_window=8)),
    "glm4": CASES["glm4"],
    "smollm3": CASES["smollm3"],
    "granite": CASES["granite"],
    "gemma2": ("Gemma2Config", dict(query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=3.0,
                                    final_logit_softcapping=2.0)),
}


@pytest.fixture(scope="module")
def families_server(tmp_path_factory: pytest.TempPathFactory):
    """One launch for both server tests: the Phi-4-mini-shaped chat model (``phi4``, its KV budget
    tiny) and SERVED's six families, each a model of the server (a worker each, all loaded at start).
    Yields (server, {model name: chat model path})."""
    root = tmp_path_factory.mktemp("families-srv")
    path = root / "tiny-phi4-mini"
    # head_dim 32: 24 rotary dims (0.75), 12 LongRoPE factors; original length 48, so answers cross it
    rope = dict(rope_type="longrope", short_factor=[1.0 + 0.05 * i for i in range(12)],
                long_factor=[1.5 + 0.25 * i for i in range(12)])
    paths = {"phi4": save_chat_model(path, CHAT_TEMPLATE, cls_name="Phi3Config",
                                     config=dict(partial_rotary_factor=0.75, original_max_position_embeddings=48,
                                                 rope_scaling=rope, pad_token_id=0))}
    paths.update({name: save_chat_model(root / name, CHAT_TEMPLATE, cls_name=cls, config={**extra, "pad_token_id": 0})
                  for name, (cls, extra) in SERVED.items()})
    entries = [{"modelName": "phi4", "modelWeightPath": str(paths["phi4"]), "cpuMemSize": 0.0002}]
    entries += [{"modelName": n, "modelWeightPath": str(paths[n]), "cpuMemSize": 0.02} for n in SERVED]
    with demo_server(root, entries[0]["modelWeightPath"], model=entries[0], more_models=entries[1:],
                     schedule={"prefillChunkTokens": 16, "maxBatchSize": 4, "maxPrefillBatchSize": 4}) as srv:
        yield srv, paths


def _model_metric(url: str, name: str, model: str) -> float:
    """The value of metric ``name`` for model ``model`` on /metrics (a server of several models
    gives each its own sample)."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    m = re.search(rf'^{re.escape(name)}{{[^}}]*model_name="{re.escape(model)}"[^}}]*}} (\S+)', text, re.M)
    assert m, text[-3000:]
    return float(m.group(1))


def test_server_phi4_mini_shape_infer_token_and_chat_equal_transformers(families_server) -> None:
    srv, paths = families_server
    path = paths["phi4"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    g = torch.Generator().manual_seed(7)
    ps = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (9, 40, 33)]
    log = srv.tail(3000)  # (phi3 is this model's alone among the server's models)
    assert "phi3" in log and "fused decode kernel not used: the phi3 block" in log, log[-3000:]

    assert [infer_ids(srv.url, p, 16, model="phi4") for p in ps] == [hf_greedy(hf, p, 16) for p in ps]
    assert infer_ids(srv.url, ps[1], 16, model="phi4") == hf_greedy(hf, ps[1], 16)  # again: a prefix-cache hit
    assert _model_metric(srv.url, "npu_prefix_cache_hit_rate", "phi4") > 0
    assert_chat_equals(srv.url, tok, lambda ids, n: hf_greedy(hf, ids, n), "What does LongRoPE do?", model="phi4")


def test_server_of_six_families_equals_transformers(families_server) -> None:
    """Each family through the launch script: /infer_token (a prompt over two prefill chunks, a short
    one, the first again: a prefix-cache hit) and the OpenAI chat route, greedy, equal transformers."""
    srv, paths = families_server
    g = torch.Generator().manual_seed(9)
    ps = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (40, 9)]
    for name in SERVED:
        path = paths[name]
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tok = transformers.AutoTokenizer.from_pretrained(path)
        want = [hf_greedy(hf, p, 12) for p in ps]
        assert [infer_ids(srv.url, p, 12, model=name) for p in ps + [ps[0]]] == want + [want[0]], name
        assert_chat_equals(srv.url, tok, lambda ids, n: hf_greedy(hf, ids, n), f"Who serves {name}?", model=name)
