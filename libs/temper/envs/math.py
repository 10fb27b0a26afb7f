"""The ``math`` environment: the model answers (``\\boxed{...}``, ``#### 42`` or
``Answer: 42``), optionally after running Python in its sandbox."""

from __future__ import annotations

from typing import Any

from temper.envs.base import (
    PYTHON_LANGS,
    ActionFormat,
    Environment,
    EnvKind,
    ParsedAction,
    fenced_blocks,
    has_unclosed_fence,
)
from temper.rewards import answers

MATH_TOOLS = {"python": '{"code": "..."} runs Python and shows its output', "submit": '{"answer": "..."}'}


def extract_answer(text: str) -> str | None:
    """The model's final answer, if it gave one explicitly (``\\boxed{}``, ``#### x``,
    ``Answer: x``); the same reading the reward's ``answer_match`` uses."""
    return answers.extract_answer(text, strict=True)


class MathEnvironment(Environment):
    kind = EnvKind.math

    def system_prompt(self) -> str:
        if self.calls_functions:
            tool = "To compute, call the python tool; what it prints comes back."
        elif self.action_format == ActionFormat.tool_call:
            tool = 'To compute, call <tool>{"name": "python", "arguments": {"code": "..."}}</tool>; its output comes back.'
        else:
            tool = "To compute, write a ```python block; its output comes back to you."
        return f"Solve the problem. {tool} Give the final answer as \\boxed{{...}}."

    def format_help(self) -> str:
        if self.calls_functions:
            return f"Give the final answer as \\boxed{{...}}. {self.function_help()}"
        return "Give the final answer as \\boxed{...}, or run Python in a ```python block."

    def parse(self, text: str, *, turn: int) -> ParsedAction:
        answer = extract_answer(text)
        if answer is not None:
            return ParsedAction("submit", answer=answer)
        if self.calls_functions:
            action = self.parse_function_calls(text)
            if action is not None:
                return action
        elif self.action_format == ActionFormat.tool_call:
            action = self.parse_tool_call(text, MATH_TOOLS)
            if action is not None:
                return action
        else:
            if has_unclosed_fence(text):
                return ParsedAction.invalid("a ``` block was opened but never closed")
            for block in fenced_blocks(text):
                if block.lang in PYTHON_LANGS and block.path is None:
                    return ParsedAction("sandbox", command={"kind": "run_python", "code": block.body})
        return ParsedAction.invalid("no final answer found")

    def submission(
        self, action: ParsedAction | None, *, final_text: str, snapshot_key: str | None, session_id: str
    ) -> dict[str, Any]:
        return {"kind": "math", "answer": action.answer if action else None, "final_text": final_text}
