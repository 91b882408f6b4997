"""Workloads: what each benchmark request asks for.

Four sources, all deterministic for a given seed:

* fixed lengths (``--prompt-len 128 --output-len 128``) with random token ids;
* uniform ranges (``--prompt-len 64:256``), each request drawing its own lengths;
* a JSONL file, one request per line: ``{"prompt_len": P, "output_len": O}`` (random
  ids), ``{"prompt_ids": [...], "output_len": O}`` or ``{"prompt": "text", "output_len": O}``;
* the chat workload (``--workload chat``): English questions (mindie_bench/chat_questions.py)
  in a seeded order, each sent as one user message with ``output_len`` as its ``max_tokens``
  cap, answered greedily at whatever length the model chooses (no ignore_eos, no min_tokens).

Random ids are drawn from ``[FIRST_ID, vocab_size)``: ids 0-2 are ``<unk>``/``<s>``/``</s>``
(pad/bos/eos) in Llama-family vocabularies, and an EOS in the prompt or a BOS in the
middle changes what the model does.

Text APIs (TGI ``/generate_stream``) need text, not ids. With ``--tokenizer`` the ids are
decoded with the model's ``tokenizer.json`` (the server re-tokenises, so the prompt
length is close to, not exactly, the requested one; the adapter reports the server's
count when the API returns it). Without a tokenizer each id is mapped to one common
English word, which nearly every BPE vocabulary encodes as a single token, so a prompt
of N words is about N tokens.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

FIRST_ID = 3

# Frequent words that are one token (with their leading space) in Llama/GPT/Qwen BPEs.
WORDS: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be",
    "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but",
    "have", "an", "had", "they", "you", "were", "their", "one", "all", "we", "can", "her",
    "has", "there", "been", "if", "more", "when", "will", "would", "who", "so", "no",
    "time", "year", "people", "way", "day", "man", "thing", "world", "life", "hand",
    "part", "child", "eye", "place", "work", "week",
)


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload; ``prompt_ids`` or ``prompt_text`` (or both) is set."""

    index: int
    prompt_len: int
    output_len: int
    prompt_ids: Optional[list[int]] = None
    prompt_text: Optional[str] = None


def parse_range(text: str) -> tuple[int, int]:
    """``"128"`` -> (128, 128); ``"64:256"`` or ``"64-256"`` -> (64, 256), bounds inclusive."""
    for sep in (":", "-"):
        if sep in text:
            lo_s, hi_s = text.split(sep, 1)
            lo, hi = int(lo_s), int(hi_s)
            break
    else:
        lo = hi = int(text)
    if lo < 1 or hi < lo:
        raise ValueError(f"bad length range {text!r}: need 1 <= low <= high")
    return lo, hi


def random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    """``n`` ids uniform in ``[FIRST_ID, vocab_size)``."""
    if vocab_size <= FIRST_ID:
        raise ValueError(f"vocab_size must be > {FIRST_ID}")
    return [rng.randrange(FIRST_ID, vocab_size) for _ in range(n)]


def synthetic(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], seed: int,
              vocab_size: int) -> list[RequestSpec]:
    """``n`` requests with random ids and lengths uniform in the given inclusive ranges."""
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        p = rng.randint(*prompt_len)
        o = rng.randint(*output_len)
        specs.append(RequestSpec(i, p, o, prompt_ids=random_ids(rng, p, vocab_size)))
    return specs


def from_jsonl(path: str | Path, n: Optional[int], seed: int, vocab_size: int,
               tokenizer: Any = None) -> list[RequestSpec]:
    """Requests from a JSONL file; ``n`` (if given) cycles or truncates the file's lines.

    A ``prompt`` text line counts its tokens with ``tokenizer`` when given, else uses its
    ``prompt_len`` field, else its whitespace word count (an estimate).
    """
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: {e}") from None
    if not rows:
        raise ValueError(f"{path}: no requests")
    count = len(rows) if n is None else n
    specs = []
    for i in range(count):
        row = rows[i % len(rows)]
        where = f"{path}:{i % len(rows) + 1}"
        if "output_len" not in row:
            raise ValueError(f"{where}: missing output_len")
        out = int(row["output_len"])
        if "prompt_ids" in row:
            ids = [int(x) for x in row["prompt_ids"]]
            specs.append(RequestSpec(i, len(ids), out, prompt_ids=ids))
        elif "prompt" in row:
            text = str(row["prompt"])
            if tokenizer is not None:
                plen = len(tokenizer.encode(text).ids)
            else:
                plen = int(row.get("prompt_len") or len(text.split()))
            specs.append(RequestSpec(i, plen, out, prompt_text=text))
        elif "prompt_len" in row:
            plen = int(row["prompt_len"])
            specs.append(RequestSpec(i, plen, out, prompt_ids=random_ids(rng, plen, vocab_size)))
        else:
            raise ValueError(f"{where}: need prompt_len, prompt_ids or prompt")
    return specs


def load_tokenizer(path: Optional[str]) -> Any:
    """A ``tokenizers.Tokenizer`` from a model directory or a tokenizer.json, or None."""
    if not path:
        return None
    from tokenizers import Tokenizer  # only needed for text APIs

    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    return Tokenizer.from_file(str(p))


def words_for_ids(ids: Sequence[int]) -> str:
    """Deterministic text of ``len(ids)`` common words (about one token per word)."""
    return " ".join(WORDS[i % len(WORDS)] for i in ids)


def text_of(spec: RequestSpec, tokenizer: Any = None) -> str:
    """The prompt as text: the spec's own text, the ids decoded, or the word mapping."""
    if spec.prompt_text is not None:
        return spec.prompt_text
    assert spec.prompt_ids is not None
    if tokenizer is not None:
        return tokenizer.decode(spec.prompt_ids, skip_special_tokens=False)
    return words_for_ids(spec.prompt_ids)


WorkloadFn = Callable[[int, int], list[RequestSpec]]

CHAT_MAX_TOKENS = 256  # the chat workload's default cap per answer


def chat_specs(n: int, seed: int, max_tokens: int = CHAT_MAX_TOKENS,
               questions: Sequence[str] = ()) -> list[RequestSpec]:
    """``n`` chat requests: the questions in an order shuffled by ``seed``, cycled when ``n`` is
    larger. ``prompt_len`` is the question's word count, an estimate the server's ``usage``
    replaces (it counts the chat template too); ``output_len`` is the cap, not a target."""
    if not questions:
        from mindie_bench.chat_questions import QUESTIONS
        questions = QUESTIONS
    order = list(questions)
    random.Random(seed).shuffle(order)
    return [RequestSpec(i, len(q.split()), max_tokens, prompt_text=q)
            for i, q in enumerate(order[i % len(order)] for i in range(n))]


class ChatWorkload:
    """The chat workload as a ``WorkloadFn``; its ``warmup`` draws from questions that are never
    measured (runner.run_segment uses a workload's ``warmup`` when it has one), so a warm-up
    request does not put a measured question into the server's prefix cache."""

    def __init__(self, max_tokens: int = CHAT_MAX_TOKENS) -> None:
        self.max_tokens = max_tokens

    def __call__(self, n: int, seed: int) -> list[RequestSpec]:
        return chat_specs(n, seed, self.max_tokens)

    def warmup(self, n: int, seed: int) -> list[RequestSpec]:
        from mindie_bench.chat_questions import WARMUP_QUESTIONS
        return chat_specs(n, seed, self.max_tokens, WARMUP_QUESTIONS)


def make_workload(*, prompt_len: str = "128", output_len: str = "128", jsonl: Optional[str] = None,
                  vocab_size: int = 32000, tokenizer: Any = None, kind: str = "random") -> WorkloadFn:
    """A function ``(n, seed) -> specs`` for the chosen source (seeded, so the same
    ``(n, seed)`` gives the same requests: that is what makes A/B comparisons fair).
    ``kind="chat"``: the chat workload, ``output_len`` a single N (the max_tokens cap)."""
    if kind == "chat":
        lo, hi = parse_range(output_len)
        if lo != hi:
            raise ValueError(f"the chat workload takes one max_tokens cap, not a range ({output_len!r})")
        return ChatWorkload(hi)
    if kind != "random":
        raise ValueError(f"unknown workload {kind!r}: random or chat")
    if jsonl:
        return lambda n, seed: from_jsonl(jsonl, n, seed, vocab_size, tokenizer)
    p, o = parse_range(prompt_len), parse_range(output_len)
    return lambda n, seed: synthetic(n, p, o, seed, vocab_size)
