"""Operator-installed plugins: environments, reward components and tool-call parsers
found through Python entry points.

A plugin is any installed distribution that declares, in its packaging metadata,

    [project.entry-points."temper.environments"]   # an Environment subclass
    [project.entry-points."temper.rewards"]        # a Component (class or instance) or a function
    [project.entry-points."temper.parsers"]        # text -> list of temper.envs.tools.ToolCall
    [project.entry-points."temper.tools"]          # a ToolSpec (or its mapping): a tool jobs name

Temper's own ``code``, ``math`` and ``shell`` environments, its reward components and
its parsers (``hermes``, ``llama3_json``, ``mistral``, ``pythonic``, ``tool_code``) are
registered the same way, in Temper's own ``pyproject.toml``, and looked up by the same code. :data:`BUILTINS` is that table
(``tests/libs/test_plugins.py`` checks that the two agree); it is read instead of
Temper's installed metadata, which an editable install leaves stale until reinstalled.

Names are read from the metadata (no import) so that validating a job spec is cheap;
an entry point's module is imported on first use and the object kept. A name nobody
registered is an :class:`UnknownPlugin` that lists what is installed; a name two
distributions register with different targets is a :class:`PluginConflict`.
"""

from __future__ import annotations

import difflib
import sys
import threading
from dataclasses import dataclass
from enum import StrEnum
from importlib import metadata
from typing import Any


class Group(StrEnum):
    environments = "temper.environments"
    rewards = "temper.rewards"
    parsers = "temper.parsers"
    tools = "temper.tools"


# What each group calls one of its plugins, in error messages.
WHAT = {
    Group.environments: "environment kind",
    Group.rewards: "reward component",
    Group.parsers: "action format",
    Group.tools: "tool",
}

TEMPER_DIST = "temper"

BUILTINS: dict[Group, dict[str, str]] = {
    Group.environments: {
        "code": "temper.envs.code:CodeEnvironment",
        "math": "temper.envs.math:MathEnvironment",
        "shell": "temper.envs.shell:ShellEnvironment",
        "agent": "temper.envs.agent:AgentEnvironment",
    },
    Group.rewards: {
        "tests_passed": "temper.rewards.components:TestsPassed",
        "compiles": "temper.rewards.components:Compiles",
        "coverage": "temper.rewards.components:Coverage",
        "efficiency": "temper.rewards.components:Efficiency",
        "answer_match": "temper.rewards.components:AnswerMatch",
        "format": "temper.rewards.components:Format",
        "turn_penalty": "temper.rewards.components:TurnPenalty",
        "reward_model": "temper.rewards.reward_model:RewardModel",
        "judge": "temper.rewards.judge:Judge",
    },
    Group.parsers: {
        "hermes": "temper.envs.tools:parse_hermes",
        "llama3_json": "temper.envs.tools:parse_llama3_json",
        "mistral": "temper.envs.tools:parse_mistral",
        "pythonic": "temper.envs.tools:parse_pythonic",
        "tool_code": "temper.envs.tools:parse_tool_code",
        "qwen3_coder": "temper.envs.tools:parse_qwen3_coder",
    },
    Group.tools: {},  # Temper's own tools are the built-ins (temper.jobspec.BuiltinTool)
}


class PluginError(LookupError):
    pass


class UnknownPlugin(PluginError):
    pass


class PluginConflict(PluginError):
    pass


@dataclass(frozen=True)
class Plugin:
    group: Group
    name: str
    value: str  # "module:attribute"
    dist: str  # the distribution that registers it

    def describe(self) -> str:
        return f"{self.name} ({self.dist})"


def _dist_name(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return str(dist.metadata["Name"]) if dist is not None else "?"


def _scan(group: Group) -> tuple[dict[str, Plugin], dict[str, list[Plugin]]]:
    found: dict[str, Plugin] = {}
    clashes: dict[str, list[Plugin]] = {}
    # Temper's own come from the table its pyproject.toml declares, not from its installed
    # metadata, which an editable install leaves stale until it is reinstalled.
    for name, value in BUILTINS[group].items():
        found[name] = Plugin(group, name, value, TEMPER_DIST)
    for ep in metadata.entry_points(group=group.value):
        dist = _dist_name(ep)
        if dist == TEMPER_DIST:
            continue
        plugin = Plugin(group, ep.name, ep.value, dist)
        have = found.get(ep.name)
        if have is None:
            found[ep.name] = plugin
        elif have.value != plugin.value:
            clashes.setdefault(ep.name, [have]).append(plugin)
    return found, clashes


_lock = threading.Lock()
_scans: dict[tuple[Group, tuple[str, ...]], tuple[dict[str, Plugin], dict[str, list[Plugin]]]] = {}
_loaded: dict[Plugin, Any] = {}


def _registry(group: Group) -> tuple[dict[str, Plugin], dict[str, list[Plugin]]]:
    # Keyed by sys.path: a distribution put on the path later is found without a restart.
    key = (group, tuple(sys.path))
    with _lock:
        hit = _scans.get(key)
    if hit is None:
        hit = _scan(group)
        with _lock:
            if len(_scans) > 64:
                _scans.clear()
            _scans[key] = hit
    return hit


def refresh() -> None:
    """Forget what was scanned and loaded (after installing a distribution in-process)."""
    with _lock:
        _scans.clear()
        _loaded.clear()


def installed(group: Group | str) -> dict[str, Plugin]:
    """Every plugin of ``group`` by name."""
    return dict(_registry(Group(group))[0])


def names(group: Group | str) -> list[str]:
    return sorted(installed(group))


def unknown_message(group: Group | str, name: str, *, also: tuple[str, ...] = ()) -> str:
    """ "unknown environment kind 'x'; installed: code (temper), ...; did you mean 'y'?"
    (``also``: names the caller accepts beside the plugins)."""
    group = Group(group)
    plugins = installed(group)
    listed = ", ".join([*also, *(p.describe() for _, p in sorted(plugins.items()))]) or "(none)"
    text = repr(name) if len(repr(name)) <= 80 else repr(name)[:77] + "..."
    message = f"unknown {WHAT[group]} {text}; installed: {listed}"
    close = difflib.get_close_matches(name, [*also, *plugins], n=1, cutoff=0.6)
    return f"{message}; did you mean {close[0]!r}?" if close else message


def lookup(group: Group | str, name: str) -> Plugin:
    group = Group(group)
    found, clashes = _registry(group)
    if name in clashes:
        who = ", ".join(f"{p.dist} ({p.value})" for p in clashes[name])
        raise PluginConflict(f"{WHAT[group]} {name!r} is registered differently by {who}")
    plugin = found.get(name)
    if plugin is None:
        raise UnknownPlugin(unknown_message(group, name))
    return plugin


def load(group: Group | str, name: str) -> Any:
    """The object the entry point names (imported once). Raises :class:`UnknownPlugin`,
    :class:`PluginConflict`, or :class:`PluginError` when its module fails to import."""
    plugin = lookup(group, name)
    with _lock:
        if plugin in _loaded:
            return _loaded[plugin]
    try:
        obj = metadata.EntryPoint(plugin.name, plugin.value, plugin.group.value).load()
    except Exception as exc:  # noqa: BLE001 - a broken plugin is named, not a crash of the caller
        raise PluginError(
            f"{WHAT[plugin.group]} {name!r} ({plugin.dist}: {plugin.value}) failed to load: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    with _lock:
        _loaded[plugin] = obj
    return obj


__all__ = [
    "BUILTINS",
    "Group",
    "Plugin",
    "PluginConflict",
    "PluginError",
    "UnknownPlugin",
    "installed",
    "load",
    "lookup",
    "names",
    "refresh",
    "unknown_message",
]
