"""Tool calls read from a model's reply, in OpenAI's shape, for the chat proxy."""

from __future__ import annotations

import re
from typing import Any

from temper.settings.inference import ToolParser


def parse_tool_calls(text: str, parser: ToolParser) -> tuple[str, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a reply, OpenAI-shaped. A reply whose calls do not
    parse is returned as content with no calls, as vLLM's parsers do."""
    from temper.envs.tools import ToolCallError, parse_calls

    try:
        calls = parse_calls(text, parser.value)
    except ToolCallError:
        return text, []
    if not calls:
        return text, []
    content = (
        re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.S).strip()
        if parser is ToolParser.hermes
        else ""
    )
    return content, [c.openai(i) for i, c in enumerate(calls)]
