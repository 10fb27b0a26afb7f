"""The catalogue of Prometheus metrics. Every service imports its metrics from here,
so names and labels stay consistent with the alert rules in deploy/prometheus/."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

# Latency buckets from 0.5 ms to 60 s: sandbox execs and bus hops are millisecond-scale.
FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

# --- bus -------------------------------------------------------------------------------
BUS_PRODUCED = Counter("temper_bus_messages_produced_total", "Messages produced", ["topic"])
BUS_CONSUMED = Counter(
    "temper_bus_messages_consumed_total", "Messages handled and committed", ["topic", "group"]
)
BUS_HANDLER_FAILURES = Counter(
    "temper_bus_handler_failures_total", "Handler attempts that raised", ["topic", "group"]
)
BUS_DEAD_LETTERS = Counter("temper_bus_dead_letters_total", "Messages sent to a dead-letter topic", ["topic"])
BUS_CONSUMER_LAG = Gauge(
    "temper_bus_consumer_lag", "Messages not yet committed by a group", ["topic", "group"]
)
BUS_PAUSED = Gauge("temper_bus_paused", "1 while a consumer has paused its partitions", ["topic", "group"])
OUTBOX_PENDING = Gauge("temper_outbox_pending", "Outbox rows committed but not yet published")
OUTBOX_PUBLISHED = Counter("temper_outbox_published_total", "Outbox rows published", ["topic"])
OUTBOX_PRUNED = Counter("temper_outbox_pruned_total", "Published outbox rows deleted after keep_published_s")
STEPS_ARCHIVED = Counter(
    "temper_steps_archived_total",
    "Step rows of finished episodes moved to object storage (temper.episode_steps)",
)
BUS_DEPENDENCY_WAITS = Counter(
    "temper_bus_dependency_waits_total",
    "Handler attempts that failed because a dependency was down (retried, never dead-lettered)",
    ["topic", "group", "dependency"],
)

# --- dependencies (every service) ------------------------------------------------------
DEPENDENCY_DOWN = Gauge(
    "temper_dependency_down", "1 while this process sees the dependency as unreachable", ["dependency"]
)
DEPENDENCY_ERRORS = Counter(
    "temper_dependency_errors_total", "Failures caused by an unreachable dependency", ["dependency"]
)
LOG_LINES_SUPPRESSED = Counter(
    "temper_log_lines_suppressed_total", "Repeated log lines dropped by the rate limit", ["logger"]
)

# --- episodes (dispatcher) -------------------------------------------------------------
EPISODE_TRANSITIONS = Counter("temper_episode_transitions_total", "Episode state transitions", ["to_state"])
EPISODES_ACTIVE = Gauge("temper_episodes_active", "Episodes neither finished nor failed", ["job_id"])
EPISODE_FAILURES = Counter("temper_episode_failures_total", "Episodes failed", ["reason"])
STEP_LEASES_EXPIRED = Counter("temper_step_leases_expired_total", "Step leases that expired", ["kind"])
EPISODES_STUCK = Gauge("temper_episodes_stuck", "Episodes whose current step is past its lease")
TURN_SECONDS = Histogram("temper_turn_seconds", "Wall time of one turn", ["kind"], buckets=FAST_BUCKETS)
JOB_ITERATION = Gauge("temper_job_iteration", "Current iteration of a job", ["job_id"])

# --- sandbox ---------------------------------------------------------------------------
SANDBOX_ACTIVE = Gauge("temper_sandbox_active", "Sandboxes in use")
SANDBOX_POOL_SIZE = Gauge("temper_sandbox_pool_size", "Warm sandboxes ready in the pool")
SANDBOX_POOL_HITS = Counter("temper_sandbox_pool_hits_total", "Acquisitions served from the warm pool")
SANDBOX_POOL_MISSES = Counter("temper_sandbox_pool_misses_total", "Acquisitions that had to create a sandbox")
SANDBOX_ACQUIRE_SECONDS = Histogram(
    "temper_sandbox_acquire_seconds", "Time to acquire a sandbox", buckets=FAST_BUCKETS
)
SANDBOX_EXEC_SECONDS = Histogram(
    "temper_sandbox_exec_seconds", "Time of one sandbox action", buckets=FAST_BUCKETS
)
SANDBOX_KILLS = Counter("temper_sandbox_kills_total", "Sandbox actions killed", ["reason"])
SANDBOX_KEPT_EVICTED = Counter(
    "temper_sandbox_kept_sessions_evicted_total",
    "Sessions destroyed to make room while still kept for an episode (every session held was kept): "
    "the episode's next step restores its workspace from its snapshot",
)
SANDBOX_FRESH_RUNS = Counter(
    "temper_sandbox_fresh_runs_total",
    "One-shot runs, by where they ran: zygote (fresh namespaces) or sandbox (a sandbox of their own)",
    ["path"],
)
SANDBOX_ZYGOTES = Gauge("temper_sandbox_zygotes", "Zygotes started (each serves one run at a time)")
SANDBOX_ZYGOTE_RECYCLES = Counter(
    "temper_sandbox_zygote_recycles_total",
    "Zygotes replaced by a fresh one, by why: limits (the cgroup refused a run's limits), runs "
    "(zygote_max_runs served), memory (resident memory above the idle baseline after a run), "
    "broken (its agent died)",
    ["reason"],
)
SANDBOX_LEAKED_PROCESSES = Gauge(
    "temper_sandbox_leaked_processes", "Processes left behind by destroyed sandboxes (must stay 0)"
)
SANDBOX_EGRESS_REFUSED = Counter(
    "temper_sandbox_egress_refused_total", "Connections the allowlist proxy refused (network: allowlist)"
)

# --- rewards ---------------------------------------------------------------------------
REWARDS_SCORED = Counter("temper_rewards_scored_total", "Episodes scored", ["status"])
REWARD_COMPONENT_SECONDS = Histogram(
    "temper_reward_component_seconds",
    "Time to compute one reward component",
    ["component"],
    buckets=FAST_BUCKETS,
)
REWARD_FAILURES = Counter(
    "temper_reward_failures_total", "Reward components that failed", ["component", "reason"]
)
REWARD_MODEL_BATCH = Histogram(
    "temper_reward_model_batch_size",
    "Transcripts scored by one reward-model forward",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
JUDGE_SECONDS = Histogram(
    "temper_judge_seconds",
    "A judge's question, from its send to its answer (or timeout)",
    buckets=FAST_BUCKETS,
)
JUDGE_VERDICTS = Counter(
    "temper_judge_verdicts_total",
    "Judge scores by outcome: scored, unparsable (recorded, not rewarded), no_answer, cached",
    ["outcome"],
)

# --- inference -------------------------------------------------------------------------
INFERENCE_REQUESTS = Counter("temper_inference_requests_total", "Generation requests", ["backend", "status"])
INFERENCE_SECONDS = Histogram(
    "temper_inference_seconds", "Generation latency per request", ["backend"], buckets=FAST_BUCKETS
)
INFERENCE_INFLIGHT = Gauge("temper_inference_inflight", "Requests in flight", ["backend"])
INFERENCE_BACKEND_HEALTHY = Gauge(
    "temper_inference_backend_healthy", "1 if a backend is healthy", ["backend"]
)
AGENT_CALLS = Counter(
    "temper_agent_calls_total",
    "Calls of agent programs to their episodes' base URLs (outcome: answered, refused, over_budget, "
    "bad_request, failed)",
    ["outcome"],
)
WEIGHT_SWITCH_SECONDS = Histogram(
    "temper_weight_switch_seconds", "Time to switch a backend to new weights", buckets=FAST_BUCKETS
)

# --- trainer ---------------------------------------------------------------------------
POLICY_VERSION = Gauge("temper_policy_version", "Latest policy version", ["job_id"])
TRAINER_STEPS = Counter("temper_trainer_steps_total", "Optimizer steps", ["job_id"])
TRAINER_LOSS = Gauge("temper_trainer_loss", "Loss of the last step", ["job_id"])
TRAINER_REWARD_MEAN = Gauge("temper_trainer_reward_mean", "Mean reward of the last batch", ["job_id"])
TRAINER_REWARD_STD = Gauge("temper_trainer_reward_std", "Reward std of the last batch", ["job_id"])
TRAINER_KL = Gauge("temper_trainer_kl", "KL to the reference policy, last step", ["job_id"])
TRAINER_CLIP_FRACTION = Gauge(
    "temper_trainer_clip_fraction", "Fraction of clipped ratios, last step", ["job_id"]
)
TRAINER_TOKENS_PER_SECOND = Gauge("temper_trainer_tokens_per_second", "Training throughput", ["job_id"])
TRAINER_LOGPROB_MISMATCH = Gauge(
    "temper_trainer_logprob_mismatch",
    "The logprob canary's last checked batch: |behaviour - recomputed| mean and max, and the share "
    "of tokens past the tolerance",
    ["job_id", "stat"],
)
TRAINER_LOGPROB_CHECKED = Counter(
    "temper_trainer_logprob_checked_tokens_total", "Tokens the logprob canary checked", ["job_id"]
)
TRAINER_MISMATCHED_BATCHES = Counter(
    "temper_trainer_mismatched_batches_total",
    "Batches whose behaviour logprobs failed the canary (algorithm.mismatch)",
    ["job_id"],
)
TRAINER_UNCHECKED_VERSIONS = Counter(
    "temper_trainer_unchecked_versions_total",
    "Versions whose first step had no token of that version to check (all stale)",
    ["job_id"],
)
TRAINER_STALENESS = Histogram(
    "temper_trainer_staleness",
    "Policy versions between behaviour and trained policy",
    buckets=(0, 1, 2, 3, 4, 8, 16),
)
INFERENCE_INTERRUPTIONS = Counter(
    "temper_inference_interruptions_total",
    "Generations a new policy version interrupted and that went on from their prefix on it "
    "(partial rollouts, CPU engine)",
)
TRAINER_TOKEN_STALENESS = Gauge(
    "temper_trainer_token_staleness",
    "The last step's model tokens: versions between the trained policy and the one that sampled each "
    "token, mean and max",
    ["job_id", "stat"],
)
TRAINER_MULTI_VERSION_SHARE = Gauge(
    "temper_trainer_multi_version_share",
    "The last step's share of trajectories whose tokens came from two or more policy versions "
    "(partial rollouts)",
    ["job_id"],
)
TRAINER_PUBLISH_FAILING = Gauge(
    "temper_trainer_publish_failing",
    "1 while a job's trained steps cannot be published as a policy version (retried with backoff)",
    ["job_id"],
)
TRAINER_PUBLISH_FAILURES = Counter(
    "temper_trainer_publish_failures_total", "Failed attempts to publish a policy version", ["job_id"]
)
TRAINER_BASE_MODELS = Gauge(
    "temper_trainer_base_models",
    "Copies of a base model the trainer holds (LoRA jobs on one base model share one)",
)
TRAINER_SKIPPED_GROUPS = Counter(
    "temper_trainer_skipped_groups_total", "Groups not trained on, any reason", ["job_id"]
)
DISPATCHER_REPLACEMENT_GROUPS = Counter(
    "temper_dispatcher_replacement_groups_total",
    "Groups started by dynamic sampling in place of zero-variance groups the trainer skipped",
    ["job_id"],
)
EVALUATIONS_FINISHED = Counter(
    "temper_evaluations_finished_total",
    "Evaluation jobs that ended with their results written, by the evaluated job and state",
    ["job_id", "state"],
)
EVALUATION_PASS_AT = Gauge(
    "temper_evaluation_pass_at",
    "The newest finished evaluation of a job's versions: the mean pass@k over its tasks",
    ["job_id", "label", "k"],
)
EVALUATION_VERSION = Gauge(
    "temper_evaluation_version",
    "The version the newest finished evaluation of a job evaluated",
    ["job_id", "label"],
)


def zero(metric: MetricWrapperBase, *label_sets: str | tuple[str, ...]) -> None:
    """Create ``metric``'s children for known label values before anything happens, so each
    exports 0: a panel or alert on a fault that has not occurred reads 0, not "no data"
    (a labelled metric has no series until its first ``.labels()``)."""
    for values in label_sets:
        metric.labels(*((values,) if isinstance(values, str) else values))


def render_latest() -> tuple[bytes, str]:
    """The body and content type of a /metrics response."""
    return generate_latest(), CONTENT_TYPE_LATEST
