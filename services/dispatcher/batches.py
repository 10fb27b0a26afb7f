"""Results handed over at the same moment go through one transaction (rewards: one pair).

Each partition of a result topic has its own worker, and each hands its results to the
dispatcher on its own: alone, or a fetched batch's first record of each key. At 64
episodes in flight that is batches of one to four, and the cost of a transaction
(begin, the locking query, one write per table, the outbox insert, commit, the Kafka
send) is paid for each. :class:`ResultBatches` lets the workers' calls that arrive while
a transaction runs wait and go through the next one together, up to ``max_batch``
results, with at most ``parallel`` transactions at a time (group commit).

What each caller sees is what it would see alone: its call returns once the transaction
that took its results committed. If a merged transaction fails, each caller's results
run again on their own (``EpisodeMachine.on_results`` of just them), so a message that
makes a transaction fail fails only its own call, which the bus retries or dead-letters
as before, and an outage reaches every caller as the outage it is.

Results of one episode never meet in one transaction: a partition hands its records of
one key over one at a time, and a call whose episode is already in the next batch waits
for the batch after it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.dispatcher import rewards
from services.dispatcher.episodes import EpisodeMachine
from temper.events import InferenceResult, RewardResult, SandboxResult

Result = InferenceResult | SandboxResult | RewardResult


@dataclass
class _Call:
    messages: list[Result]
    done: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class ResultBatches:
    def __init__(self, machine: EpisodeMachine, *, max_batch: int = 256, parallel: int = 2) -> None:
        self.machine = machine
        self.max_batch = max_batch
        self._slots = asyncio.Semaphore(parallel)
        self._queues: dict[type, list[_Call]] = {InferenceResult: [], SandboxResult: [], RewardResult: []}
        self._draining: set[type] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def take(self, messages: Sequence[Result]) -> None:
        """Take ``messages`` (of one kind, distinct episodes) with whatever else is waiting."""
        if not messages:
            return
        kind = type(messages[0])
        call = _Call(list(messages))
        self._queues[kind].append(call)
        if kind not in self._draining:
            self._draining.add(kind)
            self._spawn(self._drain(kind))
        await call.done

    async def _handle(self, messages: list[Result]) -> None:
        """One transaction (rewards: one pair) for ``messages``, all of one kind."""
        if isinstance(messages[0], RewardResult):
            await rewards.on_rewards(self.machine, messages)  # type: ignore[arg-type]
        else:
            await self.machine.on_results(messages)  # type: ignore[arg-type]

    async def close(self) -> None:
        """Wait for the transactions under way (the consumers have stopped handing over)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro) -> None:  # noqa: ANN001 - a coroutine
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self, kind: type) -> None:
        queue = self._queues[kind]
        try:
            while queue:
                await self._slots.acquire()
                batch: list[_Call] = []
                episodes: set[str | None] = set()
                size = 0
                rest: list[_Call] = []
                for call in queue:
                    ids = {m.episode_id for m in call.messages}
                    if batch and (ids & episodes or size + len(call.messages) > self.max_batch):
                        rest.append(call)
                        continue
                    batch.append(call)
                    episodes |= ids
                    size += len(call.messages)
                queue[:] = rest
                self._spawn(self._run(batch))
        finally:
            self._draining.discard(kind)

    async def _run(self, batch: list[_Call]) -> None:
        try:
            try:
                await self._handle([m for call in batch for m in call.messages])
            except Exception:  # noqa: BLE001 - each call again on its own, below
                if len(batch) == 1:
                    raise
                for call in batch:
                    await self._alone(call)
            else:
                for call in batch:
                    if not call.done.done():
                        call.done.set_result(None)
        except BaseException as exc:
            for call in batch:
                if not call.done.done():
                    call.done.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._slots.release()

    async def _alone(self, call: _Call) -> None:
        # a caller cancelled while it waited (a consumer stopping) has a done future: its
        # results still run (taking a result is idempotent), the future is left alone
        try:
            await self._handle(call.messages)
        except Exception as exc:  # noqa: BLE001 - the caller's own error, raised in its call
            if not call.done.done():
                call.done.set_exception(exc)
        else:
            if not call.done.done():
                call.done.set_result(None)
