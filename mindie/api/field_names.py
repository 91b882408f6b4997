"""OpenAI's request field names in the words of the families that build their jobs through the
OpenAI chat codec (Anthropic Messages, OpenAI Responses, Ollama): an error about a structured-output
schema names ``output_config.format.schema``, ``text.format.schema`` or ``format``, the field the
client sent, not ``response_format``, which it never did."""
from __future__ import annotations

import re

from mindie.contract.http_error import ApiError

# (OpenAI's name, the family's), longest first so a prefix is never replaced before its extension.
ANTHROPIC = (("response_format.json_schema.schema", "output_config.format.schema"),
             ("response_format.json_schema", "output_config.format"),
             ("response_format", "output_config.format"))
RESPONSES = (("response_format.json_schema", "text.format"),
             ("response_format", "text.format"),
             ("max_completion_tokens", "max_output_tokens"))
OLLAMA = (("response_format.json_schema.schema", "format"),
          ("response_format.json_schema", "format"),
          ("response_format", "format"))


def _rename(text: str, names: tuple[tuple[str, str], ...]) -> str:
    # One pass over the text: a replacement is never itself renamed (``format`` inside ``text.format``).
    pattern = "|".join(rf"(?<![\w.]){re.escape(old)}(?!\w)" for old, _ in names)
    table = dict(names)
    return re.sub(pattern, lambda m: table[m.group(0)], text)


def renamed(err: ApiError, names: tuple[tuple[str, str], ...]) -> ApiError:
    """``err`` with OpenAI's field names (in its message and ``param``) as the family calls them."""
    message = _rename(err.message, names)
    param = _rename(err.param, names) if err.param else err.param
    if message == err.message and param == err.param:
        return err
    return ApiError(err.status, message, err.error_type, param=param, timeout=err.timeout)
