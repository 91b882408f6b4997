"""The tool-call parsers by name (docs/apis.md, "Tool calls").

    parser_class("qwen3")          # MindIE's and vLLM's names (names.py) -> HermesParser
    detect(template_source)        # the format a chat template shows its model, or None

The served model's parser is the configured one (``ModelConfig[].models.<model_type>.
tool_call_options.tool_call_parser``, MindIE's key), else the one its chat template shows
(``detect``), else ``hermes`` (mindie/text/tool_calls.py).
"""
from __future__ import annotations

from mindie.text.tool_parsers import names
from mindie.text.tool_parsers.base import ToolCallStream, ToolParser, parse_text
from mindie.text.tool_parsers.deepseek import DeepSeekV3Parser, DeepSeekV31Parser
from mindie.text.tool_parsers.harmony import HarmonyParser
from mindie.text.tool_parsers.hermes import HermesParser
from mindie.text.tool_parsers.llama3 import Llama3JsonParser
from mindie.text.tool_parsers.mistral import MistralParser

__all__ = ["PARSERS", "parser_class", "detect", "ToolParser", "ToolCallStream", "parse_text"]

PARSERS: dict[str, type[ToolParser]] = {
    names.HERMES: HermesParser, names.LLAMA3_JSON: Llama3JsonParser, names.MISTRAL: MistralParser,
    names.DEEPSEEK_V3: DeepSeekV3Parser, names.DEEPSEEK_V31: DeepSeekV31Parser, names.HARMONY: HarmonyParser,
}
assert set(PARSERS) == set(names.FORMATS)


def parser_class(name: str) -> type[ToolParser]:
    """The parser a configured name means (KeyError for a name no parser has)."""
    fmt = names.canonical(name)
    if fmt is None:
        raise KeyError(name)
    return PARSERS[fmt]


def detect(template: str) -> str | None:
    """The format a chat template's source writes its model's calls in, or None.

    By the markup the template renders for an assistant's ``tool_calls``: ``[TOOL_CALLS]``
    (Mistral), DeepSeek's ``<｜tool▁calls▁begin｜>`` (v3 when it fences the arguments in a json
    code block, else v3.1), ``<tool_call>`` (Hermes, Qwen2.5, Qwen3), ``<|python_tag|>`` or the
    ``ipython`` role with ``"parameters"`` (Llama 3.x), harmony's ``<|channel|>`` with
    ``to=functions.`` (GPT-OSS)."""
    if "<|channel|>" in template and "to=functions." in template:
        return names.HARMONY
    if "[TOOL_CALLS]" in template:
        return names.MISTRAL
    if "tool▁calls▁begin" in template:
        return names.DEEPSEEK_V3 if "```json" in template else names.DEEPSEEK_V31
    if "<tool_call>" in template:
        return names.HERMES
    if "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template):
        return names.LLAMA3_JSON
    return None
