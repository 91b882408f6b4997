"""Speculative decoding through the real launch script (tests/harness.py): two servers on the demo
model, speculation on (the default) and off (``speculativeDecoding: false``), answer the same
greedy and seeded requests with the same tokens and text on /infer_token, OpenAI chat and TGI
(stop strings, lengths, logprobs, a streamed reply); the speculating one counts its proposals on
/metrics (vLLM's names) and in the request log. Config refusals of MindIE's keys."""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from mindie.config import ConfigError, load_config
from tests.harness import demo_server

# Repetitive prompts: the demo model's greedy output soon repeats itself, and the prompts repeat spans.
TEXT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a, b):\n"
IDS = [5, 91, 340, 1200, 77, 5, 91, 340, 1200, 77, 5, 91, 340, 1200, 77, 5, 91]


@pytest.fixture(scope="module")
def servers(tmp_path_factory, demo_model):
    on_dir, off_dir = tmp_path_factory.mktemp("spec_on"), tmp_path_factory.mktemp("spec_off")
    with demo_server(on_dir, demo_model, schedule={"promptLookupMin": 1, "speculationMaxStretch": 3}) as on, \
            demo_server(off_dir, demo_model, schedule={"speculativeDecoding": False}) as off:
        yield on, off


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=120)


def both(servers, path: str, body: dict) -> tuple[dict, dict]:
    on, off = servers
    a, b = post(on, path, body), post(off, path, body)
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    return a.json(), b.json()


def strip_times(x):
    """Bodies without their timings, ids and drawn seeds (they differ from run to run; the seeded
    cases set theirs)."""
    if isinstance(x, dict):
        return {k: strip_times(v) for k, v in x.items()
                if k not in ("id", "created", "prefill_time", "decode_time_arr", "system_fingerprint", "seed")}
    if isinstance(x, list):
        return [strip_times(v) for v in x]
    return x


def metric(srv, name: str) -> float:
    return metric_set(srv, name)[0]


def metric_set(srv, *names: str) -> list[float]:
    """Figures of one scrape (one set of heartbeats: figures of separate scrapes may straddle one)."""
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    totals = []
    for name in names:
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        totals.append(total)
    return totals


CASES = [
    ("/infer_token", {"input_id": IDS, "stream": False, "parameters": {"max_new_tokens": 60, "details": True}}),
    ("/infer_token", {"input_id": IDS, "stream": False,
                      "parameters": {"max_new_tokens": 47, "do_sample": True, "temperature": 0.8, "top_k": 40,
                                     "seed": 7, "repetition_penalty": 1.05, "details": True}}),
    ("/infer", {"inputs": TEXT, "stream": False, "parameters": {"max_new_tokens": 50, "details": True}}),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": TEXT}], "max_tokens": 64,
                              "temperature": 0, "logprobs": True, "top_logprobs": 2}),
    ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": TEXT}], "max_tokens": 64,
                              "temperature": 0, "stop": ["return"]}),
    ("/v1/completions", {"model": "demo", "prompt": TEXT, "max_tokens": 40, "temperature": 0.9, "seed": 3}),
    ("/generate", {"inputs": TEXT, "parameters": {"max_new_tokens": 55, "details": True, "decoder_input_details": False}}),
]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{p}-{i}" for i, (p, _) in enumerate(CASES)])
def test_same_replies_with_and_without_speculation(servers, case):
    path, body = CASES[case]
    a, b = both(servers, path, body)
    a, b = strip_times(a), strip_times(b)
    if path == "/v1/chat/completions" and body.get("logprobs"):
        la = a["choices"][0]["logprobs"]["content"]
        lb = b["choices"][0]["logprobs"]["content"]
        assert [t["token"] for t in la] == [t["token"] for t in lb]
        for x, y in zip(la, lb):
            assert x["logprob"] == pytest.approx(y["logprob"], abs=1e-4)
        a["choices"][0].pop("logprobs"), b["choices"][0].pop("logprobs")
    if path == "/generate":
        for d in (a, b):
            for t in d["details"]["tokens"]:
                t["logprob"] = round(t["logprob"], 3) if t.get("logprob") is not None else None
    assert a == b


def test_streamed_chat_is_the_same(servers):
    body = {"model": "demo", "messages": [{"role": "user", "content": TEXT}], "max_tokens": 64, "temperature": 0,
            "stream": True}
    texts = []
    for srv in servers:
        parts = []
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for ch in json.loads(line[6:])["choices"]:
                        parts.append(ch.get("delta", {}).get("content") or "")
        texts.append("".join(parts))
    assert texts[0] == texts[1] and texts[0]


def test_speculation_counted_on_metrics_and_in_the_request_log(servers):
    on, off = servers
    before = metric(on, "vllm:spec_decode_num_accepted_tokens_total")
    a, b = both(servers, "/infer_token", {"input_id": IDS, "stream": False,
                                           "parameters": {"max_new_tokens": 80}})
    assert a == b
    names = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
             "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    drafts, proposed, accepted, per_pos = metric_set(on, *names)
    # heartbeats come every second or so: wait for one after the request
    for _ in range(50):
        if accepted > before:
            break
        import time
        time.sleep(0.2)
        drafts, proposed, accepted, per_pos = metric_set(on, *names)
    assert accepted > before and proposed >= accepted and drafts > 0 and per_pos == accepted
    assert metric(off, "vllm:spec_decode_num_draft_tokens_total") == 0
    on.log.flush()
    lines = [ln for ln in Path(on.log_path).read_text(errors="replace").splitlines() if "/infer_token" in ln
             and "status=200" in ln]
    assert any(re.search(r" spec=\d+/\d+", ln) for ln in lines), lines[-3:]
    off.log.flush()
    assert not any(" spec=" in ln for ln in Path(off.log_path).read_text(errors="replace").splitlines())


def test_each_worker_says_at_start_whether_it_speculates(servers):
    on, off = servers
    said = {}
    for name, srv in (("on", on), ("off", off)):
        srv.log.flush()
        said[name] = [ln.split("speculative decoding: ", 1)[1] for ln in
                      Path(srv.log_path).read_text(errors="replace").splitlines() if "speculative decoding: " in ln]
    assert said["on"] and all(line == (
        "suffix, up to 16 proposed tokens per request and step, in steps of up to 8 decoding requests, a proposal "
        "cut to the tokens its request's recent acceptance makes worth its rows (10% of a step a row, in the step's "
        "expected tokens per second; a match of 8 tokens or longer priced at 90% acceptance), a step at most 3x as "
        "long as without its proposals") for line in said["on"]), \
        said["on"]
    assert said["off"] and all(line == "off (ScheduleConfig.speculativeDecoding: false)" for line in said["off"]), \
        said["off"]


@pytest.mark.parametrize("deploy, model, schedule, key, message", [
    ({}, {"plugin_params": '{"plugin_type":"la","level":4}'}, {}, "plugin_params", "guess_set_size, window"),
    ({}, {"plugin_params": '{"plugin_type":"la","level":2,"window":5,"guess_set_size":5}'}, {}, "plugin_params",
     "level must be an integer in [3, 16]"),
    ({}, {"plugin_params": '{"plugin_type":"la","level":4,"window":5,"guess_set_size":5,"x":1}'}, {},
     "plugin_params", "unknown key(s) x"),
    ({"speculationGamma": 16}, {"plugin_params": '{"plugin_type":"la","level":4,"window":5,"guess_set_size":5}'}, {},
     "speculationGamma", ">= plugin_params' (level-1)*(window+guess_set_size) (30)"),
    ({}, {"plugin_params": '{"plugin_type":"mtp"}'}, {}, "plugin_params", "\"memory_decoding\" or \"la\""),
    ({}, {}, {"speculationMethod": "suffx"}, "speculationMethod", "one of suffix, ngram, got 'suffx'"),
    ({}, {"plugin_params": '{"plugin_type":"memory_decoding","decoding_length":17}'}, {}, "plugin_params",
     "decoding_length"),
    ({}, {"plugin_params": "memory_decoding"}, {}, "plugin_params", "JSON object"),
    ({"speculationGamma": 4}, {"plugin_params": '{"plugin_type":"memory_decoding","decoding_length":8}'}, {},
     "speculationGamma", ">= plugin_params' decoding_length"),
    ({"speculationGamma": 481}, {}, {}, "speculationGamma", "<= 480"),
    ({}, {}, {"promptLookupMin": 4, "promptLookupMax": 3}, "promptLookupMin", "<= promptLookupMax"),
    ({}, {}, {"speculationMinAcceptance": 1.5}, "speculationMinAcceptance", "<= 1"),
    ({}, {}, {"speculationMaxStretch": -1}, "speculationMaxStretch", ">= 0"),
])
def test_config_refusals(tmp_path, deploy, model, schedule, key, message):
    cfg = {"BackendConfig": {"ModelDeployConfig": {**deploy, "ModelConfig": [{"modelName": "m", **model}]},
                             "ScheduleConfig": schedule}}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        load_config(str(p))
    assert key in str(e.value) and message in str(e.value)


def test_config_reaches_the_engine(tmp_path):
    from mindie.topology import engine_config

    def cfg(deploy=None, model=None, schedule=None):
        p = tmp_path / "config.json"
        p.write_text(json.dumps({"BackendConfig": {
            "ModelDeployConfig": {**(deploy or {}), "ModelConfig": [{"modelName": "m", **(model or {})}]},
            "ScheduleConfig": schedule or {}}}))
        return engine_config(load_config(str(p)).config)

    d = cfg()
    assert (d.spec_method, d.spec_tokens, d.spec_lookup_min, d.spec_lookup_max) == ("suffix", 16, 2, 5)
    assert cfg(deploy={"speculationGamma": 3}).spec_tokens == 3
    assert cfg(deploy={"speculationGamma": 40}).spec_tokens == 16  # proposals of 16 tokens at most
    n = cfg(schedule={"speculationMethod": "ngram"})
    assert (n.spec_method, n.spec_tokens) == ("ngram", 6)
    la = cfg(deploy={"speculationGamma": 30},
             model={"plugin_params": '{"plugin_type":"la","level":4,"window":5,"guess_set_size":5}'})
    assert (la.spec_method, la.spec_tokens) == ("suffix", 15)  # lookahead served by the suffix proposer
    m = cfg(deploy={"speculationGamma": 16},
            model={"plugin_params": '{"plugin_type":"memory_decoding","decoding_length":12,"dynamic_algo":true}'})
    assert (m.spec_method, m.spec_tokens) == ("memory_decoding", 12)
    assert cfg(schedule={"speculativeDecoding": False}).spec_method == ""
    assert d.spec_max_stretch == 2.0
    s = cfg(schedule={"promptLookupMin": 1, "promptLookupMax": 3, "speculationMaxBatch": 2,
                      "speculationMinAcceptance": 0.5, "speculationMaxStretch": 0})
    assert (s.spec_lookup_min, s.spec_lookup_max, s.spec_max_batch, s.spec_min_acceptance,
            s.spec_max_stretch) == (1, 3, 2, 0.5, 0.0)


def chat_stop(srv, stop: str) -> dict:
    r = post(srv, "/v1/chat/completions", {
        "model": "demo", "messages": [{"role": "user", "content": TEXT}], "max_tokens": 80, "temperature": 0,
        "logprobs": True, "stop": [stop]})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_stop_string_inside_a_speculative_step_ends_at_its_token(servers):
    """A verify step accepts several tokens at once; a stop string completed by one of them ends the
    answer at that token, as without speculation: the same text, token count and log-probability
    list (before the fix the step's later tokens were counted and listed). Stops taken from the
    unstopped answer at 15 depths, so most fall inside a step's run of accepted tokens."""
    on, off = servers
    full = chat_stop(off, "\x00never")  # (a stop that never matches: the plain greedy answer)
    toks = [t["token"] for t in full["choices"][0]["logprobs"]["content"]]
    text = full["choices"][0]["message"]["content"]
    assert "".join(toks) == text and len(toks) == 80, toks
    # The answer so far up to token k: it first matches where token k ends (the demo model's answers
    # repeat a short period, so a short stop would always match in the first period).
    stops = [text[:len("".join(toks[:k + 1]))] for k in range(4, 76, 5)]
    before = metric(on, "vllm:spec_decode_num_accepted_tokens_total")
    for stop in stops:
        a, b = chat_stop(on, stop), chat_stop(off, stop)
        ca, cb = a["choices"][0], b["choices"][0]
        assert ca["finish_reason"] == cb["finish_reason"] == "stop", (stop, ca, cb)
        assert ca["message"]["content"] == cb["message"]["content"], stop
        assert [t["token"] for t in ca["logprobs"]["content"]] == [t["token"] for t in cb["logprobs"]["content"]], stop
        assert a["usage"] == b["usage"], (stop, a["usage"], b["usage"])
    for _ in range(50):  # (heartbeats carry the counters: one after the requests)
        if metric(on, "vllm:spec_decode_num_accepted_tokens_total") > before:
            break
        import time
        time.sleep(0.2)
    assert metric(on, "vllm:spec_decode_num_accepted_tokens_total") > before  # it did speculate


def tgi_stream_tokens(srv, body: dict) -> list[tuple]:
    out = []
    with httpx.stream("POST", srv.url + "/generate_stream", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:{"):
                ev = json.loads(line[5:])
                d = ev["details"] or {}
                out.append((ev["index"], ev["token"]["id"], ev["token"]["text"], round(ev["token"]["logprob"], 3),
                            ev["generated_text"], d.get("generated_tokens"), d.get("finish_reason")))
    return out


@pytest.mark.parametrize("stop", [None, "mid"])
def test_tgi_stream_frames_are_the_same(servers, stop):
    """TGI's stream sends one event per token with that token's text: with speculation the tokens a
    step accepted each carry their own text (before the fix the step's text came on its last token
    and the others had ""), and a stop string inside a step ends the stream at its token."""
    on, off = servers
    body = {"inputs": TEXT, "parameters": {"max_new_tokens": 60, "details": True}}
    plain = tgi_stream_tokens(off, body)
    if stop:  # the answer up to its 27th token (a repeating answer matches a short stop at once)
        body["parameters"]["stop"] = ["".join(e[2] for e in plain[:27])]
    a, b = tgi_stream_tokens(on, body), tgi_stream_tokens(off, body)
    # (with the stop every event's text is held back: all of it could be the stop's start)
    assert len(b) == (27 if stop else 60) and (stop or sum(1 for e in b if e[2]) > 20), b
    assert a == b
