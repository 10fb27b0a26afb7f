"""Results handed over at the same moment go through one transaction (rewards: one pair).

Each partition of a result topic has its own worker, and each hands its results to the
dispatcher on its own: alone, or a fetched batch's first record of each key. At 64
episodes in flight that is batches of one to four, and the cost of a transaction
(begin, the locking query, one write per table, the outbox insert, commit, the Kafka
send) is paid for each. :class:`ResultBatches` puts each kind of result through a
:class:`temper.group_commit.GroupCommit` keyed by episode (results of one episode never
meet in one transaction), up to ``max_batch`` results, with at most ``parallel``
transactions at a time over the three kinds. A merged transaction that fails runs each
caller's results again on their own (``EpisodeMachine.on_results`` of just them), so a
message that makes a transaction fail fails only its own call, which the bus retries or
dead-letters as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from services.dispatcher import rewards
from services.dispatcher.episodes import EpisodeMachine
from temper.events import InferenceResult, RewardResult, SandboxResult
from temper.group_commit import GroupCommit

Result = InferenceResult | SandboxResult | RewardResult


class ResultBatches:
    def __init__(self, machine: EpisodeMachine, *, max_batch: int = 256, parallel: int = 2) -> None:
        self.machine = machine
        self.max_batch = max_batch
        slots = asyncio.Semaphore(parallel)
        self._by_kind: dict[type, GroupCommit[Result]] = {
            kind: GroupCommit(self._handle, key=_episode, max_batch=max_batch, slots=slots)
            for kind in (InferenceResult, SandboxResult, RewardResult)
        }

    async def take(self, messages: Sequence[Result]) -> None:
        """Take ``messages`` (of one kind, distinct episodes) with whatever else is waiting."""
        if messages:
            await self._by_kind[type(messages[0])].take(messages)

    async def _handle(self, messages: list[Result]) -> None:
        """One transaction (rewards: one pair) for ``messages``, all of one kind."""
        if isinstance(messages[0], RewardResult):
            await rewards.on_rewards(self.machine, messages)  # type: ignore[arg-type]
        else:
            await self.machine.on_results(messages)  # type: ignore[arg-type]

    async def close(self) -> None:
        """Wait for the transactions under way (the consumers have stopped handing over)."""
        for group in self._by_kind.values():
            await group.close()


def _episode(message: Result) -> str | None:
    return message.episode_id
