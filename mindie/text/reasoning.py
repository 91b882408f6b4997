"""Reasoning parsers: the thinking of a ``<think>...</think>`` model goes to ``reasoning_content``,
the answer to ``content`` (OpenAI chat route), streamed as separate deltas.

Parsers (vLLM's ``--reasoning-parser`` names):

- ``qwen3`` (Qwen3, QwQ): the thinking is what the model writes between ``<think>`` and
  ``</think>`` at the start of its answer; an answer that does not open with ``<think>`` is all
  content (``enable_thinking: false``: Qwen3's template closes an empty think block in the prompt).
- ``harmony`` (GPT-OSS): the ``analysis`` channel of OpenAI's harmony format is the thinking, the
  ``final`` channel the answer (mindie/text/harmony.py; its tool calls stay in the content for the
  ``harmony`` tool-call parser).
- ``deepseek_r1`` (DeepSeek-R1 and its distills): the template opens the think block in the
  prompt (``<think>\\n``), so everything before ``</think>`` is thinking, a leading ``<think>``
  the model writes again included, unless the prompt ends with a closed block.

Which one (``ModelConfig.reasoningParser``, docs/config.md): a name, ``none``, or ``auto`` (the
default): MindIE's ``ModelConfig.models.<type>.enable_reasoning`` when the config sets it (true: the
parser of that model type; false: none), else detected from the chat template (``detect``): a
template that writes ``<think>`` and ``</think>`` thinks; one whose generation prompt ends with
``<think>`` is DeepSeek-R1's kind.

Text, not token ids, is parsed, so it works whether ``<think>`` is one token or several, and a tag
split across stream frames is held back until it is complete (or cannot be one). As Qwen3's own
template does with past turns, the newlines next to the tags are dropped: ``reasoning_content`` is
stripped of leading and trailing newlines, ``content`` of leading ones. An answer cut by
``max_tokens`` inside the thinking is all ``reasoning_content`` (``content`` empty). The
concatenated deltas of a stream equal the non-streamed fields, however the text is split.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import msgspec

from mindie.contract.errors import FINISH_LENGTH
from mindie.text import harmony
from mindie.text.generation import Piece

__all__ = ["PARSERS", "HarmonyParser", "ReasoningParser", "Splitter", "detect", "choose", "split", "MODEL_TYPE_PARSERS"]

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    """A parser: its tags, and whether the answer starts inside the thinking (the template opens
    the block in the prompt)."""

    name: str
    starts_inside: bool
    start: str = START
    end: str = END

    def initial(self, prompt: str) -> bool:
        """Whether the answer to ``prompt`` (the rendered chat text) starts inside the thinking."""
        tail = prompt.rstrip()
        if tail.endswith(self.end):
            return False  # the template closed an empty block (thinking switched off)
        return self.starts_inside or tail.endswith(self.start)

    def splitter(self, prompt: str) -> "Splitter":
        return Splitter(self, self.initial(prompt))


@dataclass(frozen=True)
class HarmonyParser(ReasoningParser):
    """GPT-OSS's harmony format (mindie/text/harmony.py): the ``analysis`` channel is the thinking.
    Its markers are special tokens the chat route keeps in the text (``markers``); ``end`` is the
    analysis message's end (reasoning tokens are counted up to the first one)."""

    markers: tuple[str, ...] = harmony.MARKERS

    def initial(self, prompt: str) -> bool:
        return harmony.open_tail(prompt).rstrip().endswith("analysis" + harmony.MESSAGE)

    def splitter(self, prompt: str) -> harmony.HarmonySplitter:  # type: ignore[override]
        return harmony.HarmonySplitter(harmony.open_tail(prompt))


PARSERS = {"qwen3": ReasoningParser("qwen3", starts_inside=False),
           "deepseek_r1": ReasoningParser("deepseek_r1", starts_inside=True),
           "harmony": HarmonyParser("harmony", starts_inside=False, start=harmony.CHANNEL + "analysis",
                                    end=harmony.END)}
# MindIE's model-type keys under ModelConfig.models (its enable_reasoning docs) and their parser.
MODEL_TYPE_PARSERS = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "deepseekv2": "deepseek_r1",
                      "deepseek_v3": "deepseek_r1", "deepseek_v32": "deepseek_r1", "gpt_oss": "harmony"}

# Splitter states.
_PRE, _OPENING, _THINKING, _CLOSED, _CONTENT = range(5)


class Splitter:
    """One answer's text, pushed as it streams: ``push`` returns (reasoning, content) deltas."""

    __slots__ = ("p", "state", "buf", "saw_reasoning")

    def __init__(self, parser: ReasoningParser, inside: bool):
        self.p = parser
        self.state = _OPENING if inside else _PRE
        self.buf = ""
        self.saw_reasoning = inside  # reasoning_content is a string (maybe empty), else null

    @property
    def thinking(self) -> bool:
        """Whether the text so far ends inside the thinking (tokens now count as reasoning)."""
        return self.state in (_OPENING, _THINKING)

    def push(self, text: str) -> tuple[str, str]:
        if not text:
            return "", ""
        self.buf += text
        return self._run(False)

    def flush(self) -> tuple[str, str]:
        """What is held, once the answer has ended."""
        return self._run(True)

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning, content = "", ""
        start, end = self.p.start, self.p.end
        while True:
            buf = self.buf
            if self.state == _PRE:
                s = buf.lstrip()
                if s.startswith(start):
                    self.buf, self.state, self.saw_reasoning = s[len(start):], _OPENING, True
                    continue
                if not final and start.startswith(s):  # nothing yet, or a part of <think>
                    break
                self.state = _CONTENT
                continue
            if self.state == _OPENING:  # drop a repeated <think> and the newlines after it
                s = buf.lstrip()
                if s.startswith(start):
                    self.buf = s[len(start):]
                    continue
                if not final and (not s or start.startswith(s)):
                    break
                self.buf, self.state = buf.lstrip("\n"), _THINKING
                continue
            if self.state == _THINKING:
                i = buf.find(end)
                if i >= 0:
                    reasoning += buf[:i].rstrip("\n")
                    self.buf, self.state = buf[i + len(end):], _CLOSED
                    continue
                if final:
                    reasoning += buf.rstrip("\n")
                    self.buf = ""
                    break
                keep = _partial_suffix(buf, end)  # the start of </think>, and newlines before it
                head = buf[:len(buf) - keep]
                cut = len(head.rstrip("\n"))
                reasoning += buf[:cut]
                self.buf = buf[cut:]
                break
            if self.state == _CLOSED:
                s = buf.lstrip("\n")
                if not s:
                    self.buf = ""
                    break
                self.buf, self.state = s, _CONTENT
                continue
            content += buf  # _CONTENT
            self.buf = ""
            break
        return reasoning, content


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def split(parser: ReasoningParser, prompt: str, text: str) -> tuple[str | None, str]:
    """A whole answer: (reasoning_content or None when it has no thinking, content)."""
    sp = parser.splitter(prompt)
    r1, c1 = sp.push(text)
    r2, c2 = sp.flush()
    return (r1 + r2 if sp.saw_reasoning else None), c1 + c2


def detect(template: Any) -> ReasoningParser | None:
    """The parser a chat template calls for (mindie.text.chat_template.ChatTemplate): None when it
    does not think."""
    try:
        source = template.source()
    except Exception:  # noqa: BLE001 - several templates without a default: no detection
        return None
    if harmony.CHANNEL in source and harmony.MESSAGE in source:  # GPT-OSS's harmony format
        return PARSERS["harmony"]
    if START not in source or END not in source:
        return None
    try:
        prompt = template.render([{"role": "user", "content": "1+1?"}])
    except Exception:  # noqa: BLE001 - a template that refuses the probe: Qwen3's kind
        prompt = ""
    return PARSERS["deepseek_r1" if prompt.rstrip().endswith(START) else "qwen3"]


def choose(setting: str, enable_reasoning: dict[str, bool], template: Any) -> ReasoningParser | None:
    """The parser of a served model. ``setting``: ModelConfig.reasoningParser (a parser name,
    "none" or "auto"); ``enable_reasoning``: MindIE's ModelConfig.models.<type>.enable_reasoning
    values the config sets, by model type."""
    if setting == "none":
        return None
    if setting != "auto":
        return PARSERS[setting]
    if enable_reasoning:
        on = [t for t, v in enable_reasoning.items() if v]
        if not on:
            return None
        name = MODEL_TYPE_PARSERS.get(on[0])
        return PARSERS[name] if name else (detect(template) or PARSERS["qwen3"])
    return detect(template)


# -- the thinking budget ------------------------------------------------------------------------

# MindIE's example early_stopping_text for Qwen3 (its thinking-budget docs): what is written into
# the answer when the thinking reaches its budget, closing the think block.
DEFAULT_EARLY_STOPPING_TEXT = ("\n\nConsidering the limited time by the user, I have to give the solution based on "
                               "the thinking directly now.\n</think>\n\n")
MAX_THINKING_BUDGET = 2**32 - 1  # MindIE: [1, MAX_UINT32]


@dataclass(frozen=True)
class ThinkingBudget:
    """MindIE's thinking budget (``chat_template_kwargs.thinking_budget``): once the thinking has
    taken ``tokens`` tokens without closing, the front end ends that generation, writes
    ``early_text`` (``early_ids``) into the answer as if the model had, and continues the answer from
    there (a new submission of prompt + answer so far; the prefix cache keeps its prefill cheap)."""

    tokens: int
    parser: ReasoningParser
    prompt: str
    early_ids: tuple[int, ...]
    early_text: str

    def generation(self, start: Any, input_ids: list[int], params: Any) -> "BudgetedGeneration":
        """``start(ids, params)`` makes a ``mindie.text.generation.Generation``."""
        return BudgetedGeneration(self, start, input_ids, params)


class BudgetedGeneration:
    """A generation whose thinking is cut at its budget: the pipeline reads it as a Generation
    (``pieces``, ``stream``). The budget is checked after each step, so a step that brings several
    tokens may pass it by the rest of its tokens."""

    def __init__(self, budget: ThinkingBudget, start: Any, input_ids: list[int], params: Any):
        self.budget = budget
        self._start = start
        self.input_ids = input_ids
        self.params = params
        self.gen = start(input_ids, params)

    @property
    def stream(self) -> Any:
        return self.gen.stream

    async def pieces(self, tick: bool = False):
        """The pieces of the generation, then (over budget) the early text and the continuation's."""
        b = self.budget
        sp = b.parser.splitter(b.prompt)
        counted = 0
        async with contextlib.aclosing(self.gen.pieces(tick)) as pieces:
            async for p in pieces:
                if p is None:
                    yield None
                    continue
                before = sp.thinking
                sp.push(p.text)
                if before or sp.thinking:
                    counted += len(p.token_ids)
                if not (sp.thinking and counted >= b.tokens and not p.finish_reason):
                    yield p
                    continue
                yield p
                generated = list(self.gen.token_ids)
                break
            else:
                return
        # Over budget, still thinking: end this generation (aclosing cancelled it on its worker),
        # write the early-stopping text, and continue after it.
        left = self.params.max_new_tokens - len(generated) - len(b.early_ids)
        yield Piece(list(b.early_ids), b.early_text, finish_reason="" if left > 0 else FINISH_LENGTH)
        if left <= 0:
            return
        self.gen = self._start(self.input_ids + generated + list(b.early_ids),
                               msgspec.structs.replace(self.params, max_new_tokens=left))
        if self.gen.detok is not None:  # the text goes on after the early text (no fresh-start space strip)
            self.gen.detok.push(list(b.early_ids))
        async with contextlib.aclosing(self.gen.pieces(tick)) as pieces:
            async for p in pieces:
                yield p
