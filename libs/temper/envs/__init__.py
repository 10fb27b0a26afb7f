"""Environments: a task becomes a first prompt, the model's output becomes an action,
a sandbox result becomes an observation, and the environment says when to stop.

``make_environment(kind, task, ...)`` picks the implementation named by :class:`EnvKind`.
"""

from __future__ import annotations

from typing import Any

from temper.envs.base import (
    ActionFormat,
    Environment,
    EnvKind,
    ParsedAction,
    TaskView,
    render_result,
    truncate_middle,
)
from temper.envs.code import CodeEnvironment
from temper.envs.math import MathEnvironment, extract_answer

ENVIRONMENTS: dict[EnvKind, type[Environment]] = {
    EnvKind.code: CodeEnvironment,
    EnvKind.math: MathEnvironment,
}


class UnknownEnvironment(ValueError):
    pass


def make_environment(kind: str | EnvKind, task: Any, **options: Any) -> Environment:
    """The environment named ``kind`` for ``task`` (options: max_turns, action_format, limits)."""
    try:
        cls = ENVIRONMENTS[EnvKind(kind)]
    except ValueError:
        raise UnknownEnvironment(
            f"unknown environment {kind!r}; choose one of {', '.join(k.value for k in EnvKind)}"
        ) from None
    return cls(task, **options)


__all__ = [
    "ENVIRONMENTS",
    "ActionFormat",
    "CodeEnvironment",
    "EnvKind",
    "Environment",
    "MathEnvironment",
    "ParsedAction",
    "TaskView",
    "UnknownEnvironment",
    "extract_answer",
    "make_environment",
    "render_result",
    "truncate_middle",
]
