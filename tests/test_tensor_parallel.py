"""Tensor parallelism on CPU with gloo (issue 15): sharding, exactness against a single worker,
per-rank memory, batch-invariant mode's same bits alone and together on four ranks (issue 57), and a
real server of two 2-rank instances with a rank killed under load."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.harness import (InferStreams, Server, alive, descendants, free_port, run_tp_instance, short_run_dir,
                           write_config)
from tests.tiny_hf import save_random_model
from workers.models.config import ModelArgs, ModelConfigError
from workers.models.loader import load_model, parameter_bytes
from workers.models.sharding import TensorParallel, plan_shard

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=161, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
# An odd vocabulary (the last rank's embedding rows are padding) in every case.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # Biases on q/k/v/o and the MLP: o and down biases must be added once, after the all-reduce.
    "llama_bias": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True)),
    # Qwen2: q/k/v bias, tied embedding (the LM head is the vocab-parallel embedding shard).
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    # One KV head for two ranks: replicated.
    "kv1": ("LlamaConfig", dict(num_key_value_heads=1)),
}


def _make(case: str, root: Path) -> Path:
    cls, extra = CASES[case]
    save_random_model(cls, {**BASE, **extra}, root / case)
    return root / case


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    return {case: _make(case, root) for case in CASES}


def _requests() -> list[dict]:
    prompts = [[5, 6, 7, 8, 9], list(range(10, 90)), [3] * 17, list(range(100, 160, 3))]  # 80 tokens: chunked
    reqs = [{"id": f"g{i}", "prompt": p, "params": {"max_new_tokens": 24, "ignore_eos": True}}
            for i, p in enumerate(prompts)]
    reqs += [{"id": f"s{i}", "prompt": p, "params": {"max_new_tokens": 24, "ignore_eos": True, "do_sample": True,
                                                    "temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 7 + i}}
             for i, p in enumerate(prompts)]
    return reqs


def _run(model: Path, world: int, tmp: Path, env: dict[str, str] | None = None,
         requests: list[dict] | None = None) -> dict:
    """tests/tp_instance.py's result; ``env``: its TP_TEST_* switches (batch-invariant mode, requests
    alone). A single worker's result is the session's reference (llama_bias's serves both
    test_tp2_generates_what_one_worker_does and test_tp4_with_replicated_kv_heads); with the default
    requests and switches every case's reference comes from the first one's process."""
    siblings = [model.parent / c for c in CASES] if env is None and requests is None else []
    return run_tp_instance(model, world, tmp, requests or _requests(), env, siblings)


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_generates_what_one_worker_does(models: dict[str, Path], case: str, tmp_path: Path) -> None:
    """Greedy and seeded-sampling continuations (chunked prefill included) of a 2-rank instance
    equal those of a single worker on the same weights, token for token."""
    one = _run(models[case], 1, tmp_path)
    two = _run(models[case], 2, tmp_path)
    assert all(len(t) == 24 for t in one["tokens"].values())
    assert two["tokens"] == one["tokens"]
    # Greedy differs from sampling (the sampled runs are not a greedy run in disguise).
    assert one["tokens"]["g0"] != one["tokens"]["s0"] or one["tokens"]["g1"] != one["tokens"]["s1"]


def test_tp4_with_replicated_kv_heads(models: dict[str, Path], tmp_path: Path) -> None:
    """Four ranks over 4 query heads and 2 KV heads: each KV head is kept by two ranks."""
    assert _run(models["llama_bias"], 4, tmp_path)["tokens"] == _run(models["llama_bias"], 1, tmp_path)["tokens"]


def test_batch_invariant_mode_gives_the_same_bits_alone_and_together_on_four_ranks(models: dict[str, Path],
                                                                                  tmp_path: Path) -> None:
    """Batch-invariant mode (ScheduleConfig.batchInvariant) on a 4-rank instance: each request's
    tokens and their log-probabilities are the same bits run all together (prompt chunks beside
    other prompts and decodes) and then alone (one request at a time in the same instance, its
    prompt a prefix-cache hit where blocks remain). Each rank computes its shard of a row alone (the
    C kernels' products, per-row attention); the cross-rank sums add the ranks' parts in rank order
    (TensorParallel.all_reduce ``ordered``: gloo's ring orders an element's additions by the
    buffer's size, which here gave other log-probabilities alone). Two ranks' sum is one addition
    and needs no order."""
    reqs = [{**r, "params": {**r["params"], "logprobs": 0, "max_new_tokens": 12}} for r in _requests()[:5]]
    out = _run(models["qwen2"], 4, tmp_path, {"TP_TEST_INVARIANT": "1", "TP_TEST_ALONE": "1"}, reqs)
    ids = [r["id"] for r in reqs]
    together = {k: {i: out[k][i] for i in ids} for k in ("tokens", "logprobs")}
    alone = {k: {i: out[k][i + "/alone"] for i in ids} for k in ("tokens", "logprobs")}
    assert all(len(t) == 12 for t in together["tokens"].values())
    assert all(len(together["logprobs"][k]) == 12 for k in together["tokens"])
    assert alone["tokens"] == together["tokens"]
    assert alone["logprobs"] == together["logprobs"]  # floats through JSON: equal bits


@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_loads_its_shard(models: dict[str, Path], case: str) -> None:
    """Each rank holds about half the parameter bytes, and the shards put back together are the
    checkpoint (q/k/v heads, gate/up columns, o/down input columns, vocabulary rows)."""
    path = models[case]
    args = ModelArgs.from_dir(path)
    full, _ = load_model(path, torch.float32)
    ranks = [load_model(path, torch.float32, tp=TensorParallel(plan_shard(args, r, 2)))[0] for r in range(2)]
    whole = parameter_bytes(full)
    for m in ranks:
        assert 0.45 < parameter_bytes(m) / whole < 0.56, (parameter_bytes(m), whole)
    d = args.head_dim
    emb = torch.cat([m.embed_tokens.weight for m in ranks])
    assert torch.equal(emb[:args.vocab_size], full.embed_tokens.weight) and not emb[args.vocab_size:].any()
    for i in range(args.num_hidden_layers):
        f, parts = full.layers[i], [m.layers[i] for m in ranks]
        q = torch.cat([p.self_attn.qkv_proj.weight[:2 * d] for p in parts])
        assert torch.equal(q, f.self_attn.qkv_proj.weight[:args.q_size])
        o = torch.cat([p.self_attn.o_proj.weight for p in parts], dim=1)
        assert torch.equal(o, f.self_attn.o_proj.weight)
        down = torch.cat([p.mlp.down_proj.weight for p in parts], dim=1)
        assert torch.equal(down, f.mlp.down_proj.weight)
        inter = args.intermediate_size // 2
        gate = torch.cat([p.mlp.gate_up_proj.weight[:inter] for p in parts])
        assert torch.equal(gate, f.mlp.gate_up_proj.weight[:args.intermediate_size])
        k_full = f.self_attn.qkv_proj.weight[args.q_size:args.q_size + args.kv_size]
        k_parts = [p.self_attn.qkv_proj.weight[2 * d:2 * d + p.self_attn.kv_size] for p in parts]
        if args.num_key_value_heads >= 2:
            assert torch.equal(torch.cat(k_parts), k_full)
        else:  # replicated
            assert all(torch.equal(k, k_full) for k in k_parts)
        if f.self_attn.o_proj.bias is not None:  # rank 0 adds the bias once
            assert torch.equal(parts[0].self_attn.o_proj.bias, f.self_attn.o_proj.bias)
            assert not parts[1].self_attn.o_proj.bias.any()


def test_shard_plan_refuses_what_does_not_divide() -> None:
    args = ModelArgs.from_dict({**BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    with pytest.raises(ModelConfigError, match=r"ModelConfig\[0\]\.worldSize: 3 ranks cannot split this model: "
                                               r"num_attention_heads 4 is not a multiple of 3"):
        plan_shard(args, 0, 3)
    s = plan_shard(args, 1, 4)  # 2 KV heads over 4 ranks: rank 1 keeps KV head 0
    assert (s.heads, s.kv_heads, s.kv_head0, s.inter, s.vocab, s.vocab0, s.vocab_rows) == (1, 1, 0, 28, 41, 41, 41)
    assert plan_shard(args, 3, 4).vocab_rows == 161 - 123


# -- a server of two 2-rank instances ------------------------------------------------------------
def _tp_server(tmp: Path, model: str, env: dict | None = None) -> Server:
    port = free_port()
    cfg = write_config(tmp / "config.json", port=port, run_dir=short_run_dir(), workers=2, model_path=model,
                       model={"worldSize": 2})
    data = json.loads(cfg.read_text())
    data["BackendConfig"]["npuDeviceIds"] = [[0, 1], [2, 3]]
    cfg.write_text(json.dumps(data, indent=2))
    return Server(cfg, port, env=env)


def _ranks(srv: Server) -> dict[tuple[str, int], int]:
    """(instance, rank) -> pid of every live worker process."""
    out = {}
    for pid in descendants(srv.proc.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"workers.worker" not in argv or not alive(pid):
            continue
        spec = json.loads(argv[argv.index(b"--spec") + 1])
        rank = int(argv[argv.index(b"--rank") + 1]) if b"--rank" in argv else 0
        out[(spec["worker_id"], rank)] = pid
    return out


def _slots_full(srv: Server, want: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    st: dict = {}
    while time.monotonic() < deadline:
        try:
            st = httpx.get(srv.url + "/v1/status", timeout=10).json()["resource"]
        except httpx.HTTPError:
            st = {}
        if st.get("availSlotsNum") == want:
            return st
        time.sleep(0.2)
    raise AssertionError(f"slots {st} never reached {want}:\n{srv.tail()}")


@pytest.mark.timeout(300)
def test_server_of_two_tp_instances_survives_a_rank_kill(tmp_path: Path, demo_model: str) -> None:
    """npuDeviceIds [[0,1],[2,3]], worldSize 2, deviceType cpu: two instances of two processes.
    16 concurrent streams complete through both; kill -9 of rank 1 of one instance ends that
    instance's streams with errors within seconds while the other's finish, and the group comes
    back (new processes for both of its ranks) and serves again."""
    srv = _tp_server(tmp_path, demo_model)
    try:
        srv.wait_ready(120)
        _slots_full(srv, 2 * 64, 60)
        before = _ranks(srv)
        assert sorted(before) == [("w0", 0), ("w0", 1), ("w1", 0), ("w1", 1)], before

        # 16 concurrent streams, while /v2/status shows KV blocks taken on both instances. The
        # idle figures are read first: once streams run, a heartbeat may already count blocks.
        idle = httpx.get(srv.url + "/v2/status", timeout=10).json()["resource"]["dpInstMap"]
        streams = InferStreams(srv.url, 16, 48, lambda i: [5 + i, 6, 7])
        used: set[str] = set()
        deadline = time.monotonic() + 60
        while len(used) < 2 and time.monotonic() < deadline and any(t.is_alive() for t in streams.threads):
            now = httpx.get(srv.url + "/v2/status", timeout=10).json()["resource"]["dpInstMap"]
            used |= {k for k, v in now.items() if v < max(idle.values())}
            time.sleep(0.02)
        streams.join()
        assert used == {"0", "1"}, (idle, used)
        assert streams.outcome() == ([], 16)
        assert all(ev[-1]["generated_text"] is not None for ev in streams.events)

        # Long streams on both instances, then rank 1 of w0 is killed.
        streams = InferStreams(srv.url, 8, 500)
        streams.wait_started()
        deadline = time.monotonic() + 10  # the next heartbeats carry the blocks taken
        while True:
            busy = httpx.get(srv.url + "/v2/status", timeout=10).json()["resource"]["dpInstMap"]
            if all(v < max(idle.values()) for v in busy.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert all(v < max(idle.values()) for v in busy.values()), (idle, busy)
        t0 = time.monotonic()
        os.kill(before[("w0", 1)], signal.SIGKILL)
        streams.join()
        failed, finished = streams.outcome()
        assert failed and finished, srv.tail()
        assert max(failed) - t0 < 8, "the killed instance's streams did not end within seconds"

        # The group comes back: both of w0's ranks are new processes, and it serves.
        _slots_full(srv, 2 * 64, 90)
        after = _ranks(srv)
        assert after[("w0", 0)] != before[("w0", 0)] and after[("w0", 1)] != before[("w0", 1)], (before, after)
        assert after[("w1", 0)] == before[("w1", 0)] and after[("w1", 1)] == before[("w1", 1)]
        assert "rank 1 of worker w0 killed by SIGKILL" in srv.tail(400)
        for i in range(6):
            r = httpx.post(srv.url + "/infer", json={"input_id": [5, 6, 7 + i], "parameters": {
                "max_new_tokens": 8, "ignore_eos": True, "details": True}}, timeout=60)
            assert r.status_code == 200 and r.json()["details"]["generated_tokens"] == 8, r.text
    finally:
        assert srv.stop() == 0, srv.tail()
    assert not [p for p in before.values() if alive(p)]


@pytest.mark.timeout(300)
def test_a_hung_rank_is_detected_by_the_collective_timeout(tmp_path: Path, demo_model: str) -> None:
    """A rank that stops answering (SIGSTOP) is not a silent stall: rank 0's next collective times
    out (MINDIE_TP_COLLECTIVE_TIMEOUT_S, 3 s here), the instance's streams end with errors, and
    the supervisor restarts the whole group."""
    srv = _tp_server(tmp_path, demo_model, env={"MINDIE_TP_COLLECTIVE_TIMEOUT_S": "3"})
    try:
        srv.wait_ready(120)
        _slots_full(srv, 2 * 64, 60)
        before = _ranks(srv)
        streams = InferStreams(srv.url, 6, 500)
        streams.wait_started()
        t0 = time.monotonic()
        os.kill(before[("w1", 1)], signal.SIGSTOP)
        streams.join()
        failed, finished = streams.outcome()
        assert failed and finished, srv.tail()
        assert max(failed) - t0 < 3 + 6, "the stalled instance's streams did not end soon after the timeout"
        # The restarted group's new ranks (polled: the other instance's streams may end before the
        # supervisor has noticed the exit, e.g. with speculative decoding's shorter runs, and the
        # last heartbeat still shows the old group's free slots)
        deadline = time.monotonic() + 90
        while True:
            after = _ranks(srv)
            if (after.get(("w1", 0), before[("w1", 0)]) != before[("w1", 0)]
                    and after.get(("w1", 1), before[("w1", 1)]) != before[("w1", 1)]):
                break
            assert time.monotonic() < deadline, f"w1 was not restarted: {after}\n{srv.tail()}"
            time.sleep(0.2)
        _slots_full(srv, 2 * 64, 90)
        assert not alive(before[("w1", 1)]), "the stopped rank was left behind"
    finally:
        assert srv.stop() == 0, srv.tail()


def test_startup_names_the_rank_that_did_not_come_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.engine import tp_group

    monkeypatch.setattr(tp_group, "START_TIMEOUT_S", 1.0)
    t0 = time.monotonic()
    with pytest.raises(tp_group.GroupError, match=r"instance w3: rank\(s\) \[1, 2\] did not come up within 1 s"):
        tp_group.join("w3", 0, 3, str(tmp_path / "store"), "cpu")
    assert time.monotonic() - t0 < 5
