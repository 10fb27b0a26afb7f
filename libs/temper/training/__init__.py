"""GRPO training: the loss, batching of variable-length trajectories, and the
:class:`Learner` that holds a policy and its optimizer.

- loss: :func:`group_advantages`, :func:`grpo_token_loss` (``temper.training.grpo``)
- batching: :class:`Sample`, :func:`samples_from_groups`, :func:`collate` (``temper.training.batch``)
- learner: :class:`Learner`, :class:`LearnerConfig`, :func:`pick_device` (``temper.training.learner``)
- supervised warm start: :func:`warm_start` (``temper.training.sft``)

Names are imported lazily, so ``temper.settings.trainer`` (read by ``temper.settings``)
does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# ruff: noqa: F401 - the imports below only give mypy the types of the lazy names
if TYPE_CHECKING:  # the same names, typed for mypy (at run time they load on first use)
    from temper.training.batch import Batch, Sample, collate, micro_batches, samples_from_groups
    from temper.training.grpo import group_advantages, grpo_token_loss, is_zero_variance
    from temper.training.learner import Learner, LearnerConfig, StepStats, pick_device
    from temper.training.sft import WarmStartStats, warm_start

_NAMES = {
    "group_advantages": "grpo",
    "grpo_token_loss": "grpo",
    "is_zero_variance": "grpo",
    "Sample": "batch",
    "Batch": "batch",
    "collate": "batch",
    "samples_from_groups": "batch",
    "micro_batches": "batch",
    "Learner": "learner",
    "LearnerConfig": "learner",
    "StepStats": "learner",
    "pick_device": "learner",
    "warm_start": "sft",
    "WarmStartStats": "sft",
}
__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(f"temper.training.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'temper.training' has no attribute {name!r}")
