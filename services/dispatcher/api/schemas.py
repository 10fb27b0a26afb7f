"""Response and request bodies of the dispatcher's REST API (``/v1``)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from temper.jobspec import HANDLE_PATTERN, LABEL_PATTERN, TAG_PATTERN, EvalRule, Split
from temper.jobspec import Sampling as SamplingSpec

PASS_THRESHOLD = (
    "without it, an episode passed as recorded when it was scored (temper.rewards.passed: its "
    "correctness component at its maximum); with it, when its reward is at least this"
)


class _Out(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class FieldError(BaseModel):
    field: str = Field(description="dotted path of the offending field, e.g. schedule.iterations")
    message: str


class Problem(BaseModel):
    """The one error body of every 4xx/5xx answer."""

    detail: str = Field(description="what went wrong, in one line")
    errors: list[FieldError] = Field(
        [], description="the offending fields (422): each with its path and what is wrong with it"
    )


# The documented error answers of a route (FastAPI's ``responses=``).
Responses = dict[int | str, dict[str, Any]]


# --- jobs -----------------------------------------------------------------------------


class JobSummary(_Out):
    id: str
    name: str
    handle: str | None = Field(None, description="unique in the tenant; usable wherever the id is")
    tags: list[str] = []
    note: str | None = None
    state: str
    state_reason: str | None = None
    iteration: int = Field(description="iterations started so far")
    iterations: int = Field(description="iterations the spec asks for")
    policy_version: int
    taskset: str
    evaluates: dict[str, Any] | None = Field(
        None,
        description="an evaluation job: what it evaluates (`job`, `version` or `model`, `label`, `split`); "
        "null for a training job",
    )
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None = None


class Job(JobSummary):
    spec: dict[str, Any] = Field(description="the validated spec, defaults filled in")
    provenance: dict[str, Any] | None = Field(
        None,
        description="what the job was made from, recorded when it was submitted: `seeds`, `spec_sha256`, "
        "`temper` (version, git `commit` or why none, `dirty`), `model` (the initial weights, their `source` and "
        "`sha256`), `taskset` (id, tasks, `sha256` of its content), `rerun_of`; null for jobs submitted "
        "before it was recorded (docs/api.md, Reproducibility)",
    )


class Rerun(BaseModel):
    """What a rerun changes: nothing else (the same resolved spec)."""

    model_config = ConfigDict(extra="forbid")
    handle: str | None = Field(
        None,
        pattern=HANDLE_PATTERN,
        description="the new job's handle (the old one's stays its own); none: none",
    )
    name: str | None = Field(
        None, min_length=1, max_length=200, description="the new job's name; none: the same"
    )


class JobChange(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tags: list[Annotated[str, Field(pattern=TAG_PATTERN)]] | None = Field(None, max_length=20)
    note: str | None = Field(None, max_length=4000)


class JobPage(BaseModel):
    items: list[JobSummary]
    next_cursor: str | None = Field(
        None, description="pass as ?cursor= to get the next page; null on the last"
    )
    total: int = Field(description="jobs matching the filters")


# --- episodes -------------------------------------------------------------------------


class Episode(_Out):
    id: str
    job_id: str
    task_id: str
    group_id: str
    iteration: int
    state: str
    state_reason: str | None = None
    turn: int
    attempt: int
    behaviour_version: int | None = None
    reward: float | None = None
    rewards: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    has_trajectory: bool = False
    created_at: datetime
    updated_at: datetime


class EpisodePage(BaseModel):
    items: list[Episode]
    next_cursor: str | None = None
    total: int


class TranscriptTurn(BaseModel):
    turn: int
    prompt: str = Field(description="what the model read before this turn's action (decoded prompt tokens)")
    prompt_tokens: int = 0
    action_text: str = Field(description="the model's output, decoded")
    action_tokens: int = 0
    action: dict[str, Any] = Field({}, description="the action the environment parsed from it")
    observation: str = ""
    exit_code: int | None = None
    kill_reason: str | None = None
    policy_version: int | None = None
    timings: dict[str, float] = {}


class Transcript(BaseModel):
    episode: Episode
    source: str = Field(description="'trajectory' (stored after scoring) or 'steps' (an episode in progress)")
    turns: list[TranscriptTurn]
    final_observation: str = Field("", description="environment text after the last action, if any")
    reward: float | None = None
    rewards: dict[str, Any] = Field({}, description="the reward vector: each component's value and details")
    policy_versions: list[int] = Field([], description="policy versions that produced the model's tokens")
    timings: dict[str, Any] = {}
    log_key: str | None = Field(
        None,
        description="object key of the episode's log (JSON lines, one per step), once it is scored; "
        "GET /v1/episodes/{id}/log returns it",
    )


# --- metrics --------------------------------------------------------------------------


class IterationReward(BaseModel):
    iteration: int
    episodes: int = Field(description="scored episodes in this iteration")
    mean: float
    std: float
    min: float
    max: float


class TaskPassRate(BaseModel):
    task_id: str
    episodes: int
    passed: int
    pass_rate: float
    mean_reward: float


class Throughput(BaseModel):
    episodes_finished: int
    episodes_per_min: float = Field(description="finished episodes per minute over the job's life so far")
    recent_episodes_per_min: float = Field(description="over the last five minutes")


class Staleness(BaseModel):
    current_version: int = Field(description="the job's latest policy version")
    max_staleness: int = Field(description="the bound from the spec")
    mean: float | None = Field(
        None,
        description="mean (current version - behaviour version) of scored episodes the trainer has yet to use",
    )
    max: int | None = Field(None, description="the largest of those")
    in_flight_max: int | None = Field(None, description="largest staleness among unfinished episodes")


class Progress(BaseModel):
    state: str
    iteration: int
    iterations: int
    episodes_per_iteration: int
    episodes_total: int = Field(
        description="episodes the whole job will run (with dynamic sampling: plus the replacements started so far)"
    )
    episodes_by_state: dict[str, int]
    finished: int
    fraction: float = Field(description="finished / episodes_total, 0..1")


class Sampling(BaseModel):
    """Groups the trainer skipped for zero reward variance and what dynamic sampling did about them."""

    dynamic_sampling: bool = Field(description="algorithm.dynamic_sampling of the job")
    zero_variance_groups: int = Field(description="groups the trainer skipped for zero reward variance")
    replacement_groups: int = Field(description="groups started in place of skipped ones")
    unreplaced_groups: int = Field(
        description="skipped groups not (yet) replaced: all of them without dynamic sampling, "
        "else those past algorithm.max_replacement_groups or still waiting for room"
    )


class VersionTraining(BaseModel):
    """The trainer's own numbers for one policy version: those of the last step it holds
    (``None`` where the version row has none, e.g. published before the field existed)."""

    version: int = Field(description="0-based, as the policy version everywhere")
    step: int = Field(description="optimizer steps trained so far")
    loss: float | None = None
    pg_loss: float | None = None
    kl: float | None = None
    entropy: float | None = Field(None, description="mean policy entropy over the model tokens, nats")
    grad_norm: float | None = None
    clip_fraction: float | None = None
    learning_rate: float | None = None
    tokens: int | None = Field(None, description="tokens forwarded in the step")
    correction_weight_mean: float | None = Field(
        None, description="algorithm.correction: the mean importance weight of a token (1 without one)"
    )
    correction_capped_fraction: float | None = Field(
        None, description="algorithm.correction: the share of tokens whose ratio passed the cap"
    )
    canary_tokens: int | None = Field(
        None,
        description="the logprob canary: tokens this version sampled that the trainer recomputed "
        "(0: none checked, which is flagged, not a pass; None: the canary has not run on it)",
    )
    canary_mean: float | None = Field(None, description="the canary: mean |Δ logprob| of those tokens")
    canary_max: float | None = Field(None, description="the canary: the largest |Δ logprob|")
    canary_failed_batches: int | None = Field(None, description="the canary: batches past algorithm.mismatch")
    train_s: float = Field(description="trainer seconds of the steps since the version before")
    created_at: datetime


class Training(BaseModel):
    versions: list[VersionTraining]
    trained_episodes: int = Field(description="episodes an optimizer step trained on")
    skipped_groups: dict[str, int] = Field(description="groups the trainer did not train on, by reason")
    not_trained_reason: str | None = Field(
        description="while the job has no trained version: why (none once it has one)"
    )


class JobMetrics(BaseModel):
    job_id: str
    progress: Progress
    sampling: Sampling
    reward_curve: list[IterationReward]
    pass_rates: list[TaskPassRate]
    throughput: Throughput
    staleness: Staleness
    training: Training
    evaluations: list[EvaluationPoint] = Field(
        [], description="the job's evaluations, by version (docs/job-spec.md, evaluation)"
    )
    pass_threshold: float | None = Field(description=PASS_THRESHOLD)


# --- evaluations ----------------------------------------------------------------------


class EvaluationRequest(EvalRule):
    """``POST /v1/jobs/{id}/evaluations``: evaluate one of the job's versions, or a model
    directory with the job's environment and rewards, as a job of its own. ``samples``,
    ``pass_at``, ``passed_by`` and ``pass_threshold`` as in a spec's ``evaluation``."""

    version: int | None = Field(
        None, ge=0, description="a version the job published (0: its initial weights)"
    )
    model: str | None = Field(None, max_length=4096, description="a model directory instead of a version")
    taskset: str | None = Field(None, max_length=200, description="a task set of yours; default: the job's")
    split: Split | None = Field(
        None, description="held_out | train | all; default: held_out of the job's task set, all of another"
    )
    sampling: SamplingSpec | None = Field(None, description="default: the job's policy.sampling")
    max_concurrent_episodes: int | None = Field(None, ge=1, description="default: the job's")
    backend_pool: str | None = Field(
        None, max_length=200, description="default: the job's policy.backend_pool"
    )
    label: str = Field("eval", pattern=LABEL_PATTERN, description="the name its results are logged under")


class EvaluationTask(BaseModel):
    task_id: str
    samples: int = Field(description="scored episodes of the task")
    passed: int
    pass_at: dict[str, float] = Field(description="k -> pass@k (unbiased estimator), for each k <= samples")
    reward_mean: float
    components: dict[str, float] = Field(description="each reward component's mean")


class EvaluationPoint(BaseModel):
    """One evaluation of a job's version: where it stands and its results."""

    evaluation_job_id: str = Field(description="the evaluation's own job (its episodes, transcripts)")
    state: str = Field(description="the evaluation job's state")
    state_reason: str | None = None
    source_job_id: str = Field(description="the job evaluated (or whose environment evaluated a model)")
    version: int | None = Field(description="the version evaluated; null for a model directory")
    model: str | None = None
    label: str
    periodic: bool = Field(description="made by the job's evaluation section (else on request)")
    taskset: str
    split: str
    samples: int = Field(description="episodes per task")
    pass_at: dict[str, float | None] = Field(
        {}, description="k -> the mean pass@k over the tasks that have k scored samples; {} until it ends"
    )
    reward_mean: float | None = None
    components: dict[str, float] = {}
    summary: dict[str, Any] | None = Field(None, description="temper.evaluation.summary, once it ended")
    created_at: datetime
    completed_at: datetime | None = None


class Evaluation(EvaluationPoint):
    ks: list[int] = Field(description="the k of each pass@k")
    passed_by: str
    pass_threshold: float | None = None
    tasks: list[EvaluationTask] | None = Field(None, description="per task, with ?tasks=true")


# --- tenants and keys -----------------------------------------------------------------


WEIGHT = "share of a contended fleet: episodes are admitted in proportion to the tenants' weights"
CPU_QUOTA = "sandbox CPU-seconds its episodes may use in all; at it, its jobs pause"
# at most 10**15 tokens: below 2**53, so a JSON number at the bound means one integer whether
# a client reads it as a float or an int (at 2**62 the fuzzer sent 2**62 + 95 as "equal")
MAX_TOKEN_QUOTA = 10**15
TOKEN_QUOTA = "inference tokens (prompt and sampled) its episodes may use in all; at it, its jobs pause"
MEMORY_QUOTA = (
    "sandbox memory its episodes may hold in all, in GB-seconds (each action's peak memory x its "
    "wall time); at it, its jobs pause"
)
TRAINER_QUOTA = "trainer seconds its jobs' steps may take in all; at it, its jobs pause"


class TenantOut(_Out):
    id: str
    name: str
    max_concurrent_episodes: int = Field(description="quota: episodes this tenant may run at once")
    weight: float = Field(description="share of a contended fleet, relative to the other tenants' weights")
    quota_sandbox_cpu_s: float | None = Field(
        description="sandbox CPU-seconds its episodes may use in all (null: no limit)"
    )
    quota_inference_tokens: int | None = Field(
        description="prompt and sampled tokens its episodes may use in all (null: no limit)"
    )
    quota_sandbox_memory_gb_s: float | None = Field(
        description="sandbox memory its episodes may hold, in GB-seconds (null: no limit)"
    )
    quota_trainer_s: float | None = Field(description="trainer seconds its jobs may take (null: no limit)")
    created_at: datetime


class TenantDetail(TenantOut):
    active_episodes: int = Field(description="episodes of this tenant currently in flight")
    used_sandbox_cpu_s: float = Field(description="sandbox CPU-seconds its episodes have used")
    used_inference_tokens: int = Field(description="prompt and sampled tokens its episodes have used")
    used_sandbox_memory_gb_s: float = Field(
        description="sandbox memory its episodes have held, in GB-seconds"
    )
    used_trainer_s: float = Field(description="trainer seconds its jobs' published versions took")


class TenantUsage(TenantDetail):
    admin: bool = Field(description="whether the calling key is an admin key")


class KeyOut(_Out):
    id: int
    name: str
    prefix: str
    admin: bool
    created_at: datetime
    revoked_at: datetime | None = None


class NewKey(BaseModel):
    id: int
    tenant_id: str
    prefix: str
    admin: bool
    key: str = Field(description="the API key; shown only in this response")


class NewTenant(BaseModel):
    tenant: TenantOut
    key: NewKey


class CreateTenant(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=200)
    id: str | None = Field(
        None, pattern=r"^[a-z0-9][a-z0-9-]{0,63}$", description="defaults to a slug of name"
    )
    max_concurrent_episodes: int = Field(64, ge=1, le=1_000_000)
    weight: float = Field(1.0, gt=0, le=1000, description=WEIGHT)
    quota_sandbox_cpu_s: float | None = Field(None, ge=0, description=CPU_QUOTA)
    quota_inference_tokens: int | None = Field(None, ge=0, le=MAX_TOKEN_QUOTA, description=TOKEN_QUOTA)
    quota_sandbox_memory_gb_s: float | None = Field(None, ge=0, description=MEMORY_QUOTA)
    quota_trainer_s: float | None = Field(None, ge=0, description=TRAINER_QUOTA)
    admin: bool = Field(False, description="whether its first key is an admin key")


class UpdateTenant(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(None, min_length=1, max_length=200)
    max_concurrent_episodes: int | None = Field(None, ge=1, le=1_000_000)
    weight: float | None = Field(None, gt=0, le=1000, description=WEIGHT)
    quota_sandbox_cpu_s: float | None = Field(None, ge=0, description=CPU_QUOTA + "; null lifts it")
    quota_inference_tokens: int | None = Field(
        None, ge=0, le=MAX_TOKEN_QUOTA, description=TOKEN_QUOTA + "; null lifts it"
    )
    quota_sandbox_memory_gb_s: float | None = Field(None, ge=0, description=MEMORY_QUOTA + "; null lifts it")
    quota_trainer_s: float | None = Field(None, ge=0, description=TRAINER_QUOTA + "; null lifts it")


class CreateKey(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field("", max_length=200)


JobMetrics.model_rebuild()
