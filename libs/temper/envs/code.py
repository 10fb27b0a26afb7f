"""The ``code`` environment: the agent edits files and runs commands and tests in its
sandbox session over several turns, then submits the workspace for scoring."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any, ClassVar

from temper.envs.base import (
    PYTHON_LANGS,
    SHELL_LANGS,
    ActionFormat,
    Environment,
    EnvKind,
    ParsedAction,
    fenced_blocks,
    has_unclosed_fence,
    truncate_middle,
    wants_submit,
)
from temper.envs.tools import is_workspace_file

CODE_TOOLS = {
    "python": '{"code": "..."} runs Python',
    "bash": '{"command": "..."} runs a shell command',
    "write_file": '{"path": "...", "content": "..."} writes a file',
    "submit": "{} submits the workspace",
}


class CodeEnvironment(Environment):
    kind = EnvKind.code
    default_tools: ClassVar[tuple[str, ...]] = ("bash", "python", "write_file", "read_file", "submit")
    max_file_chars = 2000
    max_listing_chars = 6000

    def system_prompt(self) -> str:
        turns = f"You have {self.max_turns} turn{'s' if self.max_turns != 1 else ''}."
        if self.calls_functions:
            how = "Act by calling the tools; call submit when the task is solved."
        elif self.action_format == ActionFormat.tool_call:
            tools = "\n".join(f"- {name}: {desc}" for name, desc in CODE_TOOLS.items())
            how = f'Act with one tool call per turn: <tool>{{"name": ..., "arguments": {{...}}}}</tool>\n{tools}'
        else:
            how = (
                "Act with one fenced block per turn:\n"
                "- ```bash runs a shell command; ```python runs Python;\n"
                "- ```python path/to/file.py (any language, then a path) writes that file;\n"
                "- a line with only `submit` submits the workspace (after the block, if there is one)."
            )
        return (
            "You are a software engineer working in a sandboxed workspace (the current directory). "
            f"Change the files so the task is solved, test your work, then submit. {turns}\n{how}"
        )

    def __init__(self, task: Any, *, hide_files: Sequence[str] = (), **options: Any) -> None:
        super().__init__(task, **options)
        self.hide_files = tuple(hide_files)  # environment.hide_files: named, content not shown

    def hidden(self, path: str) -> bool:
        return any(fnmatch.fnmatchcase(path, pattern) for pattern in self.hide_files)

    def user_prompt(self) -> str:
        files = self.setup_files()
        if not files:
            return self.task.prompt
        shown, budget = [], self.max_listing_chars
        for path, content in sorted(files.items()):
            if self.hidden(path):
                shown.append(f"--- {path} (not shown)")
                continue
            body = truncate_middle(content, min(self.max_file_chars, max(200, budget)))
            budget -= len(body)
            shown.append(f"--- {path}\n{body}")
        return f"{self.task.prompt}\n\nFiles in the workspace:\n" + "\n".join(shown)

    def format_help(self) -> str:
        if self.calls_functions:
            return self.function_help()
        if self.action_format == ActionFormat.tool_call:
            return 'Reply with one <tool>{"name": "bash"|"python"|"write_file"|"submit", "arguments": {...}}</tool>.'
        return "Reply with one ```bash or ```python block, a ```python path/file.py block to write a file, or `submit`."

    def parse(self, text: str, *, turn: int) -> ParsedAction:
        action = self.parse_calls_or_submit(text, CODE_TOOLS)
        if action is not None:
            return action
        submit = wants_submit(text)
        if has_unclosed_fence(text):
            return ParsedAction.invalid("a ``` block was opened but never closed")
        blocks = fenced_blocks(text)
        actionable = []
        for b in blocks:
            if b.path is not None:
                if not is_workspace_file(b.path):
                    return ParsedAction.invalid(
                        f"cannot write {b.path!r}: use a relative path inside the workspace"
                    )
                actionable.append({"kind": "write_file", "path": b.path, "content": b.body})
            elif b.lang in PYTHON_LANGS:
                actionable.append({"kind": "run_python", "code": b.body})
            elif b.lang in SHELL_LANGS:
                actionable.append({"kind": "run_command", "command": b.body})
        if not actionable:
            if submit:
                return ParsedAction("submit")
            if blocks:
                return ParsedAction.invalid(
                    "a code block needs a language to run (```bash, ```python) or a path to write (```python x.py)"
                )
            return ParsedAction.invalid("no action found")
        note = "only the first block ran; send one block per turn" if len(actionable) > 1 else None
        return ParsedAction("sandbox", command=actionable[0], submit_after=submit, note=note)

    def submission(
        self, action: ParsedAction | None, *, final_text: str, snapshot_key: str | None, session_id: str
    ) -> dict[str, Any]:
        return {
            "kind": "code",
            "session_id": session_id,
            "snapshot_key": snapshot_key,
            "final_text": final_text,
        }
