"""The engine in-process on real models: paged KV cache, continuous batching, chunked
prefill, preemption, prefix caching, priorities, stopping, seeds, and greedy continuations
identical to transformers for every model family."""
from __future__ import annotations

import json
import random
import shutil
import threading

import msgspec
import pytest
import torch

from mindie.contract.errors import FINISH_EOS, FINISH_LENGTH
from mindie.contract.spec import EngineConfig, WorkerSpec
from mindie.contract.wire import SamplingParams, Submit
from workers.backends.cpu import CpuBackend
from workers.backends.cpu_linear import pack_linears
from workers.attention.paged import PagedAttention
from workers.engine.engine import CapacityError, Engine
from workers.engine.assembly import load_runner

transformers = pytest.importorskip("transformers")


class PortableCpuBackend(CpuBackend):
    """The CPU backend without its C kernels: the portable torch attention, norms and rope (the
    CUDA path's code)."""

    def attention_class(self) -> type:
        return PagedAttention

    def prepare_model(self, model) -> None:
        pack_linears(model)


def make_engine(model_dir: str, num_blocks: int = 256, block_size: int = 16, dtype: str = "float32",
                portable: bool = False, overlap: bool = False, thread_init=None, **cfg) -> Engine:
    engine_cfg = EngineConfig(block_size=block_size, overlap=overlap, **cfg)
    spec = WorkerSpec(worker_id="t", job_endpoint="", pub_endpoint="", model_path=model_dir, dtype=dtype,
                      engine=engine_cfg)
    runner = load_runner(spec, PortableCpuBackend() if portable else CpuBackend())
    runner.allocate_kv(num_blocks, block_size)
    return Engine(runner, engine_cfg, num_blocks, thread_init=thread_init)


def run(engine: Engine, reqs: dict[str, tuple[list[int], SamplingParams]], priority: dict | None = None,
        ) -> dict[str, tuple[list[int], str]]:
    for rid, (ids, params) in reqs.items():
        engine.add(Submit(rid, "fe", ids, params, (priority or {}).get(rid, 5)))
    out: dict[str, list[int]] = {rid: [] for rid in reqs}
    reasons: dict[str, str] = {}
    for _ in range(100000):
        if not engine.has_work():
            break
        for o in engine.step():
            out[o.seq.request_id].extend(o.token_ids)
            if o.finish_reason:
                reasons[o.seq.request_id] = o.finish_reason
    return {rid: (out[rid], reasons.get(rid, "")) for rid in reqs}


def prompts(n: int, lo: int = 3, hi: int = 90, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 32000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(demo_model) -> dict[str, list[int]]:
    """Greedy outputs of 64 mixed-length prompts, each run alone."""
    ps = prompts(64)
    eng = make_engine(demo_model)
    res = {}
    for i, p in enumerate(ps):
        res[f"r{i}"] = run(eng, {f"r{i}": (p, GREEDY)})[f"r{i}"][0]
    assert eng.check_no_leaks()
    return res


@pytest.mark.parametrize("variant", ["batch64", "tiny_cache_preemption", "chunked_prefill", "all", "all_overlapped"])
def test_greedy_outputs_independent_of_batching(demo_model, alone, variant):
    ps = prompts(64)
    kw = {"batch64": {}, "tiny_cache_preemption": dict(num_blocks=40),
          "chunked_prefill": dict(max_prefill_tokens=37),
          # (without speculative decoding, whose shorter runs leave this cache without preemptions:
          # tests/test_speculative.py preempts with it)
          "all": dict(num_blocks=40, max_prefill_tokens=37, max_batch_size=20, spec_method=""),
          "all_overlapped": dict(num_blocks=40, max_prefill_tokens=37, max_batch_size=20, overlap=True,
                                 spec_method="")}[variant]
    eng = make_engine(demo_model, **kw)
    res = run(eng, {f"r{i}": (p, GREEDY) for i, p in enumerate(ps)})
    assert {k: v[0] for k, v in res.items()} == alone
    assert all(reason == FINISH_LENGTH for _, reason in res.values())
    if "num_blocks" in kw:
        assert eng.scheduler.num_preemptions > 0
    assert eng.check_no_leaks()


def test_prefix_cache_hit_gives_same_output(demo_model):
    eng = make_engine(demo_model)
    base = prompts(1, 70, 71, seed=4)[0]
    first = run(eng, {"a": (base + [7, 8], GREEDY)})["a"][0]
    hits_before = eng.blocks.prefix_hits
    second = run(eng, {"b": (base + [7, 8], GREEDY)})["b"][0]
    assert eng.blocks.prefix_hits - hits_before == 4  # 72 tokens: four full blocks of 16 reused
    assert first == second
    # A shared prefix with a different tail reuses the blocks and matches a cold run.
    third = run(eng, {"c": (base + [9], GREEDY)})["c"][0]
    cold = run(make_engine(demo_model, enable_prefix_cache=False), {"c": (base + [9], GREEDY)})["c"][0]
    assert third == cold
    assert eng.check_no_leaks()


def test_priority_ordering_under_saturation(demo_model):
    eng = make_engine(demo_model, max_batch_size=1)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    order: list[str] = []
    eng.add(Submit("busy", "fe", [5, 6, 7], params, 5))
    eng.step()  # "busy" runs; the batch (max 1) is full from here on
    for rid, prio in [("p5a", 5), ("p5b", 5), ("p1", 1), ("p3", 3)]:
        eng.add(Submit(rid, "fe", [5, 6, 7], params, prio))
    while eng.has_work():
        for o in eng.step():
            if o.finish_reason:
                order.append(o.seq.request_id)
    assert order == ["busy", "p1", "p3", "p5a", "p5b"]


def test_request_too_large_for_cache_is_rejected(demo_model):
    eng = make_engine(demo_model, num_blocks=4)  # 64 token slots
    with pytest.raises(CapacityError, match="needs 5 KV cache blocks .* holds only 4 blocks"):
        eng.add(Submit("big", "fe", [5] * 60, SamplingParams(max_new_tokens=20)))
    assert eng.add(Submit("ok", "fe", [5] * 40, SamplingParams(max_new_tokens=20))).request_id == "ok"


def test_no_block_leaks_after_cancel_timeout_and_preemption(demo_model):
    eng = make_engine(demo_model, num_blocks=30)
    ps = prompts(12, seed=8)
    for i, p in enumerate(ps):
        eng.add(Submit(f"r{i}", "fe", p, SamplingParams(max_new_tokens=60, ignore_eos=True)))
    for _ in range(6):
        eng.step()
    for rid in ("r3", "r0", "r5", "r11"):  # cancels and timeouts (the front end's) alike
        assert eng.abort(rid) is not None
    while eng.has_work():
        eng.step()
    assert eng.scheduler.num_preemptions > 0
    assert eng.check_no_leaks()


def test_overlapped_step_cancel_in_flight(demo_model, alone):
    """With overlap a step computes on the engine's thread; a request cancelled (or timed out)
    while its step is in flight gets no output from that step, its blocks are freed once the
    step is collected, and the others are unaffected."""
    ps = prompts(64)
    eng = make_engine(demo_model, overlap=True)
    for i in range(4):
        eng.add(Submit(f"r{i}", "fe", ps[i], GREEDY))
    flight = eng.launch()
    assert flight is not None and len(flight.batch.seqs) == 4
    with pytest.raises(RuntimeError, match="in flight"):
        eng.launch()
    free_before = eng.blocks.num_free
    assert eng.abort("r1") is not None and eng.abort("r2") is not None
    assert eng.blocks.num_free == free_before  # still in use by the computing step
    outs = eng.collect(flight)
    assert sorted(o.seq.request_id for o in outs) == ["r0", "r3"]
    assert eng.blocks.num_free > free_before
    got = {o.seq.request_id: list(o.token_ids) for o in outs}
    while eng.has_work():
        for o in eng.step():
            got[o.seq.request_id].extend(o.token_ids)
    assert got == {"r0": alone["r0"], "r3": alone["r3"]}
    assert eng.check_no_leaks()
    eng.close()


def test_overlapped_step_intake_and_cancel_of_waiting_while_computing(demo_model, alone):
    """While a step computes, the loop thread admits new requests and cancels one that is
    still waiting (its blocks, none yet, and queue slot go at once); the thread init hook runs
    on the compute thread."""
    ps = prompts(64)
    seen = []
    eng = make_engine(demo_model, overlap=True, max_batch_size=2,
                      thread_init=lambda: seen.append(threading.current_thread().name))
    for i in range(3):
        eng.add(Submit(f"r{i}", "fe", ps[i], GREEDY))
    flight = eng.launch()
    assert {s.request_id for s in flight.batch.seqs} == {"r0", "r1"}  # r2 waits: batch cap 2
    eng.add(Submit("r3", "fe", ps[3], GREEDY))
    assert eng.abort("r2") is not None and eng.num_waiting == 1
    got = {o.seq.request_id: list(o.token_ids) for o in eng.collect(flight)}
    while eng.has_work():
        for o in eng.step():
            got.setdefault(o.seq.request_id, []).extend(o.token_ids)
    assert got == {"r0": alone["r0"], "r1": alone["r1"], "r3": alone["r3"]}
    assert eng.check_no_leaks()
    eng.close()
    assert seen and seen[0].startswith("engine-compute")


def test_overlapped_step_failure_is_raised_by_collect(demo_model):
    eng = make_engine(demo_model, overlap=True)
    eng.add(Submit("r", "fe", [5, 6, 7], GREEDY))

    def boom(tokens: int):
        raise ValueError("device lost")

    flight = eng.launch(before=boom)
    with pytest.raises(ValueError, match="device lost"):
        eng.collect(flight)
    assert eng.abort("r") is not None
    assert eng.check_no_leaks()
    eng.close()


def test_seeded_sampling_independent_of_batch(demo_model):
    params = SamplingParams(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1,
                            seed=424242, max_new_tokens=32, ignore_eos=True)
    p = prompts(1, seed=11)[0]
    alone_out = run(make_engine(demo_model), {"s": (p, params)})["s"][0]
    mix = {f"m{i}": (q, SamplingParams(do_sample=i % 2 == 0, temperature=0.5 + i / 40, top_k=i, seed=i,
                                       max_new_tokens=10 + i, ignore_eos=True))
           for i, q in enumerate(prompts(31, seed=12))}
    mix["s"] = (p, params)
    batched = run(make_engine(demo_model, num_blocks=60), mix)["s"][0]
    assert batched == alone_out
    other = run(make_engine(demo_model), {"s": (p, msgspec.structs.replace(params, seed=424243))})["s"][0]
    assert other != alone_out


def test_eos_from_generation_config_list(demo_model, tmp_path):
    eng = make_engine(demo_model)
    for seed in range(50):  # a prompt whose greedy output has a token not seen before it
        p = prompts(1, seed=seed)[0]
        greedy = run(eng, {"g": (p, SamplingParams(max_new_tokens=10))})["g"][0]
        fresh = [k for k in range(1, 10) if greedy[k] not in greedy[:k]]
        if fresh:
            break
    k = fresh[0]
    stop_tok = greedy[k]
    model = tmp_path / "model"
    shutil.copytree(demo_model, model)
    gen = json.loads((model / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, stop_tok]
    (model / "generation_config.json").write_text(json.dumps(gen))
    eng = make_engine(str(model))
    out, reason = run(eng, {"e": (p, SamplingParams(max_new_tokens=10))})["e"]
    assert (out, reason) == (greedy[:k + 1], FINISH_EOS)
    out, reason = run(eng, {"i": (p, SamplingParams(max_new_tokens=10, ignore_eos=True))})["i"]
    assert (out, reason) == (greedy, FINISH_LENGTH)


def test_max_seq_len_is_an_invariant(demo_model):
    """The front end caps the output at maxSeqLen (tests/test_validation.py); the engine runs
    exactly up to it and refuses a request beyond it instead of truncating it silently."""
    eng = make_engine(demo_model, max_seq_len=40)
    out, reason = run(eng, {"a": ([5] * 30, SamplingParams(max_new_tokens=10, ignore_eos=True))})["a"]
    assert (len(out), reason) == (10, FINISH_LENGTH)
    with pytest.raises(AssertionError, match="exceed maxSeqLen 40"):
        eng.add(Submit("b", "fe", [5] * 30, SamplingParams(max_new_tokens=11)))
    with pytest.raises(AssertionError, match="outside the vocabulary"):
        eng.add(Submit("c", "fe", [5, 32000], SamplingParams(max_new_tokens=1)))
    assert eng.check_no_leaks()


# -- every model family: 64 greedy tokens identical to transformers ---------------------------
from tests.test_models import CASES, _make_hf  # noqa: E402


@pytest.mark.parametrize("attention", ["cpu-kernels", "portable"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_continuation_matches_transformers(case, attention, tmp_path):
    hf, path = _make_hf(case, tmp_path)
    rng = random.Random(1)
    ps = [[rng.randrange(3, 160) for _ in range(n)] for n in (5, 24, 37)]
    n_new = 64
    expected = []
    with torch.no_grad():
        for p in ps:
            ids = list(p)
            for _ in range(n_new):
                logits = hf(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
            expected.append(ids[len(p):])
    # Block size 16 so sequences span several blocks; prefill chunks of 20 tokens.
    eng = make_engine(str(path), num_blocks=64, max_prefill_tokens=20, portable=attention == "portable")
    expect_cls = "PagedAttention" if attention == "portable" else "CpuPagedAttention"
    assert type(eng.runner.attn).__name__ == expect_cls
    res = run(eng, {f"p{i}": (p, SamplingParams(max_new_tokens=n_new, ignore_eos=True)) for i, p in enumerate(ps)})
    for i in range(len(ps)):
        assert res[f"p{i}"][0] == expected[i], f"{case}: prompt {i} diverged"
    assert eng.check_no_leaks()


def test_decode_metadata_equals_the_general_builder() -> None:
    """build_metadata's path for steps of decodes only gives the tensors the general one does
    (padded tables included), dense, as the C kernels read them."""
    from workers.attention import paged as A
    rng = random.Random(5)
    cpu = torch.device("cpu")
    for _ in range(300):
        b, bs = rng.randint(1, 40), rng.choice([1, 4, 16, 128])
        starts = [rng.randint(0, 700) for _ in range(b)]
        tables = [[rng.randint(0, 999) for _ in range(s // bs + 1 + rng.randint(0, 3))] for s in starts]
        fast = A.build_metadata(tables, starts, [1] * b, bs, cpu)
        ref = A._mixed_metadata(tables, starts, [1] * b, bs, cpu)
        assert fast.prefill is None and ref.prefill is None and fast.num_tokens == ref.num_tokens == b
        for a, r in ((fast.blocks, ref.blocks), (fast.offsets, ref.offsets), (fast.decode.rows, ref.decode.rows),
                     (fast.decode.tables, ref.decode.tables), (fast.decode.pos, ref.decode.pos)):
            assert a.dtype == r.dtype == torch.long and a.is_contiguous() and torch.equal(a, r)
    assert A.build_metadata([], [], [], 16, cpu).num_tokens == 0  # an empty step: the general builder
    # one prompt chunk in the batch: the general builder
    mixed = A.build_metadata([[3, 4], [5]], [130, 7], [1, 5], 128, cpu)
    assert mixed.prefill is not None and mixed.decode.rows.tolist() == [0]
