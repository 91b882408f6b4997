"""Chat templates: a checkpoint's messages-to-prompt template, rendered as transformers'
``tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`` renders it.

Where the template comes from: a file the config names (``ModelConfig[].models.<model_type>.
chat_template``, MindIE's key), else as transformers loads it: ``chat_template.jinja`` in the
model directory when present, else ``chat_template`` in ``tokenizer_config.json``: a string, or a
list of named templates ``[{"name": ..., "template": ...}]`` (``tool_use`` is picked when the request
has tools and the checkpoint has one, else ``default``). A checkpoint without any (the built-in
demo model, base models) gets ``CHATML_FALLBACK`` and the front end logs that once.

Rendering matches transformers (``utils/chat_template_utils.py``): an
``ImmutableSandboxedEnvironment`` with ``trim_blocks``/``lstrip_blocks`` and the ``loopcontrols``
extension; ``raise_exception`` (a TemplateError), ``strftime_now``, a ``tojson`` filter that is
``json.dumps(x, ensure_ascii=False, indent=..., separators=..., sort_keys=...)`` (not Jinja's
HTML-escaping one), the restricted ``dict`` and ``namespace``; the no-op ``{% generation %}`` tag;
variables ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the tokenizer's
special tokens as strings (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``, ...), and
the request's ``chat_template_kwargs`` (e.g. ``enable_thinking``), which override the special
tokens but never the four named first. Messages are prepared the same way: keys whose value is
None are dropped, and ``reasoning_content``/``thinking``/``reasoning`` are aliased to each other.
"""
from __future__ import annotations

import json
import logging
import os
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger("mindie.chat_template")

__all__ = ["ChatTemplate", "ChatTemplateError", "CHATML_FALLBACK", "load_chat_template"]

# ChatML (Qwen's format) without a default system prompt.
CHATML_FALLBACK = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Older Jinja releases have known sandbox escapes, and chat templates come with checkpoints
# (untrusted): below this version templates are refused, as transformers refuses them.
MIN_JINJA = (3, 1, 6)
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_RESERVED = ("messages", "tools", "documents", "add_generation_prompt")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The template refused the conversation (``raise_exception``) or could not render it."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (transformers' tracker, which
    only matters for assistant masks)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _TemplateDict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace without underscore-prefixed attributes (as transformers)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")


def _jinja_version() -> tuple[int, ...]:
    parts = []
    for p in jinja2.__version__.split(".")[:3]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


def _token_text(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _plain(value: Any) -> Any:
    """Plain JSON data only reaches the template (requests are decoded JSON already)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def _prepare(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        m = {k: _plain(v) for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class ChatTemplate:
    """One checkpoint's template(s) and special tokens; ``render`` is thread-safe."""

    def __init__(self, templates: dict[str, str] | str, special_tokens: dict[str, Any] | None = None,
                 fallback: bool = False):
        self.templates = {"default": templates} if isinstance(templates, str) else dict(templates)
        self.special_tokens = dict(special_tokens or {})
        self.fallback = fallback
        self._env = _environment()
        self._compiled: dict[str, jinja2.Template] = {}

    def source(self, tools: bool = False) -> str:
        if tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise ChatTemplateError("This model has multiple chat templates with no default specified: "
                                f"{sorted(self.templates)}")

    def _template(self, src: str) -> jinja2.Template:
        if _jinja_version() < MIN_JINJA:
            raise ChatTemplateError(f"chat templates need jinja2>={'.'.join(map(str, MIN_JINJA))} "
                                    f"(installed: {jinja2.__version__})")
        t = self._compiled.get(src)
        if t is None:
            try:
                t = self._compiled[src] = self._env.from_string(src)
            except jinja2.TemplateSyntaxError as e:
                raise ChatTemplateError(f"The model's chat template does not compile: {e}") from None
        return t

    def render(self, messages: list[dict], *, tools: list[dict] | None = None, documents: list[dict] | None = None,
               add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text of ``messages`` (``kwargs``: chat_template_kwargs)."""
        template = self._template(self.source(tools is not None))
        variables = {**self.special_tokens, **{k: _plain(v) for k, v in kwargs.items() if k not in _RESERVED}}
        try:
            return template.render(messages=_prepare(messages), tools=_plain(tools), documents=_plain(documents),
                                   add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:  # raise_exception, sandbox refusals, undefined calls
            raise ChatTemplateError(str(e) or type(e).__name__) from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError, RecursionError) as e:
            raise ChatTemplateError(f"The chat template failed on these messages: {type(e).__name__}: {e}") from None


def load_chat_template(model_dir: str | os.PathLike[str], template_file: str | os.PathLike[str] = "") -> ChatTemplate:
    """The checkpoint's template, or ``CHATML_FALLBACK`` (``.fallback`` True) when it has none.
    ``template_file``: a ``.jinja`` file that replaces the checkpoint's template (MindIE's
    ``ModelConfig[].models.<model_type>.chat_template``); the special tokens stay the checkpoint's."""
    cfg: dict[str, Any] = {}
    path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    special: dict[str, Any] = {}
    for key in _SPECIAL_KEYS:
        text = _token_text(cfg.get(key))
        if text is not None:
            special[key] = text
    extra = cfg.get("additional_special_tokens") or cfg.get("extra_special_tokens")
    if isinstance(extra, list):
        special["additional_special_tokens"] = [t for t in map(_token_text, extra) if t is not None]
    jinja_file = os.path.join(model_dir, "chat_template.jinja")
    templates: dict[str, str] | str | None = None
    if template_file:
        with open(template_file, encoding="utf-8") as f:
            templates = f.read()
    elif os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            templates = f.read()
    else:
        raw = cfg.get("chat_template")
        if isinstance(raw, str):
            templates = raw
        elif isinstance(raw, list):
            templates = {t["name"]: t["template"] for t in raw if isinstance(t, dict)
                         and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
    if not templates:
        return ChatTemplate(CHATML_FALLBACK, special, fallback=True)
    return ChatTemplate(templates, special)
