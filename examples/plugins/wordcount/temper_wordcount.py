"""An example Temper plugin (docs/environments.md walks through it).

The ``wordcount`` environment asks for the number of words in a file of the workspace;
the agent may run one shell command per turn and answers with ``ANSWER: <n>``. The
``close_count`` reward gives partial credit for a near miss."""

from __future__ import annotations

import re
from typing import Any

from temper.envs import Environment, ParsedAction
from temper.rewards import ScoreContext, Skip

ANSWER = re.compile(r"^ANSWER:\s*(-?\d+)\s*$", re.M)
SHELL = re.compile(r"```sh\n(.*?)```", re.S)


class WordCountEnvironment(Environment):
    kind = "wordcount"

    def system_prompt(self) -> str:
        return (
            "Count words. Run one shell command per turn in a ```sh block; its output comes back. "
            "When you know, reply with a line `ANSWER: <number>`."
        )

    def format_help(self) -> str:
        return "Reply with one ```sh block, or a line `ANSWER: <number>`."

    def parse(self, text: str, *, turn: int) -> ParsedAction:
        answer = ANSWER.search(text)
        if answer:
            return ParsedAction("submit", answer=answer.group(1))
        command = SHELL.search(text)
        if command:
            return ParsedAction("sandbox", command={"kind": "run_command", "command": command.group(1)})
        return ParsedAction.invalid("no ```sh block and no ANSWER line")

    def submission(
        self, action: ParsedAction | None, *, final_text: str, snapshot_key: str | None, session_id: str
    ) -> dict[str, Any]:
        return {"answer": action.answer if action else None, "final_text": final_text}


def close_count(ctx: ScoreContext) -> float:
    """1 for the right count, less the further off it is, 0 from 50 % off."""
    if ctx.task.answer is None:
        raise Skip("the task has no expected count")
    if ctx.submission.answer is None:
        return 0.0
    want, got = int(ctx.task.answer), int(ctx.submission.answer)
    return max(0.0, 1.0 - 2 * abs(got - want) / max(want, 1))
