"""Tool calls read from a model's reply, in OpenAI's shape, for the chat proxy."""

from __future__ import annotations

from typing import Any

from temper.settings.inference import ToolParser


def parse_tool_calls(text: str, parser: ToolParser) -> tuple[str, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a reply, OpenAI-shaped. A reply whose calls do not
    parse is returned as content with no calls, as vLLM's parsers do. Each call's id is
    the model's own where it wrote one (Mistral), else nine letters and digits made from
    the reply (``temper.envs.tools.call_id``: the same reply gives the same ids, and
    Mistral's templates accept them when the client sends them back)."""
    from temper.envs.tools import ToolCallError, call_content, parse_calls

    try:
        calls = parse_calls(text, parser.value)
    except ToolCallError:
        return text, []
    if not calls:
        return text, []
    return call_content(text, parser.value), [c.openai(i, seed=text) for i, c in enumerate(calls)]
