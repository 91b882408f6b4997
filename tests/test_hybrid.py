"""Hybrid linear attention: Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (workers/models/qwen3_next.py,
gated_deltanet.py; the state pool workers/attention/state_cache.py) on tiny random fp32
transformers checkpoints (tests/tiny_hf.py).

- config.json: layer_types / full_attention_interval, the linear heads and dims, the partial rotary
  factor, MoE keys; a published Qwen3.5 checkpoint's nested text_config and model.language_model.
  names; unsupported keys refused by name.
- The delta rule's chunked form equals its recurrent form, a state carried across a split.
- Logits equal transformers' over prompt chunks and decodes, two sequences in one flat batch.
- The engine: greedy tokens equal transformers' generate alone and batched, with chunked prefill
  and preemption (a small KV cache), state slots all returned; prefix hits resuming from the states
  kept at block boundaries (saved inside prompt chunks, both forms), speculative decoding with its
  verify states rolled back to the last accepted token, all at once with preemption. Tensor parallelism: tests/test_hybrid_tp.py.
- Batch-invariant mode's form (every token one recurrent step, the convolution tap by tap) equals
  transformers too (its bits alone and in mixes: tests/test_batch_invariance.py).
- The real launch script: /infer_token and the OpenAI chat route equal transformers, with a prefix
  hit and speculation (/metrics counts both); the load log gives the bytes per sequence of the
  state pool (slots, checkpoints, verify rows) and per token of the KV cache.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from mindie.contract.wire import SamplingParams
from tests.harness import demo_server
from tests.served import metric
from tests.tiny_hf import QWEN3_CHAT_TEMPLATE, save_chat_model, save_random_model
from workers.attention.paged import PagedAttention
from workers.attention.state_cache import StateCache
from workers.models.config import ModelArgs, ModelConfigError
from workers.models.gated_deltanet import chunk_gated_delta_rule, recurrent_gated_delta_rule
from workers.models.loader import load_model

transformers = pytest.importorskip("transformers")

from tests.test_engine import make_engine, run  # noqa: E402

VOCAB = 128
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, linear_conv_kernel_dim=4, linear_key_head_dim=8,
            linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, bos_token_id=1,
            eos_token_id=2)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_next": ("Qwen3NextConfig", MOE),  # fused in_proj_qkvz / in_proj_ba, MoE with shared expert
    "qwen3_5": ("Qwen3_5TextConfig", {}),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", MOE),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    root = tmp_path_factory.mktemp("hybrid")
    return {case: (save_random_model(cls, {**BASE, **extra}, root / case), root / case)
            for case, (cls, extra) in CASES.items()}


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy generate with its cache (the prompt in the chunked form, each next token
    in the recurrent form), EOS not stopping it nor suppressed (ignore_eos)."""
    cache = transformers.DynamicCache(config=hf.config)
    out, x = [], torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            out.append(int(hf(x, cache=cache, use_cache=True).logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
    return out


# ----------------------------------------------------------------------------------- config


def test_config_reads_the_hybrid_keys(models) -> None:
    args = ModelArgs.from_dir(models["qwen3_next"][1])
    hy = args.hybrid
    assert args.arch == "qwen3_next" and hy.layout == "qkvz" and args.qk_norm
    assert hy.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (hy.num_k_heads, hy.num_v_heads, hy.head_k_dim, hy.head_v_dim, hy.conv_kernel) == (2, 4, 8, 8, 4)
    assert hy.rotary_dim == 2  # partial_rotary_factor 0.25 of head_dim 8
    assert args.moe.num_experts == 4 and args.moe.shared_expert_gate and args.moe.norm_topk_prob
    m = ModelArgs.from_dir(models["qwen3_5_moe"][1])
    assert m.hybrid.layout == "split" and all(m.moe.sparse_layers) and m.moe.norm_topk_prob
    assert ModelArgs.from_dir(models["qwen3_5"][1]).moe is None
    # (conv state, recurrent state) of one sequence: 3 linear layers
    assert hy.state_bytes(4) == (3 * (2 * 16 + 32) * 3 * 4, 3 * 4 * 8 * 8 * 4)


def _cfg(models, case: str) -> dict:
    return json.loads((models[case][1] / "config.json").read_text())


def test_published_qwen3_5_layout_is_read(models, tmp_path: Path) -> None:
    """A Qwen3.5 checkpoint as published: text_config nested in a qwen3_5 config with mrope keys,
    the decoder under model.language_model., a vision tower and an MTP head beside it (skipped)."""
    hf, path = models["qwen3_5"]
    text = _cfg(models, "qwen3_5")
    text.pop("layer_types")
    text["full_attention_interval"] = 4
    text["rope_parameters"].update(mrope_section=[1, 0, 0], mrope_interleaved=True)
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
        "vision_config": {"depth": 1}, "tie_word_embeddings": False}))
    tensors = load_file(str(path / "model.safetensors"))
    renamed = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
               for k, v in tensors.items()}
    renamed["model.visual.patch_embed.weight"] = torch.zeros(2, 2)
    renamed["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    model, args = load_model(tmp_path, torch.float32)
    assert args.arch == "qwen3_5" and args.hybrid.layer_types[3] == "full_attention"
    ids = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (_paged_logits(model, [ids], [[20]]) [0] - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("patch,key", [
    ({"attention_bias": True}, "attention_bias"),
    ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]}, "layer_types"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim"),
    ({"sliding_window": 16}, "sliding_window"),
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 1.5}}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn", "factor": 2.0}}, "rope_type"),
])
def test_config_refusals_name_the_key(models, patch: dict, key: str) -> None:
    with pytest.raises(ModelConfigError, match=key):
        ModelArgs.from_dict({**_cfg(models, "qwen3_next"), **patch})


# ----------------------------------------------------------------------------------- the delta rule


def test_chunked_form_equals_recurrent_form_with_a_carried_state() -> None:
    g = torch.Generator().manual_seed(0)
    n, hk, hv, dk, dv = 150, 2, 4, 8, 6
    q, k = torch.randn(n, hk, dk, generator=g), torch.randn(n, hk, dk, generator=g)
    v = torch.randn(n, hv, dv, generator=g)
    gate = -torch.rand(n, hv, generator=g)
    beta = torch.rand(n, hv, generator=g)
    s0 = torch.randn(hv, dk, dv, generator=g) * 0.1
    s, rec = s0[None], []
    for t in range(n):
        o, s = recurrent_gated_delta_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], gate[t:t + 1], beta[t:t + 1], s)
        rec.append(o[0])
    rec_out = torch.stack(rec)
    # the whole sequence at once, and split in two with the state carried (a prefill across steps)
    whole, s_whole = chunk_gated_delta_rule(q, k, v, gate, beta, s0)
    a, s_a = chunk_gated_delta_rule(q[:70], k[:70], v[:70], gate[:70], beta[:70], s0)
    b, s_b = chunk_gated_delta_rule(q[70:], k[70:], v[70:], gate[70:], beta[70:], s_a)
    for out, last in ((whole, s_whole), (torch.cat((a, b)), s_b)):
        assert (out - rec_out).abs().max().item() <= 1e-4
        assert (last - s[0]).abs().max().item() <= 1e-4


def test_c_recurrent_step_equals_the_torch_reference() -> None:
    """The CPU's C kernel (cpu_kernels.c gdn_recurrent) against recurrent_gated_delta_rule: three
    sequences in pool slots out of order, two value heads per key head, the other slots untouched."""
    from workers.backends.cpu_deltanet import recurrent_step
    from workers.kernels import cpu_kernels
    lib = cpu_kernels.load()
    if lib is None:
        pytest.skip(f"no C kernels here: {cpu_kernels.unavailable_reason()}")
    g = torch.Generator().manual_seed(4)
    b, hk, hv, dk, dv = 3, 2, 4, 16, 24
    q, k, v = torch.randn(b, hk, dk, generator=g), torch.randn(b, hk, dk, generator=g), torch.randn(b, hv, dv, generator=g)
    gate, beta = -torch.rand(b, hv, generator=g), torch.rand(b, hv, generator=g)
    pool = torch.randn(5, hv, dk, dv, generator=g)
    slots = torch.tensor([4, 0, 2])
    want, want_state = recurrent_gated_delta_rule(q, k, v, gate, beta, pool[slots])
    got_pool = pool.clone()
    step = recurrent_step(lib)
    for _ in range(2):  # twice: the state it wrote is the one it reads next
        got = step(q, k, v, gate, beta, got_pool, slots)
        assert (got - want).abs().max().item() <= 1e-5
        assert (got_pool[slots] - want_state).abs().max().item() <= 1e-5
        want, want_state = recurrent_gated_delta_rule(q, k, v, gate, beta, want_state)
    assert torch.equal(got_pool[[1, 3]], pool[[1, 3]])


# ----------------------------------------------------------------------------------- the model


def _paged_logits(model, seqs: list[torch.Tensor], chunks: list[list[int]],
                  dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Logits of every position of each sequence, all of them in each step's flat batch: sequence
    i's prompt in ``chunks[i]``, then one decode step per remaining token."""
    a = model.args
    hy = a.hybrid
    attn = PagedAttention(model.kv_layers, 32, 16, a.num_key_value_heads, a.head_dim, dtype, torch.device("cpu"))
    model.states = StateCache(len(hy.linear_layers), 4, hy.conv_dim, hy.conv_kernel - 1, hy.num_v_heads,
                              hy.head_k_dim, hy.head_v_dim, dtype, torch.device("cpu"))
    plans = [list(c) + [1] * (len(s) - sum(c)) for s, c in zip(seqs, chunks)]
    tables = [list(range(16 * i + 15, 16 * i - 1, -1)) for i in range(len(seqs))]  # out of order on purpose
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    pos = [0] * len(seqs)
    with torch.no_grad():
        for step in range(max(len(p) for p in plans)):
            live = [i for i, p in enumerate(plans) if step < len(p)]
            ns = [plans[i][step] for i in live]
            attn.prepare([tables[i] for i in live], [pos[i] for i in live], ns)
            model.states.prepare([3 - i for i in live], [pos[i] for i in live], ns)  # slots out of order too
            ids = torch.cat([seqs[i][pos[i]:pos[i] + n] for i, n in zip(live, ns)])
            positions = torch.cat([torch.arange(pos[i], pos[i] + n) for i, n in zip(live, ns)])
            logits = model.compute_logits(model(ids, positions, attn))
            row = 0
            for i, n in zip(live, ns):
                outs[i].append(logits[row:row + n])
                row += n
                pos[i] += n
    return [torch.cat(o) for o in outs]


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(models, case: str) -> None:
    hf, path = models[case]
    model, _ = load_model(path, torch.float32)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g) for n in (90, 30)]
    with torch.no_grad():
        refs = [hf(s[None]).logits[0] for s in seqs]
    # 70 + 12 prompt tokens across two steps (the second from the carried state), then decodes; the
    # short one's prompt beside the long one's chunks, its decodes beside the long one's prompt
    outs = _paged_logits(model, seqs, [[70, 12], [20]])
    for out, ref in zip(outs, refs):
        assert (out - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("case", ["qwen3_next", "qwen3_5"])
def test_batch_invariant_form_matches_transformers(models, case: str) -> None:
    """Batch-invariant mode (ScheduleConfig.batchInvariant): every token through the recurrent step
    (the state pool's waves, prompts token by token) and the convolution summed tap by tap; the
    logits over prompt chunks and decodes equal transformers' fed one token at a time (its
    recurrent form for every token). Its bits alone and among other requests:
    tests/test_batch_invariance.py."""
    import msgspec

    from workers import settings
    hf, path = models[case]
    model, _ = load_model(path, torch.float32)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g) for n in (75, 20)]
    refs = []
    with torch.no_grad():
        for s in seqs:
            cache = transformers.DynamicCache(config=hf.config)
            refs.append(torch.cat([hf(s[None, i:i + 1], cache=cache, use_cache=True).logits[0]
                                   for i in range(len(s))]))
    before = settings.engine()
    settings.apply(msgspec.structs.replace(before, batch_invariant=True))
    try:
        outs = _paged_logits(model, seqs, [[40, 30], [20]])
        assert model.states.every_row and len(model.states.waves) == 1  # the last step: one wave of decodes
    finally:
        settings.apply(before)
    # fp32 sums in another order than transformers' over 75 recurrent steps (its own chunked and
    # recurrent forms differ by up to 6e-5 on these logits of |4|), widened by a router near a tie
    for out, ref in zip(outs, refs):
        assert (out - ref).abs().max().item() <= 2.5e-4


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_within_transformers_own_bf16_error(models, case: str) -> None:
    """bf16 weights, activations, KV and conv states (the recurrent state stays fp32) against the
    fp32 truth: never much worse than transformers' own bf16 run on the same weights."""
    import copy
    hf, path = models[case]
    model, _ = load_model(path, torch.bfloat16)
    ids = torch.randint(3, VOCAB, (60,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        truth = hf(ids[None]).logits[0]
        hf_half = copy.deepcopy(hf).to(torch.bfloat16)(ids[None]).logits[0].float()
    err = (_paged_logits(model, [ids], [[40]], torch.bfloat16)[0] - truth).abs().max().item()
    hf_err = (hf_half - truth).abs().max().item()
    # (measured on qwen3_next: ours 1.475, transformers' 1.479 on its large random logits)
    assert err <= 1.5 * hf_err + 1e-3, (err, hf_err)


@pytest.mark.parametrize("case", list(CASES))
def test_int8_w8a16_equals_the_dequantised_weights(models, case: str) -> None:
    """Every linear int8, the Gated DeltaNet projections and the experts included (the recurrent
    state and the convolution stay in the model dtype): tests/test_model_families.py's check over
    this file's paged cache and state pool, the prompt in two chunks carrying the state."""
    from tests.test_model_families import int8_check
    int8_check(models[case][1], lambda m, ids, chunks, cls: _paged_logits(m, [ids], [chunks + [12]])[0], vocab=VOCAB)


# ----------------------------------------------------------------------------------- the engine


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 80, 23, 50)]


@pytest.mark.parametrize("case", ["qwen3_next", "qwen3_5"])
def test_engine_greedy_equals_transformers_under_pressure(models, case: str) -> None:
    hf, path = models[case]
    greedy = SamplingParams(max_new_tokens=8, ignore_eos=True)
    ps = _prompts()
    want = {f"r{i}": hf_greedy(hf, p, 8) for i, p in enumerate(ps)}
    # the CPU backend: decodes through the C recurrent step where it builds; no prefix cache, no
    # speculation (the pool then has no checkpoint nor scratch rows)
    eng = make_engine(str(path), enable_prefix_cache=False, spec_method="")
    assert not eng.speculator.enabled and not eng.blocks.enable_prefix_cache
    assert eng.runner.states.rows == eng.runner.states.slots
    assert {f"r{i}": run(eng, {f"r{i}": (p, greedy)})[f"r{i}"][0] for i, p in enumerate(ps)} == want
    # 8 blocks of 16 for ~200 tokens of work: preemption; prompts cut into chunks of 24.
    eng = make_engine(str(path), num_blocks=8, max_prefill_tokens=24, max_batch_size=3, enable_prefix_cache=False,
                      spec_method="")
    assert eng.runner.states.slots == 3
    res = run(eng, {f"r{i}": (p, greedy) for i, p in enumerate(ps)})
    assert {k: v[0] for k, v in res.items()} == want
    assert eng.scheduler.num_preemptions > 0
    again = run(eng, {"x": (ps[1], greedy)})["x"][0]  # same prompt: recomputed, never resumed from a cache
    assert again == want["r1"] and eng.blocks.prefix_hits == 0
    assert eng.check_no_leaks() and sorted(eng.blocks.free_states) == [0, 1, 2]


def hf_logprobs(hf: Any, prompt: list[int], out: list[int]) -> list[float]:
    """transformers' log-probability of each token of ``out`` after ``prompt`` (one forward)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(out)[:, None])[:, 0].tolist()


def run_logged(eng, reqs: dict[str, tuple[list[int], SamplingParams]]) -> tuple[dict, dict, list[tuple[int, int]]]:
    """``run`` also collecting each request's log-probabilities and the steps' (proposed, accepted)."""
    from mindie.contract.wire import Submit
    for rid, (ids, params) in reqs.items():
        eng.add(Submit(rid, "fe", ids, params, 5))
    toks: dict[str, list[int]] = {rid: [] for rid in reqs}
    lps: dict[str, list[float]] = {rid: [] for rid in reqs}
    spec: list[tuple[int, int]] = []
    while eng.has_work():
        for o in eng.step():
            toks[o.seq.request_id] += o.token_ids
            lps[o.seq.request_id] += o.logprobs
            if o.spec_draft:
                spec.append((o.spec_draft, o.spec_accepted))
    return toks, lps, spec


class _PoolRunner:
    """What state_pool_budget reads of a runner: a row of 1,000 bytes, 3 linear layers."""

    def __init__(self, slots: int, checkpoints: int, scratch: int) -> None:
        from types import SimpleNamespace
        self.state_slots, self.state_checkpoints, self.state_scratch = slots, checkpoints, scratch
        self.kv_shape = (1, 1, 8)
        self.model = SimpleNamespace(args=SimpleNamespace(hybrid=SimpleNamespace(linear_layers=[0, 1, 2])))

    def state_bytes_per_seq(self) -> tuple[int, int]:
        return 100, 900

    def bytes_per_block(self, n: int) -> int:
        return 10 * n


def test_state_pool_is_fitted_to_the_budget(caplog) -> None:
    """A large state never refuses the budget: the slots take at most half of it (fewer sequences at
    once); the prefix checkpoints (first, as many as fit) and the verify rows (all or none:
    speculation off) share half of the rest; each cut is a WARNING naming the keys."""
    from types import SimpleNamespace
    from workers.engine.assembly import state_pool_budget
    cfg = SimpleNamespace(spec_max_batch=2, spec_tokens=4)  # 2 x 4 verify rows
    r = _PoolRunner(4, 4, 8)
    assert state_pool_budget(r, 40_000, 10, cfg) == 40_000 - 16_000  # everything fits
    assert (r.state_slots, r.state_checkpoints, r.state_scratch) == (4, 4, 8)
    r = _PoolRunner(4, 4, 8)
    with caplog.at_level("WARNING", logger="workers.engine"):
        kv = state_pool_budget(r, 10_200, 10, cfg)  # slots 4 (4,000 <= 5,100); 3 checkpoints in 3,100
    assert (r.state_slots, r.state_checkpoints, r.state_scratch) == (4, 3, 0) and kv == 10_200 - 7_000
    assert "keeps 3 state checkpoints, not 4" in caplog.text and "speculative decoding off" in caplog.text
    caplog.clear()
    r = _PoolRunner(200, 200, 8)  # maxBatchSize 200: 5 slots in half of 11,000, verify rows of 2 x 4
    with caplog.at_level("WARNING", logger="workers.engine"):
        kv = state_pool_budget(r, 11_000, 10, cfg)
    assert (r.state_slots, r.state_checkpoints, r.state_scratch) == (5, 3, 0) and kv == 11_000 - 8_000
    assert "runs at most 5 sequences at once, not 200 (maxBatchSize)" in caplog.text
    with pytest.raises(ValueError, match="one sequence's state"):
        state_pool_budget(_PoolRunner(4, 4, 8), 1005, 10, cfg)


@pytest.mark.parametrize("invariant", [False, True], ids=["chunked-form", "batch-invariant"])
@pytest.mark.parametrize("case", ["qwen3_next", "qwen3_5"])
def test_prefix_hits_resume_saved_states(models, case: str, invariant: bool) -> None:
    """Prefix caching: the linear layers' state kept at the prompt's last full block and at every
    ``state_every``-th block (here every 2nd: 32 tokens), saved inside prompt chunks of 24 that
    cross those boundaries; a repeat of the prompt and a prompt sharing its first 40 tokens resume
    from the saved states (4 and 2 cached blocks) and answer as transformers does, tokens equal
    and log-probabilities within 1e-4; a checkpoint is dropped with its evicted block."""
    import msgspec

    from workers import settings
    hf, path = models[case]
    g = torch.Generator().manual_seed(11)
    p = torch.randint(3, VOCAB, (80,), generator=g).tolist()
    q = p[:40] + torch.randint(3, VOCAB, (30,), generator=g).tolist()
    greedy = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=0)
    want = {k: hf_greedy(hf, x, 6) for k, x in (("p", p), ("q", q))}
    before = settings.engine()
    settings.apply(msgspec.structs.replace(before, batch_invariant=invariant))
    try:
        eng = make_engine(str(path), num_blocks=24, max_prefill_tokens=24, max_batch_size=4, spec_method="")
        eng.blocks.state_every = 2
        assert eng.runner.states.checkpoints == 4 and eng.blocks.enable_prefix_cache
        for rid, prompt, hits in (("p", p, 0), ("p", p, 4), ("q", q, 2)):
            before_hits = eng.blocks.prefix_hits
            toks, lps, _ = run_logged(eng, {rid: (prompt, greedy)})
            assert toks[rid] == want[rid], (rid, hits)
            assert max(abs(a - b) for a, b in zip(lps[rid], hf_logprobs(hf, prompt, want[rid]))) <= 1e-4
            assert eng.blocks.prefix_hits - before_hits == hits
        # p's checkpoints: after blocks 2 and 4 (32, 64 tokens); q's after its block 4 (64 of 70)
        kept = sorted(i for i, b in enumerate(eng.blocks.blocks) if b.state_row >= 0)
        assert len(kept) == 3 and eng.check_no_leaks()
        # other prompts' fresh blocks evict p's and q's, their checkpoints freed or taken with them
        filler = torch.randint(3, VOCAB, (200,), generator=g).tolist()
        run_logged(eng, {"f": (filler, SamplingParams(max_new_tokens=1)), "f2": (filler[1:], SamplingParams(max_new_tokens=1))})
        from workers.engine.sequence import Sequence
        assert not eng.blocks.match_prefix(Sequence(request_id="x", frontend_id="fe", prompt_len=80, tokens=list(p), params=greedy, max_new_tokens=6))
        assert eng.check_no_leaks()
    finally:
        settings.apply(before)


def oracle_proposals(eng, want: dict[str, list[int]]) -> None:
    """The engine's proposer replaced by one that knows the answers: 3 tokens a step, all right,
    the last one wrong, or the first one wrong, by turns (every kind of verify outcome, each often)."""
    turn = iter(range(1 << 30))

    def propose(seq, room: int) -> list[int]:
        done, t = seq.num_output, next(turn) % 3
        draft = list(want[seq.request_id][done:done + min(3, room)])
        if draft and t:
            j = len(draft) - 1 if t == 1 else 0
            draft[j] = (draft[j] + 1) % VOCAB
        return draft
    eng.speculator.propose = propose


@pytest.mark.parametrize("case", list(CASES))
def test_speculation_with_prefix_hits_chunks_and_preemption(models, case: str) -> None:
    """Speculative decoding on a hybrid model: the verify rows run the recurrent step token by
    token keeping the state after each, and the state after the last accepted token is the one kept
    (proposals accepted whole, rejected part-way and at once); with prefix hits, prompts in chunks
    of 24 and preemption (6 blocks of 16) at once, every answer equals transformers' (tokens, and
    log-probabilities within 1e-4 alone). Memory decoding's own proposals (a prompt again) verify
    too, here and through the launch script below."""
    hf, path = models[case]
    g = torch.Generator().manual_seed(7)
    motif = torch.randint(3, VOCAB, (6,), generator=g).tolist()
    ps = [motif * 8 + torch.randint(3, VOCAB, (n,), generator=g).tolist() + motif * 2 for n in (3, 20, 9)]
    ps.append(ps[0])  # a prefix hit once the first has finished or been preempted
    n = 12
    want = {f"r{i}": hf_greedy(hf, x, n) for i, x in enumerate(ps)}
    greedy = SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=0)
    eng = make_engine(str(path), spec_method="memory_decoding", spec_tokens=4)
    assert eng.speculator.enabled and eng.runner.states.scratch == 8 * 4  # speculationMaxBatch x gamma
    assert run_logged(eng, {"r0": (ps[0], greedy)})[0]["r0"] == want["r0"]
    # the same prompt again: a prefix hit, and memory decoding proposes the first answer's tokens
    toks, _, spec = run_logged(eng, {"r3": (ps[3], greedy)})
    assert toks["r3"] == want["r3"] and eng.blocks.prefix_hits > 0 and any(a > 0 for _, a in spec), spec
    oracle_proposals(eng, want)
    toks, lps, spec = run_logged(eng, {"r1": (ps[1], greedy)})
    assert toks["r1"] == want["r1"]
    assert max(abs(a - b) for a, b in zip(lps["r1"], hf_logprobs(hf, ps[1], want["r1"]))) <= 1e-4
    assert {d == a for d, a in spec} == {True, False} and any(0 < a < d for d, a in spec) and any(
        a == 0 for _, a in spec), spec
    eng = make_engine(str(path), num_blocks=6, max_prefill_tokens=24, max_batch_size=3, spec_method="suffix",
                      spec_tokens=4)
    oracle_proposals(eng, want)
    toks, _, spec = run_logged(eng, {f"r{i}": (x, greedy) for i, x in enumerate(ps)})
    assert toks == want
    assert eng.scheduler.num_preemptions > 0 and eng.blocks.prefix_hits > 0 and any(0 < a < d for d, a in spec)
    assert eng.check_no_leaks() and sorted(eng.blocks.free_states) == [0, 1, 2]


# ----------------------------------------------------------------------------------- the server


def test_server_infer_token_and_chat_equal_transformers(tmp_path: Path) -> None:
    path = save_chat_model(tmp_path / "chat-qwen3_5", QWEN3_CHAT_TEMPLATE, cls_name="Qwen3_5TextConfig",
                           config=dict(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                                       linear_key_head_dim=16, linear_value_head_dim=16))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    (tmp_path / "srv").mkdir()
    with demo_server(tmp_path / "srv", str(path), model={"modelName": "hybrid", "plugin_params":
                     '{"plugin_type":"memory_decoding","decoding_length":8}'},
                     schedule={"maxBatchSize": 4, "maxPrefillBatchSize": 4}) as srv:
        n = 10
        # the 70-token prompt twice: the second resumes from the state kept after its 4th block of 16
        # (a prefix hit) and speculates (memory decoding proposes the first answer's tokens)
        for ids in ([5, 6, 7, 8, 9], list(range(20, 90)), list(range(20, 90))):
            r = httpx.post(srv.url + "/infer_token", json={"input_id": ids, "stream": False, "parameters": {
                "max_new_tokens": n, "do_sample": False, "details": True, "ignore_eos": True}}, timeout=300)
            assert r.status_code == 200, r.text
            assert r.json()["details"]["generated_token_ids"] == hf_greedy(hf, ids, n), ids
        deadline = time.monotonic() + 15  # the figures come with the worker's heartbeats
        while time.monotonic() < deadline and not (metric(srv.url, "npu_prefix_cache_hit_rate") > 0 and metric(
                srv.url, "vllm:spec_decode_num_drafts_total") > 0):
            time.sleep(0.5)
        assert metric(srv.url, "npu_prefix_cache_hit_rate") > 0
        assert metric(srv.url, "vllm:spec_decode_num_accepted_tokens_total") > 0
        messages = [{"role": "user", "content": "What does a Gated DeltaNet layer keep?"}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        want = hf_greedy(hf, list(ids), n)
        r = httpx.post(srv.url + "/v1/chat/completions", json={
            "model": "hybrid", "messages": messages, "max_tokens": n, "temperature": 0}, timeout=300)
        assert r.status_code == 200, r.text
        if tok.eos_token_id in want:
            want = want[:want.index(tok.eos_token_id)]
        assert r.json()["choices"][0]["message"]["content"] == tok.decode(want, skip_special_tokens=True)
        log = srv.tail(400)
        # 3 linear layers x (conv (2*32+64) x 3 + recurrent 4 x 16 x 16 x 4); 1 full layer x K and V x 1 x 32 x 4
        per_seq = 3 * ((2 * 32 + 64) * 3 * 4 + 4 * 16 * 16 * 4)
        # + 4 prefix-cache checkpoints (one a slot) + 4 x 8 verify rows (min(speculationMaxBatch 8, 4) x 8 tokens)
        assert re.search(rf"state pool: 4 slots \(maxBatchSize\) x {per_seq} bytes per sequence .*, \+ 4 prefix-cache "
                         rf"checkpoints \+ 32 speculative verify rows of the same size = {40 * per_seq / 2**20:.2f} MiB",
                         log), log[-3000:]
        assert "KV cache 256 bytes per token (1 full-attention layers)" in log, log[-3000:]
        assert "speculative decoding: memory_decoding" in log, log[-3000:]


def test_lora_refused_naming_the_hybrid_layers(models) -> None:
    """A LoRA adapter cannot be combined with a Gated DeltaNet layer: the worker's refusal (a load
    answered 400 with it, LoraModules refused at start) names both; a tensor-parallel instance
    names its own."""
    from workers.engine.assembly import lora_refusal
    model, _ = load_model(models["qwen3_5"][1], torch.float32)
    assert re.fullmatch(
        r"LoRA adapters are not served for hybrid linear-attention models \(Qwen3-Next / Qwen3\.5\).*",
        lora_refusal(model, False))
    assert "tensor-parallel" in lora_refusal(model, True)
