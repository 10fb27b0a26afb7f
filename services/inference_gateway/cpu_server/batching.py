"""Batching for the CPU model runner: requests that arrive together run as one batch."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from services.inference_gateway.cpu_server.runner import (
    GenOutput,
    GenRequest,
    ModelRunner,
    NotServed,
    Stopped,
)
from temper import metrics

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    req: GenRequest
    fut: asyncio.Future[GenOutput]


class BatchScheduler:
    """Collects requests that arrive within ``window_ms`` of each other into one batch.

    Batches run one at a time in a worker thread (torch releases the GIL), so the event
    loop keeps accepting requests. A weight reload (or release, or base change) waits for
    the running batch, swaps the weights, and the next batch runs on the new version: a
    request is never lost, and its output names the version that produced it; a request
    whose job is no longer served here fails with :class:`NotServed`. A job's reload asks
    the running batch to stop at its next token (:attr:`ModelRunner.switching`) where the
    job's rows take partial rollouts; the rows it stopped go first into the next batch,
    from their prefixes.
    """

    def __init__(self, runner: ModelRunner, *, max_batch: int = 16, window_ms: float = 3.0) -> None:
        self.runner = runner
        self.max_batch = max_batch
        self.window_s = window_ms / 1000
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._resumed: list[_Pending] = []  # interrupted generations, ahead of the queue
        self.batches = 0
        self.inflight = 0
        self.interruptions = 0  # generations a new version interrupted (resumed on it)

    async def start(self) -> None:
        if self._task is None:
            self.runner.stopping = False
            self._task = asyncio.create_task(self._run(), name="runner-scheduler")

    async def stop(self) -> None:
        """Stop taking batches; a batch in its worker thread ends at its next token."""
        if self._task is not None:
            self.runner.stopping = True
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def submit(self, req: GenRequest) -> GenOutput:
        fut: asyncio.Future[GenOutput] = asyncio.get_running_loop().create_future()
        self.inflight += 1
        try:
            await self._queue.put(_Pending(req, fut))
            return await fut
        finally:
            self.inflight -= 1

    async def reload(self, path: str | Path, version: int, job_id: str | None = None) -> float:
        job = job_id or ""
        self.runner.switching.add(job)  # a running batch of partial rollouts stops for it
        try:
            async with self._lock:
                return await asyncio.to_thread(self.runner.load_weights, path, version, job_id)
        finally:
            self.runner.switching.discard(job)

    async def load_base(self, directory: str | Path | None, name: str) -> float:
        async with self._lock:
            return await asyncio.to_thread(self.runner.load_base, directory, name)

    async def release(self, job_id: str) -> float:
        async with self._lock:
            return await asyncio.to_thread(self.runner.release, job_id)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._resumed:
                batch, self._resumed = self._resumed[: self.max_batch], self._resumed[self.max_batch :]
                await self._batch(batch)
                continue
            first = await self._queue.get()
            batch = [first]
            deadline = loop.time() + self.window_s
            while len(batch) < self.max_batch:
                timeout = deadline - loop.time()
                if timeout <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), timeout))
                except TimeoutError:
                    break
            while len(batch) < self.max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            await self._batch(batch)

    async def _batch(self, batch: list[_Pending]) -> None:
        """Run one batch; answer its requests, or put the interrupted ones back first in line."""
        live = [p for p in batch if not p.fut.done()]
        if not live:
            return
        async with self._lock:
            # a job whose weights are not here now (another job's full weights were
            # loaded since it was routed) is refused, not run on the wrong weights
            for p in live:
                if not self.runner.serves(p.req.job_id):
                    p.fut.set_exception(NotServed(f"job {p.req.job_id!r} is not served here now"))
            live = [p for p in live if not p.fut.done()]
            if not live:
                return
            try:
                outs = await asyncio.to_thread(self.runner.generate, [p.req for p in live])
            except asyncio.CancelledError:  # stopping: the batch's callers are told so
                for p in live:
                    if not p.fut.done():
                        p.fut.set_exception(Stopped("the model runner stopped during this generation"))
                raise
            except Exception as exc:  # one bad batch fails its requests, not the server
                log.exception("batch failed")
                for p in live:
                    if not p.fut.done():
                        p.fut.set_exception(exc)
                return
        self.batches += 1
        for p, out in zip(live, outs, strict=True):
            if p.fut.done():
                continue
            if out.interrupted:
                # after the load that stopped it (it holds the lock next): on from its prefix
                self.interruptions += 1
                metrics.INFERENCE_INTERRUPTIONS.inc()
                self._resumed.append(_Pending(replace(p.req, resumed=out.resumed()), p.fut))
            else:
                p.fut.set_result(out)
