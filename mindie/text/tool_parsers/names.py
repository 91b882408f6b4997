"""The tool-call parser names a config may give (``ModelConfig[].models.<model_type>.tool_call_options.
tool_call_parser``, MindIE's key), without importing any parser: ``mindie/config.py`` checks a
configured name against this table at load.

Each name maps to the format it parses. The names are MindIE's registry names for the formats
implemented here (its ToolsCallProcessor table: ``hermes``/``qwen3``/``qwen3_moe``, ``qwen2_5``,
``llama``/``llama3``/``llama3_1``, ``deepseek_v3``/``deepseekv3``/``deepseek_v2``/``deepseekv2``,
``deepseek_v31``/``deepseekv31``) plus vLLM's ``--tool-call-parser`` names for the same formats
(``llama3_json``, ``mistral``, ``openai``: GPT-OSS's harmony, also ``harmony``/``gpt_oss``). MindIE's ChatGLM processors are not implemented.
"""
from __future__ import annotations

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
MISTRAL = "mistral"
DEEPSEEK_V3 = "deepseek_v3"
DEEPSEEK_V31 = "deepseek_v31"
HARMONY = "harmony"

FORMATS = (HERMES, LLAMA3_JSON, MISTRAL, DEEPSEEK_V3, DEEPSEEK_V31, HARMONY)

# Every accepted name -> its format.
ALIASES: dict[str, str] = {
    HERMES: HERMES, "qwen3": HERMES, "qwen3_moe": HERMES, "qwen2_5": HERMES, "qwen_2_5": HERMES,
    LLAMA3_JSON: LLAMA3_JSON, "llama": LLAMA3_JSON, "llama3": LLAMA3_JSON, "llama3_1": LLAMA3_JSON,
    MISTRAL: MISTRAL,
    DEEPSEEK_V3: DEEPSEEK_V3, "deepseekv3": DEEPSEEK_V3, "deepseek_v2": DEEPSEEK_V3, "deepseekv2": DEEPSEEK_V3,
    DEEPSEEK_V31: DEEPSEEK_V31, "deepseekv31": DEEPSEEK_V31,
    HARMONY: HARMONY, "openai": HARMONY, "gpt_oss": HARMONY,
}


def canonical(name: str) -> str | None:
    """The format a configured name means, or None for a name no parser has."""
    return ALIASES.get(name.strip().lower())
