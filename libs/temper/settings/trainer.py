"""Settings of the trainer (``TEMPER_TRAINER__*``). Imported by ``temper.settings``, so
nothing here may import torch."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, Field


class Device(StrEnum):
    auto = "auto"  # CUDA when a GPU is visible, else CPU
    cpu = "cpu"
    cuda = "cuda"


class TrainerSettings(BaseModel):
    job_id: str | None = Field(
        None,
        description="train only this job, in its own consumer group (trainer.<job>); unset: every job, group 'trainer'",
    )
    group: str | None = Field(
        None, description="consumer group of trajectories; unset: trainer or trainer.<job_id>"
    )
    device: Device = Device.auto
    bf16: bool = Field(True, description="bf16 autocast on CUDA (weights and optimizer stay float32)")
    preset: str = Field(
        "tiny", description="model preset used when the job's policy names no initial weights"
    )
    seed: int = Field(0, description="weight seed of that preset")
    micro_batch_tokens: int = Field(
        8192, ge=64, description="padded tokens per forward/backward pass; gradients accumulate across passes"
    )
    share_prompts: bool = Field(
        True,
        description="an RL step runs each group's shared prompt through the model once per micro-batch "
        "(the same logprobs and gradient, less compute); off: every sample runs whole",
    )
    memory_limit_gb: float | None = Field(
        None,
        gt=0,
        description="refuse a job whose memory estimate exceeds this; unset: the CUDA device's memory, no limit on CPU",
    )
    adv_eps: float = Field(1e-4, gt=0, description="eps in (r - mean) / (std + eps)")
    weight_decay: float = Field(0.0, ge=0)
    group_timeout_s: float = Field(
        600.0,
        gt=0,
        description="a group still short of group_size after this long is trained as it is (>= 2 samples) or skipped",
    )
    threads: int = Field(0, ge=0, description="torch CPU threads; 0 leaves torch's default")
    run_relay: bool = Field(
        True, description="publish this trainer's outbox rows itself (off when another relay runs)"
    )
