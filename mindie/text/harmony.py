"""OpenAI's harmony chat format (GPT-OSS) read from generated text.

An answer is a run of messages, each ``[<|start|>ROLE][ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT]
[ <|constrain|>TYPE]<|message|>BODY`` ended by ``<|end|>``, ``<|return|>`` (the last, final answer)
or ``<|call|>`` (a tool call: the recipient is ``functions.NAME``, the body its JSON arguments).
The chat template's generation prompt ends with ``<|start|>assistant``, so the first message of an
answer starts at ``<|channel|>``. Channels: ``analysis`` (the thinking: ``reasoning_content``),
``commentary`` (tool calls, or a preamble for the user), ``final`` (the answer).

The markers are special tokens of GPT-OSS's tokenizer (o200k_harmony): the chat route keeps their
text in the answer when a harmony parser reads it (``MARKERS``; mindie/api/openai.py). ``parse``
reads a whole text; the reasoning parser (mindie/text/reasoning.py ``HarmonySplitter``) and the
tool-call parser (mindie/text/tool_parsers/harmony.py) both re-read the text they have so far with it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["CALL", "CHANNEL", "CONSTRAIN", "END", "MARKERS", "MESSAGE", "RETURN", "START", "HarmonySplitter",
           "Message", "call_text", "open_tail", "parse"]

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, RETURN, CALL, CONSTRAIN = "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"
MARKERS = (START, CHANNEL, MESSAGE, END, RETURN, CALL, CONSTRAIN)
_TERMINATORS = (END, RETURN, CALL)
_RECIPIENT = re.compile(r"to=([^\s<]+)")


@dataclass
class Message:
    """One message as far as the text shows it."""

    raw: str  # its text, markers included
    header_done: bool  # its <|message|> is written: channel and recipient are known
    channel: str = ""
    recipient: str | None = None  # e.g. "functions.get_weather"
    body: str = ""  # what is written of the body (a possible marker start at its end held back)
    complete: bool = False  # its end marker is written

    @property
    def call_name(self) -> str | None:
        """The function a tool call addresses (recipient ``functions.NAME``), else None."""
        if self.recipient and self.recipient.startswith("functions."):
            return self.recipient[len("functions."):]
        return None


def _hold(text: str) -> str:
    """``text`` without an ending that could still become a marker."""
    for k in range(min(len(text), max(map(len, MARKERS)) - 1), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in MARKERS):
            return text[:-k]
    return text


def _next_start(text: str, pos: int) -> int:
    """Where the next message begins at or after ``pos`` (-1: none)."""
    found = [i for i in (text.find(START, pos), text.find(CHANNEL, pos)) if i >= 0]
    return min(found) if found else -1


def _header(header: str) -> tuple[str, str | None]:
    """(channel, recipient) of a message header."""
    channel = ""
    i = header.find(CHANNEL)
    if i >= 0:
        rest = header[i + len(CHANNEL):]
        channel = re.split(r"\s|<\|", rest, maxsplit=1)[0]
    m = _RECIPIENT.search(header)
    return channel, (m.group(1) if m else None)


def parse(text: str, final: bool = True) -> tuple[str, list[Message]]:
    """(text before the first message, the messages). Unless ``final``, a body's ending that could
    still become a marker is left out of its ``body``."""
    first = _next_start(text, 0)
    if first < 0:
        return (text if final else _hold(text)), []
    lead, pos, out = text[:first], first, []
    while pos < len(text):
        m = text.find(MESSAGE, pos)
        if m < 0:
            out.append(Message(text[pos:], False))
            break
        channel, recipient = _header(text[pos:m])
        b = m + len(MESSAGE)
        ends = [(i, t) for t in _TERMINATORS if (i := text.find(t, b)) >= 0]
        if not ends:
            body = text[b:]
            out.append(Message(text[pos:], True, channel, recipient, body if final else _hold(body)))
            break
        e, term = min(ends)
        out.append(Message(text[pos:e + len(term)], True, channel, recipient, text[b:e], True))
        nxt = _next_start(text, e + len(term))
        if nxt < 0:
            break  # text after the last end marker that starts no message: not part of any message
        pos = nxt
    return lead, out


def open_tail(prompt: str) -> str:
    """The message a rendered prompt leaves open (its text from the last ``<|start|>``, e.g.
    ``<|start|>assistant``), which the answer continues; "" when the prompt ends closed."""
    i = prompt.rfind(START)
    if i < 0 or any(t in prompt[i:] for t in _TERMINATORS):
        return ""
    return prompt[i:]


def call_text(name: str, arguments: str, complete: bool) -> str:
    """A tool call as the content carries it to the tool-call parser (harmony's own form)."""
    return f"{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}{arguments}{CALL if complete else ''}"


class HarmonySplitter:
    """One answer's text, pushed as it streams: ``push`` returns (reasoning, content) deltas, as
    mindie/text/reasoning.py's Splitter. The ``analysis`` bodies are the reasoning (joined by a
    newline); ``final`` and recipient-less ``commentary`` bodies are content; a message to a
    function stays in the content in harmony's form (``call_text``) for the tool-call parser.
    ``prefix``: the message the prompt left open (``open_tail``), which the answer continues."""

    __slots__ = ("prefix", "text", "sent", "saw_reasoning", "thinking")

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.text = ""
        self.sent = (0, 0)  # characters of reasoning and content sent
        self.saw_reasoning = False
        self.thinking = False  # the text so far ends inside an analysis message

    def push(self, text: str) -> tuple[str, str]:
        if not text:
            return "", ""
        self.text += text
        return self._emit(False)

    def flush(self) -> tuple[str, str]:
        return self._emit(True)

    def _emit(self, final: bool) -> tuple[str, str]:
        lead, msgs = parse(self.prefix + self.text, final)
        reasoning: list[str] = []
        content = [lead[len(self.prefix):] if not self.prefix else ""]
        for m in msgs:
            if not m.header_done:
                continue
            if m.channel == "analysis" and m.recipient is None:
                reasoning.append(m.body)
            elif (name := m.call_name) is not None:
                content.append(call_text(name, m.body, m.complete))
            else:
                content.append(m.body)
        self.saw_reasoning = self.saw_reasoning or bool(reasoning)
        self.thinking = bool(msgs) and msgs[-1].channel == "analysis" and not msgs[-1].complete
        r, c = "\n".join(reasoning), "".join(content)
        out = r[self.sent[0]:], c[self.sent[1]:]
        self.sent = (len(r), len(c))
        return out
