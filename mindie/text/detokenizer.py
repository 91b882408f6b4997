"""Tokenizer loading, prompt encoding and incremental (streaming) detokenisation.

Front ends own all text handling (the device workers only see ids). ``load_tokenizer`` reads
a Hugging Face ``tokenizer.json`` with the ``tokenizers`` library; ``TextTokenizer.encode``
adds BOS etc. exactly as the tokenizer's post-processor does; ``IncrementalDetokenizer`` turns
the ids of one request into text chunks for SSE frames.

Kept over ``tokenizers.decoders.DecodeStream`` (0.23.3, scripts/bench_detokenizer.py): DecodeStream
streams a byte-fallback byte that a later byte turns into U+FFFD (wrong text, or an "Invalid prefix"
error) and re-decodes an open invalid-byte run every step (O(n) per token), for 0.3-0.6 µs/token saved.

Streaming contract (what callers may rely on):
- ``"".join(push(...) for each step) + flush() == full_text()``, and
  ``full_text() == tokenizer.decode(all_ids, skip_special_tokens=True)`` (MindIE's
  generated_text; special tokens are always skipped, mindie.md §4.2), except the special ids
  a request asks to keep (``keep``: a tool-call format's delimiters such as ``[TOOL_CALLS]``,
  which the OpenAI chat route parses and never shows): those are rendered where they stand.
- A chunk never ends inside a character: bytes of an incomplete UTF-8 sequence (decoded as a
  trailing U+FFFD by byte-level BPE or byte-fallback tokenizers) are held back until the
  character completes. U+FFFD reaches a chunk only when the final text has it too (invalid
  byte sequences the model really produced, or a trailing incomplete character at ``flush``).
- O(1) per token: like TGI's ``prefix_offset``/``read_offset`` method (tgi.md §5) each step
  decodes only a small window: the tokens since the last completed step plus the new ones.

Why a window and not one token at a time: decoding a token alone loses context — SentencePiece
``▁`` spaces and the leading-space strip that Metaspace/Strip decoders apply to the *first*
token of whatever they decode, and byte tokens that carry part of a character. The window
starts at a token whose text was already emitted, so the strip hits both the emitted part and
the new text alike and the difference is exact. Generation starts with an empty window, so the
first generated token's leading space is stripped exactly as ``decode(all_ids)`` strips it.

Special ids are dropped before they enter the window: ``decode(skip_special_tokens=True)``
removes them before the decoder runs, so the remaining ids decode identically, and a window
that would start with a skipped token cannot wrongly strip the next token's space.

Byte-fallback tokenizers (Llama 2, Mistral: ``<0xE4>``-style tokens) need one more rule: the
``ByteFallback`` decoder converts a whole run of byte tokens at once and, if the run is not
valid UTF-8, turns *every* byte of it into U+FFFD, even bytes that alone were valid text
(``<0x3F>`` is "?", ``<0x3F><0x9F>`` is "��"). So the text of a trailing run of byte tokens is
held until a non-byte token closes the run: a character spelled with byte tokens is streamed
one step later, and the stream still matches ``decode(all_ids)`` exactly.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer

from mindie.runtime.heap import trim

__all__ = ["TextTokenizer", "IncrementalDetokenizer", "load_tokenizer"]

_REPLACEMENT = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_LONG_WINDOW = 16  # tokens; a held window longer than this is shrunk (_shrink_window)
_LONG_TEXT = 1 << 16  # characters; longer prompts are tokenised without holding the GIL


class TextTokenizer:
    """A loaded tokenizer with the few operations a front end needs."""

    __slots__ = ("tokenizer", "special_ids", "byte_ids", "vocab_size")

    def __init__(self, tokenizer: Tokenizer) -> None:
        # tokenizer.json may carry truncation/padding settings from training; a prompt must
        # never be cut or padded silently (the server applies MindIE's truncation rules).
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.tokenizer = tokenizer
        self.special_ids: frozenset[int] = frozenset(
            i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special
        )
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        # Ids of <0xXX> tokens, only when the decoder really has a ByteFallback step.
        decoder = tokenizer.decoder
        has_byte_fallback = decoder is not None and b'"ByteFallback"' in decoder.__getstate__()
        self.byte_ids: frozenset[int] = frozenset(
            i for t, i in tokenizer.get_vocab(with_added_tokens=False).items() if _BYTE_TOKEN.fullmatch(t)
        ) if has_byte_fallback else frozenset()

    def encode(self, text: str) -> list[int]:
        """Prompt ids, with the special tokens (BOS, ...) the post-processor adds.

        A long text goes through ``encode_batch``, which releases the GIL while it works (plain
        ``encode`` holds it: ~0.7 s per MB here), so a front end that tokenises a 40 MB prompt
        on a thread keeps serving its other requests and its gunicorn heartbeat."""
        if len(text) > _LONG_TEXT:
            return self.tokenizer.encode_batch([text], add_special_tokens=True)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` with special tokens skipped (MindIE's generated_text)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def detokenizer(self, keep: frozenset[int] = frozenset()) -> "IncrementalDetokenizer":
        """A fresh streaming detokeniser for one request (``keep``: special ids to keep)."""
        return IncrementalDetokenizer(self, keep)


def load_tokenizer(model_dir: str | os.PathLike[str]) -> TextTokenizer:
    """Load ``<model_dir>/tokenizer.json`` (or the file itself if a file path is given)."""
    path = Path(model_dir)
    if path.is_dir():
        path = path / "tokenizer.json"
    tokenizer = TextTokenizer(Tokenizer.from_file(str(path)))
    trim()  # the parse's freed pages: ~190 MiB for Gemma 3's 262k tokens, resident for good otherwise
    return tokenizer


class IncrementalDetokenizer:
    """Streaming text for the generated ids of one request (see the module docstring)."""

    __slots__ = ("all_ids", "_decode", "_special", "_bytes", "_ids", "_start", "_read", "_done",
                 "_emitted", "_full", "_run", "_run_stop")

    def __init__(self, tok: TextTokenizer, keep: frozenset[int] = frozenset()) -> None:
        """``keep``: special ids whose text stays in the output (a tool-call format's delimiters,
        mindie/text/tool_calls.py); every other special id is dropped as always."""
        self._decode = tok.tokenizer.decode
        self._special = tok.special_ids - keep if keep else tok.special_ids
        if keep:  # the other special ids never enter the window, so only the kept ones are rendered
            decode = tok.tokenizer.decode
            self._decode = lambda ids, skip_special_tokens=True: decode(ids, skip_special_tokens=False)
        self._bytes = tok.byte_ids
        self.all_ids: list[int] = []  # every id pushed, special ones included
        self._ids: list[int] = []  # non-special ids: what decode(skip_special_tokens=True) sees
        self._start = 0  # window start in _ids; the window's text is emitted up to _done chars
        self._read = 0  # _ids[:_read] are fully emitted (no held bytes)
        self._done = 0  # chars of decode(_ids[_start:]) already emitted
        self._emitted = 0  # chars emitted in total
        self._full: str | None = None
        self._run = -1  # start of the open run of byte-fallback tokens at the end, -1 = none
        self._run_stop = -1  # window end last decoded while that run was open

    def push(self, ids: Iterable[int]) -> str:
        """Add one step's ids; return the newly completed text ("" while bytes are held)."""
        ids = list(ids)
        self.all_ids.extend(ids)
        special = self._special
        new = [i for i in ids if i not in special] if special else ids
        if not new:
            return ""
        self._full = None
        all_ids = self._ids
        base = len(all_ids)
        all_ids.extend(new)
        start = self._start
        byte_ids = self._bytes
        if byte_ids:
            run = self._run
            for k, i in enumerate(new):
                if i in byte_ids:
                    if run < 0:
                        run = base + k
                else:
                    run = -1
            self._run = run
            if run >= 0:
                return self._emit_before_run(max(run, start))
        self._run_stop = -1
        text = self._decode(all_ids[start:], skip_special_tokens=True)
        if text.endswith(_REPLACEMENT):
            # Possibly an incomplete character: emit what precedes the trailing U+FFFD run and
            # keep the window where it is, so the held bytes are decoded again with the rest.
            end = len(text.rstrip(_REPLACEMENT))
            out = text[self._done:end] if end > self._done else ""
            self._done += len(out)
            self._emitted += len(out)
            if len(all_ids) - start > _LONG_WINDOW:
                out += self._shrink_window(text)
            return out
        out = text[self._done:] if len(text) > self._done else ""
        # Everything decoded is complete: slide the window to start after the last completed
        # step, keeping those tokens as context for the next one.
        new_start = self._read
        if new_start != start:
            self._start = new_start
            text = self._decode(all_ids[new_start:], skip_special_tokens=True)
        self._read = len(all_ids)
        self._done = len(text)
        self._emitted += len(out)
        return out

    def _emit_before_run(self, stop: int) -> str:
        """An open run of byte tokens ends the window: only the text before it is final."""
        if stop == self._run_stop:
            return ""  # same text as last step; the run just got longer
        self._run_stop = stop
        start = self._start
        text = self._decode(self._ids[start:stop], skip_special_tokens=True) if stop > start else ""
        out = text[self._done:] if len(text) > self._done else ""
        self._done += len(out)
        self._emitted += len(out)
        return out

    def _shrink_window(self, text: str) -> str:
        """Bound the window when many steps in a row end in U+FFFD; return extra final text.

        Happens on long runs of invalid bytes (each one is final garbage, but the text keeps
        ending in U+FFFD) or on many characters split across tokens. Any incomplete character
        sits in the last 3 tokens, so try a split point b among them: when
        ``decode(head) + decode(tail) == decode(window)`` no character straddles b, ``head``
        can never change, and the window restarts at b.
        """
        ids = self._ids
        decode = self._decode
        start, n = self._start, len(ids)
        for b in range(n - 1, max(start, n - 4), -1):
            head = decode(ids[start:b], skip_special_tokens=True)
            if not text.startswith(head):
                continue
            if head + decode(ids[b:], skip_special_tokens=True) != text:
                continue
            done = self._done
            out = head[done:] if len(head) > done else ""
            self._done = max(0, done - len(head))
            self._emitted += len(out)
            self._start = self._read = b
            return out
        return ""

    def full_text(self) -> str:
        """``decode(all_ids, skip_special_tokens=True)`` (cached until the next push)."""
        if self._full is None:
            self._full = self._decode(self._ids, skip_special_tokens=True)
        return self._full

    def flush(self) -> str:
        """The rest of ``full_text()`` not yet emitted (held bytes show as U+FFFD, as in decode).

        Call once the request has finished. A later ``push`` continues after the flushed text
        (exact only if the flush did not cut a character: held bytes were flushed as U+FFFD).
        """
        full = self.full_text()
        rest = full[self._emitted:]
        self._emitted = len(full)
        if rest:
            # Mark the whole window as emitted so a later push does not repeat it.
            self._done = len(self._decode(self._ids[self._start:], skip_special_tokens=True))
        return rest

    @property
    def emitted_chars(self) -> int:
        """Characters returned so far by push/flush."""
        return self._emitted
