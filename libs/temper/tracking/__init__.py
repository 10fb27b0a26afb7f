"""Experiment tracking: a job whose spec has ``tracking:`` gets an MLflow run (over MLflow's
REST API) and/or an offline W&B run (wandb's SDK), each with its spec as params, tags for
tenant and job, the trainer's numbers per policy version, the reward per iteration and its
final state. The tracker service (``services/tracker``) feeds :class:`Tracker` from the
``events`` topic (docs/tracking.md)."""

from temper.tracking.mlflow import MlflowClient, MlflowRuns, MlflowSink, TrackingRefused, TrackingUnavailable
from temper.tracking.model import Sink, TrackedJob, Update
from temper.tracking.params import flatten, flatten_values, is_secret
from temper.tracking.tracker import Tracker
from temper.tracking.wandb_offline import WandbFailed, WandbSink, read_records

__all__ = [
    "MlflowClient",
    "MlflowRuns",
    "MlflowSink",
    "Sink",
    "TrackedJob",
    "Tracker",
    "TrackingRefused",
    "TrackingUnavailable",
    "Update",
    "WandbFailed",
    "WandbSink",
    "flatten",
    "flatten_values",
    "is_secret",
    "read_records",
]
