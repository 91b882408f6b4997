"""GPT-OSS (issue 53, item 3 and its part of item 6), against transformers 5.25's GptOssForCausalLM on
tiny random checkpoints built here (fp32, save_pretrained):

- config: GPT-OSS's keys (experts, clamped SwiGLU, YaRN, layer_types windows, biases) read and
  checked, errors naming the key (an MXFP4 checkpoint's ``quantization_config`` among them);
- logits: our decoder over the paged KV cache (portable torch and the CPU attention, whose C
  kernels take the sinks) equals transformers' with attention sinks, alternating sliding
  and full layers, a prompt longer than the window, in chunks then decodes; the sinks change the
  answer (so a decoder that ignored them would fail); bf16 within transformers' own bf16 error;
- engine: greedy outputs through chunked prefill, preemption and a prefix-cache hit equal
  transformers' greedy continuation, the decodes in the fused C step (attention with the sinks,
  the experts between its calls);
- harmony: the reasoning and tool-call parsers on token sequences of a tokenizer with harmony's
  special tokens, through the streaming detokeniser token by token, whole and streamed alike;
- the real launch script on a tiny GPT-OSS chat model: /infer_token equals transformers' greedy
  output, and the OpenAI chat route, its output forced into harmony's shape by a Lark grammar,
  answers the analysis channel as reasoning_content and the commentary call as a tool call,
  streamed and not.
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from mindie.contract.wire import SamplingParams
from mindie.text.chat_template import load_chat_template
from mindie.text.detokenizer import load_tokenizer
from mindie.text.reasoning import PARSERS, detect, split
from mindie.text.tool_parsers.base import ToolCallStream, parse_text
from mindie.text.tool_parsers.harmony import HarmonyParser
from mindie.text.tool_parsers.registry import detect as detect_tools
from tests.harness import demo_server
from tests.tiny_hf import random_model
from workers.attention import CpuPagedAttention, PagedAttention
from workers.models.config import ModelArgs, ModelConfigError
from workers.models.loader import load_model

transformers = pytest.importorskip("transformers")

from tests.test_deepseek import _paged_logits as ds_paged_logits, hf_greedy  # noqa: E402
from tests.test_engine import make_engine, run  # noqa: E402

pytestmark = pytest.mark.timeout(900)

VOCAB = 300
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=2, sliding_window=12,
            max_position_embeddings=1024, rope_parameters=YARN, bos_token_id=1, eos_token_id=2)


def _gpt_oss(config: dict[str, Any]) -> Any:
    """A random GptOssForCausalLM whose sinks are large enough to matter (the default init's are ~0.08)."""
    hf = random_model("GptOssConfig", config)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return hf


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    path = tmp_path_factory.mktemp("gpt_oss") / "tiny"
    hf = _gpt_oss(BASE)
    hf.save_pretrained(path)
    return hf, path


# -- config ------------------------------------------------------------------------------------------


def test_config_reads_gpt_oss_keys(model) -> None:
    a = ModelArgs.from_dir(model[1])
    g = a.gpt_oss
    assert a.arch == "gpt_oss" and g is not None
    assert (g.num_experts, g.top_k, g.swiglu_alpha, g.swiglu_limit) == (6, 2, 1.702, 7.0)
    assert a.layer_windows == (12, None, 12, None)  # transformers' default layer_types: sliding, full, ...
    assert a.attention_bias and a.o_proj_bias and a.moe is None
    assert g.yarn == (4.0, 32.0, 1.0, 64, False)
    assert g.rope_attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1.0)
    # the YaRN frequencies and factor equal transformers'
    hf_rope = model[0].model.rotary_emb
    ours = load_model(model[1], torch.float32)[0].rope
    pos = torch.arange(200)
    cos, _ = hf_rope(torch.zeros(1, dtype=torch.float32), pos[None])
    assert torch.equal(ours.cos[:200], cos[0, :, :8])


@pytest.mark.parametrize("patch,key", [
    ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_parameters.rope_type"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"swiglu_limit": -1}, "swiglu_limit"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention", "full_attention"]}, "layer_types"),
])
def test_config_errors_name_the_key(tmp_path: Path, patch: dict, key: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "model_type": "gpt_oss", **patch}))
    with pytest.raises(ModelConfigError, match=re.escape(key)):
        ModelArgs.from_dir(tmp_path)


# -- logits over the paged cache ---------------------------------------------------------------------


def _paged_logits(model, cls: type, ids: torch.Tensor, chunks: list[int], dtype=torch.float32) -> torch.Tensor:
    """Logits of every position over a ``cls`` cache: the prompt in ``chunks``, then decodes."""
    a = model.args
    return ds_paged_logits(model, ids, chunks, cls(a.num_hidden_layers, 32, 16, a.num_key_value_heads, a.head_dim,
                                                   dtype, torch.device("cpu")))


@pytest.mark.parametrize("cls", [PagedAttention, CpuPagedAttention])
def test_logits_match_transformers(model, cls: type) -> None:
    hf, path = model
    ours, _ = load_model(path, torch.float32)
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (100,))  # past YaRN's original 64 and eight windows long
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    out = _paged_logits(ours, cls, ids, [50, 30])  # a fresh chunk, a chunk after a cached prefix, decodes
    assert (out - ref).abs().max().item() <= 1e-4
    # the sinks matter: without them the same decoder is far off
    for layer in ours.layers:
        layer.self_attn.sinks.data.fill_(-1e4)
    assert (_paged_logits(ours, cls, ids[:40], [40]) - ref[:40]).abs().max().item() > 1e-2


def test_logits_bf16_within_half_precision_tolerance(model) -> None:
    hf, path = model
    ours, _ = load_model(path, torch.bfloat16)
    torch.manual_seed(2)
    ids = torch.randint(3, VOCAB, (60,))
    with torch.no_grad():
        truth = hf(ids[None]).logits[0]
        hf_half = copy.deepcopy(hf).to(torch.bfloat16)(ids[None]).logits[0].float()
    err = (_paged_logits(ours, PagedAttention, ids, [40], torch.bfloat16) - truth).abs().max().item()
    hf_err = (hf_half - truth).abs().max().item()
    # measured: ours 0.457, transformers' own bf16 0.441 (a bf16 rounding flips an expert choice)
    assert err <= 1.5 * hf_err + 1e-3, (err, hf_err)


def test_int8_linears_compute_their_dequantised_weights(model) -> None:
    """w8a16: q/k/v, o and the LM head in int8, the router and experts exact."""
    from workers.backends.int8 import Int8Kernel, copy_dequantized_into, quantize_model
    q, args = load_model(model[1], torch.float32)
    assert quantize_model(q, Int8Kernel()) == 2 * args.num_hidden_layers + 1
    ref, _ = load_model(model[1], torch.float32)
    copy_dequantized_into(ref, q)
    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(3))
    a, b = _paged_logits(q, PagedAttention, ids, [30]), _paged_logits(ref, PagedAttention, ids, [30])
    assert (a - b).abs().max().item() <= 1e-4


# -- engine: chunked prefill, preemption, prefix cache ------------------------------------------------


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    # the last one repeats itself: the speculator (suffix lookup, on by default) drafts from it
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 100, 37, 70)] + [[7, 8, 9, 10, 11] * 8]


def test_engine_greedy_equals_transformers_under_pressure(model, caplog) -> None:
    """Chunked prefill (chunks of 29), preemption (14 blocks), speculation, a prefix-cache hit."""
    hf, path = model
    greedy = SamplingParams(max_new_tokens=10, ignore_eos=True)
    ps = _prompts()
    want = {f"r{i}": hf_greedy(hf, p, 10) for i, p in enumerate(ps)}
    # 14 blocks of 16 for ~300 tokens of work: preemption; prompts cut into chunks of 29
    with caplog.at_level("INFO", logger="workers.backends"):
        eng = make_engine(str(path), num_blocks=14, max_prefill_tokens=29, max_batch_size=4)
    fused = eng.runner.model.fast_decode  # its attention halves with the sinks, the experts between calls
    assert fused is not None or "no C kernels" in caplog.text
    res = run(eng, {f"r{i}": (p, greedy) for i, p in enumerate(ps)})
    assert {k: v[0] for k, v in res.items()} == want
    assert fused is None or fused.calls > 0
    assert eng.scheduler.num_preemptions > 0
    assert eng.speculator.draft_tokens > 0  # drafts verified as several query rows after the cached ones
    assert run(eng, {"y": (ps[1], greedy)})["y"][0] == want["r1"]
    hits = eng.blocks.prefix_hits
    again = run(eng, {"x": (ps[1], greedy)})["x"][0]  # the 100-token prompt again: 6 full blocks cached
    assert eng.blocks.prefix_hits - hits == 6 and again == want["r1"]
    assert eng.check_no_leaks()


# -- harmony: a tokenizer with its special tokens, the parsers ---------------------------------------

HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>")

# A compact harmony template (the shape of GPT-OSS's own: a developer message with the tools as a
# TypeScript-like namespace, calls in the commentary channel, results from functions.NAME; the
# generation prompt opens the assistant's message).
HARMONY_TEMPLATE = r"""{%- if tools %}{{- '<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n' }}
{%- for t in tools %}{{- '\n// ' + (t.function.description or '') + '\ntype ' + t.function.name + ' = (_: ' + (t.function.parameters | tojson) + ') => any;\n' }}{%- endfor %}
{{- '\n} // namespace functions<|end|>' }}{%- endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}{{- '<|start|>system<|message|>' + m.content + '<|end|>' }}
{%- elif m.role == 'user' %}{{- '<|start|>user<|message|>' + m.content + '<|end|>' }}
{%- elif m.role == 'assistant' %}
{%- if m.tool_calls %}{%- for tc in m.tool_calls %}{%- set f = tc.function if tc.function else tc %}{{- '<|start|>assistant<|channel|>commentary to=functions.' + f.name + ' <|constrain|>json<|message|>' + (f.arguments if f.arguments is string else (f.arguments | tojson)) + '<|call|>' }}{%- endfor %}
{%- else %}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}{%- endif %}
{%- elif m.role == 'tool' %}{{- '<|start|>functions.' + (m.name or 'tool') + ' to=assistant<|channel|>commentary<|message|>' + m.content + '<|end|>' }}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"""


def save_harmony_model(path: Path) -> Path:
    """A tiny GPT-OSS chat model: the demo model's byte-level BPE tokenizer with harmony's special
    tokens, HARMONY_TEMPLATE, ``<|return|>`` and ``<|call|>`` its EOS (as GPT-OSS's generation_config)."""
    from tokenizers import AddedToken, Tokenizer

    from workers.models.demo import ensure_demo_model

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(ensure_demo_model() / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_TOKENS])
    tok.save(str(path / "tokenizer.json"))
    eos = [tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")]
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|return|>",
        "pad_token": "<|end|>", "unk_token": "<unk>", "model_max_length": 4096, "chat_template": HARMONY_TEMPLATE}))
    cfg = {**BASE, "vocab_size": tok.get_vocab_size(with_added_tokens=True), "eos_token_id": eos, "bos_token_id": None}
    _gpt_oss(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_harmony_model(tmp_path_factory.mktemp("gpt_oss_chat") / "tiny-gpt-oss")


PROMPT_MSGS = [{"role": "user", "content": "Weather in Paris?"}]
CALL_TEXT = ('<|channel|>analysis<|message|>The user wants the weather. Call get_weather.<|end|>'
             '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
             '{"city": "Paris", "days": 3}<|call|>')
ANSWER_TEXT = ('<|channel|>analysis<|message|>Simple: say hello.\nDone.<|end|>'
               '<|start|>assistant<|channel|>final<|message|>Hello! a <|b is text.<|return|>')
# the recipient in the role part of the header, then a preamble without recipient
ROLE_CALL_TEXT = ('<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_weather'
                  '<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>')


def _stream(tok, text: str, prompt: str) -> tuple[str | None, str, list[dict], str]:
    """``text`` encoded by the model's tokenizer, decoded token by token by the streaming detokeniser
    keeping harmony's markers, through the reasoning splitter and the tool-call stream as the chat
    route runs them: (reasoning or None, content, tool calls, the whole decoded text)."""
    ids = tok.tokenizer.encode(text, add_special_tokens=False).ids
    keep = frozenset(tok.tokenizer.token_to_id(t) for t in HARMONY_TOKENS)
    assert keep <= tok.special_ids
    detok = tok.detokenizer(keep)
    sp = PARSERS["harmony"].splitter(prompt)
    stream = ToolCallStream(HarmonyParser(["get_weather"]))
    reasoning, content, calls, decoded = "", "", [], ""
    for i, tid in enumerate(ids):
        piece = detok.push([tid]) + (detok.flush() if i == len(ids) - 1 else "")
        decoded += piece
        r, c = sp.push(piece)
        if i == len(ids) - 1:
            r2, c2 = sp.flush()
            r, c = r + r2, c + c2
        reasoning += r
        c, deltas = stream.push(c, final=i == len(ids) - 1)
        content += c
        for d in deltas:
            if "id" in d:
                calls.append({"name": d["function"]["name"], "arguments": d["function"]["arguments"]})
            else:
                calls[d["index"]]["arguments"] += d["function"].get("arguments", "")
    return (reasoning if sp.saw_reasoning else None), content, calls, decoded


def test_harmony_parsers_on_tokens(chat_model: Path) -> None:
    tok = load_tokenizer(chat_model)
    template = load_chat_template(str(chat_model))
    prompt = template.render(PROMPT_MSGS, add_generation_prompt=True)
    assert prompt.endswith("<|start|>assistant")
    assert detect(template) is PARSERS["harmony"] and detect_tools(HARMONY_TEMPLATE) == "harmony"
    assert tok.tokenizer.encode("<|channel|>analysis<|message|>", add_special_tokens=False).ids[0] == \
        tok.tokenizer.token_to_id("<|channel|>")  # one token each, as GPT-OSS's tokenizer has them

    reasoning, content, calls, decoded = _stream(tok, CALL_TEXT, prompt)
    assert decoded == CALL_TEXT  # the kept markers come back where they stand
    assert reasoning == "The user wants the weather. Call get_weather."
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}] and content == ""
    # the same text whole (the non-stream answer)
    r, c = split(PARSERS["harmony"], prompt, CALL_TEXT)
    assert r == reasoning
    whole_content, whole_calls = parse_text(HarmonyParser(["get_weather"]), c)
    assert whole_content is None and [(x["function"]["name"], x["function"]["arguments"]) for x in whole_calls] == \
        [("get_weather", '{"city": "Paris", "days": 3}')]

    reasoning, content, calls, _ = _stream(tok, ANSWER_TEXT, prompt)
    assert (reasoning, content, calls) == ("Simple: say hello.\nDone.", "Hello! a <|b is text.", [])
    assert split(PARSERS["harmony"], prompt, ANSWER_TEXT) == (reasoning, content)

    reasoning, content, calls, _ = _stream(tok, ROLE_CALL_TEXT, prompt)
    assert reasoning is None and content == "Checking."
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]

    # cut by max_tokens inside the thinking: all reasoning; the prompt leaving a final message open
    assert split(PARSERS["harmony"], prompt, "<|channel|>analysis<|message|>still thinking") == ("still thinking", "")
    open_final = prompt + "<|channel|>final<|message|>"
    assert split(PARSERS["harmony"], open_final, "Plain answer.<|return|>") == (None, "Plain answer.")


def test_harmony_every_cut_equals_the_whole() -> None:
    prompt = "<|start|>user<|message|>hi<|end|><|start|>assistant"
    for text in (CALL_TEXT, ANSWER_TEXT, ROLE_CALL_TEXT):
        whole = split(PARSERS["harmony"], prompt, text)
        for i in range(len(text) + 1):
            sp = PARSERS["harmony"].splitter(prompt)
            parts = [sp.push(text[:i]), sp.push(text[i:]), sp.flush()]
            assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == (whole[0] or "", whole[1])


def test_harmony_grammar_and_rendered_call() -> None:
    from mindie.text.tool_parsers.base import Function
    f = Function("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}})
    g = HarmonyParser().grammar([f], True, lambda m: m)
    assert '"commentary to=functions.get_weather "' in g and "<|constrain|>" in g and g.rstrip().count("<|call|>") == 1
    call = HarmonyParser().render_call("get_weather", {"city": "Paris"})
    assert call == ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                    '{"city": "Paris"}<|call|>')


# -- the real server ---------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
# Noise forced into harmony's shape: an analysis message, then a call to get_weather.
HARMONY_LARK = ('start: <|channel|> "analysis" <|message|> /[a-z ]{1,20}/ <|end|> <|start|> "assistant" <|channel|> '
                '"commentary to=functions.get_weather " <|constrain|> "json" <|message|> "{\\"city\\": \\"" '
                '/[a-z]{1,8}/ "\\"}" <|call|>')


def test_server_infer_token_and_harmony_chat(chat_model: Path, tmp_path: Path) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32).eval()
    with demo_server(tmp_path, str(chat_model), schedule={"prefillChunkTokens": 32}) as srv:
        assert "reasoning parser harmony" in srv.tail(400) and "parser harmony" in srv.tail(400)
        for p in _prompts()[:2]:
            r = httpx.post(srv.url + "/infer_token", json={"input_id": p, "parameters": {
                "max_new_tokens": 12, "ignore_eos": True, "details": True}}, timeout=300)
            assert r.status_code == 200, r.text
            assert r.json()["details"]["generated_token_ids"] == hf_greedy(hf, p, 12)

        req = {"messages": PROMPT_MSGS, "tools": TOOLS, "max_tokens": 80, "temperature": 1.0, "seed": 4,
               "structured_outputs": {"grammar": HARMONY_LARK}}
        r = httpx.post(srv.url + "/v1/chat/completions", json=req, timeout=300)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        msg = choice["message"]
        assert re.fullmatch("[a-z ]{1,20}", msg["reasoning_content"]), msg
        (call,) = msg["tool_calls"]
        assert call["function"]["name"] == "get_weather" and choice["finish_reason"] == "tool_calls"
        assert re.fullmatch("[a-z]{1,8}", json.loads(call["function"]["arguments"])["city"]), call
        assert not msg["content"]

        with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**req, "stream": True}, timeout=300) as s:
            deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in s.iter_lines()
                      if line.startswith("data: {")]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == msg["reasoning_content"]
        calls = [t for d in deltas for t in d.get("tool_calls") or []]
        assert calls[0]["function"]["name"] == "get_weather"
        assert "".join(t["function"].get("arguments", "") for t in calls) == call["function"]["arguments"]
        assert not "".join(d.get("content") or "" for d in deltas)


def test_lora_refused_naming_gpt_oss(model) -> None:
    """A LoRA adapter cannot be combined with attention sinks and stacked experts: the worker's
    refusal (a load answered 400 with it, LoraModules refused at start) names both."""
    from workers.engine.assembly import lora_refusal
    ours, _ = load_model(model[1], torch.float32)
    assert lora_refusal(ours, False) == ("LoRA adapters are not served for GPT-OSS models "
                                         "(attention sinks, stacked experts)")
    assert "tensor-parallel" in lora_refusal(ours, True)
