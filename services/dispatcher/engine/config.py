"""Settings of the dispatcher's episode engine (``TEMPER_DISPATCHER__*``)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class EngineSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TEMPER_DISPATCHER__", extra="ignore")

    lease_s: float = Field(300.0, gt=0, description="how long a step may take before it is retried")
    reward_lease_s: float | None = Field(None, gt=0, description="lease of reward steps (default: lease_s)")
    trajectory_lease_s: float | None = Field(
        None,
        gt=0,
        description="a scored trajectory not in the trainer's ledger by then is sent again (default: lease_s)",
    )
    max_step_attempts: int = Field(3, ge=1, description="attempts of one step before the episode fails")
    trainer_attached: bool = Field(
        True,
        description="a trainer consumes trajectories: gate new episodes on staleness, mark episodes trained",
    )
    wait_for_training: bool = Field(
        True, description="with a trainer attached, a job completes only when its last episodes were trained"
    )
    scheduler_interval_s: float = Field(0.5, gt=0)
    reaper_interval_s: float = Field(1.0, gt=0)
    result_concurrency: int = Field(
        8, ge=1, description="results handled at once (one episode's in order); keep under the db pool size"
    )
    results_group: str = Field("dispatcher", description="consumer group of the result topics")
    policy_group: str = Field("dispatcher-policy", description="consumer group of policy.updates")
    max_observation_chars: int = Field(4000, ge=200)
    max_context_tokens: int = Field(
        32768, ge=64, description="an episode whose prompt would pass this is scored"
    )
