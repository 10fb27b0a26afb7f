"""Function calling: parse the model's tool calls, check them against the declared
schemas, and turn them into sandbox actions.

Parsers (``environment.action_format``, registered under ``temper.parsers``): ``hermes`` reads every
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` of a turn, in order (Qwen,
Hermes); ``llama3_json`` reads a turn that is a JSON object ``{"name": ...,
"parameters": {...}}`` (several joined by ``;``), optionally after ``<|python_tag|>``.
A malformed call, an unknown tool or arguments that do not fit the schema is a
:class:`ToolCallError`; the environment turns it into an observation.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from temper import plugins
from temper.jobspec import BUILTIN_TOOLS, BuiltinTool, ToolSpec

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
SAFE_PATH = re.compile(r"^(?!/)(?!.*\.\.)[A-Za-z0-9_./-]{1,200}$")


class ToolCallError(ValueError):
    pass


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def openai(self, index: int) -> dict[str, Any]:
        """The call as an OpenAI ``tool_calls`` entry (arguments as a JSON string)."""
        return {
            "id": f"call_{index}",
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }


def builtin_tools(*names: BuiltinTool | str) -> list[ToolSpec]:
    """ToolSpecs of built-ins, with their default schemas."""
    return [ToolSpec.model_validate({"function": {"name": str(n)}}) for n in names]


def _call(obj: Any, args_key: str) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ToolCallError('a tool call must be a JSON object with a string "name"')
    args = obj.get(args_key, obj.get("arguments" if args_key != "arguments" else "parameters", {}))
    if isinstance(args, str):  # some models send the arguments JSON-encoded, as OpenAI does
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise ToolCallError(f'"{args_key}" of {obj["name"]!r} is a string that is not JSON') from None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ToolCallError(f'"{args_key}" of {obj["name"]!r} must be a JSON object')
    return ToolCall(obj["name"], args)


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ToolCallError(f"{what} is not valid JSON ({exc.msg} at char {exc.pos})") from None


def parse_hermes(text: str) -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` in order; an unclosed one is an error."""
    bodies = _HERMES.findall(text)
    rest = _HERMES.sub("", text)
    if "<tool_call>" in rest:
        raise ToolCallError("a <tool_call> was opened but never closed with </tool_call>")
    return [_call(_json(b.strip(), f"tool call {i + 1}"), "arguments") for i, b in enumerate(bodies)]


def parse_llama3_json(text: str) -> list[ToolCall]:
    """The whole turn as one or more JSON calls (``;``-separated); none if it does not start with ``{``."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return []
    decoder = json.JSONDecoder()
    calls, at = [], 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError as exc:
            raise ToolCallError(f"the tool call is not valid JSON ({exc.msg} at char {exc.pos})") from None
        calls.append(_call(obj, "parameters"))
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
        if at < len(body) and body[at] != "{":
            raise ToolCallError("text after the tool call; reply with only the JSON call")
    return calls


def parse_calls(text: str, parser: str) -> list[ToolCall]:
    """The calls in ``text`` read by the parser registered as ``parser`` under
    ``temper.parsers`` (Temper's own: ``hermes``, ``llama3_json``). A plugin parser returns
    a list of :class:`ToolCall` (or of ``{"name", "arguments"}`` objects) and raises
    :class:`ToolCallError` for a malformed call; any other failure is one too."""
    fn = plugins.load(plugins.Group.parsers, str(parser))
    try:
        calls = fn(text)
    except ToolCallError:
        raise
    except Exception as exc:  # noqa: BLE001 - a plugin's bug reaches the model as an observation
        raise ToolCallError(f"the {parser} parser failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(calls, list):
        raise ToolCallError(f"the {parser} parser returned {type(calls).__name__}, not a list of calls")
    return [c if isinstance(c, ToolCall) else _call(c, "arguments") for c in calls]


# --- argument checking: the JSON-schema subset function schemas use ---------------------------------

_PY_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def schema_errors(value: Any, schema: Mapping[str, Any], path: str = "arguments") -> list[str]:
    """Where ``value`` breaks ``schema`` (type, required, properties, enum, items,
    additionalProperties: false); empty if it fits."""
    errors: list[str] = []
    kind = schema.get("type")
    kinds = [kind] if isinstance(kind, str) else list(kind or [])
    if kinds:
        ok = any(
            isinstance(value, _PY_TYPES.get(k, (object,)))
            and not (k in ("integer", "number") and isinstance(value, bool))
            for k in kinds
        )
        if not ok:
            return [f"{path} must be of type {'/'.join(kinds)}, not {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path} must be one of {schema['enum']}")
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for name in schema.get("required") or []:
            if name not in value:
                errors.append(f"{path}.{name} is required")
        for name, v in value.items():
            if name in props:
                errors += schema_errors(v, props[name], f"{path}.{name}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{path}.{name} is not a parameter")
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, v in enumerate(value):
            errors += schema_errors(v, schema["items"], f"{path}[{i}]")
    return errors


# --- from a call to an action ---------------------------------------------------------------------


def call_action(call: ToolCall, tools: Mapping[str, ToolSpec]) -> dict[str, Any]:
    """The sandbox command (``temper.sandbox.Action`` as a dict) of a checked call, or
    ``{"kind": "submit", "answer": ...}``; raises :class:`ToolCallError`."""
    spec = tools.get(call.name)
    if spec is None:
        raise ToolCallError(f"unknown tool {call.name!r}; available: {', '.join(sorted(tools))}")
    errors = schema_errors(call.arguments, spec.function.parameters)
    if errors:
        raise ToolCallError(f"{call.name}: " + "; ".join(errors))
    a = call.arguments
    if spec.command is not None:
        command = re.sub(r"{(\w+)}", lambda m: shlex.quote(str(a.get(m.group(1), ""))), spec.command)
        return {"kind": "run_command", "command": command}
    run = spec.run
    if run is BuiltinTool.submit:
        answer = a.get("answer")
        return {"kind": "submit", "answer": None if answer is None else str(answer)}
    if run is BuiltinTool.python:
        return {"kind": "run_python", "code": str(a.get("code", ""))}
    if run is BuiltinTool.bash:
        return {"kind": "run_command", "command": str(a.get("command", ""))}
    path = str(a.get("path", ""))
    if not SAFE_PATH.match(path):
        raise ToolCallError(f"{call.name}: path {path!r} must be relative and inside the workspace")
    if run is BuiltinTool.write_file:
        return {"kind": "write_file", "path": path, "content": str(a.get("content", ""))}
    return {"kind": "read_file", "path": path}


def tool_table(tools: Sequence[ToolSpec]) -> dict[str, ToolSpec]:
    return {t.function.name: t for t in tools}


__all__ = [
    "BUILTIN_TOOLS",
    "ToolCall",
    "ToolCallError",
    "builtin_tools",
    "call_action",
    "parse_calls",
    "parse_hermes",
    "parse_llama3_json",
    "schema_errors",
    "tool_table",
]
