"""Ranks 1..N-1 of a trainer under ``torchrun``: no Kafka, no database, no HTTP. Each
holds its shard of every job's learner and runs what rank 0 commands
(:mod:`services.trainer.ranks`): ``load`` a job's learner, ``step`` on a batch (this
rank trains on its share), ``publish`` a version (this rank uploads its shard of the
state), ``ping``, ``stop``. It reads the object store for initial weights and versions
and writes its own shard files there."""

from __future__ import annotations

import asyncio
import logging

import torch

from services.trainer.learners import build_learner
from services.trainer.ranks import Ranks
from temper import eventloop
from temper.jobspec import JobSpec
from temper.logs import configure_logging, log_event
from temper.runtime import load_settings
from temper.settings import Settings
from temper.storage import make_store
from temper.training import Learner, pick_device

log = logging.getLogger("temper.trainer")


async def follow(settings: Settings) -> None:
    trainer = settings.trainer
    if trainer.threads:
        torch.set_num_threads(trainer.threads)
    ranks = Ranks.from_env()
    device = await asyncio.to_thread(ranks.init, pick_device(trainer.device))
    store = make_store(settings)
    learners: dict[str, Learner] = {}
    log_event(log, "trainer rank started", rank=ranks.rank, world=ranks.world, device=str(device))
    while True:
        op, args = await asyncio.to_thread(ranks.receive)
        if op == "stop":
            log_event(log, "trainer rank stopped", rank=ranks.rank)
            return
        if op == "load":
            # the same calls as rank 0, so that their collectives meet; a job that rank 0
            # cannot load fails here the same way, before any collective
            try:
                spec = JobSpec.model_validate(args["spec"])
                checkpoint = args["checkpoint"]
                learners[args["job_id"]] = await build_learner(
                    spec, trainer, store, device, tuple(checkpoint) if checkpoint else None, ranks=ranks
                )
            except Exception as exc:  # noqa: BLE001 - rank 0 reports it; keep following
                log_event(log, "cannot load job", logging.ERROR, job_id=args["job_id"], error=repr(exc)[:300])
        elif op == "unload":  # rank 0 let go of a completed job
            learners.pop(args["job_id"], None)
        elif op == "step":
            learner = learners[args["job_id"]]
            learner.version = args["version"]
            # a failure here leaves the ranks out of step: raise, and torchrun restarts them all
            await asyncio.to_thread(learner.step, args["groups"])
        elif op == "publish":
            learner = learners[args["job_id"]]
            try:
                await learner.publish_version(
                    store, args["prefix"], job_id=args["job_id"], version=args["version"],
                    base_model=args["base_model"],
                )  # fmt: skip
                learner.version = args["version"]
            except Exception as exc:  # noqa: BLE001 - rank 0 has the same error and retries
                log_event(log, "publish failed", logging.ERROR, job_id=args["job_id"], error=repr(exc)[:300])


def main() -> None:
    settings = load_settings(service="trainer")
    configure_logging("trainer", settings.log.level, settings.log.json_lines, settings.log.file)
    eventloop.run(follow(settings))
