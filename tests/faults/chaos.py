"""A chaos run: a private Postgres, a private object store behind a proxy that sees the
trainer's publishes and can refuse requests, optionally a private Kafka broker, one
:class:`FaultStack` of services on them, and groups of jobs submitted in turn, each
group broken at chosen moments. ``bench/chaos.py`` (``make chaos``) runs every scenario;
test_reduced_chaos.py (in ``make test``; alone: ``make chaos-reduced``) a few.

**The workload** (``workload.py``): each group is three jobs at once on one base model,
two training LoRA adapters and one its full weights, served by two CPU engines inside the
gateway (a full-weight job holds an engine alone). Their episodes are multi-turn code
episodes whose every turn runs an action in a sandbox session that carries state from
turn to turn; the last workspace is scored by hidden tests in fresh sandboxes.

**Kills land in flight.** A service is killed at a fault point (``temper.faults``) it is
holding an operation at: a sandbox worker after running an agent's action (its other
sessions live), the scorer with a score computed and not recorded, the gateway with a
generation's tokens not yet tagged and with a version about to be loaded, the trainer
after an optimizer step and in the middle of a publish, the dispatcher with a batch of
results in an open transaction. ``in_flight`` is the work held there at the kill (for
the servers: the steps whose results were awaited); a scenario with none fails.

**Recovery** runs from the fault to the first *correct* progress after it: for the
gateway a result it answered after the kill whose version the registry holds for the
job; for a sandbox worker a turn the new process ran in the workspace of the snapshot it
continued from; for the scorer a score taken after its restart; for the trainer a version
published after the kill; for the dispatcher and the servers any of those.

**Checks** after each group: the counts of before (every episode scored once and trained
once, nothing trained twice, no outbox row lost) and the content checks of
``content.py`` (versions, logprobs, re-scores, workspaces).
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from services.launcher.resources import storage_settings
from temper import faults
from temper.db import SKIPPED_JOB_ENDED, SKIPPED_STALE, Step
from temper.storage import NotFound, S3Store
from tests.faults import content, workload
from tests.faults.harness import (
    CACHE_DIR,
    Facts,
    FaultError,
    FaultStack,
    PrivateKafka,
    PrivateMinio,
    PrivatePostgres,
    Tripwire,
)

PUBLISH = rb"PUT /[^ ]*/versions/v\d+/"
# service -> moment -> the fault point it is killed at
KILLS: dict[str, dict[str, str]] = {
    "sandbox_worker": {"action": "sandbox.act"},
    "reward_scorer": {"score": "scorer.score"},
    "inference_gateway": {"generation": "gateway.generate", "adapter load": "gateway.load"},
    "trainer": {"step": "trainer.step", "publish": "trainer.publish"},
    "dispatcher": {"batch": "dispatcher.batch"},
}
GROUP = (("lora-a", True), ("lora-b", True), ("full", False))
EPISODES = 8  # per iteration and job
TERMINAL = ("completed", "failed", "cancelled")


class JobFinished(Exception):
    """The group's jobs ended before the moment came: submit another group and try there."""


@dataclass
class Recovery:
    seconds: float
    in_flight: int  # the work held at the fault point (or awaited from the server) at the fault
    what: str  # the correct progress that ended it


@dataclass
class Outcome:
    scenario: str
    recovery_s: float | None = None
    in_flight: int | None = None
    error: str | None = None
    job_ok: bool = False

    def took(self, recovery: Recovery) -> None:
        self.recovery_s = round(recovery.seconds, 2)
        self.in_flight = recovery.in_flight

    @property
    def passed(self) -> bool:
        return self.error is None and self.job_ok and self.recovery_s is not None and bool(self.in_flight)


@dataclass
class JobCheck:
    episodes_lost: int
    double_scored: int
    double_trained: int
    outbox_lost: int
    problems: list[str]
    summary: str = ""
    content: content.ContentCheck = field(default_factory=content.ContentCheck)

    @property
    def ok(self) -> bool:
        return not self.problems and self.episodes_lost == 0 and self.outbox_lost == 0 and self.content.ok


class Chaos:
    """The private servers, one FaultStack of services on them, and the job groups in turn."""

    def __init__(
        self, workdir: Path, step_timeout_s: float, *, private_kafka: bool = True, rescore: int = 6
    ) -> None:
        """Without ``private_kafka`` the shared broker serves (and cannot be restarted).
        ``rescore``: scored episodes of each job scored again by the content check."""
        self.timeout = step_timeout_s
        self.rescore = rescore
        self.faults = workdir / "faults"
        self.pg = PrivatePostgres().start()
        self.s3 = PrivateMinio().start()
        self.kafka = PrivateKafka().start() if private_kafka else None
        # Pass-through proxy in front of the object store: sees the publishes, refuses on demand.
        self.proxy = Tripwire(self.s3.port, PUBLISH, lambda: None, drop=False)
        # The stack's own spec sizes the engines: every job of a group on one engine at once.
        sizing = workload.spec("chaos", iterations=1, episodes=EPISODES * len(GROUP), lora=False)
        self.stack = FaultStack(
            workdir,
            sizing,
            db_url=self.pg.url,
            storage={**self.s3.settings(), "TEMPER_STORAGE__ENDPOINT": self.proxy.endpoint},
            bootstrap=self.kafka.bootstrap if self.kafka else None,
            policy_source=workload.cached_policy(CACHE_DIR),
            engines=2,
            faults_dir=self.faults,
        ).prepare()
        self.init = self.stack.spec["policy"]["init"]
        self.store = S3Store(storage_settings(self.stack.stack_env))
        self.stack.start(timeout_s=300)
        self.groups = 0
        self.jobs: dict[str, dict[str, Any]] = {}  # job id -> spec, of the current group
        self.all_jobs: list[str] = []

    def close(self) -> None:
        self.stack.stop()
        self.proxy.close()
        for server in (self.kafka, self.s3, self.pg):
            if server is not None:
                server.close()

    # --- one group of jobs -------------------------------------------------------------------
    def submit(self, name: str, iterations: int) -> None:
        """Two LoRA jobs and a full-weight job of the workload, at once."""
        self.groups += 1
        self.jobs = {}
        for suffix, lora in GROUP:
            spec = workload.spec(
                f"chaos-{self.groups}-{name}-{suffix}", iterations=iterations, episodes=EPISODES, lora=lora
            )
            spec["policy"]["init"] = self.init
            job_id = self.stack.submit(spec, taskset=("chaos", workload.taskset_bytes()))
            self.jobs[job_id] = spec
            self.all_jobs.append(job_id)

    def check_job(self) -> JobCheck:
        """Wait for the group's jobs, count what a fault may have cost, check the content."""
        stack = self.stack
        lost = double_scored = double_trained = 0
        problems: list[str] = []
        lines = []
        for job_id, spec in self.jobs.items():
            facts = stack.wait_job(self.timeout * 3, job_id)
            schedule = spec["schedule"]
            expected = schedule["iterations"] * schedule["episodes_per_iteration"]
            done = {e.id for e in facts.episodes if facts.rewards_done.get(e.id) == 1}
            trained = {e for e, r in facts.ledger.items() if r.step is not None and not r.skipped}
            # dropped by the job's staleness rule: scored once, the drop recorded; not lost
            stale = {e for e, r in facts.ledger.items() if r.skipped == SKIPPED_STALE}
            # the group a stale drop left without a step: recorded when the job completed
            ended = {e for e, r in facts.ledger.items() if r.skipped == SKIPPED_JOB_ENDED}
            lost += expected - len(done & (trained | stale | ended))
            double_scored += sum(1 for n in facts.rewards_done.values() if n > 1)
            # One step per version (``checkpoint_every: 1``): the samples the published
            # versions trained on, past one per trajectory.
            double_trained += max(0, sum(facts.version_samples.values()) - len(trained))
            try:
                stack.assert_each_episode_scored_and_trained_once(facts, allow_stale=True, spec=spec)
            except AssertionError as exc:
                problems.append(f"job {job_id} check: {exc}")
            resent = sum(n - 1 for n in stack.commands(job_id)["trajectories"].values() if n > 1)
            lines.append(
                f"job {job_id} ({spec['name']}): {facts.job.state}, {len(facts.episodes)} episodes, "
                f"versions {facts.versions}, trajectories resent {resent}, stale {len(stale)}, "
                f"left at the end {len(ended)}"
            )
        outbox = stack.outbox_lost()
        problems += outbox[:5]
        checked = asyncio.run(
            content.check(stack.database_url, self.store, list(self.jobs), rescore=self.rescore)
        )
        problems += checked.problems[:20]
        lines.append(checked.summary())
        lines.append(f"outbox rows lost {len(outbox)}")
        return JobCheck(
            lost, double_scored, double_trained, len(outbox), problems, "\n  ".join(lines), checked
        )

    def group_facts(self) -> dict[str, Facts]:
        return {job_id: self.stack.facts(job_id) for job_id in self.jobs}

    def _until(self, what: str, came: Callable[[dict[str, Facts]], bool], every_s: float = 0.1) -> None:
        """Until ``came`` holds; :class:`JobFinished` if every job of the group ended first."""

        def check() -> bool:
            facts = self.group_facts()
            if came(facts):
                return True
            if all(f.job.state in TERMINAL for f in facts.values()):
                raise JobFinished(f"the jobs ended before {what}")
            return False

        self.stack.wait(what, check, self.timeout, every_s=every_s)

    def mid_iteration(self) -> int:
        """Until each job of the group has a version out and episodes in flight; the steps in
        flight then (read again later, they could all have finished in between)."""
        busy: list[int] = []

        def mid(facts: dict[str, Facts]) -> bool:
            busy[:] = [sum(f.leased for f in facts.values())]
            return busy[0] > 0 and any(
                f.job.policy_version >= 1 and f.job.state == "running" for f in facts.values()
            )

        self._until("a version out and episodes in flight", mid)
        return busy[0]

    def in_flight(self) -> int:
        """Steps of the group whose results are awaited now."""
        return sum(f.leased for f in self.group_facts().values())

    # --- correct progress ------------------------------------------------------------------
    def _valid_answer(self, f: Facts, step: Step, since: datetime) -> bool:
        result = step.result or {}
        answered = result.get("answered_at")
        return (
            answered is not None
            and datetime.fromisoformat(answered) > since
            and int(result.get("policy_version", -1)) in {0, *f.versions}
        )

    def _continued(self, step: Step, since: datetime, pid: int | None) -> bool:
        """A sandbox turn run after ``since`` (by process ``pid``) in the workspace it should
        have continued from."""
        result = step.result or {}
        if step.completed_at is None or _aware(step.completed_at) <= since:
            return False
        if pid is not None and not str(result.get("worker", "")).endswith(f"-{pid}"):
            return False
        printed = workload.printed_digest((result.get("exec") or {}).get("stdout") or "")
        request = step.request or {}
        key = request.get("snapshot_key")
        if key:
            try:
                files = workload.snapshot_files(asyncio.run(self.store.get(key)))
            except NotFound:
                return False
        else:
            files = {p: str(c).encode() for p, c in (request.get("files") or {}).items()}
        return printed is not None and printed == workload.workspace_digest(files)

    def correct_progress(self, service: str | None, since: datetime, pid: int | None = None) -> str | None:
        """What correct progress the group made after ``since``, if any (see the module docstring)."""
        for job_id, f in self.group_facts().items():
            if service in ("inference_gateway", None, "dispatcher"):
                if any(self._valid_answer(f, s, since) for s in f.inference):
                    return f"job {job_id}: a result with a registered version"
            if service in ("sandbox_worker", None, "dispatcher"):
                if any(
                    self._continued(s, since, pid if service == "sandbox_worker" else None) for s in f.sandbox
                ):
                    return f"job {job_id}: a sandbox turn in its snapshot's workspace"
            if service in ("reward_scorer", None, "dispatcher"):
                if any(s.completed_at is not None and _aware(s.completed_at) > since for s in f.scored):
                    return f"job {job_id}: a score"
            if service in ("trainer", None):
                if any(_aware(at) > since for at in f.published_at.values()):
                    return f"job {job_id}: a version published"
        if all(f.job.state in TERMINAL for f in self.group_facts().values()):
            return "the jobs ended (their checks say whether anything was lost)"
        return None

    def recovered(
        self, fault_at: float, since: datetime, service: str | None, pid: int | None = None
    ) -> Recovery:
        found: list[str] = []

        def moved() -> bool:
            what = self.correct_progress(service, since, pid)
            if what:
                found.append(what)
            return bool(what)

        self.stack.wait("correct progress after the fault", moved, self.timeout, every_s=0.2)
        return Recovery(time.monotonic() - fault_at, 0, found[0])

    # --- the faults ------------------------------------------------------------------------
    def kill_at(self, service: str, moment: str, *, gather_s: float = 0.5) -> Recovery:
        """Arm ``service``'s fault point for ``moment``, wait until it holds work (and
        ``gather_s`` more, so that more can pile up), SIGKILL the service, disarm, start it
        again, and wait for correct progress. A sandbox worker is armed once sessions have
        state (a few turns behind them), so that they go on from their snapshots in the new
        process. (Only the first arrivals can be waited for: held actions keep the worker's
        slots, so no later turn comes while they are held.)"""
        point = KILLS[service][moment]
        proc = self.stack.services[service].proc
        assert proc is not None and proc.poll() is None, f"{service} is not running"
        if service == "sandbox_worker":
            self._until(
                "turns behind sessions", lambda facts: sum(len(f.sandbox) for f in facts.values()) >= 4
            )
        faults.arm(self.faults, point)
        try:
            self._until(
                f"{service} to hold work at {point}", lambda _: bool(faults.held(self.faults, point)), 0.05
            )
            time.sleep(gather_s)
            held = [h for h in faults.held(self.faults, point) if h["pid"] == proc.pid]
            fault_at, since = time.monotonic(), datetime.now(UTC)
            self.stack.kill(service, signal.SIGKILL)
        finally:
            faults.disarm(self.faults, point)
        if not held:
            raise FaultError(f"the work held at {point} was not {service}'s (pid {proc.pid})")
        self.stack.start_service(service)
        self.stack.wait_healthy(service, self.timeout)
        if service == "reward_scorer":  # a score is taken by the dispatcher: after the new scorer's start
            since = datetime.now(UTC)
        new = self.stack.services[service].proc
        recovery = self.recovered(fault_at, since, service, new.pid if new is not None else None)
        recovery.in_flight = sum(int(h.get("work", 1)) for h in held)
        return recovery

    def restart_kafka(self) -> Recovery:
        assert self.kafka is not None, "the shared broker is not restarted: use private_kafka"
        work = self.mid_iteration()
        t0 = time.monotonic()
        self.kafka.stop()
        time.sleep(5)
        self.kafka.start()
        return self._back(t0, work)

    def restart_postgres(self) -> Recovery:
        work = self.mid_iteration()
        t0 = time.monotonic()
        self.pg.restart(down_s=5)
        return self._back(t0, work)

    def restart_object_store(self) -> Recovery:
        work = self.mid_iteration()
        t0 = time.monotonic()
        self.s3.stop()
        time.sleep(5)
        self.s3.start()
        return self._back(t0, work)

    def refuse_object_store(self, seconds: float = 20.0) -> Recovery:
        """503 on every request for ``seconds``, starting as the trainer uploads a version."""
        started: list[tuple[float, int]] = []
        acted = threading.Event()

        def refuse() -> None:
            try:
                started.append((time.monotonic(), self.in_flight()))
                self.proxy.refuse(seconds)
            finally:
                acted.set()

        self.proxy.on_trip = refuse
        self.proxy.tripped_at = None
        self.proxy.armed = True
        try:
            self._until("a version upload", lambda _: acted.is_set())
        finally:
            self.proxy.armed = False
        t0, work = started[0]
        time.sleep(max(0.0, t0 + seconds - time.monotonic()))
        # the publish that tripped it is held too: one more unit of work
        return self._back(t0, work + 1)

    def _back(self, fault_at: float, in_flight: int) -> Recovery:
        """The broken server is back: correct progress from now on."""
        recovery = self.recovered(fault_at, datetime.now(UTC), None)
        recovery.in_flight = in_flight
        return recovery


def _aware(at: datetime) -> datetime:
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)
