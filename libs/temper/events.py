"""The messages Temper services exchange over the bus, and the lifecycle events
downstream consumers read from ``events``.

Every message carries an envelope: ``type``, ``schema_version``, ``id``,
``occurred_at`` and the causal ids (job, episode, turn, step kind, attempt). The
wire format is JSON. ``python -m temper.events`` writes their JSON Schemas to
``docs/events/`` so consumers can validate what they read.
"""

from __future__ import annotations

import json
import sys
import uuid
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from temper.clock import utcnow


class Topics:
    INFERENCE_REQUESTS = "inference.requests"
    INFERENCE_RESULTS = "inference.results"
    SANDBOX_REQUESTS = "sandbox.requests"
    SANDBOX_RESULTS = "sandbox.results"
    REWARD_REQUESTS = "reward.requests"
    REWARD_RESULTS = "reward.results"
    TRAJECTORIES = "trajectories"
    POLICY_UPDATES = "policy.updates"
    EVENTS = "events"
    JUDGE_RESULTS = "judge.results"  # the gateway's answers to the reward scorer's judges

    ALL = (
        INFERENCE_REQUESTS,
        INFERENCE_RESULTS,
        JUDGE_RESULTS,
        SANDBOX_REQUESTS,
        SANDBOX_RESULTS,
        REWARD_REQUESTS,
        REWARD_RESULTS,
        TRAJECTORIES,
        POLICY_UPDATES,
        EVENTS,
    )

    @staticmethod
    def dead_letter(topic: str) -> str:
        return f"{topic}.dlq"


class BadMessage(ValueError):
    """A message that can never be handled (not JSON, unknown type, wrong fields)."""


class Message(BaseModel):
    """The envelope every message shares."""

    model_config = ConfigDict(extra="forbid")
    SCHEMA_VERSION: ClassVar[int] = 1

    type: str
    schema_version: int = 1
    id: uuid.UUID = Field(default_factory=uuid.uuid4)
    occurred_at: datetime = Field(default_factory=utcnow)
    job_id: str | None = None
    episode_id: str | None = None
    turn: int | None = None
    kind: str | None = Field(None, description="step kind: inference, sandbox, reward")
    attempt: int = 0

    def key(self) -> str:
        """The partition key: the episode, else the job."""
        return self.episode_id or self.job_id or str(self.id)

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_tokens: int = Field(64, ge=1, le=32768)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []


class InferenceRequest(Message):
    type: Literal["inference.request"] = "inference.request"
    kind: str | None = "inference"
    model: str = Field(description="the job's policy.model")
    init: str | None = Field(None, description="the job's policy.init: the weights its version 0 is")
    pool: str = Field("default", description="the job's policy.backend_pool")
    prompt_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    partial_rollout: bool = Field(
        False,
        description="the episode takes partial rollouts: a generation in progress when a new version "
        "is loaded may be interrupted and resumed with its prefix on that version (where the backend can)",
    )
    reply_to: Literal["inference.results", "judge.results"] = Field(
        "inference.results",
        description="the topic the result goes to: inference.results (the dispatcher's episodes), or "
        "judge.results (a reward scorer's judge asking)",
    )


class InferenceResult(Message):
    type: Literal["inference.result"] = "inference.result"
    kind: str | None = "inference"
    token_ids: list[int] = []
    logprobs: list[float] = []
    token_versions: list[int] = Field(
        default_factory=list,
        description="the policy version that sampled each token (empty: every token is policy_version's)",
    )
    text: str = ""
    finish_reason: str | None = None
    policy_version: int = Field(0, description="the version that sampled the last token")
    backend: str | None = None
    error: str | None = None


class SandboxRequest(Message):
    type: Literal["sandbox.request"] = "sandbox.request"
    kind: str | None = "sandbox"
    session_id: str
    action: dict[str, Any]
    more_actions: list[dict[str, Any]] = Field(
        default_factory=list,
        description="actions of the same turn that run after `action`, in order (several tool calls)",
    )
    limits: dict[str, Any] | None = None
    snapshot_key: str | None = Field(
        None, description="where to restore the session from if this worker lacks it"
    )
    snapshot_after: bool = True
    keep_s: float | None = Field(
        None,
        ge=0,
        description="keep the session at least this long after this step, idle or not: the time the episode "
        "may still need it (until its deadline); None: the worker's idle expiry alone",
    )
    files: dict[str, str] = Field(
        default_factory=dict,
        description="the task's starting files: written into the workspace when the session is created "
        "fresh (not when it is restored from snapshot_key)",
    )
    setup: list[dict[str, Any]] = Field(
        default_factory=list,
        description="actions run once when the session is created fresh, after `files` and before `action` "
        "(an environment package's setup program); one that fails fails the step",
    )


class SandboxResult(Message):
    type: Literal["sandbox.result"] = "sandbox.result"
    kind: str | None = "sandbox"
    session_id: str
    result: dict[str, Any] = {}
    more_results: list[dict[str, Any]] = Field(
        default_factory=list, description="the results of the request's `more_actions`, in order"
    )
    snapshot_key: str | None = None
    worker: str | None = None
    error: str | None = None


class RewardRequest(Message):
    type: Literal["reward.request"] = "reward.request"
    kind: str | None = "reward"
    task_id: str
    taskset_id: str | None = None
    submission: dict[str, Any]
    weights: dict[str, float] = {}
    settings: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="the job's settings of the components given with some"
    )
    turns_used: int = 0
    max_turns: int = 1
    format_ok: bool = True


class RewardComponent(BaseModel):
    model_config = ConfigDict(extra="forbid")
    value: float | None = None
    ok: bool = True
    reason: str | None = None
    details: dict[str, Any] = {}


class RewardResult(Message):
    type: Literal["reward.result"] = "reward.result"
    kind: str | None = "reward"
    task_id: str
    reward: float = 0.0
    components: dict[str, RewardComponent] = {}
    error: str | None = None


class TrajectoryReady(Message):
    type: Literal["trajectory.ready"] = "trajectory.ready"
    task_id: str
    group_id: str
    trajectory_key: str = Field(description="object-storage key of the trajectory JSON")
    behaviour_version: int
    reward: float


class PolicyUpdate(Message):
    type: Literal["policy.update"] = "policy.update"
    version: int
    checkpoint_key: str
    step: int


class LifecycleEvent(Message):
    """Events for analytics: job/episode state changes, rewards, policy versions, and an
    evaluation's results (``evaluation``: on the evaluated job, ``version`` the version it
    evaluated, ``data`` the results: ``temper.evaluation.summary`` with the evaluation's
    label, job id, task set and split)."""

    type: Literal["lifecycle"] = "lifecycle"
    event: Literal["job.state", "episode.state", "episode.reward", "policy.version", "evaluation"]
    tenant: str | None = None
    state: str | None = None
    reason: str | None = None
    reward: float | None = None
    version: int | None = None
    data: dict[str, Any] = {}


AnyMessage = Annotated[
    InferenceRequest
    | InferenceResult
    | SandboxRequest
    | SandboxResult
    | RewardRequest
    | RewardResult
    | TrajectoryReady
    | PolicyUpdate
    | LifecycleEvent,
    Field(discriminator="type"),
]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(AnyMessage)
MESSAGE_TYPES: dict[str, type[Message]] = {
    m.model_fields["type"].default: m
    for m in (
        InferenceRequest,
        InferenceResult,
        SandboxRequest,
        SandboxResult,
        RewardRequest,
        RewardResult,
        TrajectoryReady,
        PolicyUpdate,
        LifecycleEvent,
    )
}


def decode(data: bytes) -> Message:
    """Parse a message from the wire; :class:`BadMessage` names what is wrong."""
    try:
        raw = orjson.loads(data)  # a third of json's time on a result; strict JSON (no NaN)
    except orjson.JSONDecodeError as exc:  # invalid UTF-8 too
        raise BadMessage(f"not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise BadMessage("not a JSON object")
    version = raw.get("schema_version")
    model = MESSAGE_TYPES.get(raw.get("type", ""))
    if model is None:
        raise BadMessage(f"unknown message type {raw.get('type')!r}")
    if version is not None and version > model.SCHEMA_VERSION:
        raise BadMessage(
            f"{model.__name__} schema_version {version} is newer than this reader's {model.SCHEMA_VERSION}"
        )
    try:
        return _ADAPTER.validate_python(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"][1:]) or "(root)"
        raise BadMessage(f"{raw.get('type')}: field {where}: {first['msg']}") from None


def write_schemas(directory: Path) -> list[Path]:
    """Write one JSON Schema per message type, plus an index; returns the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, model in sorted(MESSAGE_TYPES.items()):
        path = directory / f"{name}.schema.json"
        schema = model.model_json_schema()
        schema["$id"] = f"https://temper.dev/schemas/{name}/v{model.SCHEMA_VERSION}"
        path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("docs/events")
    for p in write_schemas(out):
        sys.stdout.write(f"wrote {p}\n")
