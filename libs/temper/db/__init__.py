"""The database: SQLAlchemy 2 async models that run on Postgres (asyncpg) and SQLite
(aiosqlite), the engine and sessions, and the migration entry point."""

from temper.db.engine import Database, DatabaseUnavailable
from temper.db.models import (
    SKIPPED_JOB_ENDED,
    SKIPPED_STALE,
    SKIPPED_ZERO_VARIANCE,
    AgentCall,
    AgentKey,
    ApiKey,
    Base,
    Episode,
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
    "AgentCall",
    "AgentKey",
    "ApiKey",
    "Base",
    "Database",
    "DatabaseUnavailable",
    "Episode",
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
