"""The environment of a tenant package (``environment.kind: package``).

Everything comes from the package as the job pinned it (``environment.package``, see
:mod:`temper.envpkg`): the instructions, the first user message, the tools (each a
command run in the agent's sandbox) and the public files that start the workspace. The
setup program runs in the agent's sandbox when its session is created, before any
action. The submission names the package so the reward scorer can run its grade
program in a fresh sandbox; nothing of the package runs in the dispatcher."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from temper.envs.base import Environment, ParsedAction


class PackageEnvironment(Environment):
    kind = "package"

    def __init__(self, task: Any, *, package: Mapping[str, Any] | None = None, **options: Any) -> None:
        if not package:
            raise ValueError(
                "a package environment needs environment.package, pinned when the job is submitted"
            )
        self.package = dict(package)
        super().__init__(task, **options)

    def system_prompt(self) -> str:
        return str(self.package.get("instructions") or "")

    def user_prompt(self) -> str:
        template = str(self.package.get("prompt_template") or "{prompt}")
        return template.replace("{prompt}", self.task.prompt)

    def setup_files(self) -> dict[str, str]:
        # The package's own files win: a task cannot replace the package's tools.
        return {
            **super().setup_files(),
            **{str(k): str(v) for k, v in (self.package.get("files") or {}).items()},
        }

    def setup_actions(self) -> list[dict[str, Any]]:
        setup = self.package.get("setup")
        return [{"kind": "run_command", "command": setup}] if setup else []

    def format_help(self) -> str:
        return self.function_help()

    def parse(self, text: str, *, turn: int) -> ParsedAction:
        action = self.parse_calls_or_submit(text, {})
        return action if action is not None else ParsedAction.invalid("no tool call found")

    def submission(
        self, action: ParsedAction | None, *, final_text: str, snapshot_key: str | None, session_id: str
    ) -> dict[str, Any]:
        keep = ("name", "version", "key", "setup", "grade", "grade_limits", "rubric", "hidden")
        return {
            "kind": "package",
            "answer": action.answer if action else None,
            "final_text": final_text,
            "snapshot_key": snapshot_key,
            "session_id": session_id,
            "package": {k: self.package.get(k) for k in keep},
        }
