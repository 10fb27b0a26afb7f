"""The environment of an agent program (``environment.kind: agent``, docs/agents.md).

The episode is one run of the user's program in the episode's sandbox: the dispatcher
starts it with the episode's own OpenAI-compatible base URL and key in its environment,
the program calls the policy through the gateway as often as it likes (up to
``max_turns`` calls), and when it exits the task's graders score the workspace and the
answer (what the program printed last: :func:`answer_of`). There are no turns for the dispatcher to
parse: the model's tokens are the calls the gateway recorded (``temper.agent_traces``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from temper.envs.base import Environment, ParsedAction
from temper.envs.tools import ToolCall, call_id
from temper.jobspec import AgentSpec
from temper.limits import NetworkPolicy, split_host_port
from temper.policy.tokenizer import ChatTokenizer
from temper.rewards import answers

# What the agent's run may take unless the job or task says otherwise: agents think and
# call tools for minutes, not the 10 s of one sandbox action.
DEFAULT_WALL_S = 300.0
# The probe tool of the template check: any function schema the agent might send.
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look something up.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}


def base_url(gateway_url: str, episode_id: str) -> str:
    """The episode's OpenAI-compatible base URL on the gateway."""
    return f"{gateway_url.rstrip('/')}/agent/{episode_id}/v1"


def answer_of(stdout: str) -> str | None:
    """The agent's answer: what it printed last in an explicit form (``\\boxed{...}``,
    ``#### 42``, ``Answer: 42``: what ``answer_match`` reads), else its last non-empty line
    of output (None if it printed nothing)."""
    explicit = answers.extract_answer(stdout, strict=True)
    if explicit is not None:
        return explicit
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    return lines[-1] if lines else None


class AgentEnvironment(Environment):
    kind = "agent"
    runs_agent: ClassVar[bool] = True
    # The tools a warm start renders its conversations with (``temper run``'s
    # local.warm_start); the agent sends its own with each call.
    default_tools: ClassVar[tuple[str, ...]] = ("python",)

    def __init__(
        self, task: Any, *, agent: AgentSpec | Mapping[str, Any] | None = None, **options: Any
    ) -> None:
        if agent is None:
            raise ValueError("an agent environment needs environment.agent (the program it runs)")
        self.agent = agent if isinstance(agent, AgentSpec) else AgentSpec.model_validate(agent)
        super().__init__(task, **options)
        self.limits.setdefault("wall_s", DEFAULT_WALL_S)

    def system_prompt(self) -> str:
        return ""  # the agent writes its own messages

    def format_help(self) -> str:
        return ""

    def parse(self, text: str, *, turn: int) -> ParsedAction:
        # Never called: the dispatcher reads no model output of an agent episode.
        return ParsedAction.invalid("an agent episode has no turns for the dispatcher to parse")

    def setup_files(self) -> dict[str, str]:
        return {**super().setup_files(), **self.agent.files}

    def sandbox_limits(self, gateway_url: str) -> dict[str, Any]:
        """The run's limits: the job's and task's, with the gateway added to an allowlist
        network (the only place the sandbox can reach, unless the job lists more)."""
        host, port = split_host_port(gateway_url.removeprefix("http://"))
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        allow = [str(a) for a in self.limits.get("allow") or []]
        network = self.limits.get("network")
        if network not in (None, NetworkPolicy.allowlist.value, NetworkPolicy.allowlist):
            raise ValueError(
                f"an agent's sandbox reaches the gateway through the allowlist proxy: limits.network must be "
                f"allowlist (or left out), not {network}"
            )
        return {**self.limits, "network": NetworkPolicy.allowlist.value, "allow": [*allow, target]}

    def run_action(self, *, gateway_url: str, episode_id: str, key: str, model: str) -> dict[str, Any]:
        """The sandbox action that runs the agent: its command in the workspace, with the
        episode's base URL and key (and the task) in its environment."""
        env = {
            "OPENAI_BASE_URL": base_url(gateway_url, episode_id),
            "OPENAI_API_KEY": key,
            "TEMPER_MODEL": model,
            "TEMPER_EPISODE_ID": episode_id,
            "TEMPER_TASK_ID": self.task.id,
            "TEMPER_TASK_PROMPT": self.task.prompt,
            "TEMPER_MAX_CALLS": str(self.max_turns),
        }
        return {
            "kind": "run_command",
            "command": self.agent.command,
            "env": env,
            "timeout_s": float(self.limits["wall_s"]),
        }

    def check_template(self, tok: ChatTokenizer) -> None:
        """What every agent with tools needs of the template, rendered at the door: a user
        turn with a tool schema, an assistant turn that calls it (OpenAI's ``tool_calls``
        with an id), the result as a tool message with its ``tool_call_id``, and the
        continuation that extends a sampled turn with that result. Raises
        :class:`~temper.policy.TemplateError` with the template's own error."""
        call = ToolCall("lookup", {"query": "x"}, call_id("probe", 0)).message(0)
        result = [{"role": "tool", "content": "probe result", "tool_call_id": call["id"], "name": "lookup"}]
        first = [{"role": "user", "content": self.task.prompt or "probe"}]
        tok.render_text(first, tools=[_PROBE_TOOL])
        tok.render_text(
            [*first, {"role": "assistant", "content": "", "tool_calls": [call]}, *result], tools=[_PROBE_TOOL]
        )
        tok.continuation([], result, tools=[_PROBE_TOOL])

    def submission(
        self, action: ParsedAction | None, *, final_text: str, snapshot_key: str | None, session_id: str
    ) -> dict[str, Any]:
        return {
            "kind": "agent",
            "answer": answer_of(final_text),
            "final_text": final_text,
            "snapshot_key": snapshot_key,
            "session_id": session_id,
        }
