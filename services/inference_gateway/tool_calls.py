"""Tool calls read from a model's reply, in OpenAI's shape, for the chat proxy."""

from __future__ import annotations

from typing import Any


def parse_tool_calls(
    text: str, parser: str, *, parallel: bool = True, tools: list[dict[str, Any]] | None = None
) -> tuple[str, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a reply, OpenAI-shaped, read by the parser named
    ``parser`` (``temper.parsers``). A reply whose calls do not parse is returned as content
    with no calls, as vLLM's parsers do. Each call's id is the model's own where it wrote one
    (Mistral), else nine letters and digits made from the reply
    (``temper.envs.tools.call_id``: the same reply gives the same ids, and Mistral's
    templates accept them when the client sends them back). ``parallel=False`` keeps the
    first call only. Arguments a parser reads as text (Qwen3-Coder's) take the types of
    the request's ``tools`` schemas."""
    from temper.envs.tools import ToolCallError, call_content, parse_calls

    try:
        calls = parse_calls(text, str(parser))
    except ToolCallError:
        return text, []
    if not calls:
        return text, []
    if not parallel:
        calls = calls[:1]
    schemas = {
        str((t.get("function") or {}).get("name")): (t.get("function") or {}).get("parameters")
        for t in tools or []
    }
    calls = [c.typed(schemas.get(c.name)) for c in calls]
    return call_content(text, str(parser)), [c.openai(i, seed=text) for i, c in enumerate(calls)]
