"""The manifest of a tenant environment package (``environment.yaml``).

A manifest that does not validate raises :class:`ManifestError`, whose errors name the
field and the line of the YAML it came from (``tools.0.command (line 12): ...``)."""

from __future__ import annotations

import re
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from temper import plugins
from temper.jobspec import ActionFormat, ToolSpec
from temper.limits import NetworkPolicy
from temper.sandbox import SandboxLimits

NAME = r"^[a-z0-9][a-z0-9_.-]{0,63}$"
VERSION = r"^[0-9A-Za-z][0-9A-Za-z._-]{0,31}$"
COMPONENT = r"^[A-Za-z_][A-Za-z0-9_]{0,63}$"
# Formats Temper reads itself do not render a tool schema; a package declares its tools as
# function schemas, so it needs a function-calling parser.
TEXT_FORMATS = (ActionFormat.code_block.value, ActionFormat.tool_call.value)


# What the agent's sandbox may reach (docs/sandbox.md): none, loopback (the sandbox's own
# services) or allowlist (``limits.allow``). Never the host's network: a tenant's package
# cannot ask for what only an operator may grant.
PACKAGE_NETWORKS = (NetworkPolicy.none, NetworkPolicy.loopback, NetworkPolicy.allowlist)


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME, description="lower-case letters, digits, . _ -")
    version: str = Field(pattern=VERSION)
    description: str = ""
    instructions: str = Field(description="the system message of every episode")
    prompt_template: str = Field(
        "{prompt}", description="the first user message; {prompt} is replaced by the task's prompt"
    )
    action_format: str = Field(
        ActionFormat.hermes.value,
        description="a function-calling parser: hermes, llama3_json, mistral, pythonic, tool_code or a plugin's",
    )
    max_turns: int = Field(4, ge=1, le=100)
    tools: list[ToolSpec] = Field(min_length=1, description="OpenAI function schemas bound to commands")
    limits: dict[str, Any] = Field(default_factory=dict, description="the agent's sandbox limits")
    network: NetworkPolicy = Field(
        NetworkPolicy.none, description="the agent's sandbox: none, loopback or allowlist"
    )
    rubric: dict[str, float] = Field(min_length=1, description="component -> weight")
    setup: str | None = Field(
        None, description="shell command run in the agent's sandbox before its first action"
    )
    grade: str = Field(min_length=1, description="shell command run in a fresh grading sandbox")
    grade_limits: dict[str, Any] = Field(default_factory=dict, description="the grading sandbox's limits")
    hidden: str = Field(
        "hidden", pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$", description="hidden files directory"
    )

    @field_validator("network", mode="before")
    @classmethod
    def _network(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in [n.value for n in PACKAGE_NETWORKS]:
            allowed = ", ".join(n.value for n in PACKAGE_NETWORKS)
            raise ValueError(f"network {value!r} is not one a package may ask for; allowed: {allowed}")
        try:  # with the limits (declared above): allowlist needs limits.allow, services a network
            SandboxLimits.model_validate({**info.data.get("limits", {}), "network": value})
        except ValidationError as exc:
            raise ValueError(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None
        return value

    @field_validator("action_format")
    @classmethod
    def _format(cls, value: str) -> str:
        if value in TEXT_FORMATS:
            raise ValueError(
                f"{value!r} renders no tool schemas; a package needs a function-calling format "
                "(hermes, llama3_json, mistral, pythonic, tool_code)"
            )
        if value not in plugins.installed(plugins.Group.parsers):
            raise ValueError(plugins.unknown_message(plugins.Group.parsers, value))
        return value

    @field_validator("limits", "grade_limits")
    @classmethod
    def _limits(cls, value: dict[str, Any]) -> dict[str, Any]:
        if "network" in value:
            raise ValueError("set the network with the top-level 'network' field, not in limits")
        try:
            SandboxLimits.model_validate(value)
        except ValidationError as exc:
            err = exc.errors()[0]
            raise ValueError(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}") from None
        return value

    @field_validator("rubric")
    @classmethod
    def _rubric(cls, value: dict[str, float]) -> dict[str, float]:
        bad = [n for n in value if not re.match(COMPONENT, n)]
        if bad:
            raise ValueError(f"component names must be identifiers: {bad}")
        return value

    @model_validator(mode="after")
    def _tools(self) -> Manifest:
        names = [t.function.name for t in self.tools]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"tools: duplicate names {dupes}")
        return self

    def agent_limits(self) -> dict[str, Any]:
        """The agent's sandbox limits a job on this package runs with."""
        return {**self.limits, "network": self.network.value}

    def package_spec(self, key: str, files: dict[str, str]) -> dict[str, Any]:
        """What a job pins when it names this package (``environment.package``): everything
        the dispatcher and the scorer need, the archive's key for the hidden files, and
        the public files that start the agent's workspace."""
        return {
            "name": self.name, "version": self.version, "key": key, "instructions": self.instructions,
            "prompt_template": self.prompt_template, "setup": self.setup, "grade": self.grade,
            "grade_limits": self.grade_limits, "rubric": self.rubric, "hidden": self.hidden, "files": files,
        }  # fmt: skip


class ManifestError(ValueError):
    """``errors``: (field, line or None, message)."""

    def __init__(self, errors: list[tuple[str, int | None, str]]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"{f}{f' (line {n})' if n else ''}: {m}" for f, n, m in errors))


def _line(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """The 1-based line of the YAML node at ``loc`` (the deepest one that exists)."""
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            node = next((v for k, v in node.value if k.value == part), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
        else:
            break
        if node is None:
            break
        line = node.start_mark.line + 1
    return line


def parse_manifest(text: str | bytes) -> Manifest:
    """The manifest in ``text``; :class:`ManifestError` naming each bad field and its line."""
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise ManifestError(
            [("(document)", mark.line + 1 if mark else None, f"not valid YAML: {exc}")]
        ) from None
    if not isinstance(data, dict):
        raise ManifestError([("(document)", None, "environment.yaml must be a mapping")])
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        errors = []
        for e in exc.errors():
            loc = tuple(e["loc"])
            message = e["msg"].removeprefix("Value error, ")
            errors.append((".".join(str(p) for p in loc) or "(root)", _line(node, loc), message))
        raise ManifestError(errors) from None
