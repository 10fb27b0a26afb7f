"""Weights & Biases in offline mode: the :class:`temper.tracking.model.Sink` of
``tracking.wandb``. Each tracked job gets one W&B run, id = the job's id, written by wandb's own
SDK (``wandb.init(mode="offline")``, whose wandb-core writes the ``.wandb`` transaction log)
under ``<wandb_dir>/<tenant>/wandb/offline-run-<time>-<job id>/run-<job id>.wandb``;
``wandb sync`` uploads it. Nothing is sent anywhere: online mode is refused at the spec's door.

What a run holds (docs/tracking.md): the flattened, redacted spec as its config (typed), with
``temper.tenant``, ``temper.job_id``, ``temper.job_name``, ``temper.version``; tags
``tenant:<id>``, ``job:<id>`` and the spec's own; one history row per (policy version or
iteration) with ``train/*`` against the step metric ``policy_version`` and ``rollout/*``
against ``iteration`` (``define_metric``), each row's ``_timestamp`` its event's
``occurred_at``; ``temper.state`` and ``temper.state_reason`` in the summary; at the job's end
the run's exit (0 completed, 1 failed, 2 cancelled).

A history row is written only for values the run does not hold yet: a redelivered event, or
the end's second look at every iteration, adds nothing unless a number changed. What the run
holds is kept in memory and, the first time a process sees the job, read back from the job's
``.wandb`` files with wandb's own reader (:func:`read_records`, ``wandb leet inspect --json``)
and completed from the database (every version's and iteration's numbers), so a tracker that
restarted, or died with points not yet flushed, resumes the run (a new file, ``resume``, its
``_step`` going on from the last) and logs each missing point once.

Every wandb call runs on one thread of its own (the SDK blocks; ``wandb.init`` takes about half
a second). wandb.init replaces ``sys.exit`` and ``sys.excepthook`` for its exit handling: they
are put back, so a crash of the tracker is never logged as the job's failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from temper import __version__
from temper.logs import get_logger
from temper.tracking.model import STEP_AXES, Point, TrackedJob, Update

log = get_logger("temper.tracking.wandb")

T = TypeVar("T")
EXIT_CODES = {"completed": 0, "failed": 1, "cancelled": 2}
SUMMARY_KEYS = ("temper.state", "temper.state_reason")
MAX_TAG, MAX_NAME = 64, 128  # W&B's limits on a tag and a run's display name
CACHED_JOBS = 1000
READ_TIMEOUT_S = 120.0

Row = tuple[str, int, dict[str, float], int]  # step axis, its value, the values, timestamp ms


class WandbFailed(RuntimeError):
    """wandb could not write the run (not an outage: the bus retries, then dead-letters)."""


# --- reading a .wandb file ------------------------------------------------------------------------


def read_records(path: Path, *, timeout_s: float = READ_TIMEOUT_S) -> list[dict[str, Any]]:
    """Every record of a ``.wandb`` transaction log, decoded by wandb's own reader: the
    ``wandb leet inspect --json`` command of the installed wandb (its wandb-core binary reads the
    log and prints one JSON object per record: ``{"num", "type", <type>: {...}}``; a history
    record's ``item`` holds the row's values decoded). A log cut short (a process that died
    mid-write) gives the records before the cut."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_ERROR_REPORTING": "false", "WANDB_SILENT": "true"}
    done = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
        capture_output=True, text=True, timeout=timeout_s, env=env, check=False,
    )  # fmt: skip
    records = []
    for line in done.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except ValueError:
                break
    if done.returncode != 0:
        log.warning("wandb's reader stopped early", extra={"path": str(path), "stderr": done.stderr[-500:]})
    return records


def history(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history rows (``item`` of each ``history`` record), in the order written."""
    return [dict((r.get("history") or {}).get("item") or {}) for r in records if r.get("type") == "history"]


@dataclass
class RunLog:
    """What a job's W&B run holds: for each (step axis, step) the newest value of each metric,
    the next ``_step``, its ``temper.*`` summary, and the job's end its newest file recorded
    (``exit_code``: None while open, or closed as preempting)."""

    logged: dict[tuple[str, int], dict[str, float]] = field(default_factory=dict)
    next_step: int = 0
    summary: dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None
    files: int = 0

    def add(self, records: Iterable[dict[str, Any]]) -> None:
        """Take in the records of one more file (the files in the order they were written)."""
        self.files += 1
        self.exit_code = None
        preempted = False
        axes = [axis for _, axis in STEP_AXES]
        for record in records:
            kind = record.get("type")
            body = record.get(kind) if isinstance(kind, str) else None
            body = body if isinstance(body, dict) else {}
            if kind == "history":
                item = body.get("item") or {}
                step = item.get("_step")
                if isinstance(step, int):
                    self.next_step = max(self.next_step, step + 1)
                for axis in axes:
                    at = item.get(axis)
                    if isinstance(at, int) and not isinstance(at, bool):
                        values = {
                            k: v for k, v in item.items()
                            if not k.startswith("_") and k not in axes and isinstance(v, int | float)
                        }  # fmt: skip
                        self.logged.setdefault((axis, at), {}).update(values)
            elif kind == "summary":
                update = body.get("update") or {}
                self.summary.update({k: v for k, v in update.items() if k in SUMMARY_KEYS})
            elif kind == "preempting":
                preempted = True
            elif kind == "exit" and not preempted:  # a preempted run's exit is the tracker's, not the job's
                self.exit_code = int(body.get("exit_code") or 0)

    def rows(self, points: Iterable[Point]) -> list[Row]:
        """The history rows ``points`` add: one per (axis, step), in the order they first
        come, with the values the run does not hold yet (new, or changed; of two points of
        one key the later wins) and the newest point's timestamp."""
        pending: dict[tuple[str, int], tuple[dict[str, float], int]] = {}
        for key, value, ts, step in points:
            axis = _axis(key)
            if axis is None:
                log.warning("a metric with no step axis is not logged to W&B", extra={"metric": key})
                continue
            values, at = pending.get((axis, step), ({}, ts))
            values[key] = value
            pending[(axis, step)] = (values, max(at, ts))
        out = []
        for (axis, step), (values, ts) in pending.items():
            held = self.logged.get((axis, step), {})
            changed = {k: v for k, v in values.items() if held.get(k) != v}
            if changed:
                out.append((axis, step, changed, ts))
        return out


def _axis(key: str) -> str | None:
    return next((axis for prefix, axis in STEP_AXES if key.startswith(prefix)), None)


# --- the sink -------------------------------------------------------------------------------------


@dataclass
class _Entry:
    log: RunLog
    run: Any = None  # the open wandb Run, or None
    ending: int | None = None  # the job ended with this exit code; its open run finishes after the grace
    timer: asyncio.Task[None] | None = None


class WandbSink:
    """One offline W&B run per job under ``root`` (``TEMPER_TRACKING__WANDB_DIR``).

    At the job's end the run stays open ``end_grace_s`` more (numbers come after it: the trainer
    publishes its last version once the job completed, and the ``events`` topic orders a job's
    events only within a partition), then finishes with the job's exit code; a later number
    resumes it in a new file and ends it again. ``backfill`` gives, for a job seen for the first
    time by this process, every point the database holds for it (so a run resumed after a crash
    is completed); ``max_open`` bounds the runs open at once (each holds a stream in wandb-core):
    the least recently written one is closed (marked preempting unless its job ended) and
    resumed, in a new file, when its job logs again."""

    def __init__(
        self,
        root: Path,
        *,
        flush_s: float = 2.0,
        end_grace_s: float = 30.0,
        backfill: Callable[[TrackedJob], Awaitable[list[Point]]] | None = None,
        max_open: int = 64,
    ) -> None:
        self.root = Path(root)
        self.flush_s = flush_s
        self.end_grace_s = end_grace_s
        self.backfill = backfill
        self.max_open = max_open
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None

    def wants(self, job: TrackedJob) -> bool:
        return job.tracking.wandb is not None

    def directory(self, tenant: str) -> Path:
        """The ``dir`` given to ``wandb.init`` for a tenant's runs (wandb adds ``wandb/``)."""
        return self.root / tenant

    def run_files(self, job_id: str, tenant: str) -> list[Path]:
        """The job's ``.wandb`` files, oldest first (more than one when the run was resumed)."""
        runs = self.directory(tenant) / "wandb"

        def order(path: Path) -> tuple[str, int]:  # offline-run-<time>-<id>[-<n> when a second in one second]
            head, _, tail = path.parent.name.rpartition(f"-{job_id}")
            return head, int(tail[1:]) if tail[1:].isdigit() else 0

        return sorted(runs.glob(f"offline-run-*/run-{job_id}.wandb"), key=order)

    async def _call(self, fn: Callable[[], T]) -> T:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wandb")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def log(self, job: TrackedJob, update: Update) -> None:
        entry = self._entries.get(job.id)
        points = list(update.points)
        try:
            if entry is None:
                entry = _Entry(await self._call(lambda: self._read(job)))
                if self.backfill is not None:
                    points = [*await self.backfill(job), *points]
                self._entries[job.id] = entry
            self._entries.move_to_end(job.id)
            rows = entry.log.rows(points)
            summary = {k: v for k, v in update.tags.items() if k in SUMMARY_KEYS}
            exit_code = EXIT_CODES.get(update.state) if update.state is not None else None
            if exit_code is None and (entry.ending is not None or entry.log.exit_code is not None):
                summary = {}  # the job ended, which no job leaves: an older state redelivered changes nothing
            summary = {k: v for k, v in summary.items() if entry.log.summary.get(k) != v}
            armed = await self._call(lambda: self._write(job, entry, rows, summary, exit_code))
        except Exception as exc:
            # the run may be broken (wandb-core gone): close what can be, read it back next time
            if entry is not None:
                self._entries.pop(job.id, None)
                self._disarm(entry)
                await self._call(partial(self._close, entry))
            raise WandbFailed(f"W&B could not log job {job.id}: {exc!r}") from exc
        if armed:
            self._disarm(entry)
            entry.timer = asyncio.create_task(self._finish_later(entry), name=f"wandb-end-{job.id}")
        await self._evict()

    async def _finish_later(self, entry: _Entry) -> None:
        await asyncio.sleep(self.end_grace_s)
        entry.timer = None
        await self._call(partial(self._close, entry, only_ended=True))

    @staticmethod
    def _disarm(entry: _Entry) -> None:
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None

    async def _evict(self) -> None:
        open_ids = [job_id for job_id, e in self._entries.items() if e.run is not None]
        for job_id in open_ids[: max(0, len(open_ids) - self.max_open)]:
            entry = self._entries[job_id]
            self._disarm(entry)
            await self._call(partial(self._close, entry))
        while len(self._entries) > CACHED_JOBS:
            _, entry = self._entries.popitem(last=False)
            self._disarm(entry)
            await self._call(partial(self._close, entry))

    async def aclose(self) -> None:
        """Close every open run, so each file is complete: a job that ended finishes with its
        exit code, any other is marked preempting (the job goes on, the tracker stopped) and a
        later tracker resumes it."""
        if self._pool is None:
            return
        entries = list(self._entries.values())
        self._entries.clear()
        for entry in entries:
            self._disarm(entry)
            await self._call(partial(self._close, entry))
        self._pool.shutdown(wait=True)
        self._pool = None

    # --- on the wandb thread (one: the decisions below never race) ------------------------------

    def _read(self, job: TrackedJob) -> RunLog:
        run_log = RunLog()
        for path in self.run_files(job.id, job.tenant):
            run_log.add(read_records(path))
        return run_log

    def _write(
        self, job: TrackedJob, entry: _Entry, rows: list[Row], summary: dict[str, str], exit_code: int | None
    ) -> bool:
        """Write ``rows`` and ``summary``, opening (or resuming) the run when there is something
        to write; True when the run is open and its job ended (finish it after the grace)."""
        if exit_code is not None:
            entry.ending = exit_code
        elif entry.run is None and entry.log.exit_code is not None and rows:
            entry.ending = entry.log.exit_code  # a number after the end: resumed, then ended again
        unfinished = entry.ending is not None and entry.log.exit_code != entry.ending
        if entry.run is None and (rows or summary or unfinished):
            entry.run = self._open(job, resume=entry.log.files > 0)
            entry.log.files += 1
            entry.log.exit_code = None
        run = entry.run
        for axis, step, values, ts in rows:
            run.log({**values, axis: step, "_timestamp": ts / 1000}, step=entry.log.next_step, commit=True)
            entry.log.next_step += 1
            entry.log.logged.setdefault((axis, step), {}).update(values)
        if summary:
            run.summary.update(summary)
            entry.log.summary.update(summary)
        if run is None:
            entry.ending = None
        return run is not None and entry.ending is not None

    def _open(self, job: TrackedJob, *, resume: bool) -> Any:
        import wandb  # here: the SDK costs a second to import, and only W&B jobs need it

        spec = job.tracking.wandb
        assert spec is not None
        directory = self.directory(job.tenant)
        directory.mkdir(parents=True, exist_ok=True)
        # wandb-core reports its own crashes to W&B unless told not to: nothing leaves this host
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        settings = wandb.Settings(
            mode="offline", silent=True, console="off", save_code=False, disable_git=True,
            x_disable_stats=True, x_disable_meta=True, x_disable_machine_info=True, x_save_requirements=False,
            x_transaction_log_flush_interval=self.flush_s,
        )  # fmt: skip
        config = {**job.config, "temper.tenant": job.tenant, "temper.job_id": job.id,
                  "temper.job_name": job.name, "temper.version": __version__}  # fmt: skip
        tags = [f"tenant:{job.tenant}", f"job:{job.id}", *job.labels]
        hooks = sys.exit, sys.excepthook
        try:
            run = wandb.init(
                project=spec.project, id=job.id, name=job.name[:MAX_NAME], dir=str(directory), config=config,
                tags=[t[:MAX_TAG] for t in dict.fromkeys(tags)], resume="allow" if resume else None,
                reinit="create_new", settings=settings,
            )  # fmt: skip
        finally:
            sys.exit, sys.excepthook = hooks
        for _, axis in STEP_AXES:
            run.define_metric(axis)
        for prefix, axis in STEP_AXES:
            run.define_metric(f"{prefix}*", step_metric=axis)
        return run

    @staticmethod
    def _close(entry: _Entry, *, only_ended: bool = False) -> None:
        """Finish the open run: with the job's exit code when it ended, else marked preempting
        (``only_ended``: leave a run whose job did not end open)."""
        if entry.run is None or (only_ended and entry.ending is None):
            return
        run, entry.run = entry.run, None
        ending, entry.ending = entry.ending, None
        try:
            if ending is None:
                run.mark_preempting()
                run.finish()
            else:
                run.finish(exit_code=ending)
                entry.log.exit_code = ending
        except Exception:  # a broken run: what wandb-core flushed stays in its file
            log.warning("a W&B run did not close cleanly", exc_info=True)
