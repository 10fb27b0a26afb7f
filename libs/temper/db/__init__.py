"""The database: SQLAlchemy 2 async models that run on Postgres (asyncpg) and SQLite
(aiosqlite), the engine and sessions, and the migration entry point."""

from temper.db.engine import Database, DatabaseUnavailable
from temper.db.models import (
    SKIPPED_JOB_ENDED,
    SKIPPED_STALE,
    SKIPPED_ZERO_VARIANCE,
    ApiKey,
    Base,
    Episode,
    Evaluation,
    EvaluationOutcome,
    EvaluationResult,
    InferenceBackend,
    Job,
    OutboxRow,
    PolicyVersion,
    Step,
    Task,
    TaskOutcome,
    TaskSet,
    Tenant,
    TrainedTrajectory,
)

__all__ = [
    "ApiKey",
    "Base",
    "Database",
    "DatabaseUnavailable",
    "Episode",
    "Evaluation",
    "EvaluationOutcome",
    "EvaluationResult",
    "InferenceBackend",
    "Job",
    "OutboxRow",
    "PolicyVersion",
    "SKIPPED_JOB_ENDED",
    "SKIPPED_STALE",
    "SKIPPED_ZERO_VARIANCE",
    "Step",
    "Task",
    "TaskOutcome",
    "TaskSet",
    "Tenant",
    "TrainedTrajectory",
]
