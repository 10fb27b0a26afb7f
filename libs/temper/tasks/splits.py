"""Held-out tasks: a task set split into a train part and a held-out part when it is
uploaded (docs/tasks-and-rewards.md, "Held-out tasks").

A task's part is written once, on its row (``tasks.split``), and every training path draws
from the train part only (``temper.tasks.service.sampleable``): a held-out task never
reaches a training episode, the curriculum or a training pass rate. Evaluations name the
part they sample (``evaluation.split``).

Two rules:

- **by seed**: ``fraction`` of the tasks, ``round(fraction x tasks)``, are held out: those
  whose ``sha256("<seed>:<task id>")`` is smallest. The choice depends on the ids and the
  seed only, not on the order of the file, and the same upload splits the same way;
- **by a field**: a task whose ``metadata.<field>`` is one of ``values`` is held out (a
  dataset's own ``split: test`` column, imported into the metadata).

A rule that holds out no task, or every task, is refused: the first is a mistake, the second
a task set to evaluate on (upload it without a split and evaluate on ``split: all``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from temper.tasks.models import TaskSpec


class TaskSplit(StrEnum):
    """A task's part of its set."""

    train = "train"
    held_out = "held_out"


class SplitError(ValueError):
    """A split rule that cannot be applied to the uploaded tasks."""


class HeldOut(BaseModel):
    """How an upload is split: ``fraction`` (with ``seed``) or ``field`` (with ``values``)."""

    model_config = ConfigDict(extra="forbid")
    fraction: float | None = Field(None, gt=0, lt=1, description="the share of tasks held out, by seed")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="the seed of the choice")
    field: str | None = Field(
        None, min_length=1, max_length=64, pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$",
        description="a metadata field: a task whose value is one of values is held out",
    )  # fmt: skip
    values: list[str] = Field(default_factory=list, max_length=100)

    @model_validator(mode="after")
    def _one_rule(self) -> HeldOut:
        if (self.fraction is None) == (self.field is None):
            raise ValueError(
                "a held-out split is by fraction (and seed) or by field (and values), one of the two"
            )
        if self.field is not None and not self.values:
            raise ValueError("a split by field needs the values that mark a held-out task")
        if self.field is None and self.values:
            raise ValueError("values apply to a split by field")
        return self

    def describe(self) -> str:
        if self.fraction is not None:
            return f"{self.fraction:g} of the tasks by seed {self.seed}"
        return f"metadata.{self.field} in {self.values}"


def _rank(seed: int, task_id: str) -> str:
    return hashlib.sha256(f"{seed}:{task_id}".encode()).hexdigest()


def _field_value(task: TaskSpec, field: str) -> Any:
    meta = task.metadata.model_dump(mode="json")
    return meta.get(field)


def held_out_ids(tasks: Sequence[TaskSpec], rule: HeldOut) -> set[str]:
    """The ids of ``tasks`` that ``rule`` holds out; :class:`SplitError` when it holds out
    none or all of them."""
    if rule.fraction is not None:
        count = round(rule.fraction * len(tasks))
        ranked = sorted(tasks, key=lambda t: _rank(rule.seed, t.id))
        held = {t.id for t in ranked[:count]}
    else:
        assert rule.field is not None
        wanted = set(rule.values)
        held = {t.id for t in tasks if (v := _field_value(t, rule.field)) is not None and str(v) in wanted}
    if not held:
        raise SplitError(f"the held-out split ({rule.describe()}) holds out none of the {len(tasks)} tasks")
    if len(held) == len(tasks):
        raise SplitError(
            f"the held-out split ({rule.describe()}) holds out all {len(tasks)} tasks, leaving none to train on; "
            "a task set only to evaluate on needs no split (evaluate on split: all)"
        )
    return held


def record_of(rule: HeldOut, tasks: int, held: int) -> dict[str, Any]:
    """What a task set row keeps of its split (``task_sets.held_out``)."""
    return {**rule.model_dump(mode="json", exclude_none=True), "tasks": tasks, "held_out": held}
