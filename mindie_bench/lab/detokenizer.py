#!/usr/bin/env python3
"""Streaming detokenisation: mindie.text.detokenizer vs a ``tokenizers.decoders.DecodeStream`` wrapper.

Pushes N ids one at a time through each implementation and prints µs per token and whether the
stream is exact (chunks + flush == decode(all ids, skip_special_tokens=True), and no U+FFFD in a
chunk unless the final text has one). Tokenizers: the demo model's byte-level BPE (real text and
random ids) and the test suite's Llama-2-style / Metaspace byte-fallback tokenizers.

    python3 -m mindie_bench.lab.detokenizer [--tokens 2000] [--repeat 5]

Also ``mindie-bench detokenizer ...`` (mindie_bench/lab/__init__.py lists the lab's commands).

Front-end internals, on purpose: it measures ``mindie.text.detokenizer`` itself (and uses the test
suite's tokenizers in tests/).
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from tokenizers.decoders import DecodeStream  # noqa: E402

from mindie.text.detokenizer import IncrementalDetokenizer, TextTokenizer, load_tokenizer  # noqa: E402

FFFD = "\ufffd"
TEXT = (
    "The quick brown fox jumps over the lazy dog. Café naïve résumé déjà vu. 中文测试，你好世界。"
    " emoji 😀🎉👍🏽 party time!\n  two leading spaces, tabs\tand numbers 12345. "
)


class DecodeStreamDetokenizer:
    """The same interface as IncrementalDetokenizer, on tokenizers' DecodeStream."""

    def __init__(self, tok: TextTokenizer) -> None:
        self._tok = tok.tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self.all_ids: list[int] = []
        self._emitted = 0

    def push(self, ids: Iterable[int]) -> str:
        ids = list(ids)
        self.all_ids.extend(ids)
        out = self._stream.step(self._tok, ids) or ""
        self._emitted += len(out)
        return out

    def full_text(self) -> str:
        return self._tok.decode(self.all_ids, skip_special_tokens=True)

    def flush(self) -> str:
        full = self.full_text()
        rest, self._emitted = full[self._emitted:], len(full)
        return rest


IMPLS = {"hand-written": IncrementalDetokenizer, "DecodeStream": DecodeStreamDetokenizer}


def run(impl, tok: TextTokenizer, ids: list[int]) -> tuple[float, str]:
    """(seconds for pushing ids one at a time, verdict)."""
    d = impl(tok)
    chunks: list[str] = []
    t0 = time.perf_counter()
    try:
        for i in ids:
            chunks.append(d.push((i,)))
    except Exception as e:  # DecodeStream raises "Invalid prefix" on some byte-fallback runs
        return time.perf_counter() - t0, f"raises {type(e).__name__}: {str(e)[:40]!r}"
    dt = time.perf_counter() - t0
    rest = d.flush()
    full = tok.decode(ids)
    if "".join(chunks) + rest != full:
        return dt, "WRONG TEXT"
    if FFFD not in full and any(FFFD in c for c in chunks):
        return dt, "U+FFFD mid-stream"
    return dt, "exact"


def cases(n: int) -> list[tuple[str, TextTokenizer, list[int]]]:
    from workers.models.demo import ensure_demo_model

    import test_detokenizer as T  # the test suite's trained tokenizers

    rng = random.Random(0)
    out = []
    demo = load_tokenizer(ensure_demo_model())
    for name, tok in [("demo byte-level", demo), *T.TOKENIZERS.items()]:
        text_ids = tok.tokenizer.encode(TEXT * (n // 10), add_special_tokens=False).ids[:n]
        out.append((f"{name}: text", tok, text_ids))
        if name == "demo byte-level" or name.startswith("llama2"):
            out.append((f"{name}: random ids", tok, [rng.randrange(tok.vocab_size) for _ in range(n)]))
    bl = T.TOKENIZERS["byte_level"]
    stray = next(i for t, i in sorted(bl.tokenizer.get_vocab().items()) if len(t) == 1 and bl.decode([i]) == FFFD)
    out.append(("byte_level: invalid bytes", bl, [stray] * n))
    sp = T.TOKENIZERS["llama2_bytefallback"]
    out.append(("llama2: invalid byte run", sp, [sp.tokenizer.token_to_id("<0x80>")] * n))
    # "?" (<0x3F>) is valid alone, but ByteFallback turns the run <0x3F><0x9F> into "\ufffd\ufffd"
    qmark = [sp.tokenizer.token_to_id(t) for t in ("<0x3F>", "<0x9F>")]
    text_ids = next(ids for label, _, ids in out if label == "llama2_bytefallback: text")[: n - 2]
    while text_ids and text_ids[-1] in sp.byte_ids:  # the pair must open a run of its own
        text_ids.pop()
    out.append(("llama2: text, then <0x3F><0x9F>", sp, text_ids + qmark))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5, help="best of this many runs")
    args = ap.parse_args(argv)
    print(f"{'case':34} " + " ".join(f"{k + ' µs/tok':>18} {'':18}" for k in IMPLS))
    for label, tok, ids in cases(args.tokens):
        cells = []
        for impl in IMPLS.values():
            runs = [run(impl, tok, ids) for _ in range(args.repeat)]
            best = min(dt for dt, _ in runs)
            cells.append(f"{best / len(ids) * 1e6:18.2f} {runs[0][1][:18]:18}")
        print(f"{label:34} " + " ".join(cells))


if __name__ == "__main__":
    main()
