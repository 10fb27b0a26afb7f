"""What every tracking system is given: the job as the tracker knows it (:class:`TrackedJob`)
and what one lifecycle event logs (:class:`Update`), worked out once by
:class:`temper.tracking.Tracker` and handed to each :class:`Sink` the job's spec names (MLflow,
W&B). A sink only translates: which points, params and state an event means is decided in one
place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from temper import __version__
from temper.jobspec import Tracking
from temper.tracking.params import Scalar

Point = tuple[str, float, int, int]  # key, value, timestamp ms, step

# the axis each point's step counts along, by the key's prefix: train/* and eval/* per policy
# version, rollout/* per iteration (W&B plots each family against its own step metric)
STEP_AXES = (("train/", "policy_version"), ("eval/", "policy_version"), ("rollout/", "iteration"))


def axis_of(key: str) -> str:
    for prefix, axis in STEP_AXES:
        if key.startswith(prefix):
            return axis
    raise ValueError(f"no step axis for the metric {key!r} (temper.tracking.model.STEP_AXES)")


@dataclass(frozen=True)
class TrackedJob:
    """A job whose spec asks for tracking. ``params`` (text) and ``config`` (typed) are the same
    flattened, redacted spec (:mod:`temper.tracking.params`)."""

    id: str
    tenant: str
    name: str
    tracking: Tracking
    params: dict[str, str]
    config: dict[str, Scalar] = field(default_factory=dict)
    labels: tuple[str, ...] = ()  # the spec's tags

    @property
    def tags(self) -> dict[str, str]:
        """The run's key-value tags (MLflow's; W&B gets them in its config)."""
        return {"temper.tenant": self.tenant, "temper.job_name": self.name, "temper.version": __version__,
                "mlflow.runName": self.name}  # fmt: skip


@dataclass(frozen=True)
class Update:
    """What one event logs: metric ``points``, run ``tags`` (``temper.state``,
    ``temper.state_reason``), and, on a ``job.state`` event, the job's ``state``; ``at_ms`` is
    the event's ``occurred_at``."""

    points: list[Point]
    tags: dict[str, str]
    state: str | None
    at_ms: int

    def __bool__(self) -> bool:
        return bool(self.points or self.tags)


class Sink(Protocol):
    """One tracking system. ``log`` raises a ``ConnectionError`` while the system cannot be
    reached (the bus retries the event for as long as that lasts) and anything else when the
    event cannot be logged (retried ``TEMPER_BUS__MAX_RETRIES`` times, then dead-lettered).
    Logging an update again must change nothing: a redelivered event is logged twice."""

    def wants(self, job: TrackedJob) -> bool: ...

    async def log(self, job: TrackedJob, update: Update) -> None: ...

    async def aclose(self) -> None: ...
