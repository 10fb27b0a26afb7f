"""Continuous batching for the CPU model runner: a request joins the running batch at its
next token, and a finished one leaves it at once."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.inference_gateway.cpu_server.decoding import Decoding, Row
from services.inference_gateway.cpu_server.runner import (
    GenOutput,
    GenRequest,
    ModelRunner,
    NotServed,
    Stopped,
)
from temper import cores, metrics

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    req: GenRequest
    fut: asyncio.Future[GenOutput]


@dataclass
class _Change:
    """A change of what the runner serves (weights loaded, a base changed, a job let go)."""

    call: Callable[[], float]
    fut: asyncio.Future[float]
    job: str | None = None  # a reload: the job whose next version it loads


class BatchScheduler:
    """Runs the runner's batches in a thread of its own (torch releases the GIL, so the event
    loop keeps taking requests), one token of every row at a time. A request joins the
    running batch before its next token, up to ``max_batch`` rows; a request that finds
    the runner idle waits ``window_ms`` for others to start with it.

    A change of weights (a reload, a release, a base change) waits until the rows running
    finish (no request joins meanwhile), runs alone, and the requests that waited run on
    the new version: a request is never lost, its tokens all come from one version, and its
    output names that version. A request whose job is no longer served here fails with
    :class:`NotServed`. :meth:`stop` abandons the running rows at their next token
    (:class:`Stopped`).

    Partial rollouts: while a reload of job J waits, the running rows of job J whose
    request takes partial rollouts (``GenRequest.partial_rollout``) are cut at their next
    token and set aside with what they sampled; the reload runs once no row runs (the
    other rows finish first, as above), and the rows set aside go on first, from their
    prefixes, on the weights served then. Each token names the version that sampled it.
    """

    def __init__(self, runner: ModelRunner, *, max_batch: int = 16, window_ms: float = 3.0) -> None:
        self.runner = runner
        self.max_batch = max_batch
        self.window_s = window_ms / 1000
        self._cv = threading.Condition()
        self._waiting: deque[_Pending] = deque()
        self._changes: deque[_Change] = deque()
        self._aside: list[Row] = []  # partial rollouts cut for a reload, to go on after it (this thread's)
        self._closing = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle_lock = threading.Lock()  # changes made while no thread runs
        self.batches = 0  # prefills: groups of requests that started decoding together
        self.inflight = 0
        self.rows = 0  # rows decoding now
        self.interruptions = 0  # partial rollouts cut for a new version (that went on on it)
        self._role = f"engine-{id(self):x}"  # in the process's core share (temper.cores)

    async def start(self) -> None:
        if self._thread is None:
            self.runner.stopping = False
            self._closing = False
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._work, name="model-runner", daemon=True)
            self._thread.start()

    async def stop(self) -> None:
        """Stop taking requests; rows decoding end at their next token (:class:`Stopped`),
        and so do the requests and changes still waiting."""
        thread = self._thread
        if thread is None:
            return
        self.runner.stopping = True
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        await asyncio.to_thread(thread.join)
        self._thread = None
        self.runner.stopping = False  # its thread is gone; a direct generate may run again
        with self._cv:
            left: list[asyncio.Future[Any]] = [p.fut for p in self._waiting] + [c.fut for c in self._changes]
            self._waiting.clear()
            self._changes.clear()
        for fut in left:
            if not fut.done():
                fut.set_exception(Stopped("the model runner stopped before this ran"))

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def submit(self, req: GenRequest) -> GenOutput:
        fut: asyncio.Future[GenOutput] = asyncio.get_running_loop().create_future()
        self.inflight += 1
        try:
            with self._cv:
                self._waiting.append(_Pending(req, fut))
                self._cv.notify_all()
            return await fut
        finally:
            self.inflight -= 1

    async def reload(self, path: str | Path, version: int, job_id: str | None = None) -> float:
        return await self._change(lambda: self.runner.load_weights(path, version, job_id), job=job_id or "")

    async def load_base(self, directory: str | Path | None, name: str) -> float:
        return await self._change(lambda: self.runner.load_base(directory, name))

    async def release(self, job_id: str) -> float:
        return await self._change(lambda: self.runner.release(job_id))

    async def _change(self, call: Callable[[], float], job: str | None = None) -> float:
        if self._thread is None:  # not started (or stopped): nothing decodes

            def alone() -> float:
                with self._idle_lock:
                    return call()

            return await asyncio.to_thread(alone)
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        with self._cv:
            self._changes.append(_Change(call, fut, job))
            self._cv.notify_all()
        return await fut

    # --- the runner's thread -----------------------------------------------------------------
    def _settle(self, fut: asyncio.Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
        """Answer a caller on the event loop (from this thread)."""

        def settle() -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def _work(self) -> None:
        batch: Decoding | None = None
        try:
            while True:
                with self._cv:
                    while (
                        not self._closing
                        and batch is None
                        and not self._aside
                        and not self._waiting
                        and not self._changes
                    ):
                        self._cv.wait()
                    if self._closing:
                        raise Stopped("the model runner is stopping")
                    if batch is None and self._changes:
                        change = self._changes.popleft()
                    else:
                        change = None
                    if (
                        batch is None
                        and change is None
                        and not self._aside
                        and len(self._waiting) < self.max_batch
                    ):
                        # an idle runner: others arriving with this request start with it
                        self._cv.wait(self.window_s)
                        if self._closing:
                            raise Stopped("the model runner is stopping")
                    changing = bool(self._changes) or change is not None
                    reloading = {c.job for c in self._changes if c.job is not None}
                    joining = [] if changing else self._take(batch)
                if change is not None:
                    self._run_change(change)
                    continue
                if reloading and batch is not None:
                    batch = self._cut(batch, reloading)
                starting = joining or (not changing and self._aside and (batch is None or batch.can_join))
                cores.set_busy(self._role, bool(starting) or batch is not None)
                cores.fit()  # every core while the trainer waits, half while it steps
                if starting:
                    batch = self._join(batch, joining)
                if batch is not None:
                    batch = self._advance(batch)
                if batch is None:
                    cores.set_busy(self._role, False)
        except Stopped as exc:
            self._fail(batch, exc)
        except BaseException as exc:  # noqa: BLE001 - the thread ends; its callers are told
            log.exception("the model runner's thread failed")
            self._fail(batch, exc)
        finally:
            self.rows = 0
            cores.set_busy(self._role, False)

    def _take(self, batch: Decoding | None) -> list[_Pending]:
        """Requests to start now (called with the condition held): up to the room left, all
        of them only when the running batch can take rows in (else when it is done)."""
        if batch is not None and not batch.can_join:
            return []
        room = self.max_batch - (len(batch.rows) if batch is not None else 0) - len(self._aside)
        taken: list[_Pending] = []
        while self._waiting and len(taken) < room:
            p = self._waiting.popleft()
            if not p.fut.done():  # a caller that gave up is not decoded
                taken.append(p)
        return taken

    def _run_change(self, change: _Change) -> None:
        try:
            result = change.call()
        except BaseException as exc:  # noqa: BLE001 - the caller gets it
            self._settle(change.fut, exc=exc)
        else:
            self._settle(change.fut, result)

    def _cut(self, batch: Decoding, jobs: set[str]) -> Decoding | None:
        """Set aside the partial rollouts of ``jobs`` (whose next version waits to load)."""
        cut = [r for r in batch.rows if r.req.partial_rollout and (r.req.job_id or "") in jobs]
        if not cut:
            return batch
        batch.remove(cut)
        self._aside.extend(cut)
        log.info(
            "%d partial rollouts of jobs %s cut for their next version (at %s tokens)",
            len(cut), ", ".join(sorted(jobs)), ", ".join(str(len(r.ids)) for r in cut),
        )  # fmt: skip
        self.rows = len(batch.rows)
        return batch if batch.rows else None

    def _resume(self) -> list[Row]:
        """The rows set aside, on the weights now served to their jobs (one whose job is not
        served here any more fails alone)."""
        rows: list[Row] = []
        aside, self._aside = self._aside, []
        for r in aside:
            if r.ticket.fut.done():  # its caller gave up
                continue
            try:
                adapter, version = self.runner.served(r.req.job_id)
            except NotServed as exc:
                self._settle(
                    r.ticket.fut, exc=NotServed(f"job {r.req.job_id!r} is not served here now: {exc}")
                )
                continue
            r.resume_on(version, adapter)
            self.interruptions += 1
            metrics.INFERENCE_INTERRUPTIONS.inc()
            rows.append(r)
        return rows

    def _join(self, batch: Decoding | None, joining: list[_Pending]) -> Decoding | None:
        """Prefill the rows set aside (first) and the requests taken, and put them in the
        running batch. A request that cannot be served here now fails alone; a prefill
        that fails fails its own requests."""
        rows: list[Row] = self._resume()
        for p in joining:
            try:
                row = self.runner.row(p.req, ticket=p)
            except NotServed as exc:
                self._settle(p.fut, exc=NotServed(f"job {p.req.job_id!r} is not served here now: {exc}"))
                continue
            if row.finish is not None:  # nothing to generate (max_tokens 0)
                self._settle(p.fut, row.output())
            else:
                rows.append(row)
        if not rows:
            return batch
        try:
            new = self.runner.prefill(rows)
        except Exception as exc:  # noqa: BLE001 - one bad request fails its group, not the server
            log.exception("prefill failed")
            for r in rows:
                self._settle(r.ticket.fut, exc=exc)
            return batch
        self.batches += 1
        if batch is None:
            self.rows = len(new.rows)
            return new
        batch.join(new)
        self.rows = len(batch.rows)
        return batch

    def _advance(self, batch: Decoding) -> Decoding | None:
        try:
            done = self.runner.advance(batch)
        except Stopped:
            raise
        except Exception as exc:  # noqa: BLE001 - a failed step fails its rows, not the server
            log.exception("decoding step failed")
            for r in batch.rows:
                self._settle(r.ticket.fut, exc=exc)
            self.rows = 0
            return None
        for r in done:
            self._settle(r.ticket.fut, r.output())
        self.rows = len(batch.rows)
        return batch if batch.rows else None

    def _fail(self, batch: Decoding | None, exc: BaseException) -> None:
        rows, self._aside = [*(batch.rows if batch is not None else []), *self._aside], []
        if isinstance(exc, Stopped):
            exc = Stopped("the model runner stopped during this generation")
        for r in rows:
            self._settle(r.ticket.fut, exc=exc)
