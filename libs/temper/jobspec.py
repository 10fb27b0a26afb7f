"""The job spec: what a team submits to ``POST /v1/jobs`` (JSON or YAML).

Every field is documented in docs/job-spec.md; a bad spec is refused with the path of
the offending field (``schedule.iterations: Input should be greater than 0``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from temper import plugins
from temper.problems import field_path, message, yaml_problem


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Sampling(_Spec):
    temperature: float = Field(1.0, ge=0, le=5)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(128, ge=1, le=32768, description="tokens per model turn")
    stop: list[str] = []


class PolicySpec(_Spec):
    model: str = Field(description="policy model name, as the inference gateway's backends know it")
    backend_pool: str = Field("default", description="which gateway backend pool serves it")
    init: str | None = Field(
        None,
        description="initial weights: a local model directory, an object-store key, or another job's "
        "published version as job:<job id or handle>@v<N> (or @latest), resolved at submission",
    )
    sampling: Sampling = Sampling()

    @field_validator("init")
    @classmethod
    def _job_reference(cls, value: str | None) -> str | None:
        if value is not None and value.startswith(JOB_REF_PREFIX) and not JOB_REF.fullmatch(value):
            raise ValueError(
                "a job's version is named job:<job id or handle>@v<N> or job:<job id or handle>@latest"
            )
        return value


BEST_OF = 1
HANDLE_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,99}$"  # a job's handle (and the form of its id)
JOB_REF_PREFIX = "job:"
JOB_REF = re.compile(r"job:([a-z0-9][a-z0-9._-]{0,99})@(v[0-9]{1,9}|latest)")


def job_reference(init: str | None) -> tuple[str, int | None] | None:
    """``(job, version)`` of a ``job:<job>@v<N>`` init (version None for ``@latest``), else None."""
    match = JOB_REF.fullmatch(init or "")
    if match is None:
        return None
    job, version = match.groups()
    return job, None if version == "latest" else int(version[1:])


class Curriculum(StrEnum):
    uniform = "uniform"
    # prefer tasks whose pass rate in this job (and its prior_from_job) is strictly in (0, 1)
    learnable = "learnable"


class TaskSampling(_Spec):
    taskset: str = Field(
        "",
        max_length=200,
        description="task set id or name; an sft job given from_job instead gets the set made from that job's "
        "episodes here at submission",
    )
    group_size: int = Field(4, ge=1, le=256, description="samples per task: the GRPO group")
    curriculum: Curriculum = Curriculum.learnable
    seed: int = 0
    prior_from_job: str | None = Field(
        None,
        max_length=64,
        description="start the curriculum from this job's recorded pass rates (a job of yours on the same task set)",
    )
    from_job: str | None = Field(
        None,
        pattern=HANDLE_PATTERN,
        description="sft: a finished job of yours (id or handle) whose scored episodes are the data, made into a "
        "task set of conversations at submission (rejection sampling)",
    )
    best_of: int | None = Field(
        None,
        ge=1,
        le=1000,
        description=f"with from_job: each task's best N episodes by reward (default {BEST_OF})",
    )
    min_reward: float | None = Field(
        None, description="with from_job: only episodes whose reward is at least this (default: any reward)"
    )

    @model_validator(mode="after")
    def _data(self) -> TaskSampling:
        if self.from_job is None:
            if self.best_of is not None or self.min_reward is not None:
                raise ValueError(
                    "best_of and min_reward apply with from_job (an sft job on a job's episodes)"
                )
            if not self.taskset:
                raise ValueError("taskset: a task set id or name is required (or, for an sft job, from_job)")
        else:  # the task set made from the job's episodes is pinned in taskset at submission
            self.best_of = self.best_of or BEST_OF
        if self.min_reward is not None and not math.isfinite(self.min_reward):
            raise ValueError("min_reward must be a finite number")
        return self


class ActionFormat(StrEnum):
    """How the model's output is parsed into actions (the tool-call parser)."""

    code_block = "code_block"  # ```python ...``` / ```bash ...``` blocks
    tool_call = "tool_call"  # <tool>{"name": ..., "arguments": ...}</tool>
    hermes = "hermes"  # Hermes/Qwen: <tool_call>{"name": ..., "arguments": ...}</tool_call>, several per turn
    llama3_json = (
        "llama3_json"  # Llama 3: the turn is {"name": ..., "parameters": ...} (several joined by ";")
    )
    mistral = "mistral"  # Mistral: [TOOL_CALLS] [{"name": ..., "arguments": ...}, ...]
    pythonic = "pythonic"  # the turn is a Python list of calls: [f(a=1), g()] (Llama 3.2, Gemma 3)
    tool_code = "tool_code"  # Gemma: calls name(a=1) in ```tool_code blocks


class BuiltinTool(StrEnum):
    """What a declared tool does in the sandbox."""

    bash = "bash"  # {"command": str}
    python = "python"  # {"code": str}
    write_file = "write_file"  # {"path": str, "content": str}
    read_file = "read_file"  # {"path": str}
    submit = "submit"  # {"answer"?: str}: ends the episode


def _string_params(*names: str, optional: tuple[str, ...] = ()) -> dict[str, Any]:
    props = {n: {"type": "string"} for n in (*names, *optional)}
    return {"type": "object", "properties": props, "required": list(names)}


BUILTIN_TOOLS: dict[BuiltinTool, tuple[str, dict[str, Any]]] = {
    BuiltinTool.bash: ("Run a shell command in the workspace.", _string_params("command")),
    BuiltinTool.python: ("Run Python code; what it prints comes back.", _string_params("code")),
    BuiltinTool.write_file: ("Write a file in the workspace.", _string_params("path", "content")),
    BuiltinTool.read_file: ("Read a file of the workspace.", _string_params("path")),
    BuiltinTool.submit: (
        "Submit: end the episode (with the final answer, if any).",
        _string_params(optional=("answer",)),
    ),
}


TOOL_NAME = r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$"
JSON_SCHEMA_TYPES = frozenset({"object", "string", "integer", "number", "boolean", "array", "null"})


class ToolFunction(_Spec):
    name: str = Field(pattern=TOOL_NAME)
    description: str = ""
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="JSON schema of the arguments (an object schema)",
    )

    @model_validator(mode="after")
    def _object_schema(self) -> ToolFunction:
        if self.parameters.get("type", "object") != "object":
            raise ValueError("parameters must be a JSON schema of type object")
        for name, prop in (self.parameters.get("properties") or {}).items():
            kind = prop.get("type") if isinstance(prop, dict) else None
            if kind is not None and kind not in JSON_SCHEMA_TYPES:
                raise ValueError(f"parameters.properties.{name}.type {kind!r} is not a JSON schema type")
        return self


class ToolSpec(_Spec):
    """An OpenAI function schema bound to what it does: a built-in (``run``) or a shell
    ``command`` template whose ``{arg}`` placeholders are filled with shell-quoted arguments."""

    type: Literal["function"] = "function"
    function: ToolFunction
    run: BuiltinTool | None = Field(
        None, description="the built-in it runs; default: the one named like the tool"
    )
    command: str | None = Field(None, description="a shell command template, e.g. 'python grade.py {answer}'")

    @model_validator(mode="after")
    def _bound(self) -> ToolSpec:
        if self.run is not None and self.command is not None:
            raise ValueError("give run or command, not both")
        if self.run is None and self.command is None:
            name = self.function.name
            if name in BuiltinTool.__members__:
                self.run = BuiltinTool(name)
            elif name in plugins.installed(plugins.Group.tools):
                self._bind_plugin(name)
            else:
                raise ValueError(
                    f"tool {name!r} needs run (one of {', '.join(BuiltinTool)}) or a command template, "
                    f"or a temper.tools plugin of that name ({plugins.unknown_message(plugins.Group.tools, name)})"
                )
        if self.run is not None and not self.function.parameters.get("properties"):
            description, parameters = BUILTIN_TOOLS[self.run]
            self.function.parameters = parameters
            self.function.description = self.function.description or description
        if self.command is not None:
            props = set((self.function.parameters.get("properties") or {}).keys())
            for field in re.findall(r"{(\w+)}", self.command):
                if field not in props:
                    raise ValueError(
                        f"command placeholder {{{field}}} is not a parameter of {self.function.name!r}"
                    )
        return self

    def _bind_plugin(self, name: str) -> None:
        """Take what the ``temper.tools`` plugin ``name`` does (its ``run`` or ``command``),
        and its schema unless the spec gives one. The plugin is a ToolSpec or a mapping
        of one; the stored spec keeps the result, so it runs without the plugin's code."""
        try:
            obj = plugins.load(plugins.Group.tools, name)
        except plugins.PluginError as exc:
            raise ValueError(str(exc)) from None
        if isinstance(obj, dict) and obj.get("run") is None and obj.get("command") is None:
            raise ValueError(f"the temper.tools plugin {name!r} gives neither run nor command")
        try:
            bound = obj if isinstance(obj, ToolSpec) else ToolSpec.model_validate(obj)
        except ValidationError as exc:
            raise ValueError(
                f"the temper.tools plugin {name!r} is not a tool: {exc.errors()[0]['msg']}"
            ) from None
        self.run, self.command = bound.run, bound.command
        if not self.function.parameters.get("properties"):
            self.function.parameters = bound.function.parameters
        self.function.description = self.function.description or bound.function.description

    def openai_schema(self) -> dict[str, Any]:
        """The OpenAI function schema the chat template renders."""
        return {"type": "function", "function": self.function.model_dump()}


PACKAGE_KIND = "package"  # a tenant environment package (temper.envpkg), named by name and version
AGENT_KIND = "agent"  # a user's agent program in the sandbox, calling the policy through the gateway
AGENT_FILES_BYTES = 256 << 10
_AGENT_PATH = re.compile(r"^(?!/)(?!.*\.\.)[A-Za-z0-9_./-]{1,200}$")


class AgentSpec(_Spec):
    """What an agent episode runs (``environment.kind: agent``, docs/agents.md): the user's
    program, in the episode's sandbox, calling the policy through the episode's own
    OpenAI-compatible base URL (``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` in its environment)."""

    command: str = Field(
        min_length=1,
        max_length=4000,
        description="the shell command that runs the agent in the workspace; its last line of output is the "
        "episode's answer",
    )
    files: dict[str, str] = Field(
        default_factory=dict,
        description="workspace path -> text: the agent's own files, written over the task's (256 KiB in all)",
    )

    @field_validator("files")
    @classmethod
    def _safe_files(cls, files: dict[str, str]) -> dict[str, str]:
        for path in files:
            if not _AGENT_PATH.match(path):
                raise ValueError(
                    f"file {path[:80]!r}: a relative path inside the workspace (letters, digits, ._/-)"
                )
        size = sum(len(p.encode()) + len(t.encode()) for p, t in files.items())
        if size > AGENT_FILES_BYTES:
            raise ValueError(f"the agent's files are {size} bytes; at most {AGENT_FILES_BYTES}")
        return files


LISTING_KINDS = frozenset({"code", "shell"})  # their first prompt lists the workspace's files


class EnvironmentSpec(_Spec):
    kind: str = Field(
        "code",
        description="code | math | shell, an environment an operator installed (temper.environments), "
        "package: a tenant environment package named by name and version, or agent: a program of "
        "yours that calls the policy through an OpenAI-compatible base URL (environment.agent)",
    )
    name: str | None = Field(None, max_length=64, description="package: the package's name")
    version: str | None = Field(None, max_length=32, description="package: the package's version")
    package: dict[str, Any] | None = Field(
        None,
        description="package: what the job runs, pinned from the package by the server when the job is "
        "submitted (anything sent here is replaced)",
    )
    max_turns: int = Field(
        4, ge=1, le=100, description="turns of an episode; kind agent: the model calls one agent run may make"
    )
    agent: AgentSpec | None = Field(None, description="kind agent: the program the episode runs")
    max_episode_s: float | None = Field(
        None,
        gt=0,
        le=7 * 24 * 3600,
        description="an episode's wall-clock budget from its start; reached, the episode ends and is scored "
        "with what it left (ended_by: max_episode_s); its sandbox session lives at least that long",
    )
    max_episode_tokens: int | None = Field(
        None,
        ge=1,
        description="tokens the model may sample over all of an episode's turns (each turn's max_tokens is "
        "at most what is left); spent, the episode ends and is scored (ended_by: max_episode_tokens)",
    )
    action_format: str = Field(
        ActionFormat.code_block.value,
        description="code_block | tool_call, or a tool-call parser (hermes, llama3_json, mistral, pythonic, "
        "tool_code, or a temper.parsers plugin)",
    )
    limits: dict[str, Any] = Field(default_factory=dict, description="sandbox limits (see docs/sandbox.md)")
    system_prompt: str | None = Field(
        None, description="replaces the environment's instructions; an empty string sends no system message"
    )
    tools: list[ToolSpec] | None = Field(
        None,
        description="tools passed to the chat template (function-calling formats); default: the environment's own",
    )
    tool_role: Literal["tool", "user"] | None = Field(
        None,
        description="the role of the messages that carry tool results: tool (OpenAI's, with tool_call_id), or "
        "user for chat templates without a tool role (Gemma 3); default: the environment's own (tool)",
    )
    tools_in_prompt: Literal["full", "names"] | None = Field(
        None,
        description="function-calling formats: what the chat template is given of each tool: full (its OpenAI "
        "schema: name, description, parameters) or names (the name only: a much shorter prompt, for a policy "
        "that learned the tools' arguments elsewhere, e.g. in a warm start); default full",
    )
    hide_files: list[str] = Field(
        default_factory=list,
        max_length=32,
        description="code and shell: glob patterns (fnmatch) of workspace files the first prompt names "
        "without their content (the agent runs or reads them); the others are shown whole",
    )

    @model_validator(mode="after")
    def _unique_tools(self) -> EnvironmentSpec:
        if self.kind == PACKAGE_KIND and not (self.name and self.version):
            raise ValueError("kind package needs the package's name and version")
        if self.kind != PACKAGE_KIND and (self.name or self.version or self.package):
            raise ValueError("name, version and package apply to kind package only")
        if self.hide_files and self.kind not in LISTING_KINDS:
            raise ValueError(
                f"hide_files applies to the environments that show the workspace in their prompt "
                f"({', '.join(sorted(LISTING_KINDS))}), not {self.kind!r}"
            )
        if self.tools_in_prompt is not None and self.action_format in OWN_FORMATS:
            raise ValueError(
                f"tools_in_prompt applies to function-calling formats (the chat template renders the tools); "
                f"action_format {self.action_format} describes them in the environment's own instructions"
            )
        if self.kind == AGENT_KIND:
            self._agent_consistent()
        elif self.agent is not None:
            raise ValueError("agent applies to kind agent only")
        names = [t.function.name for t in self.tools or []]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"tools: duplicate names {dupes}")
        return self

    def _agent_consistent(self) -> None:
        """Kind agent: a program to run; the messages and tools are the agent's own, and
        ``action_format`` names the parser the gateway reads the model's tool calls with."""
        if self.agent is None:
            raise ValueError("kind agent needs agent.command (the program the episode runs)")
        given = [
            n
            for n in ("system_prompt", "tools", "tool_role", "tools_in_prompt")
            if getattr(self, n) is not None
        ]
        if given:
            raise ValueError(
                f"{', '.join(given)}: not with kind agent (the agent sends its own messages and tools)"
            )
        budgets = [n for n in ("max_episode_s", "max_episode_tokens") if getattr(self, n) is not None]
        if budgets:
            raise ValueError(
                f"{', '.join(budgets)}: not with kind agent (its run is bounded by limits.wall_s and max_turns)"
            )
        if self.action_format in (ActionFormat.code_block.value, ActionFormat.tool_call.value):
            raise ValueError(
                "kind agent: action_format names the tool-call parser the gateway reads the model's replies "
                "with (hermes, llama3_json, mistral, pythonic, tool_code, qwen3_coder or a temper.parsers "
                f"plugin), not {self.action_format}"
            )


class Algorithm(StrEnum):
    """A preset of the objective's parts (docs/training.md, "Presets")."""

    grpo = "grpo"
    dr_grpo = "dr_grpo"
    dapo = "dapo"
    rloo = "rloo"
    sft = "sft"  # supervised fine-tuning on conversations: no rollouts, no rewards
    dpo = "dpo"  # direct preference optimisation on (chosen, rejected) pairs: no rollouts
    reward_model = "reward_model"  # a sequence-classification reward model, Bradley-Terry on pairs


RL_ALGORITHMS = frozenset({Algorithm.grpo, Algorithm.dr_grpo, Algorithm.dapo, Algorithm.rloo})
# Jobs that learn from a task set's data as it is, without episodes: the trainer steps
# through it (services.trainer.supervised); the task kind each one trains on.
OFFLINE_DATA = {Algorithm.sft: "chat", Algorithm.dpo: "preference", Algorithm.reward_model: "preference"}


class Advantage(StrEnum):
    group_norm = "group_norm"  # (r - mean) / (std + eps): GRPO, DAPO
    group_mean = "group_mean"  # r - mean: Dr. GRPO
    leave_one_out = "leave_one_out"  # r - mean of the others: RLOO


class Aggregation(StrEnum):
    token_mean = "token_mean"  # every model token of the batch weighs the same
    seq_mean = "seq_mean"  # mean over each sequence's tokens, then over sequences
    seq_sum = "seq_sum"  # sum over each sequence's tokens / loss_constant, mean over sequences


class KLEstimator(StrEnum):
    none = "none"
    k1 = "k1"  # log pi_theta - log pi_ref
    k3 = "k3"  # exp(log pi_ref - log pi_theta) - (log pi_ref - log pi_theta) - 1


class Overlong(StrEnum):
    keep = "keep"  # trained like any other response
    filter = "filter"  # responses of overlong_max_tokens model tokens or more carry no loss
    penalty = "penalty"  # reward minus a penalty growing linearly over the last overlong_buffer tokens


class Precision(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"  # bf16 autocast on CUDA; weights, gradients and AdamW state stay fp32


# What each preset sets; a field given explicitly in the spec wins over its preset.
PRESETS: dict[Algorithm, dict[str, Any]] = {
    Algorithm.grpo: {"advantage": Advantage.group_norm, "aggregation": Aggregation.token_mean,
                     "overlong": Overlong.keep},
    Algorithm.dr_grpo: {"advantage": Advantage.group_mean, "aggregation": Aggregation.seq_sum,
                        "overlong": Overlong.keep},
    Algorithm.dapo: {"advantage": Advantage.group_norm, "aggregation": Aggregation.token_mean,
                     "clip_eps_high": 0.28, "overlong": Overlong.penalty},
    Algorithm.rloo: {"advantage": Advantage.leave_one_out, "aggregation": Aggregation.token_mean,
                     "overlong": Overlong.keep},
    Algorithm.sft: {},
    Algorithm.dpo: {},
    Algorithm.reward_model: {},
}  # fmt: skip
REFUSED_ALGORITHMS = {
    "ppo": "ppo needs a value model, which Temper does not train",
}
SFT_BATCH_SIZE = 8
DPO_BETA = 0.1

# What a job without episodes (sft, dpo, reward_model) has no use for (it runs no episodes
# and scores nothing), as spec paths. Given in such a spec, each is refused; at the door
# (the raw document) even at its default.
RL_ONLY_FIELDS: dict[str, tuple[str, ...]] = {
    "policy": ("sampling",),
    "tasks": ("group_size", "curriculum", "prior_from_job"),
    "algorithm": (
        "advantage", "aggregation", "loss_constant", "clip_eps", "clip_eps_high", "kl_coef",
        "kl_estimator", "entropy_coef", "overlong", "overlong_max_tokens", "overlong_buffer",
        "groups_per_step", "skip_zero_variance", "dynamic_sampling", "max_replacement_groups",
        "mismatch", "correction",
    ),
    "schedule": ("episodes_per_iteration", "max_concurrent_episodes", "max_staleness", "partial_rollouts"),
}  # fmt: skip
RL_ONLY_TOP = ("environment", "rewards", "evaluation")
SFT_REFUSAL = "applies to RL jobs only; an sft, dpo or reward_model job runs no episodes (leave it out)"


def rl_only_errors(data: Any) -> list[tuple[str, str]]:
    """The RL-only fields a spec document of a job without episodes names (the raw mapping,
    before defaults)."""
    if not isinstance(data, dict):
        return []
    algorithm = data.get("algorithm")
    if not isinstance(algorithm, dict) or algorithm.get("name") not in [a.value for a in OFFLINE_DATA]:
        return []
    errors = [(name, SFT_REFUSAL) for name in RL_ONLY_TOP if name in data]
    for section, names in RL_ONLY_FIELDS.items():
        given = data.get(section)
        if isinstance(given, dict):
            errors += [(f"{section}.{n}", SFT_REFUSAL) for n in names if n in given]
    return errors


# The default LoRA targets: every decoder projection under the names of both layouts,
# separate (Llama, Qwen, Mistral, Gemma) and fused (Phi-3: q, k and v in qkv_proj; gate
# and up in gate_up_proj); a model gets those of them it has (temper.training.lora).
DEFAULT_LORA_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "qkv_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "gate_up_proj",
    "down_proj",
)


class LoraSpec(_Spec):
    """LoRA adapters instead of full weights (PEFT). Absent: the trainer updates every weight."""

    rank: int = Field(16, ge=1, le=1024, description="adapter rank r")
    alpha: float = Field(32.0, gt=0, description="scaling numerator: updates are scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input")
    target_modules: list[str] | None = Field(
        None,
        min_length=1,
        description="names of the linear layers that get an adapter (suffixes of module names); default: "
        "every attention and MLP projection the model has, separate (q_proj, k_proj, v_proj, o_proj, "
        "gate_proj, up_proj, down_proj) or fused (Phi-3's qkv_proj, gate_up_proj)",
    )

    @model_validator(mode="after")
    def _names(self) -> LoraSpec:
        if self.target_modules is None:
            return self
        bad = [m for m in self.target_modules if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", m)]
        if bad:
            raise ValueError(f"target_modules: not module names: {bad}")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError("target_modules: names repeat")
        return self


class OnMismatch(StrEnum):
    flag = "flag"  # train on, record the mismatch and give the job a reason
    skip = "skip"  # refuse the batch: no optimizer step, its groups are skipped with the reason
    halt = "halt"  # refuse the batch and pause the job (resumed over the API)


class MismatchSpec(_Spec):
    """The logprob canary (``temper.training.canary``): on the first step after a version,
    each token that version sampled is recomputed by the trainer and compared with the
    logprob the engine reported."""

    tolerance: float = Field(
        1e-4,
        gt=0,
        description="per-token |Δ logprob| counted as a mismatch (fp32 engines measure ≤ 7.6e-6; "
        "bf16 vLLM up to 0.38: set e.g. 0.5 there)",
    )
    max_share: float = Field(
        0.01, ge=0, lt=1, description="a batch fails when more of its checked tokens than this share mismatch"
    )
    on_mismatch: OnMismatch = Field(OnMismatch.flag, description="what a failed batch does")


class Correction(StrEnum):
    none = "none"
    tis = "tis"  # truncated importance sampling: each token's loss times min(rho, cap)
    mis = "mis"  # masked importance sampling: times rho where rho <= cap, else no loss


class CorrectionLevel(StrEnum):
    token = "token"  # rho of each token
    sequence = "sequence"  # rho of the whole response (the product over its tokens)


class CorrectionSpec(_Spec):
    """Train/inference mismatch correction (docs/training.md): ``rho`` is the trainer's
    probability of a sampled token (at the weights before this step) over the engine's;
    with a correction on, the clipped ratio is taken against the trainer's probability and
    the engine's enters only through ``rho``."""

    kind: Correction = Field(
        Correction.none, description="none, tis (truncate rho at cap) or mis (mask past cap)"
    )
    level: CorrectionLevel = Field(CorrectionLevel.token, description="rho per token or per response")
    cap: float = Field(2.0, gt=1, le=1000, description="the bound on rho")


class AlgorithmSpec(_Spec):
    name: Algorithm = Field(Algorithm.grpo, description="a preset of the parts below")
    learning_rate: float = Field(1e-4, gt=0, le=1)
    advantage: Advantage | None = Field(None, description="default: the preset's")
    aggregation: Aggregation | None = Field(None, description="default: the preset's")
    loss_constant: int | None = Field(
        None,
        ge=1,
        description="divisor of seq_sum; default: policy.sampling.max_tokens x environment.max_turns",
    )
    clip_eps: float = Field(0.2, gt=0, le=1, description="lower clip bound: ratio >= 1 - clip_eps")
    clip_eps_high: float | None = Field(
        None,
        gt=0,
        le=10,
        description="upper clip bound: ratio <= 1 + clip_eps_high; default: the preset's, else clip_eps",
    )
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: KLEstimator = KLEstimator.k3
    entropy_coef: float = Field(0.0, ge=0, description="weight of the entropy bonus")
    overlong: Overlong | None = Field(None, description="default: the preset's")
    overlong_max_tokens: int | None = Field(
        None,
        ge=1,
        description="model tokens of a full-length response; default: policy.sampling.max_tokens x environment.max_turns",
    )
    overlong_buffer: int | None = Field(
        None,
        ge=1,
        description="the band before overlong_max_tokens where the penalty grows; default: a fifth of it",
    )
    max_grad_norm: float = Field(1.0, gt=0)
    groups_per_step: int = Field(4, ge=1, description="groups in one optimizer batch")
    batch_size: int | None = Field(
        None,
        ge=1,
        le=4096,
        description=f"sft, dpo, reward_model: conversations (pairs) in one optimizer batch; default {SFT_BATCH_SIZE}",
    )
    beta: float | None = Field(
        None,
        gt=0,
        le=100,
        description=f"dpo: the temperature of the DPO loss (how far the policy may move from its reference); "
        f"default {DPO_BETA}",
    )
    checkpoint_every: int = Field(
        1, ge=1, description="optimizer steps between checkpoints / policy versions"
    )
    skip_zero_variance: bool = True
    dynamic_sampling: bool = Field(
        False,
        description="start a fresh group (drawn by the curriculum) for each zero-variance group the trainer skips",
    )
    max_replacement_groups: int = Field(
        8,
        ge=0,
        description="with dynamic_sampling: replacement groups started per iteration at most; "
        "past it, skipped groups stay unreplaced (counted) and the job goes on",
    )
    max_tokens_per_microbatch: int | None = Field(
        None,
        ge=64,
        description="padded tokens per forward/backward; default: TEMPER_TRAINER__MICRO_BATCH_TOKENS",
    )
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass")
    precision: Precision | None = Field(None, description="default: TEMPER_TRAINER__BF16")
    lora: LoraSpec | None = Field(None, description="train a LoRA adapter; absent: full weights")
    mismatch: MismatchSpec = Field(default_factory=MismatchSpec, description="the logprob canary")
    correction: CorrectionSpec = Field(
        default_factory=CorrectionSpec, description="train/inference mismatch correction (TIS, MIS)"
    )

    @field_validator("name", mode="before")
    @classmethod
    def _refused(cls, value: Any) -> Any:
        if isinstance(value, str) and value in REFUSED_ALGORITHMS:
            allowed = ", ".join(a.value for a in Algorithm)
            raise ValueError(f"{REFUSED_ALGORITHMS[value]}; allowed: {allowed}")
        return value

    @model_validator(mode="after")
    def _preset(self) -> AlgorithmSpec:
        if self.beta is not None and self.name is not Algorithm.dpo:
            raise ValueError("beta applies to dpo only")
        if self.name in OFFLINE_DATA:
            self.batch_size = self.batch_size or SFT_BATCH_SIZE
            if self.name is Algorithm.dpo:
                self.beta = self.beta or DPO_BETA
            if self.name is Algorithm.reward_model and self.lora is not None:
                raise ValueError(
                    "lora: a reward_model job trains full weights (LoRA reward models are not built)"
                )
            return self
        if self.batch_size is not None:
            raise ValueError(
                "batch_size applies to sft, dpo and reward_model only; an RL step takes groups_per_step groups"
            )
        for name, value in PRESETS[self.name].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.clip_eps_high is None:
            self.clip_eps_high = self.clip_eps
        if self.kl_coef > 0 and self.kl_estimator is KLEstimator.none:
            raise ValueError("kl_coef > 0 needs a kl_estimator (k1 or k3)")
        if self.dynamic_sampling and not self.skip_zero_variance:
            # replacements answer the trainer's zero-variance skips; without skips there are none
            raise ValueError(
                "dynamic_sampling needs skip_zero_variance: true (it replaces the skipped groups)"
            )
        if (
            self.overlong_max_tokens
            and self.overlong_buffer
            and self.overlong_buffer > self.overlong_max_tokens
        ):
            raise ValueError("overlong_buffer must not exceed overlong_max_tokens")
        return self


class Schedule(_Spec):
    iterations: int = Field(
        10,
        ge=1,
        le=100000,
        description="RL: iterations of episodes; sft, dpo, reward_model: epochs (passes over the data)",
    )
    episodes_per_iteration: int = Field(16, ge=1)
    max_concurrent_episodes: int = Field(16, ge=1)
    max_staleness: int = Field(
        1,
        ge=0,
        description="how many policy versions behind the trainer a trajectory's oldest token may be",
    )
    partial_rollouts: bool = Field(
        False,
        description="a generation in progress when the job's next version is loaded is interrupted and "
        "resumed with its prefix on that version (CPU engine; docs/training.md, Partial rollouts)",
    )


class MlflowTracking(_Spec):
    """Where the job's run goes on an MLflow tracking server (its REST API)."""

    uri: str = Field(max_length=500, description="the tracking server, http(s)://host[:port][/prefix]")
    experiment: str = Field("temper", min_length=1, max_length=250, description="created when missing")

    @field_validator("uri")
    @classmethod
    def _http_uri(cls, value: str) -> str:
        parsed = urlsplit(value)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(
                "must be an http:// or https:// URL with a host (the tracking server's REST API)"
            )
        if parsed.username or parsed.password:
            raise ValueError("must not carry credentials (they would be stored with the spec)")
        if parsed.query or parsed.fragment:
            raise ValueError("must not have a query or fragment")
        try:
            parsed.port  # noqa: B018 - raises on a bad port
        except ValueError:
            raise ValueError("has an invalid port") from None
        return value.rstrip("/")


class WandbMode(StrEnum):
    # online needs wandb.ai, which no test here can reach: it is refused rather than untested
    offline = "offline"


class WandbTracking(_Spec):
    """A W&B run written offline (a ``.wandb`` file under TEMPER_TRACKING__WANDB_DIR; ``wandb
    sync`` uploads it)."""

    project: str = Field(
        min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="the W&B project the run is synced to",
    )  # fmt: skip
    mode: WandbMode = WandbMode.offline

    @field_validator("mode", mode="before")
    @classmethod
    def _offline_only(cls, value: Any) -> Any:
        if value != WandbMode.offline.value:
            raise ValueError(
                f"only 'offline' is supported (got {value!r}): the run is written to a .wandb file that "
                "`wandb sync` uploads; logging to a W&B server directly is not built"
            )
        return value


class Tracking(_Spec):
    """Experiment tracking: each named system gets the job's params, metrics and state."""

    mlflow: MlflowTracking | None = None
    wandb: WandbTracking | None = None


class Split(StrEnum):
    """Which tasks of a task set (docs/tasks-and-rewards.md, "Held-out tasks"): training jobs
    draw from ``train`` only; an evaluation names its part."""

    train = "train"
    held_out = "held_out"
    all = "all"


DEFAULT_PASS_RULE = "default"  # temper.rewards.passed: the verdict of every training pass rate
REWARD_PASS_RULE = "reward"
LABEL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class EvalRule(_Spec):
    """How an evaluation samples and judges each task: ``samples`` episodes per task, pass@k
    for each ``k`` of ``pass_at`` (every k <= samples), and what "passed" means."""

    samples: int = Field(1, ge=1, le=256, description="episodes per task")
    pass_at: list[int] = Field(
        default_factory=lambda: [1], min_length=1, max_length=16, description="the k of each pass@k"
    )
    passed_by: str = Field(
        DEFAULT_PASS_RULE,
        max_length=200,
        description="default (tests_passed, else answer_match, else reward >= 1), reward (the scalar reward), "
        "or one of the job's reward components; with reward or a component, passed means >= pass_threshold",
    )
    pass_threshold: float | None = Field(
        None, ge=-1e9, le=1e9, description="with passed_by reward or a component; default 1.0"
    )

    @model_validator(mode="after")
    def _rule(self) -> EvalRule:
        ks = self.pass_at
        if any(k < 1 for k in ks):
            raise ValueError("pass_at: every k is at least 1")
        if len(set(ks)) != len(ks):
            raise ValueError(f"pass_at: {ks} repeats a k")
        over = [k for k in ks if k > self.samples]
        if over:
            raise ValueError(
                f"pass_at: k={over[0]} exceeds samples ({self.samples}): pass@k needs at least k samples "
                "per task (raise samples or lower k)"
            )
        self.pass_at = sorted(ks)
        if self.passed_by == DEFAULT_PASS_RULE:
            if self.pass_threshold is not None:
                raise ValueError(
                    "pass_threshold applies with passed_by reward or a reward component (the default rule "
                    "has its own verdict)"
                )
        elif self.pass_threshold is None:
            self.pass_threshold = 1.0
        return self


class EvaluationSpec(EvalRule):
    """A training job's periodic evaluation: every ``every_versions``-th policy version (0
    included) is evaluated by a job of its own (docs/job-spec.md, "evaluation")."""

    every_versions: int = Field(ge=1, le=100000, description="evaluate versions 0, N, 2N, ...")
    taskset: str | None = Field(
        None, max_length=200, description="a task set of yours, by id or name; default: tasks.taskset"
    )
    split: Split | None = Field(
        None,
        description="held_out | train | all; default: held_out of the job's own task set, all of another",
    )
    sampling: Sampling | None = Field(None, description="default: policy.sampling")
    max_concurrent_episodes: int | None = Field(
        None,
        ge=1,
        description="episodes of one evaluation in flight; default: schedule.max_concurrent_episodes",
    )
    backend_pool: str | None = Field(
        None,
        max_length=200,
        description="the gateway pool that serves the evaluations; default: policy.backend_pool",
    )
    label: str = Field(
        "eval", pattern=LABEL_PATTERN, description="the name its results are logged under (eval/pass@1, ...)"
    )


class EvaluateSpec(EvalRule):
    """What an evaluation job evaluates (its own spec carries it; created by a training job's
    ``evaluation`` or by ``POST /v1/jobs/{id}/evaluations``, never submitted as a job): version
    ``version`` of job ``job``, or the model directory ``model`` with that job's environment."""

    job: str = Field(max_length=64, description="the job whose version (or whose environment) is evaluated")
    version: int | None = Field(None, ge=0, description="the version evaluated; None with model")
    model: str | None = Field(None, max_length=4096, description="a model directory evaluated instead")
    split: Split = Split.all
    label: str = Field("eval", pattern=LABEL_PATTERN)
    periodic: bool = Field(False, description="started by the job's evaluation (else on request)")

    @model_validator(mode="after")
    def _one_model(self) -> EvaluateSpec:
        if (self.version is None) == (self.model is None):
            raise ValueError("an evaluation names a version or a model directory, one of the two")
        return self


TAG_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/=-]{0,63}$"


class JobSpec(_Spec):
    name: str = Field(min_length=1, max_length=200, description="free text: several jobs may share it")
    handle: str | None = Field(
        None,
        pattern=HANDLE_PATTERN,
        description="a name for this job unique in its tenant, usable wherever its id is (lowercase letters, "
        "digits, '.', '_', '-'; not starting with 'job-')",
    )
    tags: list[Annotated[str, Field(pattern=TAG_PATTERN)]] = Field(
        default_factory=list, max_length=20, description="labels to find jobs by (GET /v1/jobs?tag=)"
    )
    note: str | None = Field(None, max_length=4000, description="a note for people; changed with PATCH")
    policy: PolicySpec
    tasks: TaskSampling
    environment: EnvironmentSpec = EnvironmentSpec()
    rewards: dict[str, float | dict[str, Any]] = Field(
        default_factory=lambda: dict[str, float | dict[str, Any]]({"tests_passed": 1.0}),
        description="reward component -> weight, or -> {weight: ..., <the component's settings>}; the scalar "
        "reward is the weighted sum",
    )
    algorithm: AlgorithmSpec = AlgorithmSpec()
    schedule: Schedule = Schedule()
    tracking: Tracking = Field(default_factory=Tracking, description="experiment tracking (docs/tracking.md)")
    evaluation: EvaluationSpec | None = Field(
        None, description="evaluate every N-th policy version on a task set or a split of one"
    )
    evaluate: EvaluateSpec | None = Field(
        None, description="(an evaluation job's own) what it evaluates; set by the server, never submitted"
    )

    @field_validator("rewards")
    @classmethod
    def _reward_entries(cls, value: dict[str, float | dict[str, Any]]) -> dict[str, float | dict[str, Any]]:
        """A component's entry is its weight, or a mapping with ``weight`` and its settings
        (each component checks its own: :func:`plugin_errors`)."""
        for name, entry in value.items():
            if isinstance(entry, dict):
                weight = entry.get("weight")
                if "weight" not in entry:
                    raise ValueError(
                        f"{name}: a component given with settings needs its weight: {{weight: ...}}"
                    )
                if (
                    isinstance(weight, bool)
                    or not isinstance(weight, int | float)
                    or not math.isfinite(weight)
                ):
                    raise ValueError(f"{name}.weight: a finite number, not {weight!r}")
                entry["weight"] = float(weight)
            elif not math.isfinite(entry):
                raise ValueError(f"{name}: a finite weight, not {entry!r}")
        return value

    @field_validator("handle")
    @classmethod
    def _not_an_id(cls, value: str | None) -> str | None:
        if value is not None and value.startswith("job-"):
            raise ValueError("a handle must not start with 'job-' (job ids do)")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if self.tasks.from_job is not None and not self.is_sft:
            raise ValueError(
                "tasks.from_job: a job's episodes are data for sft jobs (algorithm.name: sft), "
                f"not {self.algorithm.name}"
            )
        if self.is_offline:
            return self._sft_consistent()
        if self.schedule.episodes_per_iteration % self.tasks.group_size:
            raise ValueError(
                f"schedule.episodes_per_iteration ({self.schedule.episodes_per_iteration}) must be a multiple "
                f"of tasks.group_size ({self.tasks.group_size})"
            )
        if not self.rewards:
            raise ValueError("rewards: name at least one reward component")
        if self.evaluation is not None and self.evaluate is not None:
            raise ValueError(
                "evaluation and evaluate: an evaluation job evaluates; it has no evaluation of its own"
            )
        for where, rule in (("evaluation", self.evaluation), ("evaluate", self.evaluate)):
            if rule is not None and rule.passed_by not in (
                DEFAULT_PASS_RULE,
                REWARD_PASS_RULE,
                *self.rewards,
            ):
                raise ValueError(
                    f"{where}.passed_by: {rule.passed_by!r} is not default, reward or one of the job's rewards "
                    f"({', '.join(sorted(self.rewards))})"
                )
        if self.evaluation is not None and self.evaluation.split is None:
            own = self.evaluation.taskset in (None, self.tasks.taskset)
            self.evaluation.split = Split.held_out if own else Split.all
        a = self.algorithm
        longest = self.policy.sampling.max_tokens * self.environment.max_turns
        if a.aggregation is Aggregation.seq_sum and a.loss_constant is None:
            a.loss_constant = longest
        if a.overlong is not Overlong.keep:
            a.overlong_max_tokens = a.overlong_max_tokens or longest
            a.overlong_buffer = a.overlong_buffer or max(1, a.overlong_max_tokens // 5)
            if a.overlong_buffer > a.overlong_max_tokens:
                raise ValueError("algorithm.overlong_buffer must not exceed algorithm.overlong_max_tokens")
        return self

    def _sft_consistent(self) -> JobSpec:
        """A spec without episodes (sft, dpo, reward_model) that sets an RL-only field to anything but its default is refused
        (a stored spec holds every default, so only a changed value can be told apart here;
        the door refuses the field at its default too: :func:`rl_only_errors`)."""
        errors = []
        for section, names in RL_ONLY_FIELDS.items():
            given = getattr(self, section)
            for name in names:
                field = type(given).model_fields[name]
                if getattr(given, name) != field.get_default(call_default_factory=True):
                    errors.append(f"{section}.{name}")
        if self.environment != EnvironmentSpec():
            errors.append("environment")
        if self.rewards != JobSpec.model_fields["rewards"].get_default(call_default_factory=True):
            errors.append("rewards")
        if self.evaluation is not None or self.evaluate is not None:
            # an episode needs an environment and rewards, which an sft spec has none of
            errors.append("evaluation" if self.evaluation is not None else "evaluate")
        if errors:
            raise ValueError(f"{', '.join(errors)}: {SFT_REFUSAL}")
        return self

    def reward_weights(self) -> dict[str, float]:
        """Component -> weight (:func:`reward_weights` of ``rewards``)."""
        return reward_weights(self.rewards)

    def reward_settings(self) -> dict[str, dict[str, Any]]:
        """Component -> its settings, for the components given with some."""
        return reward_settings(self.rewards)

    @property
    def is_sft(self) -> bool:
        return self.algorithm.name is Algorithm.sft

    @property
    def is_offline(self) -> bool:
        """A job without episodes (sft, dpo, reward_model): the trainer steps through its
        task set's data; :meth:`sft_steps` and :meth:`sft_batch` say which item when."""
        return self.algorithm.name in OFFLINE_DATA

    @property
    def data_kind(self) -> str | None:
        """The task kind a job without episodes trains on (chat, preference); None for RL."""
        return OFFLINE_DATA.get(self.algorithm.name)

    def sft_steps(self, conversations: int) -> tuple[int, int]:
        """(optimizer steps per epoch, steps in all) of an sft job on ``conversations``:
        each epoch is every conversation once, in batches of ``algorithm.batch_size`` (the
        last one of an epoch may be smaller); ``schedule.iterations`` epochs."""
        per_epoch = -(-conversations // (self.algorithm.batch_size or SFT_BATCH_SIZE))
        return per_epoch, per_epoch * self.schedule.iterations

    def sft_batch(self, conversations: int, step: int) -> list[int]:
        """The conversations (indices, in id order) of sft step ``step`` (0-based): a
        function of the seed, the epoch and the step alone, so a trainer that restarts from
        a version trains on exactly the batches after it."""
        import random

        per_epoch, _ = self.sft_steps(conversations)
        epoch, k = divmod(step, per_epoch)
        order = list(range(conversations))
        random.Random(f"{self.tasks.seed}:{epoch}").shuffle(order)
        size = self.algorithm.batch_size or SFT_BATCH_SIZE
        return order[k * size : (k + 1) * size]


def reward_weights(rewards: Mapping[str, Any]) -> dict[str, float]:
    """Each component's weight in a spec's ``rewards`` (stored or parsed): the number
    itself, or the ``weight`` of a component given with settings."""
    return {name: float(e["weight"] if isinstance(e, Mapping) else e) for name, e in rewards.items()}


def reward_settings(rewards: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The settings of each component given as ``{weight: ..., ...}`` (without the weight)."""
    return {
        name: {k: v for k, v in e.items() if k != "weight"}
        for name, e in rewards.items()
        if isinstance(e, Mapping)
    }


class SpecError(ValueError):
    """A spec that does not validate; ``errors`` lists (field path, message)."""

    def __init__(self, errors: list[tuple[str, str]]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"{path}: {msg}" for path, msg in errors))


OWN_FORMATS = (ActionFormat.code_block.value, ActionFormat.tool_call.value)


def plugin_errors(spec: JobSpec) -> list[tuple[str, str]]:
    """(field path, message) for each name in ``spec`` that no installed plugin (Temper's
    own included) implements: the environment kind, the action format's parser and the
    reward components. Checked wherever a spec comes in (``parse_spec``, and at the door
    of ``POST /v1/jobs``), so an unimplemented value is refused, never accepted and
    failing later."""
    errors: list[tuple[str, str]] = []
    if spec.is_offline:  # no environment, parser or reward runs
        return errors
    env = spec.environment
    if env.kind == PACKAGE_KIND:  # the package's own names are checked when it is uploaded and pinned
        return errors
    if env.kind not in plugins.installed(plugins.Group.environments):
        errors.append(("environment.kind", plugins.unknown_message(plugins.Group.environments, env.kind)))
    fmt = env.action_format
    if fmt not in OWN_FORMATS and fmt not in plugins.installed(plugins.Group.parsers):
        message = plugins.unknown_message(plugins.Group.parsers, fmt, also=OWN_FORMATS)
        errors.append(("environment.action_format", message))
    rewards = plugins.installed(plugins.Group.rewards)
    settings = spec.reward_settings()
    for name in spec.rewards:
        if name not in rewards:
            errors.append((f"rewards.{name[:80]}", plugins.unknown_message(plugins.Group.rewards, name)))
        else:  # a component whose settings are required is refused without them too
            errors += _settings_errors(name, settings.get(name, {}))
    return errors


EVALUATE_REFUSAL = (
    "is set by the server on an evaluation job; evaluate a version with POST /v1/jobs/{id}/evaluations "
    "(temper eval), or give a training job an evaluation section"
)


def submitted_errors(spec: JobSpec) -> list[tuple[str, str]]:
    """What a submitted spec may not carry: an evaluation job's ``evaluate`` (the server makes
    those jobs, with the version's checkpoint and the task count it checked)."""
    return [("evaluate", EVALUATE_REFUSAL)] if spec.evaluate is not None else []


def _settings_errors(name: str, given: dict[str, Any]) -> list[tuple[str, str]]:
    """What the component ``name`` says of the settings ``given`` for it (its own schema:
    :meth:`temper.rewards.Component.settings_errors`; unknown settings are refused)."""
    from temper.rewards.components import NotAComponent, component_of

    try:
        component = component_of(name, plugins.load(plugins.Group.rewards, name))
    except (plugins.PluginError, NotAComponent) as exc:
        return [(f"rewards.{name}", str(exc))]
    return [(f"rewards.{name}.{path}" if path else f"rewards.{name}", msg)
            for path, msg in component.settings_errors(given)]  # fmt: skip


def parse_spec(data: dict[str, Any] | str | bytes) -> JobSpec:
    """Validate a spec given as a mapping, or as JSON/YAML text, and the plugins it names."""
    if isinstance(data, bytes | str):
        try:
            data = yaml.safe_load(data)
        except yaml.YAMLError as exc:
            raise SpecError([("(document)", f"not valid YAML/JSON: {yaml_problem(exc)}")]) from None
    if not isinstance(data, dict):
        raise SpecError([("(document)", "the spec must be a mapping")])
    if errors := rl_only_errors(data):
        raise SpecError(errors)
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError([(field_path(e["loc"]), message(e)) for e in exc.errors()]) from None
    errors = submitted_errors(spec) + plugin_errors(spec)
    if errors:
        raise SpecError(errors)
    return spec
