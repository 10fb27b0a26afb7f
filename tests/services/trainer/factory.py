"""Trajectories made with the real tiny model and tokenizer, stored where their
``trajectory.ready`` messages point, and a job row to train them for."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from temper.db import Database, Job, Tenant
from temper.events import Topics, TrajectoryReady
from temper.policy import create_model, default_tokenizer, encode_chat, token_logprobs
from temper.storage import ObjectStore, object_key
from temper.trajectory import Segment, Trajectory

TOK = default_tokenizer()
TENANT = "acme"


def job_spec(
    *,
    group_size: int = 4,
    groups_per_step: int = 2,
    checkpoint_every: int = 1,
    max_staleness: int = 8,
    kl_coef: float = 0.0,
) -> dict[str, Any]:
    return {
        "name": "trainer-test",
        "policy": {"model": "temper-policy"},
        "tasks": {"taskset": "ts-1", "group_size": group_size},
        "algorithm": {
            "learning_rate": 1e-3,
            "groups_per_step": groups_per_step,
            "checkpoint_every": checkpoint_every,
            "kl_coef": kl_coef,
        },
        "schedule": {"episodes_per_iteration": group_size * groups_per_step, "max_staleness": max_staleness},
    }


async def add_job(db: Database, job_id: str, spec: dict[str, Any]) -> None:
    async with db.session() as s:
        if await s.get(Tenant, TENANT) is None:
            s.add(Tenant(id=TENANT, name="Acme"))
    async with db.session() as s:
        s.add(Job(id=job_id, tenant_id=TENANT, name=spec["name"], spec=spec, state="running"))


@dataclass
class Made:
    trajectory: Trajectory
    message: TrajectoryReady


class TrajectoryFactory:
    """Multi-turn trajectories whose behaviour logprobs come from the trainer's initial
    policy (the tiny preset, seed 0), stored as JSON where the messages point."""

    def __init__(self, job_id: str, seed: int = 0) -> None:
        self.job_id = job_id
        self.model = create_model("tiny", seed=0)
        self.rng = random.Random(seed)
        self.count = 0

    def make(self, group: str, reward: float, *, version: int = 0, shift: float = 0.0) -> Made:
        """``shift``: added to every behaviour logprob (an engine that reports other weights')."""
        self.count += 1
        episode = f"{self.job_id}-ep{self.count:04d}"
        prompt = encode_chat(TOK, [{"role": "user", "content": f"Solve {group}."}])
        a1 = TOK.encode("x = " + str(self.rng.randint(0, 99))) + [TOK.stop_ids[0]]
        obs = TOK.encode("ok") + [TOK.hf.convert_tokens_to_ids("<|assistant|>")]
        a2 = TOK.encode("done" * self.rng.randint(1, 2)) + [TOK.stop_ids[0]]
        ids = prompt + a1 + obs + a2
        mask = [0] * len(prompt) + [1] * len(a1) + [0] * len(obs) + [1] * len(a2)
        with torch.no_grad():
            lp = token_logprobs(self.model, torch.tensor([ids]), None, torch.tensor([mask]))[0].tolist()
        lp = [x + shift for x in lp]
        n1, n2 = len(prompt), len(prompt) + len(a1) + len(obs)
        traj = Trajectory(
            job_id=self.job_id,
            episode_id=episode,
            task_id=f"task-{group}",
            group_id=group,
            reward=reward,
            segments=[
                Segment(role="prompt", token_ids=prompt),
                Segment(role="model", token_ids=a1, logprobs=lp[n1 : n1 + len(a1)], policy_version=version),
                Segment(role="observation", token_ids=obs),
                Segment(role="model", token_ids=a2, logprobs=lp[n2:], policy_version=version),
            ],
        )
        key = object_key(TENANT, self.job_id, "trajectories", f"{episode}.json")
        msg = TrajectoryReady(
            job_id=self.job_id,
            episode_id=episode,
            task_id=traj.task_id,
            group_id=group,
            trajectory_key=key,
            behaviour_version=version,
            reward=reward,
        )
        return Made(traj, msg)

    def group(self, name: str, rewards: list[float], *, version: int = 0, shift: float = 0.0) -> list[Made]:
        return [self.make(name, r, version=version, shift=shift) for r in rewards]


async def store_all(store: ObjectStore, made: list[Made]) -> None:
    for m in made:
        await store.put(m.message.trajectory_key, m.trajectory.model_dump_json().encode(), "application/json")


async def send_all(bus: Any, made: list[Made]) -> None:
    for m in made:
        await bus.send_message(Topics.TRAJECTORIES, m.message)


async def wait_for(predicate: Callable[[], Awaitable[bool]], within: float = 30.0, what: str = "") -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        await asyncio.sleep(0.05)


def trainer_env(
    database_url: str, kafka_bootstrap: str, s3_settings: Any, unique: str, job_id: str
) -> dict[str, str]:
    """The environment of a trainer process for ``job_id`` on the real stack."""
    return {
        **os.environ,
        "TEMPER_MODE": "distributed",
        "TEMPER_DB__URL": database_url,
        "TEMPER_BUS__BOOTSTRAP": kafka_bootstrap,
        "TEMPER_STORAGE__ENDPOINT": s3_settings.endpoint,
        "TEMPER_STORAGE__ACCESS_KEY": s3_settings.access_key,
        "TEMPER_STORAGE__SECRET_KEY": s3_settings.secret_key.get_secret_value(),
        "TEMPER_STORAGE__BUCKET": s3_settings.bucket,
        "TEMPER_TRAINER__JOB_ID": job_id,
        "TEMPER_TRAINER__DEVICE": "cpu",
        "TEMPER_TRAINER__THREADS": "1",
    }
