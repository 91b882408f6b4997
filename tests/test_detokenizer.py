"""Incremental detokenisation: the stream must equal decode(all ids, skip_special_tokens=True).

The tokenizers are trained here on a small corpus (no downloads): a byte-level BPE (GPT-2 /
Llama 3 / Qwen style), a Llama-2 style SentencePiece BPE with byte fallback and the Strip
decoder, and Metaspace Unigrams with byte fallback (T5/Mistral-like pre-tokenisation).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from mindie.text.detokenizer import IncrementalDetokenizer, TextTokenizer, load_tokenizer

FFFD = "\ufffd"
CORPUS = [
    "Hello world, this is a test.", "  leading spaces and  double  spaces ", "Café naïve résumé déjà vu",
    "中文测试，你好世界。", "日本語のテキストです", "emoji 😀🎉👍🏽 party time", "Ünïcödé àccents ñ Ω",
    "tabs\tand\nnewlines\n\n", "The quick brown fox jumps over the lazy dog.",
    "数字 12345 and symbols !@#$%^&*()", " I was 15 when I started.", "▁literal▁marker and ▁ spaces",
] * 4
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
SAMPLES = [
    "Hello world", " I was 15", "  two leading spaces", "中文测试，你好世界。", "emoji 😀🎉👍🏽!",
    "Café naïve résumé", "mixed 中文 and 😀 and é", "trailing space ", "line\nbreaks\n\nhere",
    "未见过的字符：龘靐齉 and 🦜🪿", "x", " ",
]


def _byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=420, special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.add_special_tokens(["<|im_end|>"])
    tok.add_tokens([AddedToken("<tool>", special=False)])  # added but not special: decoded
    return tok


def _with_byte_tokens(trained: Tokenizer) -> models.BPE:
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    for b in BYTE_TOKENS:
        vocab.setdefault(b, len(vocab))
    return models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)


def _llama2() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    # a small alphabet so most CJK characters and emoji go through byte fallback
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=60, show_progress=False))
    tok.model = _with_byte_tokens(tok)
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def _unigram(prepend_scheme: str) -> Tokenizer:
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend_scheme)
    tok.train_from_iterator(CORPUS, trainers.UnigramTrainer(
        vocab_size=200, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>", show_progress=False))
    data = json.loads(tok.to_str())["model"]
    vocab = [tuple(v) for v in data["vocab"]]
    have = {p for p, _ in vocab}
    vocab += [(b, -20.0) for b in BYTE_TOKENS if b not in have]
    tok.model = models.Unigram(vocab, unk_id=data["unk_id"], byte_fallback=True)
    tok.decoder = decoders.Sequence([
        decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme=prepend_scheme)])
    return tok


BUILDERS = {
    "byte_level": _byte_level,
    "llama2_bytefallback": _llama2,
    "unigram_first": lambda: _unigram("first"),
    "unigram_always": lambda: _unigram("always"),
}
TOKENIZERS = {name: TextTokenizer(build()) for name, build in BUILDERS.items()}
NAMES = list(TOKENIZERS)


def stream(tok: TextTokenizer, ids: list[int], sizes: list[int] | None = None) -> tuple[list[str], str]:
    """Push ids in steps (sizes cycles; default one id per step); returns (chunks, flush)."""
    d = tok.detokenizer()
    chunks = []
    i = k = 0
    while i < len(ids):
        n = sizes[k % len(sizes)] if sizes else 1
        chunks.append(d.push(ids[i:i + n]))
        i += n
        k += 1
    return chunks, d.flush()


def check_stream(tok: TextTokenizer, ids: list[int], sizes: list[int] | None = None) -> list[str]:
    chunks, rest = stream(tok, ids, sizes)
    full = tok.tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(chunks) + rest == full
    if FFFD not in full:
        assert not any(FFFD in c for c in chunks + [rest]), (chunks, rest)
    return chunks


def content_ids(tok: TextTokenizer, text: str) -> list[int]:
    """The ids a model would generate for ``text`` (no BOS)."""
    return tok.tokenizer.encode(text, add_special_tokens=False).ids


# ---------------------------------------------------------------------------------------------
# TextTokenizer / load_tokenizer
# ---------------------------------------------------------------------------------------------


def test_encode_adds_bos_like_the_post_processor() -> None:
    bl = TOKENIZERS["byte_level"]
    assert bl.encode("Hello")[0] == bl.tokenizer.token_to_id("<s>")
    assert bl.encode("Hello")[1:] == content_ids(bl, "Hello")
    sp = TOKENIZERS["llama2_bytefallback"]
    assert sp.encode("Hello")[0] == sp.tokenizer.token_to_id("<s>")
    uni = TOKENIZERS["unigram_first"]  # no post-processor: nothing added
    assert uni.encode("Hello") == content_ids(uni, "Hello")


def test_special_and_byte_ids() -> None:
    bl = TOKENIZERS["byte_level"]
    tid = bl.tokenizer.token_to_id
    assert bl.special_ids == {tid("<s>"), tid("</s>"), tid("<pad>"), tid("<|im_end|>")}
    assert tid("<tool>") not in bl.special_ids
    assert bl.byte_ids == frozenset()  # byte-level BPE has no ByteFallback decoder
    sp = TOKENIZERS["llama2_bytefallback"]
    assert {sp.tokenizer.id_to_token(i) for i in sp.byte_ids} == set(BYTE_TOKENS)
    assert bl.vocab_size == bl.tokenizer.get_vocab_size(with_added_tokens=True)


def test_load_tokenizer_dir_and_file_and_no_truncation(tmp_path: Path) -> None:
    raw = _byte_level()
    raw.enable_truncation(max_length=4)  # settings in tokenizer.json must not cut prompts
    raw.enable_padding(length=64)
    raw.save(str(tmp_path / "tokenizer.json"))
    text = "The quick brown fox jumps over the lazy dog."
    for where in (tmp_path, tmp_path / "tokenizer.json", str(tmp_path)):
        tok = load_tokenizer(where)
        ids = tok.encode(text)
        assert len(ids) > 4 and ids[1:] == content_ids(tok, text)
        assert tok.decode(ids) == text


# ---------------------------------------------------------------------------------------------
# Streaming: examples
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("text", SAMPLES)
def test_stream_of_encoded_text(name: str, text: str) -> None:
    tok = TOKENIZERS[name]
    ids = content_ids(tok, text)
    for sizes in (None, [2], [3, 1], [5]):
        check_stream(tok, ids, sizes)


@pytest.mark.parametrize("name", NAMES)
def test_first_token_leading_space_matches_decode(name: str) -> None:
    tok = TOKENIZERS[name]
    ids = content_ids(tok, " I was 15")
    chunks = check_stream(tok, ids)
    full = tok.decode(ids)
    # whatever decode does with the first token's leading space, the first text chunk agrees
    first = next(c for c in chunks if c)
    assert full.startswith(first) and first[0] == full[0]
    # a later token keeps its space: "was" is preceded by one
    assert " was" in "".join(chunks)


def test_seed_example_token_texts_llama2_style() -> None:
    # MindIE's example streams "was", " ", "1", "5" for "...was 15" (Llama-2 tokenizer: the
    # lone "▁" token is a space only in context; decoded alone the Strip decoder eats it).
    tok = TOKENIZERS["llama2_bytefallback"]
    t = tok.tokenizer.token_to_id
    tail = [t("▁"), t("1"), t("5")]
    assert None not in tail and tok.decode([t("▁")]) == ""
    chunks = check_stream(tok, content_ids(tok, "I was") + tail)
    assert chunks[-3:] == [" ", "1", "5"]
    assert "".join(chunks) == "I was 15"


@pytest.mark.parametrize("name", NAMES)
def test_special_tokens_skipped_anywhere(name: str) -> None:
    tok = TOKENIZERS[name]
    specials = sorted(tok.special_ids)
    words = content_ids(tok, "Hello world 中文")
    ids = [specials[0]] + words[:2] + specials + words[2:] + [specials[-1]]
    check_stream(tok, ids)
    assert tok.decode(ids) == tok.decode(words)
    d = tok.detokenizer()
    assert d.push([specials[0]]) == "" and d.flush() == ""
    assert d.all_ids == [specials[0]]


@pytest.mark.parametrize("name", NAMES)
def test_kept_special_tokens_are_streamed_where_they_stand(name: str) -> None:
    """``keep``: the special ids a request keeps (a tool-call format's delimiters, such as
    ``[TOOL_CALLS]``) are rendered where they stand, every other special id is still dropped;
    at any step size the chunks add up to that text."""
    tok = TOKENIZERS[name]
    specials = sorted(tok.special_ids)
    kept, dropped = specials[-1], specials[0]
    words = content_ids(tok, "Hello world 中文 😀")
    ids = [dropped] + words[:2] + [kept] + words[2:] + [dropped, kept]
    want = tok.tokenizer.decode([i for i in ids if i != dropped], skip_special_tokens=False)
    assert tok.tokenizer.id_to_token(kept) in want and want.count(tok.tokenizer.id_to_token(kept)) == 2
    for sizes in ([1], [2], [3, 1], [len(ids)]):
        d = tok.detokenizer(frozenset({kept}))
        chunks, i, k = [], 0, 0
        while i < len(ids):
            chunks.append(d.push(ids[i:i + sizes[k % len(sizes)]]))
            i += sizes[k % len(sizes)]
            k += 1
        assert "".join(chunks) + d.flush() == want == d.full_text(), sizes
    check_stream(tok, ids)  # without keep: all of them dropped, as before


def test_non_special_added_token_is_streamed() -> None:
    tok = TOKENIZERS["byte_level"]
    ids = content_ids(tok, "call") + [tok.tokenizer.token_to_id("<tool>")] + content_ids(tok, " now")
    assert "<tool>" in tok.decode(ids)
    check_stream(tok, ids)


def test_byte_level_holds_incomplete_characters() -> None:
    tok = TOKENIZERS["byte_level"]
    ids = content_ids(tok, "😀")
    assert len(ids) > 1  # the emoji is split across tokens
    d = tok.detokenizer()
    outs = [d.push([i]) for i in ids]
    assert outs[:-1] == [""] * (len(ids) - 1) and outs[-1] == "😀"
    # a stream cut inside a character: flush shows what decode shows
    d = tok.detokenizer()
    assert d.push(ids[:-1]) == ""
    assert d.flush() == tok.decode(ids[:-1]) and FFFD in tok.decode(ids[:-1])


def byte_ids(tok: TextTokenizer, *values: int) -> list[int]:
    return [tok.tokenizer.token_to_id(f"<0x{v:02X}>") for v in values]


def test_byte_fallback_character_is_released_when_the_run_closes() -> None:
    tok = TOKENIZERS["llama2_bytefallback"]
    x = [next(i for i in content_ids(tok, "the") if i not in tok.byte_ids)]
    d = tok.detokenizer()
    outs = [d.push([i]) for i in byte_ids(tok, 0xE4, 0xB8, 0xAD)]  # 中
    assert outs == ["", "", ""]
    assert d.push(x) == tok.decode(byte_ids(tok, 0xE4, 0xB8, 0xAD) + x)
    assert d.flush() == ""


def test_byte_fallback_run_invalidated_later() -> None:
    # "?" alone is valid, but ByteFallback turns the whole invalid run <0x3F><0x9F> into "��":
    # nothing of the run may be streamed before the run is closed.
    for name in ("llama2_bytefallback", "unigram_first"):
        tok = TOKENIZERS[name]
        ids = content_ids(tok, "4")[-1:] + byte_ids(tok, 0x3F, 0x9F)
        chunks, rest = stream(tok, ids)
        full = tok.decode(ids)
        assert full.endswith(FFFD * 2)
        assert "".join(chunks) + rest == full
        assert not any(FFFD in c or "?" in c for c in chunks)


def test_push_after_flush_continues() -> None:
    tok = TOKENIZERS["unigram_first"]
    a, b = content_ids(tok, "Hello"), content_ids(tok, " world 中文")
    d = tok.detokenizer()
    out = "".join(d.push([i]) for i in a) + d.flush()
    out += "".join(d.push([i]) for i in b) + d.flush()
    assert out == d.full_text() == tok.decode(a + b)
    assert d.emitted_chars == len(out)


def _window_sizes(tok, ids: list[int]) -> list[int]:
    """Stream ``ids`` one at a time, check the text is exact, return every decoded window's size."""
    d = tok.detokenizer()
    sizes: list[int] = []
    real = d._decode

    def spy(window: list[int], skip_special_tokens: bool = True) -> str:
        sizes.append(len(window))
        return real(window, skip_special_tokens=skip_special_tokens)

    d._decode = spy  # type: ignore[method-assign]
    out = "".join(d.push([i]) for i in ids)
    d._decode = real  # type: ignore[method-assign]
    assert out + d.flush() == tok.decode(ids)
    return sizes


@pytest.mark.parametrize("name", NAMES)
def test_window_stays_small(name: str) -> None:
    tok = TOKENIZERS[name]
    ids = content_ids(tok, " ".join(SAMPLES) * 20)
    sizes = _window_sizes(tok, ids)
    assert len(ids) > 1000
    # O(1) amortised per token: windows never reach back into the history. The largest window
    # is a run of byte-fallback tokens decoded once when it closes (ByteFallback must see the
    # whole run at once); the samples' longest run is 10 CJK/emoji characters of 3-4 bytes.
    assert max(sizes) <= 48
    assert sum(sizes) <= 4 * len(ids)


@pytest.mark.parametrize("name", NAMES)
def test_long_runs_of_invalid_bytes_stay_linear(name: str) -> None:
    # Every step ends in U+FFFD (final garbage or an open byte run): exact, and the decoded
    # windows stay bounded instead of growing with the whole run.
    tok = TOKENIZERS[name]
    if tok.byte_ids:
        stray = byte_ids(tok, 0x80)[0]
    else:  # byte-level: any single-byte token >= 0x80 decodes to U+FFFD alone
        vocab = tok.tokenizer.get_vocab()
        stray = next(i for t, i in sorted(vocab.items()) if len(t) == 1 and tok.decode([i]) == FFFD)
    ids = [stray] * 2000 + content_ids(tok, " ok")
    sizes = _window_sizes(tok, ids)
    assert sum(sizes) <= 20 * len(ids)


# ---------------------------------------------------------------------------------------------
# Streaming: properties
# ---------------------------------------------------------------------------------------------

ALPHABET = st.sampled_from(
    list("abcdefgh xyz  \n\t.,!?0123") + list("éèüñçÅΩ") + list("中文测试你好龘靐日本語") + ["😀", "🎉", "👍", "\U0001F3FD", "🦜"]
)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(data=st.data())
def test_property_random_ids(name: str, data: st.DataObject) -> None:
    tok = TOKENIZERS[name]
    biased = sorted(tok.byte_ids) + sorted(tok.special_ids) + content_ids(tok, "中文 😀 ▁ é I was")
    ids = data.draw(st.lists(
        st.one_of(st.integers(0, tok.vocab_size - 1), st.sampled_from(biased)), min_size=1, max_size=40))
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=5))
    check_stream(tok, ids, sizes)


@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(text=st.text(ALPHABET, min_size=1, max_size=40), sizes=st.lists(st.integers(1, 3), min_size=1, max_size=4))
def test_property_encoded_text_never_streams_broken_characters(name: str, text: str, sizes: list[int]) -> None:
    tok = TOKENIZERS[name]
    ids = content_ids(tok, text)
    chunks = check_stream(tok, ids, sizes)
    full = tok.decode(ids)
    assert FFFD not in full  # every character is representable (byte fallback / byte level)
    assert not any(FFFD in c for c in chunks)


def test_detokenizer_type() -> None:
    assert isinstance(TOKENIZERS["byte_level"].detokenizer(), IncrementalDetokenizer)
