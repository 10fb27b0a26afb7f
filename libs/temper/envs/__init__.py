"""Environments: a task becomes a first prompt, the model's output becomes an action,
a sandbox result becomes an observation, and the environment says when to stop.

``make_environment(kind, task, ...)`` builds the environment registered under ``kind``
in the ``temper.environments`` entry points (:mod:`temper.plugins`): Temper's own
``code``, ``math`` and ``shell``, and any an operator installed.
"""

from __future__ import annotations

from typing import Any

from temper import plugins
from temper.envs.agent import AgentEnvironment
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
from temper.envs.package import PackageEnvironment
from temper.envs.shell import ShellEnvironment
from temper.jobspec import AGENT_KIND, PACKAGE_KIND, EnvironmentSpec


class UnknownEnvironment(ValueError):
    pass


def environment_class(kind: str) -> type[Environment]:
    """The class registered as environment ``kind``; :class:`UnknownEnvironment` names
    the installed ones when there is none (or it is not an :class:`Environment`).
    ``package`` (a tenant package) is built in: its code is data run in sandboxes."""
    if kind == PACKAGE_KIND:
        return PackageEnvironment
    try:
        cls = plugins.load(plugins.Group.environments, str(kind))
    except plugins.PluginError as exc:
        raise UnknownEnvironment(str(exc)) from None
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise UnknownEnvironment(
            f"environment {kind!r} names {cls!r}, which is not a temper.envs.Environment"
        )
    return cls


def environment_kinds() -> list[str]:
    return plugins.names(plugins.Group.environments)


def make_environment(kind: str, task: Any, **options: Any) -> Environment:
    """The environment named ``kind`` for ``task`` (options: max_turns, action_format, limits)."""
    return environment_class(kind)(task, **options)


def environment_options(env: EnvironmentSpec) -> dict[str, Any]:
    """:func:`make_environment`'s options for a job's ``environment`` section (a package's
    pinned contents, an agent's program)."""
    options: dict[str, Any] = {
        "max_turns": env.max_turns,
        "action_format": env.action_format,
        "limits": env.limits,
        "system_prompt": env.system_prompt,
        "tools": env.tools,
        "tool_role": env.tool_role,
        "tools_in_prompt": env.tools_in_prompt,
    }
    if env.kind == PACKAGE_KIND:
        options["package"] = env.package
    if env.kind == AGENT_KIND:
        options["agent"] = env.agent
    if env.hide_files:
        options["hide_files"] = env.hide_files
    return options


__all__ = [
    "ActionFormat",
    "AgentEnvironment",
    "CodeEnvironment",
    "EnvKind",
    "Environment",
    "MathEnvironment",
    "PackageEnvironment",
    "ParsedAction",
    "ShellEnvironment",
    "TaskView",
    "UnknownEnvironment",
    "environment_class",
    "environment_kinds",
    "environment_options",
    "extract_answer",
    "make_environment",
    "render_result",
    "truncate_middle",
]
