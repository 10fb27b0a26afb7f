"""Typed settings for every Temper process.

One object, nested per subsystem, read from the environment with the prefix
``TEMPER_`` and ``__`` between levels (``TEMPER_BUS__BOOTSTRAP``). The same code
runs embedded or distributed by these settings alone.
"""

from __future__ import annotations

import os
import types
import typing
from collections.abc import Mapping
from enum import StrEnum
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from temper.settings.inference import InferenceSettings
from temper.settings.sandbox import SandboxSettings
from temper.settings.trainer import Device, TrainerSettings

# Settings that were removed or moved: still present in the environment, each stops startup
# with what replaces it (a leftover would otherwise be ignored, an operator's dead knob).
RETIRED = {
    "TEMPER_API__SECRET": "removed: nothing read it; callers authenticate with per-tenant API keys "
    "(temper admin create-tenant, POST /v1/tenants/{id}/keys)",
    "TEMPER_API__HOST": "moved: use TEMPER_HOST (every service listens where it says)",
    "TEMPER_API__PORT": "moved: use TEMPER_PORT (every service listens where it says)",
    "TEMPER_INFERENCE__HOST": "moved: use TEMPER_HOST (every service listens where it says)",
    "TEMPER_INFERENCE__PORT": "moved: use TEMPER_PORT (every service listens where it says)",
    "TEMPER_ALLOW_UNSAFE": "moved: use TEMPER_SANDBOX__ALLOW_UNSAFE",
}


class Mode(StrEnum):
    embedded = "embedded"
    distributed = "distributed"


class BusKind(StrEnum):
    inprocess = "inprocess"
    kafka = "kafka"


class StorageKind(StrEnum):
    local = "local"
    s3 = "s3"


class DatabaseSettings(BaseModel):
    url: str = "sqlite+aiosqlite:///./.temper/temper.db"
    echo: bool = False
    pool_size: int = Field(10, ge=1)
    outbox_keep_published_s: float = Field(
        3600.0,
        gt=0,
        description="published outbox rows are deleted this long after publishing (Kafka keeps the "
        "messages; the rows are kept a while to look into what was sent)",
    )

    @field_validator("url")
    @classmethod
    def _supported_driver(cls, url: str) -> str:
        if not url.startswith(("postgresql+asyncpg://", "sqlite+aiosqlite://")):
            raise ValueError(
                "TEMPER_DB__URL must start with postgresql+asyncpg:// or sqlite+aiosqlite:// "
                f"(got {url.split('://', 1)[0]}://...)"
            )
        return url

    @property
    def is_sqlite(self) -> bool:
        return self.url.startswith("sqlite")


class BusSettings(BaseModel):
    kind: BusKind | None = None  # None: in-process when embedded, Kafka when distributed
    bootstrap: str = "127.0.0.1:59092"
    partitions: int = Field(6, ge=1)
    max_retries: int = Field(3, ge=0, description="handler attempts before a message goes to <topic>.dlq")
    retry_backoff_s: float = Field(0.2, ge=0)
    connect_timeout_s: float = Field(15.0, gt=0)
    client_id: str = "temper"
    namespace: str = Field(
        "",
        pattern=r"^[A-Za-z0-9._-]*$",
        description="put in front of every Kafka topic and consumer group name (e.g. 'staging.'), "
        "so deployments can share a cluster",
    )


class StorageSettings(BaseModel):
    kind: StorageKind | None = None  # None: local directory when embedded, S3 when distributed
    root: Path = Path(".temper/objects")
    endpoint: str = "127.0.0.1:59000"
    access_key: str = "temper"
    secret_key: SecretStr = SecretStr("temper-secret-key")
    bucket: str = "temper"
    secure: bool = False
    region: str = "us-east-1"


class RedisSettings(BaseModel):
    url: str = "redis://127.0.0.1:56379/0"


class ApiSettings(BaseModel):
    bootstrap_key: SecretStr | None = Field(
        None, description="if set, an admin API key with this value is created for tenant 'default' at start"
    )


class RewardScorerSettings(BaseModel):
    group: str = Field("reward-scorer", description="consumer group of reward.requests, shared by replicas")
    concurrency: int = Field(8, ge=1, description="submissions scored at once by one scorer")
    model_device: Device = Field(
        Device.auto, description="where reward models run: auto (a GPU where the process sees one), cpu, cuda"
    )
    model_batch: int = Field(
        16, ge=1, le=1024, description="transcripts one reward-model forward scores at most"
    )
    model_cache_dir: Path | None = Field(
        None,
        description="where graders' models are fetched from object storage to (None: a temporary directory)",
    )


class DispatcherSettings(BaseModel):
    """The dispatcher's episode state machine (``TEMPER_DISPATCHER__*``)."""

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
    fleet_max_episodes: int | None = Field(
        None,
        ge=1,
        description="episodes in flight across all tenants; when more wait, the room is shared "
        "by tenant weight (default: no limit beyond each tenant's max_concurrent_episodes)",
    )
    reaper_interval_s: float = Field(1.0, gt=0)
    archive_after_s: float | None = Field(
        3600.0,
        gt=0,
        description="move a finished episode's steps to object storage this long after it finished "
        "(temper.episode_steps; None: keep them in Postgres)",
    )
    archive_interval_s: float = Field(60.0, gt=0, description="how often the dispatcher archives steps")
    result_concurrency: int = Field(
        8, ge=1, description="results handled at once (one episode's in order); keep under the db pool size"
    )
    results_group: str = Field("dispatcher", description="consumer group of the result topics")
    policy_group: str = Field("dispatcher-policy", description="consumer group of policy.updates")
    max_observation_chars: int = Field(4000, ge=200)
    max_context_tokens: int = Field(
        32768, ge=64, description="an episode whose prompt would pass this is scored"
    )
    models: list[str] = Field(
        default_factory=list,
        description="model names the gateway serves beyond its model_name and backends' models; "
        "a job naming another model is refused at submission",
    )


class AgentSettings(BaseModel):
    """Agent programs run in sandboxes (``environment.kind: agent``, docs/agents.md)
    (``TEMPER_AGENT__*``), read by the dispatcher and the sandbox worker."""

    url: str | None = Field(
        None,
        description="the inference gateway as an agent's sandbox reaches it (http://host:port); each "
        "episode's base URL is <url>/agent/<episode>/v1. Unset: jobs with environment.kind agent are refused",
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = value.rstrip("/")
        rest = value.removeprefix("http://")
        if rest == value or not rest or "/" in rest or ":" not in rest:
            raise ValueError(f"{value!r} is not http://host:port (the gateway's address, no path)")
        return value


class LogSettings(BaseModel):
    level: str = "INFO"
    json_lines: bool = True
    file: Path | None = Field(None, description="append logs to this file instead of stderr")


class RetentionSettings(BaseModel):
    days: float | None = Field(
        None,
        gt=0,
        description="delete the objects of jobs finished more than this many days ago (None: keep all)",
    )


class TrackingSettings(BaseModel):
    """Experiment tracking of the jobs that ask for it (docs/tracking.md; ``TEMPER_TRACKING__*``)."""

    wandb_dir: Path | None = Field(
        None,
        description="where W&B offline runs are written, one wandb/ directory per tenant under it "
        "(None: <data_dir>/wandb)",
    )
    wandb_flush_s: float = Field(
        2.0,
        ge=0,
        description="how often wandb-core flushes an open run to its .wandb file (0: only when a buffer "
        "fills or the run finishes)",
    )
    wandb_end_grace_s: float = Field(
        30.0,
        ge=0,
        description="a W&B run stays open this long after its job's end for the numbers that come after "
        "it (the last version), then finishes",
    )


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TEMPER_", env_nested_delimiter="__", extra="ignore")

    mode: Mode = Mode.embedded
    service: str = "temper"
    host: str = Field("127.0.0.1", description="address this service process listens on")
    port: int | None = Field(
        None, ge=1, le=65535, description="port this service process listens on; unset: the service's default"
    )
    data_dir: Path = Path(".temper")
    db: DatabaseSettings = DatabaseSettings()
    bus: BusSettings = BusSettings()
    storage: StorageSettings = StorageSettings()
    redis: RedisSettings = RedisSettings()
    api: ApiSettings = ApiSettings()
    log: LogSettings = LogSettings()
    sandbox: SandboxSettings = SandboxSettings()
    inference: InferenceSettings = InferenceSettings()
    trainer: TrainerSettings = TrainerSettings()
    reward_scorer: RewardScorerSettings = RewardScorerSettings()
    dispatcher: DispatcherSettings = DispatcherSettings()
    retention: RetentionSettings = RetentionSettings()
    tracking: TrackingSettings = TrackingSettings()
    agent: AgentSettings = AgentSettings()

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_environment(cls, data: Any) -> Any:
        problems = unknown_settings(os.environ)
        if problems:
            raise ValueError("; ".join(problems))
        return data

    @model_validator(mode="after")
    def _resolve_and_refuse_unsafe(self) -> Settings:
        distributed = self.mode is Mode.distributed
        if self.bus.kind is None:
            self.bus.kind = BusKind.kafka if distributed else BusKind.inprocess
        if self.storage.kind is None:
            self.storage.kind = StorageKind.s3 if distributed else StorageKind.local
        if distributed:
            if self.bus.kind is BusKind.inprocess:
                raise ValueError("TEMPER_BUS__KIND=inprocess cannot be used with TEMPER_MODE=distributed")
            if self.db.is_sqlite:
                raise ValueError("TEMPER_DB__URL must point at Postgres in distributed mode")
        return self


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The settings model a field holds (``X`` or ``X | None``), or None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [m for a in typing.get_args(annotation) if (m := _model_of(a)) is not None]
        return models[0] if len(models) == 1 else None
    return None


def unknown_settings(environ: Mapping[str, str]) -> list[str]:
    """One line per ``TEMPER_*`` variable that names no setting: a retired one (with what
    replaces it), or a nested one (``TEMPER_<SECTION>__...``) whose path through the
    models does not exist. Top-level names that are no field (``TEMPER_URL``,
    ``TEMPER_API_KEY`` of the client, ``TEMPER_CACHE_DIR`` of the scripts) are not settings
    and pass."""
    problems = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith("TEMPER_"):
            continue
        if upper in RETIRED:
            problems.append(f"{upper} is no longer a setting ({RETIRED[upper]})")
            continue
        parts = upper.removeprefix("TEMPER_").lower().split("__")
        if len(parts) < 2:
            continue
        model: type[BaseModel] = Settings
        for depth, part in enumerate(parts):
            fields = model.model_fields
            if part not in fields:
                known = ", ".join(sorted(fields))
                problems.append(f"{upper} names no setting ({part!r} is not one of: {known})")
                break
            annotation = fields[part].annotation
            sub = _model_of(annotation)
            if sub is None:
                if depth < len(parts) - 1 and typing.get_origin(annotation) is not dict:
                    problems.append(f"{upper} names no setting ({part!r} is a value, not a section)")
                break
            model = sub
    return problems


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()
