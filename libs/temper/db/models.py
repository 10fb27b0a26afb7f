"""Tables. Postgres is the source of truth; every column type here also exists in SQLite.

Every datetime column is :class:`UTCDateTime`: it takes aware datetimes only and gives
back aware UTC datetimes on both databases (SQLite stores no offset, so without it
reads come back naive)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from temper.clock import utcnow

# SQLite only auto-increments INTEGER PRIMARY KEY, so big ids are plain integers there.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class UTCDateTime(TypeDecorator[datetime]):
    """``TIMESTAMP WITH TIME ZONE`` that refuses naive datetimes on the way in (their zone
    is a guess) and stamps UTC on the way out where the driver returns naive values."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(
                f"naive datetime {value.isoformat()}: use temper.clock.utcnow() or an aware value"
            )
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON, datetime: UTCDateTime()}


class Tenant(Base):
    __tablename__ = "tenants"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    max_concurrent_episodes: Mapped[int] = mapped_column(Integer, default=64)
    weight: Mapped[float] = mapped_column(
        Float, default=1.0, doc="share of a contended fleet, relative to the other tenants'"
    )
    quota_sandbox_cpu_s: Mapped[float | None] = mapped_column(
        Float, default=None, doc="sandbox CPU-seconds its episodes may use in all; None: no limit"
    )
    quota_inference_tokens: Mapped[int | None] = mapped_column(
        BigInteger, default=None, doc="prompt and sampled tokens its episodes may use in all; None: no limit"
    )
    quota_sandbox_memory_gb_s: Mapped[float | None] = mapped_column(
        Float, default=None, doc="sandbox memory its episodes may hold, in GB-seconds; None: no limit"
    )
    quota_trainer_s: Mapped[float | None] = mapped_column(
        Float, default=None, doc="trainer seconds its jobs' steps may take in all; None: no limit"
    )
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200), default="")
    prefix: Mapped[str] = mapped_column(String(16), doc="first characters of the key, for display")
    key_hash: Mapped[str] = mapped_column(
        String(128), unique=True, doc="sha256 of the key; the key is never stored"
    )
    admin: Mapped[bool] = mapped_column(Boolean, default=False, doc="may create tenants and change quotas")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)


class TaskSet(Base):
    __tablename__ = "task_sets"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    source: Mapped[str] = mapped_column(String(200), default="")
    status: Mapped[str] = mapped_column(String(32), default="pending")
    task_count: Mapped[int] = mapped_column(Integer, default=0)
    storage_key: Mapped[str | None] = mapped_column(String(512), default=None)
    held_out: Mapped[dict[str, Any] | None] = mapped_column(
        default=None,
        doc="how the upload was split (temper.tasks.splits): the rule and the counts; None: no split",
    )
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Task(Base):
    """One task of a task set. How often it was solved is not kept here: it is counted
    from :class:`TaskOutcome` rows (``temper.tasks.service.outcome_totals``)."""

    __tablename__ = "tasks"
    __table_args__ = (UniqueConstraint("task_set_id", "key", name="uq_tasks_set_key"),)
    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    task_set_id: Mapped[str] = mapped_column(ForeignKey("task_sets.id", ondelete="CASCADE"), index=True)
    key: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(32))
    prompt: Mapped[str] = mapped_column(Text)
    spec: Mapped[dict[str, Any]] = mapped_column(default=dict, doc="files, tests, solution, answer, limits")
    meta: Mapped[dict[str, Any]] = mapped_column(default=dict, doc="source, tags, difficulty")
    status: Mapped[str] = mapped_column(String(32), default="pending", doc="pending | valid | invalid")
    status_reasons: Mapped[list[Any]] = mapped_column(default=list)
    prompt_hash: Mapped[str] = mapped_column(String(64), default="", index=True)
    tests_hash: Mapped[str] = mapped_column(String(64), default="", index=True)
    validation: Mapped[dict[str, Any] | None] = mapped_column(
        default=None, doc="the last validation's oracle and do-nothing runs (temper.tasks.oracle)"
    )
    split: Mapped[str] = mapped_column(
        String(16),
        default="train",
        server_default="train",
        doc="train | held_out, set at upload (temper.tasks.splits); training draws from train only",
    )


class TaskOutcome(Base):
    """One scored episode's verdict on its task: written once, by the dispatcher's scoring
    transaction (``temper.rewards.passed`` decides ``passed``), never updated. Attempts,
    pass rates and difficulty, per task, per job or per policy version, are counted from
    these rows; the unique episode id makes a second write for one episode fail."""

    __tablename__ = "task_outcomes"
    __table_args__ = (Index("ix_task_outcomes_job_version", "job_id", "policy_version"),)
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    episode_id: Mapped[str] = mapped_column(ForeignKey("episodes.id", ondelete="CASCADE"), unique=True)
    # no foreign key, as on Episode.task_id: the history needs no task row
    task_id: Mapped[str] = mapped_column(String(200), index=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    policy_version: Mapped[int | None] = mapped_column(
        Integer, default=None, doc="the episode's behaviour version: the oldest policy that acted in it"
    )
    passed: Mapped[bool] = mapped_column(Boolean)
    reward: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Evaluation(Base):
    """One evaluation: a job of its own (``job_id``, whose spec's ``evaluate`` says what it
    evaluates) that samples policy version ``version`` of ``source_job_id`` (or the model
    directory ``model``) on a task set or a split of one, ``samples`` episodes per task. Written
    when the evaluation job is created; ``summary`` and ``completed_at`` when its last episode
    finished (with its per-task rows, :class:`EvaluationResult`)."""

    __tablename__ = "evaluations"
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    # no foreign key: an evaluation's results outlive nothing they need from the job's row
    source_job_id: Mapped[str] = mapped_column(String(64), index=True)
    version: Mapped[int | None] = mapped_column(Integer, default=None, doc="None: a model directory")
    model: Mapped[str | None] = mapped_column(Text, default=None, doc="the model directory evaluated")
    checkpoint_key: Mapped[str | None] = mapped_column(String(512), default=None)
    label: Mapped[str] = mapped_column(String(64), default="eval")
    periodic: Mapped[bool] = mapped_column(Boolean, default=False, doc="started by the job's evaluation")
    # one periodic evaluation per job, version and label: "<job>:<version>:<label>"; None on request
    periodic_key: Mapped[str | None] = mapped_column(String(200), default=None, unique=True)
    taskset_id: Mapped[str] = mapped_column(String(64))
    split: Mapped[str] = mapped_column(String(16))
    samples: Mapped[int] = mapped_column(Integer)
    pass_at: Mapped[list[Any]] = mapped_column()
    passed_by: Mapped[str] = mapped_column(String(200), default="default")
    pass_threshold: Mapped[float | None] = mapped_column(Float, default=None)
    summary: Mapped[dict[str, Any] | None] = mapped_column(
        default=None, doc="temper.evaluation.summary over its tasks, written at its end"
    )
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    completed_at: Mapped[datetime | None] = mapped_column(default=None)


class EvaluationResult(Base):
    """One task's results in one evaluation: scored samples, passes, pass@k per k, the mean
    reward and each component's mean (``temper.evaluation.TaskResult``)."""

    __tablename__ = "evaluation_results"
    job_id: Mapped[str] = mapped_column(
        ForeignKey("evaluations.job_id", ondelete="CASCADE"), primary_key=True
    )
    task_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    samples: Mapped[int] = mapped_column(Integer)
    passed: Mapped[int] = mapped_column(Integer)
    pass_at: Mapped[dict[str, Any]] = mapped_column(doc='{"1": 0.5, "4": 0.9}: k -> pass@k')
    reward_mean: Mapped[float] = mapped_column(Float)
    components: Mapped[dict[str, Any]] = mapped_column(default=dict, doc="component -> mean value")


class EvaluationOutcome(Base):
    """One scored evaluation episode's verdict, written once by the dispatcher's scoring
    transaction (never a :class:`TaskOutcome`: no training pass rate or curriculum counts it)."""

    __tablename__ = "evaluation_outcomes"
    episode_id: Mapped[str] = mapped_column(ForeignKey("episodes.id", ondelete="CASCADE"), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    task_id: Mapped[str] = mapped_column(String(200))
    policy_version: Mapped[int | None] = mapped_column(Integer, default=None)
    passed: Mapped[bool] = mapped_column(Boolean)
    reward: Mapped[float] = mapped_column(Float)
    components: Mapped[dict[str, Any]] = mapped_column(default=dict, doc="component -> value")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Job(Base):
    """A training job. ``state`` and ``state_reason`` change only through
    ``temper.lifecycle.transition_job`` (``JobState``; failed and cancelled always carry a
    reason). ``policy_version`` is written only by the trainer."""

    __tablename__ = "jobs"
    # a handle names one job of its tenant (several NULLs are fine in both databases)
    __table_args__ = (Index("ux_jobs_tenant_handle", "tenant_id", "handle", unique=True),)
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    handle: Mapped[str | None] = mapped_column(String(100), default=None, doc="unique per tenant, optional")
    tags: Mapped[list[Any]] = mapped_column(default=list)
    note: Mapped[str | None] = mapped_column(Text, default=None)
    spec: Mapped[dict[str, Any]] = mapped_column()
    state: Mapped[str] = mapped_column(String(32), default="pending", index=True)
    state_reason: Mapped[str | None] = mapped_column(Text, default=None, doc="why it entered its state")
    iteration: Mapped[int] = mapped_column(Integer, default=0)
    policy_version: Mapped[int] = mapped_column(
        Integer, default=0, doc="the trainer's latest published version"
    )
    provenance: Mapped[dict[str, Any] | None] = mapped_column(
        default=None,
        doc="what the job was made from, recorded at submission (temper.provenance): seeds, spec digest, "
        "Temper's version and commit, model and task-set digests; None for jobs from before 0010",
    )
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)


class Episode(Base):
    """One rollout. ``state`` changes only through ``temper.lifecycle.transition_episode``
    (``EpisodeState``); ``lease_expires_at`` is its waiting step's lease, cleared when it
    leaves the waiting states."""

    __tablename__ = "episodes"
    __table_args__ = (Index("ix_episodes_job_state", "job_id", "state"),)
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    tenant_id: Mapped[str] = mapped_column(String(64), index=True)
    task_id: Mapped[str] = mapped_column(String(200))
    group_id: Mapped[str] = mapped_column(String(64), index=True)
    iteration: Mapped[int] = mapped_column(Integer, default=0)
    state: Mapped[str] = mapped_column(String(32), default="pending")
    state_reason: Mapped[str | None] = mapped_column(Text, default=None)
    turn: Mapped[int] = mapped_column(Integer, default=0)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    format_errors: Mapped[int] = mapped_column(Integer, default=0, doc="turns whose output did not parse")
    behaviour_version: Mapped[int | None] = mapped_column(Integer, default=None)
    reward: Mapped[float | None] = mapped_column(Float, default=None)
    rewards: Mapped[dict[str, Any]] = mapped_column(default=dict)
    session_id: Mapped[str | None] = mapped_column(String(64), default=None)
    snapshot_key: Mapped[str | None] = mapped_column(String(512), default=None)
    trajectory_key: Mapped[str | None] = mapped_column(String(512), default=None)
    steps_key: Mapped[str | None] = mapped_column(
        String(512), default=None, doc="where its steps went once archived (temper.episode_steps)"
    )
    lease_expires_at: Mapped[datetime | None] = mapped_column(default=None, index=True)
    timings: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # what it consumed, counted by the transaction that accepts each result (once per result)
    sandbox_cpu_s: Mapped[float] = mapped_column(Float, default=0.0)
    # peak memory x wall time of each sandbox action, summed
    sandbox_memory_gb_s: Mapped[float] = mapped_column(Float, default=0.0)
    inference_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    # its own switch (a job's schedule.partial_rollouts; an evaluation episode keeps it off):
    # its generations may be interrupted and resumed on a newer version
    partial_rollouts: Mapped[bool] = mapped_column(Boolean, default=False)
    # environment.max_episode_s from its start; environment.max_episode_tokens counts model_tokens
    deadline_at: Mapped[datetime | None] = mapped_column(default=None)
    model_tokens: Mapped[int] = mapped_column(Integer, default=0, doc="tokens its model sampled")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class Step(Base):
    """One command of a turn and, once it arrives, its result. The unique key makes a
    redelivered result a no-op. ``state`` (``temper.lifecycle.StepState``) changes only
    through the lifecycle's step functions: ``leased`` while the result is awaited (until
    ``lease_expires_at``, cleared on leaving it), then ``done``, ``failed`` (attempts spent)
    or ``cancelled`` (its job ended)."""

    __tablename__ = "steps"
    __table_args__ = (UniqueConstraint("episode_id", "turn", "kind", name="uq_steps_episode_turn_kind"),)
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    episode_id: Mapped[str] = mapped_column(ForeignKey("episodes.id", ondelete="CASCADE"), index=True)
    turn: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(32), doc="inference | sandbox | reward")
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    state: Mapped[str] = mapped_column(String(16), default="leased", doc="leased | done | failed | cancelled")
    request: Mapped[dict[str, Any]] = mapped_column(default=dict)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    lease_expires_at: Mapped[datetime | None] = mapped_column(default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    completed_at: Mapped[datetime | None] = mapped_column(default=None)


class PolicyVersion(Base):
    __tablename__ = "policy_versions"
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_key: Mapped[str] = mapped_column(String(512))
    step: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)
    train_s: Mapped[float] = mapped_column(
        Float, default=0.0, doc="trainer seconds of the steps since the version before"
    )
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Written by the inference gateway, once every backend that serves the job confirmed it
    # serves this version; the dispatcher starts iterations on it (not on the trainer's word).
    served_at: Mapped[datetime | None] = mapped_column(default=None)
    served_by: Mapped[list[Any] | None] = mapped_column(default=None, doc="the backends that confirmed it")


class InferenceBackend(Base):
    """A backend of the inference gateway and what it can serve, as the gateway reports it
    at start (``temper.policy.placement.BackendInfo``): the dispatcher checks jobs against
    these rows, at submission and before it starts one. Written by the gateway only."""

    __tablename__ = "inference_backends"
    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    pool: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(32))
    models: Mapped[list[Any]] = mapped_column(doc="the model names its own weights answer to")
    loads_models: Mapped[bool] = mapped_column(Boolean, doc="it takes any model directory or prefix too")
    weights: Mapped[list[Any]] = mapped_column(doc="what it loads: lora, full")
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


# ``TrainedTrajectory.skipped`` of a group with zero reward variance: the trainer writes it,
# the dispatcher's dynamic sampling reads it (services/dispatcher/sampling.py).
SKIPPED_ZERO_VARIANCE = "zero_reward_variance"
SKIPPED_STALE = "stale"  # more than the job's max_staleness versions behind the learner
# buffered when the dispatcher completed the job: too few groups were left for a step
SKIPPED_JOB_ENDED = "job_ended"


class TrainedTrajectory(Base):
    """The trainer's ledger: which trajectory was consumed by which optimizer step, so a
    restarted trainer neither trains on one twice nor drops one."""

    __tablename__ = "trained_trajectories"
    episode_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_id: Mapped[str] = mapped_column(String(64), index=True)
    trajectory_key: Mapped[str] = mapped_column(String(512))
    group_id: Mapped[str] = mapped_column(String(64))
    step: Mapped[int | None] = mapped_column(Integer, default=None, doc="None while buffered, else the step")
    skipped: Mapped[str | None] = mapped_column(String(64), default=None, doc="why it was not trained on")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class OutboxRow(Base):
    """A command written in the same transaction as the state change that caused it."""

    __tablename__ = "outbox"
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    topic: Mapped[str] = mapped_column(String(200))
    key: Mapped[str | None] = mapped_column(String(200), default=None)
    payload: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    published_at: Mapped[datetime | None] = mapped_column(default=None, index=True)
    claimed_until: Mapped[datetime | None] = mapped_column(
        default=None, doc="the writer relays the row itself until then; other relays leave it"
    )


class AgentKey(Base):
    """The credential of one agent episode (``environment.kind: agent``): the dispatcher
    issues it in the transaction that starts the episode's agent and hands the key to the
    agent's sandbox; only its SHA-256 is kept. The gateway's agent proxy takes a call only
    with the key of the episode named in its URL, before ``expires_at`` and while the
    episode is acting (``temper.agent_traces``)."""

    __tablename__ = "agent_keys"
    key_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    episode_id: Mapped[str] = mapped_column(ForeignKey("episodes.id", ondelete="CASCADE"), index=True)
    job_id: Mapped[str] = mapped_column(String(64))
    tenant_id: Mapped[str] = mapped_column(String(64))
    expires_at: Mapped[datetime] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class AgentCall(Base):
    """One model call an agent episode made through the gateway's proxy, in the order the
    gateway recorded them (``id``); its body (prompt and sampled ids, logprobs, the policy
    version, the messages) is a JSON object in object storage at ``body_key``, put before
    the row is written. Written by the gateway only; the dispatcher builds the episode's
    trajectory from them (``temper.agent_traces``)."""

    __tablename__ = "agent_calls"
    __table_args__ = (Index("ix_agent_calls_episode", "episode_id", "attempt", "id"),)
    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    episode_id: Mapped[str] = mapped_column(ForeignKey("episodes.id", ondelete="CASCADE"))
    job_id: Mapped[str] = mapped_column(String(64))
    attempt: Mapped[int] = mapped_column(Integer, doc="the agent run's attempt (the sandbox step's)")
    request_id: Mapped[str] = mapped_column(String(80), unique=True)
    policy_version: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    finish_reason: Mapped[str | None] = mapped_column(String(32), default=None)
    extends: Mapped[bool] = mapped_column(
        Boolean, doc="its prompt extends the previous call's prompt and sampled ids token for token"
    )
    body_key: Mapped[str] = mapped_column(String(512))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
