"""The ``shell`` environment: the agent has one tool, bash, in a workspace that persists
across its turns (the episode's sandbox session), and the task's instructions. It says
it is done with ``submit`` (or runs out of turns); the task's hidden tests then grade
the workspace it left, in a fresh scoring sandbox, exactly as for ``code``.

Registered as a plugin like the others (``temper.environments``: ``shell``)."""

from __future__ import annotations

from typing import Any

from temper.envs.base import (
    SHELL_LANGS,
    ActionFormat,
    EnvKind,
    ParsedAction,
    fenced_blocks,
    has_unclosed_fence,
    wants_submit,
)
from temper.envs.code import CodeEnvironment

SHELL_TOOLS = {
    "bash": '{"command": "..."} runs a shell command in the workspace',
    "submit": "{} says you are done; the workspace is graded",
}


class ShellEnvironment(CodeEnvironment):
    kind = EnvKind.shell
    default_tools = ("bash", "submit")

    def system_prompt(self) -> str:
        turns = f"You have {self.max_turns} turn{'s' if self.max_turns != 1 else ''}."
        if self.calls_functions:
            how = "Act by calling the bash tool; call submit when you are done."
        elif self.action_format == ActionFormat.tool_call:
            tools = "\n".join(f"- {name}: {desc}" for name, desc in SHELL_TOOLS.items())
            how = f'Act with one tool call per turn: <tool>{{"name": ..., "arguments": {{...}}}}</tool>\n{tools}'
        else:
            how = (
                "Act with one ```bash block per turn; its output comes back to you.\n"
                "When you are done, write `submit` on a line of its own (after the block, if there is one)."
            )
        return (
            "You work in a Linux shell; the current directory is your workspace and it keeps "
            "its files between turns. Do what the task asks; hidden tests check the workspace "
            f"after you submit. {turns}\n{how}"
        )

    def format_help(self) -> str:
        if self.calls_functions:
            return self.function_help()
        if self.action_format == ActionFormat.tool_call:
            return 'Reply with one <tool>{"name": "bash"|"submit", "arguments": {...}}</tool>.'
        return "Reply with one ```bash block, or `submit` on a line of its own when you are done."

    def parse(self, text: str, *, turn: int) -> ParsedAction:
        action = self.parse_calls_or_submit(text, SHELL_TOOLS)
        if action is not None:
            return action
        submit = wants_submit(text)
        if has_unclosed_fence(text):
            return ParsedAction.invalid("a ``` block was opened but never closed")
        blocks = fenced_blocks(text)
        commands = [b.body for b in blocks if b.lang in SHELL_LANGS and b.path is None]
        if not commands:
            if submit:
                return ParsedAction("submit")
            if blocks:
                return ParsedAction.invalid("only ```bash blocks run here (the one tool is bash)")
            return ParsedAction.invalid("no action found")
        note = "only the first block ran; send one block per turn" if len(commands) > 1 else None
        return ParsedAction(
            "sandbox", command={"kind": "run_command", "command": commands[0]}, submit_after=submit, note=note
        )

    def submission(
        self, action: ParsedAction | None, *, final_text: str, snapshot_key: str | None, session_id: str
    ) -> dict[str, Any]:
        return {**super().submission(action, final_text=final_text, snapshot_key=snapshot_key,
                                     session_id=session_id), "kind": "shell"}  # fmt: skip
