"""The environment interface: what turns a task into a conversation with the policy.

An environment is stateless: everything it needs between turns is in the episode's
steps (the parsed action of each turn, the sandbox result), so a restarted dispatcher
rebuilds it from the task and the job spec alone.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Literal

from temper.envs.tools import (
    ToolCall,
    ToolCallError,
    builtin_tools,
    call_action,
    call_id,
    is_workspace_file,
    parse_calls,
    tool_table,
)
from temper.jobspec import ActionFormat, ToolSpec
from temper.policy.tokenizer import ChatTokenizer, TemplateError

# The formats an environment reads itself; every other action format names a parser of
# function calls (a ``temper.parsers`` plugin) whose tools the chat template renders.
OWN_FORMATS = frozenset({ActionFormat.code_block, ActionFormat.tool_call})


class EnvKind(StrEnum):
    """Temper's own environments (plugins may register more kinds)."""

    code = "code"  # edit files and run commands and tests over several turns, then submit
    math = "math"  # give a final answer, optionally after running Python
    shell = "shell"  # run bash in a persistent workspace; the task's tests grade it


@dataclass(frozen=True)
class TaskView:
    """The fields of a task an environment reads (a ``temper.db.Task`` row or a dict)."""

    id: str
    kind: str
    prompt: str
    spec: Mapping[str, Any] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, task: Any) -> TaskView:
        if isinstance(task, TaskView):
            return task
        get = task.get if isinstance(task, Mapping) else lambda k, d=None: getattr(task, k, d)
        return cls(
            id=str(get("id", "")),
            kind=str(get("kind", "code")),
            prompt=str(get("prompt", "")),
            spec=dict(get("spec", None) or {}),
            meta=dict(get("meta", None) or {}),
        )


ActionKind = Literal["sandbox", "submit", "invalid"]


@dataclass
class ParsedAction:
    """What the model's output asks for.

    ``sandbox``: run ``command`` (a ``temper.sandbox.Action`` as a dict) in the episode's
    session, then the ``more`` commands of the same turn in order (several tool calls),
    then (if ``submit_after``) score. ``submit``: score now (``answer`` for math).
    ``invalid``: nothing runs; ``error`` goes back to the model as the observation and the
    episode's format flag turns false. ``calls``: the function calls that run, one per
    command, in the shape an assistant message's ``tool_calls`` has (each with its
    ``id``; its result's tool message carries it as ``tool_call_id``).
    """

    kind: ActionKind
    command: dict[str, Any] | None = None
    more: list[dict[str, Any]] | None = None
    answer: str | None = None
    submit_after: bool = False
    format_ok: bool = True
    error: str | None = None
    note: str | None = None
    calls: list[dict[str, Any]] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ParsedAction:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    @classmethod
    def invalid(cls, error: str) -> ParsedAction:
        return cls(kind="invalid", format_ok=False, error=error)


# ```lang [path]\n body ``` — an info string, then the body up to the closing fence.
_FENCE = re.compile(r"```[ \t]*([^\n`]*)\n(.*?)```", re.S)
_TOOL = re.compile(r"<tool>(.*?)</tool>", re.S)
_UNCLOSED_TOOL = re.compile(r"<tool>(?!.*</tool>)", re.S)
_SUBMIT_LINE = re.compile(
    r"^\s*(?:`{0,3})\s*(?:<submit\s*/?>|submit|SUBMIT|Submit)\s*(?:`{0,3})\s*\.?\s*$", re.M
)

PYTHON_LANGS = frozenset({"python", "py", "python3"})
SHELL_LANGS = frozenset({"bash", "sh", "shell", "console", "zsh"})


@dataclass(frozen=True)
class Block:
    lang: str
    path: str | None
    body: str


def fenced_blocks(text: str) -> list[Block]:
    """Fenced code blocks in order; ``python src/x.py`` or ``file src/x.py`` names a path."""
    blocks = []
    for info, body in _FENCE.findall(text):
        words = info.strip().split()
        lang = words[0].lower() if words else ""
        path = None
        if len(words) > 1:
            path = words[1].removeprefix("path=").strip("\"'")
        elif lang.startswith(("file:", "path=")):
            lang, path = "file", lang.split(":", 1)[-1].split("=", 1)[-1]
        blocks.append(Block(lang, path, body))
    return blocks


def has_unclosed_fence(text: str) -> bool:
    return text.count("```") % 2 == 1


def wants_submit(text: str) -> bool:
    """``submit`` (or ``<submit/>``) on a line of its own, outside code blocks."""
    return bool(_SUBMIT_LINE.search(_FENCE.sub("", text)))


def truncate_middle(text: str, limit: int) -> str:
    """Keep the head and the tail (errors are often at the end); say how much was cut."""
    if len(text) <= limit:
        return text
    head = int(limit * 0.6)
    tail = limit - head
    cut = len(text) - head - tail
    return f"{text[:head]}\n[... {cut} characters cut ...]\n{text[-tail:]}"


class Environment(ABC):
    """One implementation per kind, registered under ``temper.environments``;
    :func:`temper.envs.make_environment` picks it by name."""

    kind: ClassVar[str]
    observation_role: ClassVar[str] = "tool"
    # True for an environment whose episode is one run of an agent program that calls the
    # policy itself (temper.envs.agent): the dispatcher starts it instead of asking for turns.
    runs_agent: ClassVar[bool] = False

    def __init__(
        self,
        task: Any,
        *,
        max_turns: int = 4,
        action_format: ActionFormat | str = ActionFormat.code_block,
        limits: Mapping[str, Any] | None = None,
        max_observation_chars: int = 4000,
        system_prompt: str | None = None,
        tools: Sequence[ToolSpec | Mapping[str, Any]] | None = None,
        tool_role: str | None = None,
        tools_in_prompt: str | None = None,
    ) -> None:
        self.task = TaskView.of(task)
        # ``environment.tool_role``: the role of the messages that carry tool results
        # (``user`` for templates without a tool role); else the environment's own
        self.tool_role: str = tool_role or self.observation_role
        self.custom_system_prompt = system_prompt
        # ``environment.tools_in_prompt``: ``names`` gives the template each tool's name only
        self.tools_in_prompt = tools_in_prompt or "full"
        self.max_turns = max(1, max_turns)
        self.action_format = str(action_format)
        self.limits = {**dict(self.task.spec.get("limits") or {}), **dict(limits or {})}
        self.max_observation_chars = max_observation_chars
        declared = [t if isinstance(t, ToolSpec) else ToolSpec.model_validate(t) for t in tools or []]
        self.tools = declared or builtin_tools(*self.default_tools)

    default_tools: ClassVar[tuple[str, ...]] = ("python", "submit")

    @property
    def calls_functions(self) -> bool:
        return self.action_format not in OWN_FORMATS

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """The OpenAI function schemas the chat template renders (function-calling formats
        only): whole, or with ``tools_in_prompt: names`` the name alone."""
        if not self.calls_functions:
            return None
        if self.tools_in_prompt == "names":
            return [{"type": "function", "function": {"name": t.function.name}} for t in self.tools]
        return [t.openai_schema() for t in self.tools]

    # --- the first prompt ---------------------------------------------------------------------
    @abstractmethod
    def system_prompt(self) -> str: ...

    def user_prompt(self) -> str:
        return self.task.prompt

    def first_messages(self) -> list[dict[str, str]]:
        """The system message (the job's own instructions if it gives them; none if they are
        empty) and the task."""
        system = self.system_prompt() if self.custom_system_prompt is None else self.custom_system_prompt
        user = {"role": "user", "content": self.user_prompt()}
        return [{"role": "system", "content": system}, user] if system else [user]

    def first_prompt_ids(self, tok: ChatTokenizer) -> list[int]:
        """The first prompt, rendered by the model's chat template (with the tools)."""
        return tok.render(self.first_messages(), tools=self.tool_schemas())

    def setup_files(self) -> dict[str, str]:
        """Files the sandbox session starts with (the task's visible files; never its tests)."""
        files = self.task.spec.get("files") or {}
        return {str(k): str(v) for k, v in files.items()} if isinstance(files, Mapping) else {}

    def setup_actions(self) -> list[dict[str, Any]]:
        """Commands run in the sandbox session when it is created, after the starting files
        and before the first action (``temper.sandbox.Action`` as dicts)."""
        return []

    # --- one turn -----------------------------------------------------------------------------
    @abstractmethod
    def parse(self, text: str, *, turn: int) -> ParsedAction:
        """The model's output to an action; never raises (malformed output is ``invalid``)."""

    def observe(
        self,
        action: ParsedAction,
        result: Mapping[str, Any] | None,
        more_results: Sequence[Mapping[str, Any]] = (),
    ) -> list[str]:
        """The observation texts of a turn: one per command that ran (the first command's
        ``result``, then ``more_results`` in order), or the error of an invalid action."""
        if action.kind == "invalid":
            return [f"Error: {action.error}\n{self.format_help()}"]
        commands = [action.command or {}, *(action.more or [])]
        results = [result or {}, *more_results]
        texts = [
            render_result(c, r, self.max_observation_chars) for c, r in zip(commands, results, strict=False)
        ]
        if action.note:
            texts[-1] = f"{texts[-1]}\nNote: {action.note}"
        return texts

    def observation_messages(
        self,
        texts: str | Sequence[str],
        *,
        calls: Sequence[Mapping[str, Any]] | None = None,
        seed: str = "",
    ) -> list[dict[str, Any]]:
        """The messages that carry a turn's observations. In the tool role: one tool message
        per text, each with the ``tool_call_id`` (and ``name``) of the call it answers
        (``calls`` in order; a text no call produced, such as a format error, gets an id made
        from ``seed``), as OpenAI's format and the templates that check ids (Mistral's)
        expect. In the user role (``environment.tool_role: user``, for templates without a
        tool role such as Gemma 3's): one user message with every text, so that roles still
        alternate."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        if self.tool_role == "user":
            return [{"role": "user", "content": "\n\n".join(texts)}]
        messages = []
        for i, text in enumerate(texts):
            call = calls[i] if calls and i < len(calls) else None
            msg: dict[str, Any] = {"role": self.tool_role, "content": text}
            msg["tool_call_id"] = str(call["id"]) if call and call.get("id") else call_id(seed, i)
            if call and isinstance(call.get("function"), Mapping):
                msg["name"] = call["function"].get("name")
            messages.append(msg)
        return messages

    def observation_ids(
        self,
        tok: ChatTokenizer,
        model_ids: Sequence[int],
        texts: str | Sequence[str],
        *,
        calls: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """The ids that extend the conversation after the model's sampled ``model_ids``: the
        rest of the template's end-of-turn, the observation messages
        (:meth:`observation_messages`: one per tool call, answering ``calls``) as the
        template renders them, and the opening of the next assistant turn. Sampled ids are
        never changed. Raises :class:`~temper.policy.TemplateError` where the template
        cannot render them."""
        seed = ",".join(map(str, model_ids))
        messages = self.observation_messages(texts, calls=calls, seed=seed)
        return tok.continuation(model_ids, messages, tools=self.tool_schemas())

    def check_template(self, tok: ChatTokenizer) -> None:
        """Render what this environment's episodes will render, or raise
        :class:`~temper.policy.TemplateError` with the template's own error: the first
        prompt with the tools; a conversation where the assistant calls a tool (OpenAI's
        ``tool_calls`` shape, with an id) and its result follows (in the tool role, or as a
        user turn with ``tool_role: user``); and the continuation that extends a sampled
        turn token-wise with that result. With a function-calling format, a template that
        renders nothing of the tools is refused unless the system prompt names each of
        them (Gemma 3's template drops them)."""
        tools = self.tool_schemas()
        first = self.first_messages()
        prompt = tok.render_text(first, tools=tools)
        if tools and prompt == tok.render_text(first, tools=None):
            system = first[0]["content"] if first[0]["role"] == "system" else ""
            unnamed = [t.function.name for t in self.tools if t.function.name not in system]
            if unnamed:
                raise TemplateError(
                    "the chat template ignores tools (the prompt is the same with and without them) and "
                    f"the system prompt does not name {', '.join(unnamed)}: describe the tools in "
                    "environment.system_prompt, or use a template that renders tools"
                )
        name, args = "tool", {}
        if self.tools:
            name, args = self.tools[0].function.name, _example_arguments(self.tools[0].function.parameters)
        call = ToolCall(name, args, call_id("probe", 0)).message(0)
        result = self.observation_messages(
            ['[exit code 0; 0.01s]\nstdout:\nprobe "result"'], calls=[call], seed="probe"
        )
        if self.calls_functions:
            reply: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [call]}
        else:
            reply = {"role": "assistant", "content": "A reply."}
        tok.render_text([*first, reply, *result], tools=tools)
        tok.continuation([], result, tools=tools)

    def is_last_turn(self, turn: int) -> bool:
        return turn + 1 >= self.max_turns

    @abstractmethod
    def submission(
        self, action: ParsedAction | None, *, final_text: str, snapshot_key: str | None, session_id: str
    ) -> dict[str, Any]:
        """What the reward scorer judges."""

    @abstractmethod
    def format_help(self) -> str:
        """One or two lines reminding the model of the action format."""

    # --- shared parsing -----------------------------------------------------------------------
    def parse_function_calls(self, text: str) -> ParsedAction | None:
        """Function calls (hermes, llama3_json, mistral, pythonic, tool_code, a plugin's)
        checked against the declared tools; None if the turn has none. The calls that run
        in the sandbox run in order, each with its own observation; a submit call scores
        the episode once they ran (calls after the submit are ignored, and the last
        observation says so). Each call keeps the model's id, or gets one made from the
        turn's text (the same text, the same ids)."""
        table = tool_table(self.tools)
        try:
            calls = [
                c.with_id(text, i).typed(table[c.name].function.parameters if c.name in table else None)
                for i, c in enumerate(parse_calls(text, self.action_format))
            ]
            commands = [call_action(c, table) for c in calls]
        except ToolCallError as exc:
            return ParsedAction.invalid(str(exc))
        if not commands:
            return None
        kinds = [c["kind"] for c in commands]
        end = kinds.index("submit") if "submit" in kinds else len(commands)
        runs, ignored = commands[:end], len(commands) - end - 1
        if not runs:
            return ParsedAction("submit", answer=commands[0].get("answer"))
        note = f"{ignored} tool call(s) after submit were ignored" if ignored > 0 else None
        return ParsedAction(
            "sandbox",
            command=runs[0],
            more=runs[1:] or None,
            submit_after=end < len(commands),
            note=note,
            calls=[c.message(i) for i, c in enumerate(calls[:end])],
        )

    def parse_calls_or_submit(self, text: str, tool_help: Mapping[str, str]) -> ParsedAction | None:
        """For the tool formats (function calls, ``<tool>``): the call, else ``submit`` where
        the text says so, else an invalid action. None for the other formats."""
        if self.calls_functions:
            action = self.parse_function_calls(text)
        elif self.action_format == ActionFormat.tool_call:
            action = self.parse_tool_call(text, tool_help)
        else:
            return None
        if action is not None:
            return action
        return ParsedAction("submit") if wants_submit(text) else ParsedAction.invalid("no tool call found")

    def function_help(self) -> str:
        names = ", ".join(t.function.name for t in self.tools)
        if self.action_format == ActionFormat.llama3_json:
            return f'Reply with a JSON call {{"name": ..., "parameters": {{...}}}} of one of: {names}.'
        if self.action_format == "mistral":
            return f'Call tools as [TOOL_CALLS] [{{"name": ..., "arguments": {{...}}}}]; tools: {names}.'
        if self.action_format == "pythonic":
            return f"Reply with a Python list of calls, [name(argument=value)]; tools: {names}."
        if self.action_format == "tool_code":
            return f"Call a tool in a ```tool_code block, name(argument=value); tools: {names}."
        return f'Call a tool as <tool_call>{{"name": ..., "arguments": {{...}}}}</tool_call>; tools: {names}.'

    def parse_tool_call(self, text: str, tools: Mapping[str, str]) -> ParsedAction | None:
        """``<tool>{"name": ..., "arguments": {...}}</tool>``: None if there is none."""
        calls = _TOOL.findall(text)
        if not calls:
            if _UNCLOSED_TOOL.search(text):
                return ParsedAction.invalid("a <tool> tag was opened but never closed with </tool>")
            return None
        try:
            call = json.loads(calls[0])
        except json.JSONDecodeError as exc:
            return ParsedAction.invalid(f"the tool call is not valid JSON ({exc.msg} at char {exc.pos})")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ParsedAction.invalid('a tool call must be a JSON object with a "name"')
        args = call.get("arguments") or {}
        if not isinstance(args, dict):
            return ParsedAction.invalid('"arguments" must be a JSON object')
        name = call["name"]
        if name not in tools:
            return ParsedAction.invalid(f"unknown tool {name!r}; available: {', '.join(sorted(tools))}")
        note = "only the first tool call ran; make one call per turn" if len(calls) > 1 else None
        action = self.tool_action(name, args)
        if action.kind != "invalid" and note:
            action.note = note
        return action

    def tool_action(self, name: str, args: Mapping[str, Any]) -> ParsedAction:
        if name == "python":
            code = args.get("code")
            if not isinstance(code, str) or not code.strip():
                return ParsedAction.invalid('python needs {"code": "..."}')
            return ParsedAction("sandbox", command={"kind": "run_python", "code": code})
        if name == "bash":
            cmd = args.get("command")
            if not isinstance(cmd, str) or not cmd.strip():
                return ParsedAction.invalid('bash needs {"command": "..."}')
            return ParsedAction("sandbox", command={"kind": "run_command", "command": cmd})
        if name == "write_file":
            path, content = args.get("path"), args.get("content")
            if not isinstance(path, str) or not is_workspace_file(path):
                return ParsedAction.invalid('write_file needs a relative "path" inside the workspace')
            if not isinstance(content, str):
                return ParsedAction.invalid('write_file needs a string "content"')
            return ParsedAction("sandbox", command={"kind": "write_file", "path": path, "content": content})
        if name == "submit":
            answer = args.get("answer")
            return ParsedAction("submit", answer=None if answer is None else str(answer))
        return ParsedAction.invalid(f"unknown tool {name!r}")


def _example_arguments(schema: Mapping[str, Any]) -> dict[str, Any]:
    """Arguments of the schema's required parameters (each a value of its type), for the
    template check's probe call."""
    samples = {"string": "x", "integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}}
    props = schema.get("properties") or {}
    out: dict[str, Any] = {}
    for name in schema.get("required") or []:
        kind = (props.get(name) or {}).get("type", "string")
        out[str(name)] = samples.get(kind if isinstance(kind, str) else "string", "x")
    return out


def render_result(command: Mapping[str, Any], result: Mapping[str, Any], limit: int) -> str:
    """A sandbox ``ExecResult`` (as a dict) as text the model reads."""
    kind = command.get("kind")
    parts: list[str] = []
    error = result.get("error")
    if kind == "write_file":
        if error:
            return f"Could not write {command.get('path')}: {error}"
        return f"Wrote {command.get('path')} ({len((command.get('content') or '').encode())} bytes)."
    if kind == "read_file":
        return f"Error: {error}" if error else truncate_middle(result.get("content") or "", limit)
    if kind == "list_files":
        files = result.get("files") or []
        return "\n".join(f["path"] + ("/" if f.get("is_dir") else "") for f in files) or "(empty)"
    kill = result.get("kill_reason")
    exit_code = result.get("exit_code")
    status = f"exit code {exit_code}" if exit_code is not None else "no exit code"
    if kill:
        status = f"killed ({_KILL_TEXT.get(kill, kill)})"
    elif result.get("signal"):
        status = f"died of signal {result['signal']}"
    parts.append(f"[{status}; {float(result.get('wall_s') or 0):.2f}s]")
    budget = max(200, limit - 100)
    for stream in ("stdout", "stderr"):
        out = result.get(stream) or ""
        if out:
            cut = " (truncated by the sandbox)" if result.get(f"{stream}_truncated") else ""
            parts.append(f"{stream}{cut}:\n{truncate_middle(out.rstrip(), budget // 2)}")
    if error:
        parts.append(f"error: {error}")
    if len(parts) == 1:
        parts.append("(no output)")
    return "\n".join(parts)


_KILL_TEXT = {
    "timeout": "wall-clock time limit",
    "cpu": "CPU time limit",
    "memory": "out of memory",
    "pids": "too many processes",
    "output": "too much output",
    "disk": "disk or file size limit",
    "signal": "killed by a signal",
}
