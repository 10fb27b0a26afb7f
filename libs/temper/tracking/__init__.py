"""Experiment tracking: a job whose spec has ``tracking:`` gets an MLflow run (over MLflow's
REST API) with its spec as params, tags for tenant and job, the trainer's numbers per policy
version, the reward per iteration and its final state. The tracker service
(``services/tracker``) feeds :class:`Tracker` from the ``events`` topic (docs/tracking.md)."""

from temper.tracking.mlflow import MlflowClient, MlflowRuns, TrackingRefused, TrackingUnavailable
from temper.tracking.params import flatten, is_secret
from temper.tracking.tracker import Tracker

__all__ = [
    "MlflowClient",
    "MlflowRuns",
    "Tracker",
    "TrackingRefused",
    "TrackingUnavailable",
    "flatten",
    "is_secret",
]
