"""Function calling: parse the model's tool calls, check them against the declared
schemas, and turn them into sandbox actions.

Parsers (``environment.action_format``, registered under ``temper.parsers``): ``hermes`` reads every
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` of a turn, in order (Qwen,
Hermes); ``llama3_json`` reads a turn that is a JSON object ``{"name": ...,
"parameters": {...}}`` (several joined by ``;``), optionally after ``<|python_tag|>``;
``mistral`` reads ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (Mistral v0.3;
also ``[TOOL_CALLS]name[ARGS]{...}`` of later Mistral tokenizers); ``pythonic`` reads a
turn that is a Python list of calls, ``[f(a=1), g()]`` (Llama 3.2, Gemma 3 as vLLM serves
it); ``tool_code`` reads the calls in ````` ```tool_code ````` blocks (Gemma's own
function-calling format); ``qwen3_coder`` reads Qwen3-Coder's XML calls,
``<tool_call><function=name><parameter=p>value</parameter></function></tool_call>``, whose
values the tool's schema types. A malformed call, an unknown tool or arguments that do not fit
the schema is a :class:`ToolCallError`; the environment turns it into an observation.

Every call has an id (``ToolCall.id``: the model's own where it wrote one, as Mistral's
may, else :func:`call_id`, nine letters and digits as Mistral's templates demand); the
tool message answering it carries it as ``tool_call_id``.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import shlex
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from temper import plugins
from temper.jobspec import BUILTIN_TOOLS, BuiltinTool, ToolSpec

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_PATH_CHARS = re.compile(r"[A-Za-z0-9_./-]{1,200}")


def is_workspace_file(path: str) -> bool:
    """Whether a model may name ``path`` as a file to write or read: relative, inside the
    workspace (no ``..``) and a file's name: no empty component and not ending in ``.``
    (``.``, ``a/`` and ``a/.`` are directories; a write to one would fail only where the
    file lands, which for a lone write is the scorer, after the episode)."""
    if not _PATH_CHARS.fullmatch(path) or path.startswith("/") or ".." in path:
        return False
    parts = path.split("/")
    return "" not in parts and parts[-1] != "."


class ToolCallError(ValueError):
    pass


_ID_ALPHABET = string.ascii_letters + string.digits
_ID = re.compile(r"^[A-Za-z0-9]{9}$")


def call_id(seed: str, index: int) -> str:
    """A tool call's id: nine letters and digits (what Mistral's templates and tokenizers
    accept; any OpenAI client takes it), the same for the same ``seed`` and ``index``."""
    digest = int.from_bytes(hashlib.sha256(f"{index}:{seed}".encode()).digest()[:12], "big")
    out = []
    for _ in range(9):
        digest, r = divmod(digest, len(_ID_ALPHABET))
        out.append(_ID_ALPHABET[r])
    return "".join(out)


def usable_id(value: Any) -> str | None:
    """A model-written call id kept as it is when every template takes it (nine letters and
    digits), else None (one is made with :func:`call_id`)."""
    return value if isinstance(value, str) and _ID.match(value) else None


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str | None = None  # the model's own id (Mistral), when it wrote a usable one
    # The arguments are the text the model wrote for each (Qwen3-Coder's XML): their types
    # come from the tool's schema (typed_arguments).
    raw: bool = False

    def with_id(self, seed: str, index: int) -> ToolCall:
        """This call with its id: the model's, else :func:`call_id` of ``seed`` and ``index``."""
        return self if self.id else ToolCall(self.name, self.arguments, call_id(seed, index), self.raw)

    def typed(self, schema: Mapping[str, Any] | None) -> ToolCall:
        """This call with its arguments of the types ``schema`` (the function's parameters)
        gives them, where the model wrote them as text (:attr:`raw`)."""
        if not self.raw:
            return self
        return ToolCall(self.name, typed_arguments(self.arguments, schema or {}), self.id)

    def openai(self, index: int, *, seed: str = "") -> dict[str, Any]:
        """The call as an OpenAI ``tool_calls`` entry (arguments as a JSON string)."""
        return {
            "id": self.id or call_id(seed, index),
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }

    def message(self, index: int, *, seed: str = "") -> dict[str, Any]:
        """The call as an assistant message's ``tool_calls`` entry for a chat template: the
        OpenAI shape with the arguments as an object (what Hugging Face templates render)."""
        return {
            "id": self.id or call_id(seed, index),
            "type": "function",
            "function": {"name": self.name, "arguments": dict(self.arguments)},
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
    return ToolCall(obj["name"], args, usable_id(obj.get("id")))


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


# --- Mistral: [TOOL_CALLS] -----------------------------------------------------------------------

MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}$")
_JSON_LIST = re.compile(r"^\[\s*\{")


def _json_list_of_calls(body: str) -> list[ToolCall]:
    try:
        obj, end = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError as exc:
        raise ToolCallError(f"the tool calls are not valid JSON ({exc.msg} at char {exc.pos})") from None
    if body[end:].strip():
        raise ToolCallError("text after the list of tool calls; the calls end the turn")
    if isinstance(obj, dict):
        obj = [obj]
    if not isinstance(obj, list) or not obj:
        raise ToolCallError("[TOOL_CALLS] needs a non-empty JSON list of calls")
    return [_call(o, "arguments") for o in obj]


def parse_mistral(text: str) -> list[ToolCall]:
    """Mistral's calls: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id"?: ...}, ...]``
    (Mistral-7B-Instruct-v0.3 and its tokenizer v3), or one ``[TOOL_CALLS]name[ARGS]{...}``
    (with ``[CALL_ID]id`` before ``[ARGS]`` in some) per call (later tokenizers). The
    content before the first marker is the assistant's text. ``[TOOL_CALLS]`` is a special
    token: text decoded without special tokens has lost it, so a turn that is only a JSON
    list of calls reads as if it were there. None if the turn has neither."""
    at = text.find(MISTRAL_CALLS)
    if at < 0:
        body = text.strip()
        return _json_list_of_calls(body) if _JSON_LIST.match(body) else []
    parts = text[at + len(MISTRAL_CALLS) :].split(MISTRAL_CALLS)
    if parts[0].lstrip().startswith(("[", "{")):
        if len(parts) > 1:
            raise ToolCallError("[TOOL_CALLS] twice in one turn; give every call in one list")
        return _json_list_of_calls(parts[0].strip())
    calls = []
    for i, part in enumerate(parts):
        head, sep, args = part.partition(MISTRAL_ARGS)
        if not sep:
            raise ToolCallError(
                f"tool call {i + 1}: [TOOL_CALLS] must be followed by a JSON list of calls "
                "or by name[ARGS]{...}"
            )
        name, _, cid = head.partition(MISTRAL_CALL_ID)
        name = name.strip()
        if not _NAME.match(name):
            raise ToolCallError(f"tool call {i + 1}: {name[:40]!r} is not a tool name")
        try:
            obj, end = json.JSONDecoder().raw_decode(args.strip())
        except json.JSONDecodeError as exc:
            raise ToolCallError(
                f"the arguments of {name!r} are not valid JSON ({exc.msg} at char {exc.pos})"
            ) from None
        if args.strip()[end:].strip():
            raise ToolCallError(f"text after the arguments of {name!r}; the calls end the turn")
        calls.append(_call({"name": name, "arguments": obj, "id": cid.strip()}, "arguments"))
    return calls


# --- Python calls: pythonic lists and Gemma's tool_code blocks --------------------------------------

_TOOL_CODE = re.compile(r"```tool_code[ \t]*\n(.*?)```", re.S)


def _python(src: str, what: str, mode: str) -> Any:
    try:
        return ast.parse(src, mode=mode)
    except SyntaxError as exc:
        raise ToolCallError(f"{what} is not valid Python ({exc.msg}, line {exc.lineno})") from None
    except (ValueError, RecursionError, MemoryError) as exc:  # null bytes, absurd nesting
        raise ToolCallError(f"{what} is not valid Python ({type(exc).__name__})") from None


def _dotted(node: ast.AST) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _python_call(node: ast.AST, where: str) -> ToolCall:
    """One call expression ``name(arg=literal, ...)`` (``print(call)`` unwrapped) as a call."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "print"
        and len(node.args) == 1
        and not node.keywords
        and isinstance(node.args[0], ast.Call)
    ):
        node = node.args[0]  # Gemma's examples print the call's result
    if not isinstance(node, ast.Call):
        raise ToolCallError(f"{where} is not a function call, name(argument=value, ...)")
    name = _dotted(node.func)
    if name is None:
        raise ToolCallError(f"{where}: the called thing is not a tool name")
    if node.args:
        raise ToolCallError(f"{where}: {name} takes its arguments by name ({name}(x=1)), not by position")
    args: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise ToolCallError(f"{where}: {name}: **arguments are not accepted; name each argument")
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            raise ToolCallError(
                f"{where}: {name}: argument {kw.arg} is not a literal (a string, number, list, dict, "
                "True, False or None)"
            ) from None
    return ToolCall(name, args)


def parse_pythonic(text: str) -> list[ToolCall]:
    """The turn as a Python list of calls, ``[f(a=1, b="x"), g()]`` (the pythonic format of
    Llama 3.2 and of Gemma 3 as vLLM serves it); none if it does not start with ``[``."""
    body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
    if not body.startswith("["):
        return []
    tree = _python(body, "the list of tool calls", "eval")
    if not isinstance(tree.body, ast.List):
        raise ToolCallError("the tool calls must be one Python list, [f(a=1), g()], and nothing after it")
    return [_python_call(e, f"tool call {i + 1}") for i, e in enumerate(tree.body.elts)]


def parse_tool_code(text: str) -> list[ToolCall]:
    """Every call in the turn's ````` ```tool_code ````` blocks, in order (Gemma's format:
    one call per line, ``name(arg=value)``, ``print(...)`` around it allowed, or a list of
    calls); an unclosed block is an error."""
    blocks = _TOOL_CODE.findall(text)
    if "```tool_code" in _TOOL_CODE.sub("", text):
        raise ToolCallError("a ```tool_code block was opened but never closed with ```")
    calls: list[ToolCall] = []
    for b, body in enumerate(blocks, 1):
        tree = _python(body, f"tool_code block {b}", "exec")
        for stmt in tree.body:
            where = f"tool_code block {b}, line {stmt.lineno}"
            if not isinstance(stmt, ast.Expr):
                raise ToolCallError(f"{where}: only function calls, name(argument=value), not statements")
            items = stmt.value.elts if isinstance(stmt.value, ast.List) else [stmt.value]
            calls += [_python_call(e, where) for e in items]
    return calls


# --- Qwen3-Coder: XML calls ------------------------------------------------------------------------

_QWEN3_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_QWEN3_FUNCTION = re.compile(r"^\s*<function=([^>\n]*)>(.*?)</function>\s*$", re.S)
_QWEN3_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.S)


def parse_qwen3_coder(text: str) -> list[ToolCall]:
    """Qwen3-Coder's calls, every ``<tool_call>`` of the turn in order, each one function
    with its parameters as text (its chat template writes each value on lines of its own)::

        <tool_call>
        <function=name>
        <parameter=path>
        src/x.py
        </parameter>
        </function>
        </tool_call>

    The values stay text (:attr:`ToolCall.raw`); the tool's schema types them where the call
    is checked (an integer parameter's ``3`` becomes 3, an object's JSON an object). An
    unclosed call, a call without exactly one function, or text outside the parameters is
    an error."""
    bodies = _QWEN3_CALL.findall(text)
    if "<tool_call>" in _QWEN3_CALL.sub("", text):
        raise ToolCallError("a <tool_call> was opened but never closed with </tool_call>")
    calls = []
    for i, body in enumerate(bodies, 1):
        m = _QWEN3_FUNCTION.match(body)
        if m is None:
            raise ToolCallError(f"tool call {i} must hold one <function=name>...</function>")
        name, inner = m.group(1).strip(), m.group(2)
        if not _NAME.match(name):
            raise ToolCallError(f"tool call {i}: {name[:40]!r} is not a tool name")
        args: dict[str, Any] = {}
        for param, value in _QWEN3_PARAMETER.findall(inner):
            key = param.strip()
            if not key or key in args:
                raise ToolCallError(f"tool call {i} ({name}): parameter {key!r} is empty or given twice")
            args[key] = value.removeprefix("\n").removesuffix("\n")
        if _QWEN3_PARAMETER.sub("", inner).strip():
            raise ToolCallError(f"tool call {i} ({name}): text outside <parameter=...>...</parameter>")
        calls.append(ToolCall(name, args, raw=True))
    return calls


def typed_arguments(args: Mapping[str, Any], schema: Mapping[str, Any]) -> dict[str, Any]:
    """Text arguments with the types ``schema``'s properties give them: integers, numbers,
    booleans (``true``/``false``), null, and objects and arrays written as JSON (or as a
    Python literal); a value that does not read as its type stays text, for the schema
    check to name. Parameters the schema does not describe stay text."""
    props = schema.get("properties") or {}
    out: dict[str, Any] = {}
    for name, value in args.items():
        kind = (props.get(name) or {}).get("type") if isinstance(props.get(name), Mapping) else None
        out[name] = _typed(value, kind) if isinstance(value, str) else value
    return out


def _typed(value: str, kind: Any) -> Any:
    kinds = [kind] if isinstance(kind, str) else list(kind or [])
    text = value.strip()
    for k in kinds:
        if k == "string":
            return value
        if k == "integer" and re.fullmatch(r"-?\d+", text):
            return int(text)
        if k == "number" and re.fullmatch(r"-?\d+(\.\d+)?([eE][-+]?\d+)?", text):
            return float(text) if any(c in text for c in ".eE") else int(text)
        if k == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if k == "null" and text in ("null", "None"):
            return None
        if k in ("object", "array"):
            for read in (json.loads, ast.literal_eval):
                try:
                    parsed = read(text)
                except (ValueError, SyntaxError, RecursionError, MemoryError):
                    continue
                if isinstance(parsed, dict if k == "object" else list):
                    return parsed
    return value


def call_content(text: str, parser: str) -> str:
    """The assistant's text of a turn whose calls ``parser`` read: the turn without them."""
    if parser in ("hermes", "qwen3_coder"):
        return _HERMES.sub("", text).strip()
    if parser == "tool_code":
        return _TOOL_CODE.sub("", text).strip()
    if parser == "mistral" and MISTRAL_CALLS in text:
        return text[: text.find(MISTRAL_CALLS)].strip()
    return ""


def parse_calls(text: str, parser: str) -> list[ToolCall]:
    """The calls in ``text`` read by the parser registered as ``parser`` under
    ``temper.parsers`` (Temper's own: ``hermes``, ``llama3_json``, ``mistral``, ``pythonic``,
    ``tool_code``). A plugin parser returns
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
    call = call.typed(spec.function.parameters)
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
    if not is_workspace_file(path):
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
    "call_content",
    "call_id",
    "parse_calls",
    "parse_hermes",
    "parse_llama3_json",
    "parse_mistral",
    "parse_pythonic",
    "parse_qwen3_coder",
    "parse_tool_code",
    "schema_errors",
    "tool_table",
    "typed_arguments",
]
