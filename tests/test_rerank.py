"""Rerank and score (/rerank, /v1/rerank, /v2/rerank through the ``cohere`` client and Jina's body;
vLLM's /score) on the real launch script: a tiny random sequence-classification model (a
cross-encoder: the sigmoid of its one logit) and a tiny random causal LM served as a Qwen3-Reranker
style decoder reranker (``ModelConfig.rerank: "yes-no"``: softmax over the "no"/"yes" logits after
its prompt), each score against transformers on the same fp32 weights within 1e-4; top_n,
return_documents, the errors in each route's shape, a model that cannot rerank, one relayed by the
coordinator; the engine's score path in process (chunked prefill, Qwen3 and Llama heads)."""
from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from mindie.contract.wire import SamplingParams, Submit

cohere = pytest.importorskip("cohere")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

QUERY = "What does a fox eat?"
DOCS = ["Foxes eat rabbits, rodents, birds and berries.", "The stock market closed higher today.",
        "A fox is a small omnivorous mammal.", "Paris is the capital of France.", "x"]


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def save_seqcls_model(path: Path, cls: str = "Llama", layers: int = 2) -> Path:
    """A tiny random ``<cls>ForSequenceClassification`` (num_labels 1) with the demo model's tokenizer
    (whose post-processor pairs two texts as ``<s> A <s> B``)."""
    from workers.models.demo import ensure_demo_model
    demo = ensure_demo_model()
    base = {k: v for k, v in json.loads((demo / "config.json").read_text()).items()
            if k not in ("architectures", "torch_dtype", "model_type")}
    base.update(num_hidden_layers=layers, num_labels=1, pad_token_id=None)
    cfg = getattr(transformers, f"{cls}Config")(**base)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, f"{cls}ForSequenceClassification")(cfg).eval()
    with torch.no_grad():  # norms away from 1, the head big enough to spread the scores
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / f, path / f)
    return path


class CrossEncoderRef:
    """transformers' forward of the sequence-classification model: the sigmoid of the last token's logit."""

    def __init__(self, path: Path) -> None:
        self.tok = transformers.AutoTokenizer.from_pretrained(str(path))
        self.model = transformers.AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32)
        self.model.eval()

    def ids(self, q: str, d: str) -> list[int]:
        return self.tok(q, d)["input_ids"]

    def score(self, q: str, d: str) -> float:
        with torch.no_grad():
            return sigmoid(float(self.model(torch.tensor([self.ids(q, d)])).logits[0, 0]))


class DecoderRerankerRef:
    """The causal LM's logits at the end of Qwen3-Reranker's prompt: softmax over (no, yes) at yes."""

    def __init__(self, path: Path) -> None:
        from mindie.text.rerank import QWEN3_RERANKER_TEMPLATE
        self.template = QWEN3_RERANKER_TEMPLATE
        self.tok = transformers.AutoTokenizer.from_pretrained(str(path))
        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        self.no, self.yes = self.tok.convert_tokens_to_ids("no"), self.tok.convert_tokens_to_ids("yes")

    def ids(self, q: str, d: str) -> list[int]:
        return self.tok(self.template.replace("{query}", q).replace("{document}", d))["input_ids"]

    def score(self, q: str, d: str) -> float:
        with torch.no_grad():
            logits = self.model(torch.tensor([self.ids(q, d)])).logits[0, -1]
        return float(torch.softmax(logits[[self.no, self.yes]], dim=0)[1])


# -- servers ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cross(demo_servers, tmp_path_factory):
    """The cross-encoder, its prompts in chunks of 16 tokens (a long pair is scored over several)."""
    d = save_seqcls_model(tmp_path_factory.mktemp("xenc") / "tiny-cross-encoder")
    s = demo_servers.get(str(d), schedule={"prefillChunkTokens": 16, "maxPrefillTokens": 16})
    s.ref = CrossEncoderRef(d)
    s.co = cohere.ClientV2(api_key="none", base_url=s.url, timeout=120)
    s.co1 = cohere.Client(api_key="none", base_url=s.url, timeout=120)
    return s


@pytest.fixture(scope="module")
def decoder(demo_servers, tmp_path_factory):
    from tests.tiny_hf import QWEN3_CHAT_TEMPLATE, save_chat_model
    d = save_chat_model(tmp_path_factory.mktemp("dec") / "tiny-qwen3-reranker", QWEN3_CHAT_TEMPLATE)
    s = demo_servers.get(str(d), model={"rerank": "yes-no"})
    s.ref = DecoderRerankerRef(d)
    s.co = cohere.ClientV2(api_key="none", base_url=s.url, timeout=120)
    return s


def _check_ranked(results, ref_scores: list[float], top_n: int | None = None) -> None:
    """Results sorted by score, each equal to the reference within 1e-4, every index once."""
    want = sorted(range(len(ref_scores)), key=lambda i: -ref_scores[i])[:top_n or len(ref_scores)]
    assert [r.index for r in results] == want, ([r.index for r in results], ref_scores)
    for r in results:
        assert abs(r.relevance_score - ref_scores[r.index]) < 1e-4, (r.index, r.relevance_score, ref_scores)


# -- the cross-encoder ------------------------------------------------------------------------------
def test_cohere_v2_rerank_equals_transformers(cross):
    ref = [cross.ref.score(QUERY, d) for d in DOCS]
    assert max(ref) - min(ref) > 1e-3  # the scores differ: the order is a real check
    r = cross.co.rerank(model="demo", query=QUERY, documents=DOCS)
    _check_ranked(r.results, ref)
    assert r.id and r.meta.api_version.version == "2" and r.meta.billed_units.search_units == 1
    assert r.meta.tokens.input_tokens == sum(len(cross.ref.ids(QUERY, d)) for d in DOCS)
    assert all(getattr(x, "document", None) is None for x in r.results)  # Cohere v2 returns no documents
    top = cross.co.rerank(model="demo", query=QUERY, documents=DOCS, top_n=2)
    _check_ranked(top.results, ref, top_n=2)


def _received(srv) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("request_received_total"))


def test_counted_in_metrics_and_request_log(cross):
    before = _received(cross)
    r = httpx.post(cross.url + "/v2/rerank", json={"model": "demo", "query": QUERY, "documents": DOCS[:2]},
                   headers={"req-id": "rerank-log-1"}, timeout=60)
    assert r.status_code == 200, r.text
    assert _received(cross) == before + 1  # one request, whatever its pairs
    n = sum(len(cross.ref.ids(QUERY, d)) for d in DOCS[:2])
    deadline = time.monotonic() + 10
    while f"request rerank-log-1 /v2/rerank status=200 in={n} " not in cross.tail(400):
        assert time.monotonic() < deadline, cross.tail(20)
        time.sleep(0.2)


def test_long_pair_over_prefill_chunks(cross):
    long = " ".join(DOCS * 6)  # several 16-token chunks: the score is the prompt's last position's
    assert len(cross.ref.ids(QUERY, long)) > 48
    r = cross.co.rerank(model="demo", query=QUERY, documents=[long, DOCS[0]])
    _check_ranked(r.results, [cross.ref.score(QUERY, long), cross.ref.score(QUERY, DOCS[0])])


def test_cohere_v1_rerank_documents_and_objects(cross):
    ref = [cross.ref.score(QUERY, d) for d in DOCS]
    r = cross.co1.rerank(model="demo", query=QUERY, documents=[{"text": d} for d in DOCS], top_n=3,
                         return_documents=True)
    _check_ranked(r.results, ref, top_n=3)
    assert [x.document.text for x in r.results] == [DOCS[x.index] for x in r.results]
    assert r.meta.api_version.version == "1"
    bare = cross.co1.rerank(model="demo", query=QUERY, documents=DOCS, return_documents=False)
    assert all(x.document is None for x in bare.results)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank"])
def test_jina_body(cross, path):
    ref = [cross.ref.score(QUERY, d) for d in DOCS]
    r = httpx.post(cross.url + path, json={"model": "demo", "query": QUERY, "documents": DOCS, "top_n": 10},
                   timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "demo" and body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] > 0
    res = body["results"]
    assert len(res) == len(DOCS)  # top_n beyond the documents: all of them
    assert [x["document"]["text"] for x in res] == [DOCS[x["index"]] for x in res]  # Jina's default: returned
    assert [x["index"] for x in res] == sorted(range(len(DOCS)), key=lambda i: -ref[i])
    assert all(abs(x["relevance_score"] - ref[x["index"]]) < 1e-4 for x in res)


def test_vllm_score(cross):
    ref = [cross.ref.score(QUERY, d) for d in DOCS]
    for t1 in (QUERY, [QUERY]):  # one text_1 against every text_2
        r = httpx.post(cross.url + "/score", json={"model": "demo", "text_1": t1, "text_2": DOCS}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["model"] == "demo" and body["id"].startswith("score-")
        assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))  # the request's order
        assert all(d["object"] == "score" and abs(d["score"] - ref[d["index"]]) < 1e-4 for d in body["data"])
    pairs = httpx.post(cross.url + "/v1/score", json={"text_1": [DOCS[0], QUERY], "text_2": [QUERY, DOCS[2]]},
                       timeout=60).json()["data"]
    assert abs(pairs[0]["score"] - cross.ref.score(DOCS[0], QUERY)) < 1e-4
    assert abs(pairs[1]["score"] - cross.ref.score(QUERY, DOCS[2])) < 1e-4


@pytest.mark.parametrize("body, param", [
    ({"query": QUERY, "documents": []}, "documents"),
    ({"query": QUERY, "documents": "one"}, "documents"),
    ({"query": QUERY, "documents": [1, 2]}, "documents"),
    ({"query": QUERY, "documents": [{"title": "no text"}]}, "documents"),
    ({"query": "", "documents": DOCS}, "query"),
    ({"query": ["q"], "documents": DOCS}, "query"),
    ({"documents": DOCS}, "query"),
    ({"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
    ({"query": QUERY, "documents": DOCS, "top_n": "2"}, "top_n"),
    ({"query": QUERY, "documents": DOCS, "return_documents": "yes"}, "return_documents"),
    ({"query": QUERY, "documents": ["fox " * 3000]}, None),  # over maxInputTokenLen
    ({"query": QUERY, "documents": ["d"] * 1001}, "documents"),
])
def test_bad_rerank_requests_are_400_in_cohere_shape(cross, body, param):
    r = httpx.post(cross.url + "/v2/rerank", json={"model": "demo", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"message"} and r.json()["message"], r.text
    if param:
        assert param in r.json()["message"], r.text
    with pytest.raises(cohere.errors.BadRequestError) as e:  # what the client raises, the body kept
        cross.co.rerank(model="demo", query=QUERY, documents=[], top_n=0)
    assert "message" in e.value.body


@pytest.mark.parametrize("body, param", [
    ({"text_1": QUERY}, "text_2"), ({"text_1": [], "text_2": "a"}, "text_1"),
    ({"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"), ({"text_1": 3, "text_2": "a"}, "text_1"),
])
def test_bad_score_requests_are_400_in_openai_shape(cross, body, param):
    r = httpx.post(cross.url + "/score", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert httpx.post(cross.url + "/score", content=b"[[[", timeout=60).status_code == 400


def test_unknown_model_is_404_and_bad_json_400(cross):
    with pytest.raises(cohere.errors.NotFoundError):
        cross.co.rerank(model="nope", query=QUERY, documents=DOCS)
    r = httpx.post(cross.url + "/v1/rerank", content=b"{not json", timeout=60)
    assert r.status_code == 400 and "message" in r.json()


def test_cross_encoder_refuses_generation(cross):
    """A sequence-classification model has no LM head: generation is a 400 that says so."""
    r = httpx.post(cross.url + "/v1/completions", json={"model": "demo", "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "sequence-classification" in r.json()["error"]["message"], r.text
    assert httpx.post(cross.url + "/infer", json={"inputs": "hi"}, timeout=60).status_code == 400


# -- the decoder reranker -----------------------------------------------------------------------------
def test_decoder_reranker_equals_transformers(decoder):
    ref = [decoder.ref.score(QUERY, d) for d in DOCS]
    assert max(ref) - min(ref) > 1e-4
    r = decoder.co.rerank(model="demo", query=QUERY, documents=DOCS, top_n=4)
    _check_ranked(r.results, ref, top_n=4)
    s = httpx.post(decoder.url + "/score", json={"text_1": QUERY, "text_2": DOCS}, timeout=60).json()["data"]
    assert all(abs(d["score"] - ref[d["index"]]) < 1e-4 for d in s)
    # it is still a chat model: generation is served beside it
    g = httpx.post(decoder.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert g.status_code == 200, g.text


def test_plain_model_cannot_rerank(demo_servers, demo_model):
    srv = demo_servers.get(demo_model)  # a causal LM with no rerank configuration
    for path in ("/rerank", "/v2/rerank"):
        r = httpx.post(srv.url + path, json={"query": QUERY, "documents": DOCS}, timeout=60)
        assert r.status_code == 400 and "ModelConfig.rerank" in r.json()["message"], r.text
    r = httpx.post(srv.url + "/score", json={"text_1": QUERY, "text_2": DOCS}, timeout=60)
    assert r.status_code == 400 and "ModelConfig.rerank" in r.json()["error"]["message"], r.text
    with pytest.raises(cohere.errors.BadRequestError) as e:
        cohere.ClientV2(api_key="none", base_url=srv.url).rerank(model="demo", query=QUERY, documents=DOCS)
    assert "cannot rerank" in e.value.body["message"]


# -- through the coordinator -----------------------------------------------------------------------------
def test_rerank_through_the_coordinator(cross, tmp_path):
    from tests.coord_harness import Coordinator
    coord = Coordinator(tmp_path, [cross], name="rerank")
    try:
        coord.wait_ready_line()
        coord.wait_ready()
        via = cohere.ClientV2(api_key="none", base_url=coord.url, timeout=120).rerank(
            model="demo", query=QUERY, documents=DOCS, top_n=3)
        direct = cross.co.rerank(model="demo", query=QUERY, documents=DOCS, top_n=3)
        # (the same pairs, batched as the engine steps fall: equal up to the kernels' rounding)
        assert [x.index for x in via.results] == [x.index for x in direct.results]
        assert all(abs(a.relevance_score - b.relevance_score) < 1e-5 for a, b in zip(via.results, direct.results))
        s = httpx.post(coord.url + "/score", json={"text_1": QUERY, "text_2": DOCS[:2]}, timeout=60)
        assert s.status_code == 200 and len(s.json()["data"]) == 2, s.text
        bad = httpx.post(coord.url + "/v1/rerank", json={"query": QUERY, "documents": []}, timeout=60)
        assert bad.status_code == 400 and set(bad.json()) == {"message"}, bad.text
    finally:
        coord.stop()


# -- in process: the engine's score path, the scoring rule ---------------------------------------------
@pytest.mark.parametrize("cls", ["Llama", "Qwen3"])
def test_engine_scores_equal_transformers(tmp_path, cls):
    from tests.test_engine import make_engine
    d = save_seqcls_model(tmp_path / cls, cls)
    ref = CrossEncoderRef(d)
    ids = ref.ids(QUERY, " ".join(DOCS * 3))
    with torch.no_grad():
        want = float(ref.model(torch.tensor([ids])).logits[0, 0])
    for chunk in (0, 16):
        eng = make_engine(str(d), prefill_chunk_tokens=chunk, max_prefill_tokens=16 if chunk else 8192)
        eng.add(Submit("s", "fe", ids, SamplingParams(max_new_tokens=1, pooling="score")))
        eng.add(Submit("e", "fe", ids[:20], SamplingParams(max_new_tokens=1, pooling="mean")))  # beside it
        outs = {}
        while eng.has_work():
            for o in eng.step():
                outs[o.seq.request_id] = o
        got = np.frombuffer(outs["s"].embedding, dtype="<f4")
        assert got.shape == (1,) and abs(float(got[0]) - want) < 1e-4 and outs["s"].finish_reason == "pooled"
        assert eng.check_no_leaks()


def test_engine_yes_no_logits_equal_transformers(tmp_path):
    from tests.test_engine import make_engine
    from tests.tiny_hf import QWEN3_CHAT_TEMPLATE, save_chat_model
    d = save_chat_model(tmp_path / "qwen3", QWEN3_CHAT_TEMPLATE)
    ref = DecoderRerankerRef(d)
    ids = ref.ids(QUERY, DOCS[0])
    with torch.no_grad():
        logits = ref.model(torch.tensor([ids])).logits[0, -1]
    eng = make_engine(str(d))
    eng.add(Submit("s", "fe", ids, SamplingParams(max_new_tokens=1, pooling="score",
                                                  score_tokens=[ref.no, ref.yes])))
    eng.add(Submit("g", "fe", ids, SamplingParams(max_new_tokens=2, ignore_eos=True)))  # a generation beside it
    outs = {}
    while eng.has_work():
        for o in eng.step():
            outs.setdefault(o.seq.request_id, []).append(o)
    got = np.frombuffer(outs["s"][0].embedding, dtype="<f4")
    assert np.allclose(got, [float(logits[ref.no]), float(logits[ref.yes])], atol=1e-4)
    assert sum(len(o.token_ids) for o in outs["g"]) == 2


def test_scorer_rules(tmp_path, demo_model):
    from mindie.text.detokenizer import load_tokenizer
    from mindie.text.rerank import QWEN3_RERANKER_TEMPLATE, load_scorer
    tok = load_tokenizer(demo_model)
    plain = load_scorer(demo_model, tok)
    assert plain.kind == "" and "ModelConfig.rerank" in plain.why
    assert load_scorer(demo_model, tok, "off").why
    yn = load_scorer(demo_model, tok, "yes-no")
    assert yn.kind == "yes-no" and yn.template == QWEN3_RERANKER_TEMPLATE
    assert yn.tokens == (tok.tokenizer.token_to_id("no"), tok.tokenizer.token_to_id("yes"))
    assert yn.score([0.0, 0.0]) == 0.5 and abs(yn.score([1.0, 3.0]) - sigmoid(2.0)) < 1e-12
    with pytest.raises(ValueError, match="rerankTemplate"):
        load_scorer(demo_model, tok, "yes-no", "no placeholders")
    # a checkpoint that declares itself a yes/no reranker (vLLM's classifier_from_token)
    d = tmp_path / "declared"
    shutil.copytree(demo_model, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "classifier_from_token": ["no", "yes"]}))
    assert load_scorer(d, tok).kind == "yes-no"
    # a classification head of two labels gives no relevance score
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForSequenceClassification"],
                                               "id2label": {"0": "a", "1": "b"}}))
    two = load_scorer(d, tok)
    assert two.kind == "" and "num_labels" in two.why
    with pytest.raises(ValueError, match="causal LM"):
        load_scorer(d, tok, "yes-no")


def test_rerank_config_keys(demo_model, tmp_path):
    from mindie.config import ConfigError, load_config
    from tests.harness import write_config
    cfg = load_config(str(write_config(tmp_path / "c.json", port=2000, run_dir=str(tmp_path), model_path=demo_model,
                                       model={"rerank": "yes-no", "rerankTemplate": "{query}|{document}"})),
                      env={}).config.backend.model_deploy.models[0]
    assert (cfg.rerank, cfg.rerank_template) == ("yes-no", "{query}|{document}")
    with pytest.raises(ConfigError, match="rerank"):
        load_config(str(write_config(tmp_path / "d.json", port=2000, run_dir=str(tmp_path), model_path=demo_model,
                                     model={"rerank": "maybe"})), env={})
