"""Structured output in the engine (issue 29): a request's ``SamplingParams.constraint`` compiled with
llguidance, its token masks, and jump-forward.

* ``Grammars`` (one per worker): llguidance's tokenizer built from the model's ``tokenizer.json``
  (with the model's EOS ids), and every constraint compiled on a thread of its own, cached by
  content (kind + spec), each from the grammar text the contract gives it (mindie/contract/grammar.py,
  the very text the front end checked). A compile never runs on the worker loop or the compute
  thread: a request whose grammar is compiling waits outside the scheduler (the engine's
  ``poll_constraints``); a constraint llguidance refuses ends that request with the contract's
  ``ConstraintError`` (a 400). The cache keeps
  each compiled grammar as a template matcher that is never advanced; a request gets a
  ``deep_copy`` (tens of microseconds, even for a large schema).
* ``ConstraintState`` (one per constrained request): its matcher, advanced with each accepted token
  (on the worker loop, after a step), and ``jump``: the tokens the grammar forces next.
* ``MaskJob`` (one per step with constrained rows): the rows' masks computed on the mask thread while
  the model step runs; the sampler waits for them only when it needs them.

Jump-forward is exact: a token is emitted without a model step only when the mask at its position
admits that one token (llguidance's masks follow the tokenizer's canonical tokenization inside forced
text, so a fixed JSON key is mostly such tokens), so greedy, seeded and penalised sampling would have
drawn it anyway, and its log-probability under the masked distribution is 0. llguidance's fast-forward
tokens are only the cheap hint that a forced run starts (they may begin with a token the mask does
not force, e.g. ``{"`` where ``{`` is allowed too). The forced tokens join the request's tokens
beyond what its KV cache holds, so the next step computes them with the last sampled one as a small
prefill chunk (docs/design.md, "Constrained decoding").
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Iterable, Sequence as Seq

import numpy as np

from mindie.contract.grammar import ConstraintError, first_lines, grammar_text, parser_limits
from mindie.contract.wire import Constraint
from mindie.runtime.heap import trim

log = logging.getLogger("workers.engine")

try:  # a worker without llguidance still serves unconstrained requests
    import llguidance
    from llguidance import LLExecutor, LLMatcher, LLTokenizer, TokenizerWrapper
    import llguidance.numpy as llg_np
except ImportError:  # pragma: no cover - llguidance is in install_requires
    llguidance = None


def load_tokenizer(model_dir: str, vocab_size: int, eos_ids: Iterable[int]) -> "LLTokenizer":
    """llguidance's tokenizer from ``model_dir/tokenizer.json`` (the same file the front ends
    tokenize with), its mask as wide as the model's logits where the tokenizer allows it, its end of
    sequence the model's EOS ids (those of config.json and generation_config.json; the tokenizer's
    own when there are none, as for the null model). The parse's freed pages go back to the kernel
    (mindie/runtime/heap.py: a large vocabulary's JSON and its Python objects, ~100 MiB for Gemma 3's)."""
    try:
        return _build_tokenizer(model_dir, vocab_size, eos_ids)
    finally:
        trim()


def _build_tokenizer(model_dir: str, vocab_size: int, eos_ids: Iterable[int]) -> "LLTokenizer":
    path = os.path.join(model_dir, "tokenizer.json")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConstraintError(f"constraints need the model's tokenizer.json, and {path} cannot be read: "
                              f"{e.strerror}") from None
    eos = sorted(eos_ids) or None
    try:
        tok = LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
    except ValueError:  # the tokenizer has more ids than the LM head: its own size
        tok = LLTokenizer(text, eos_token=eos)
    added = json.loads(text).get("added_tokens") or []
    if not any(not a.get("special", False) for a in added):
        return tok
    # Added tokens that are not special (Qwen3's <think>, </think>, <tool_call>): llguidance treats
    # every added token as special (a Lark grammar names it <think>; its bytes never match text),
    # yet tokenizes forced text with the tokenizer as it is, which matches them in text: a forced
    # "</think>" then allowed the token that the matcher refuses. The same tokenizer again, with a
    # text tokenizer that never yields an added token (they stay reachable by name only).
    return LLTokenizer(TokenizerWrapper(_TextTokenizer(tok, text, eos)), n_vocab=tok.vocab_size,
                       eos_token=list(tok.eos_tokens))


class _TextTokenizer:
    """What llguidance's ``TokenizerWrapper`` takes: the token bytes of ``tok`` (llguidance's own
    decoding), every added token special, and text tokenized with them split as text."""

    def __init__(self, tok: "LLTokenizer", text: str, eos: list[int] | None) -> None:
        from tokenizers import Tokenizer

        data = json.loads(text)
        for a in data.get("added_tokens") or []:
            a["special"] = True
        self._hf = Tokenizer.from_str(json.dumps(data))
        self._hf.encode_special_tokens = True  # added tokens in text are split as text
        self.tokens = [tok.decode_bytes([i]) for i in range(tok.vocab_size)]
        self.special_token_ids = [int(a["id"]) for a in data.get("added_tokens") or []]
        self.eos_token_id = (eos or list(tok.eos_tokens))[0]
        self.bos_token_id = None

    def __call__(self, s: bytes | str) -> list[int]:
        if isinstance(s, bytes):
            s = s.decode("utf-8", errors="replace")
        return self._hf.encode(s, add_special_tokens=False).ids


class Grammars:
    """A worker's constraint compiler: llguidance's tokenizer (built on the compile thread as soon as
    the worker starts), compiled grammars cached by content (the ``cache_size`` most recently used,
    errors included, so a repeated bad constraint is answered at once), and the mask thread."""

    def __init__(self, model_dir: str, vocab_size: int, eos_ids: Iterable[int], *, cache_size: int = 128,
                 mask_threads: int = 0) -> None:
        if llguidance is None:  # pragma: no cover
            raise RuntimeError("llguidance is not installed")
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        # llguidance's own pool for a batch's masks (it drops the GIL); a small one: on the CPU
        # backend the model step uses the cores.
        self._executor = LLExecutor(num_threads=mask_threads or max(1, min(4, (os.cpu_count() or 2) // 4)))
        eos = frozenset(int(e) for e in eos_ids)
        self._tokenizer: Future = self._compile_pool.submit(load_tokenizer, model_dir, vocab_size, eos)
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.compiles = 0  # grammars compiled (cache misses)
        self.hits = 0  # requests served from the cache
        self.compile_s = 0.0  # total compile time

    # -- the tokenizer ------------------------------------------------------------------------
    def wait_tokenizer(self) -> None:
        """Block until the tokenizer is built, or failed (its error stays for the requests)."""
        wait([self._tokenizer])

    def tokenizer(self, timeout: float | None = None) -> "LLTokenizer":
        """llguidance's tokenizer (waits for it; raises ConstraintError when it could not be built)."""
        return self._tokenizer.result(timeout)

    @property
    def words(self) -> int:
        """int32 words of one mask."""
        return (self.tokenizer().vocab_size + 31) // 32

    # -- compiling ----------------------------------------------------------------------------
    def compile(self, c: Constraint) -> Future:
        """The future template matcher of ``c`` (ConstraintError on failure), cached by content.
        Never blocks: the compile runs on the compile thread."""
        key = (c.kind, c.spec)
        fut = self._cache.get(key)
        if fut is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return fut
        fut = self._compile_pool.submit(self._compile, c)
        self._cache[key] = fut
        while len(self._cache) > self.cache_size:
            old_key, old = next(iter(self._cache.items()))
            if not old.done():
                break  # never evict a compile in progress (requests wait on it)
            del self._cache[old_key]
        return fut

    def _compile(self, c: Constraint) -> "LLMatcher":
        t0 = time.perf_counter()
        tok = self.tokenizer()
        grammar = grammar_text(c)
        m = LLMatcher(tok, grammar, log_level=0, limits=parser_limits())  # the front end's limits
        self.compiles += 1
        self.compile_s += time.perf_counter() - t0
        if m.is_error():
            raise ConstraintError(f"{c.kind} constraint: {first_lines(m.get_error())}")
        return m

    def state(self, template: "LLMatcher", stop_ids: Seq[int] = ()) -> "ConstraintState":
        """A new request's state on a compiled grammar."""
        tok = self.tokenizer()
        return ConstraintState(template.deep_copy(), frozenset(tok.eos_tokens), stop_ids, self.words)

    # -- masks --------------------------------------------------------------------------------
    def masks(self, states: list["ConstraintState"]) -> "MaskJob":
        """The masks of ``states`` at their current positions: those already known copied now, the
        rest computed on the mask thread (MaskJob.wait)."""
        return MaskJob(self, states)

    def close(self) -> None:
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._mask_pool.shutdown(wait=True)


class ConstraintState:
    """One constrained request: its matcher at the tokens it has accepted, and the mask there once
    computed (``bits``; it stays valid until the next token is consumed)."""

    __slots__ = ("matcher", "eos", "stop", "words", "bits", "forced", "error")

    def __init__(self, matcher: "LLMatcher", eos: frozenset[int], stop_ids: Seq[int], words: int) -> None:
        self.matcher = matcher
        self.eos = eos  # what the grammar ends with: the model's EOS ids
        self.stop = tuple(int(t) for t in stop_ids if 0 <= t < words * 32)  # allowed once the grammar accepts
        self.words = words
        self.bits: np.ndarray | None = None
        self.forced = 0  # tokens emitted without a model step
        self.error = ""

    def ends(self, tok: int) -> bool:
        """Whether ``tok`` ends the request's output as the grammar stands (EOS or a stop id, with
        the grammar accepting)."""
        return (tok in self.eos or tok in self.stop) and self.matcher.is_accepting()

    def consume(self, tok: int) -> bool:
        """Advance over an accepted token; False (and ``error`` set) when the grammar refuses it."""
        self.bits = None
        if self.matcher.consume_token(tok):
            return True
        self.error = first_lines(self.matcher.get_error()) or f"token {tok} is not allowed here"
        return False

    def fill(self, row: np.ndarray) -> None:
        """This position's mask into ``row`` (int32 words); the stop ids are allowed where the grammar
        accepts. A matcher that fails here (a grammar too complex to follow) allows everything and
        records the error: the request ends after this step."""
        llg_np.fill_next_token_bitmask(self.matcher, row.reshape(1, -1))
        self._finish(row)

    def _finish(self, row: np.ndarray) -> None:
        if self.matcher.is_error():
            self.error = self.error or first_lines(self.matcher.get_error())
            row.fill(-1)
        elif self.stop and self.matcher.is_accepting():
            words = row.view(np.uint32)
            for t in self.stop:
                words[t >> 5] |= np.uint32(1 << (t & 31))
        self.bits = row.copy()

    def check_draft(self, draft: list[int]) -> list[int]:
        """The longest prefix of a speculative proposal the grammar allows from here, cut before an
        end token (EOS or a stop id: the request's end is left to a sampled token)."""
        n = self.matcher.validate_tokens(draft)
        for j in range(min(n, len(draft))):
            if draft[j] in self.eos or draft[j] in self.stop:
                return draft[:j]
        return draft[:n]

    def draft_masks(self, draft: list[int]) -> np.ndarray:
        """The masks [len(draft), words] after each proposed token (row j: after draft[:j + 1]),
        computed by advancing the matcher and rolling it back; the state is as before."""
        bits, error = self.bits, self.error
        out = np.empty((len(draft), self.words), dtype=np.int32)
        done = 0
        try:
            for j, tok in enumerate(draft):
                if not self.matcher.consume_token(tok):
                    out[j:] = -1  # (checked by check_draft: not expected) every token, so no row is empty
                    break
                done += 1
                self.fill(out[j])
        finally:
            if done:
                self.matcher.rollback(done)
            self.bits, self.error = bits, error
        return out

    def jump(self, limit: int, *, first: bool = False) -> list[int]:
        """Up to ``limit`` tokens the grammar forces from here (each the only token its mask admits),
        consumed. Stops before the first free choice, leaving its mask in ``bits`` when it was
        computed. A grammar that is complete and admits exactly one end token forces that too, unless
        ``first`` (the tokens forced before a request's first step, which must sample one): then it
        also stops before an end token or a stop id."""
        out: list[int] = []
        m = self.matcher
        # llguidance's fast-forward tokens from here: the cheap hint that forced text follows
        # (computed once per run of them: it costs twice a mask); the masks decide.
        hint: list[int] = []
        while len(out) < limit and not m.is_error():
            if m.is_stopped():  # complete: only an end token may follow
                ends = self.eos | set(self.stop) if m.is_accepting() else self.eos
                if len(ends) == 1 and not first:
                    out.append(next(iter(ends)))
                break
            if not hint:
                hint = m.compute_ff_tokens()
                if not hint:  # no forced text here
                    break
            row = np.empty(self.words, dtype=np.int32)
            self.fill(row)
            tok = single_token(row)
            if tok is None or (first and (tok in self.eos or tok in self.stop)) or not self.consume(tok):
                break
            out.append(tok)
            hint = hint[1:] if tok == hint[0] else []
        self.forced += len(out)
        return out


def single_token(row: np.ndarray) -> int | None:
    """The token of a mask that admits exactly one, else None."""
    nz = np.flatnonzero(row)
    if len(nz) != 1:
        return None
    w = int(row[nz[0]]) & 0xFFFFFFFF
    if w & (w - 1):
        return None
    return int(nz[0]) * 32 + w.bit_length() - 1


class MaskJob:
    """One step's masks for its constrained rows, in the order given: ``bits`` [rows, words] int32,
    bit ``t`` of a row set when token ``t`` is allowed. Known masks are copied at once; the others are
    computed on the mask thread while the model step runs (``wait`` joins it)."""

    def __init__(self, grammars: Grammars, states: list[ConstraintState]) -> None:
        self.states = states
        self.words = grammars.words
        self.bits = np.empty((len(states), self.words), dtype=np.int32)
        todo = []
        for i, st in enumerate(states):
            if st.bits is not None:
                self.bits[i] = st.bits
            else:
                todo.append(i)
        self.computed = len(todo)
        # The masks as a CPU sampler adds them (``additive``, float32 [rows, words * 32]: 0 where a
        # token is allowed, -inf where not), made on the mask thread beside the step: adding it to
        # the logits costs a quarter of a masked fill (0.46 against 1.9 ms at 32 rows x 32000 ids).
        self.additive: np.ndarray | None = None
        self._future: Future = grammars._mask_pool.submit(self._compute, grammars._executor, todo)

    def _compute(self, executor: "LLExecutor", todo: list[int]) -> None:
        if len(todo) == 1:
            self.states[todo[0]].fill(self.bits[todo[0]])
        elif todo:
            llg_np.fill_next_token_bitmask_par(executor, [(self.states[i].matcher, i) for i in todo], self.bits)
            for i in todo:
                self.states[i]._finish(self.bits[i])
        banned = np.unpackbits((~self.bits).view(np.uint8), axis=1, bitorder="little").view(bool)
        additive = np.zeros(banned.shape, dtype=np.float32)
        np.putmask(additive, banned, np.float32(-np.inf))
        self.additive = additive

    def wait(self) -> np.ndarray:
        """The masks (blocks until computed). Idempotent; raises what the mask thread raised."""
        self._future.result()
        return self.bits


def first_allowed(row: np.ndarray, start: int, vocab_size: int) -> int:
    """The first token at or after ``start`` (wrapping) that a mask allows, inside ``vocab_size``
    (the null model's pick for a constrained row)."""
    allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size])
    if not len(allowed):
        return start % vocab_size
    j = int(np.searchsorted(allowed, start % vocab_size))
    return int(allowed[j % len(allowed)])


__all__ = ["ConstraintState", "Grammars", "MaskJob", "first_allowed", "load_tokenizer", "single_token"]
