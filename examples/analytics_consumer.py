"""An example downstream consumer of Temper's ``events`` topic.

It keeps per-job aggregates — episodes by state, mean reward per iteration, the latest
policy version and job state — from the lifecycle events the dispatcher publishes.
It runs against either bus (``TEMPER_BUS__KIND=kafka`` with ``TEMPER_BUS__BOOTSTRAP``,
or the in-process bus), and prints a summary line per job every few seconds::

    TEMPER_BUS__KIND=kafka python examples/analytics_consumer.py --group analytics

Delivery is at-least-once, so the aggregates are built to tolerate duplicates: an
episode's state is a map keyed by episode id (the last state seen wins, and a state
never moves back out of a finished one) and each reward counts once per episode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from temper.bus import Record, make_bus
from temper.events import BadMessage, LifecycleEvent, Topics, decode
from temper.settings import Settings

log = logging.getLogger("temper.examples.analytics")
FINISHED = {"scored", "trained", "failed", "cancelled"}


@dataclass
class JobStats:
    state: str | None = None
    policy_version: int = 0
    episode_state: dict[str, str] = field(default_factory=dict)
    rewards: dict[int, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))

    def episodes_by_state(self) -> dict[str, int]:
        return dict(Counter(self.episode_state.values()))

    def mean_reward_by_iteration(self) -> dict[int, float]:
        return {it: sum(r.values()) / len(r) for it, r in sorted(self.rewards.items()) if r}


class Aggregates:
    def __init__(self) -> None:
        self.jobs: dict[str, JobStats] = defaultdict(JobStats)
        self.skipped = 0

    def apply(self, event: LifecycleEvent) -> None:
        if not event.job_id:
            return
        job = self.jobs[event.job_id]
        if event.event == "job.state":
            job.state = event.state
        elif event.event == "episode.state" and event.episode_id and event.state:
            current = job.episode_state.get(event.episode_id)
            if current in FINISHED and event.state not in FINISHED | {"trained"}:
                return  # a redelivered older event
            job.episode_state[event.episode_id] = event.state
        elif event.event == "episode.reward" and event.episode_id and event.reward is not None:
            job.rewards[int(event.data.get("iteration", 0))][event.episode_id] = event.reward
        elif event.event == "policy.version" and event.version is not None:
            job.policy_version = max(job.policy_version, event.version)

    async def handle(self, record: Record) -> None:
        try:
            message = decode(record.value)
        except BadMessage:
            self.skipped += 1  # a newer schema or a stranger: analytics never blocks on it
            return
        if isinstance(message, LifecycleEvent):
            self.apply(message)

    def summary(self) -> dict[str, dict]:
        return {
            job_id: {
                "state": s.state,
                "policy_version": s.policy_version,
                "episodes": s.episodes_by_state(),
                "mean_reward": s.mean_reward_by_iteration(),
            }
            for job_id, s in self.jobs.items()
        }


async def run(settings: Settings, group: str, every_s: float) -> None:
    bus = make_bus(settings)
    await bus.start()
    await bus.create_topics([Topics.EVENTS])
    aggregates = Aggregates()
    consumer = await bus.subscribe([Topics.EVENTS], group, aggregates.handle)
    try:
        while True:
            await asyncio.sleep(every_s)
            for job_id, row in aggregates.summary().items():
                sys.stdout.write(json.dumps({"job_id": job_id, **row}, default=str) + "\n")
            sys.stdout.flush()
    finally:
        await consumer.stop()
        await bus.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", default="analytics-example", help="Kafka consumer group")
    parser.add_argument("--every", type=float, default=5.0, help="seconds between summaries")
    args = parser.parse_args()
    try:
        asyncio.run(run(Settings(), args.group, args.every))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
