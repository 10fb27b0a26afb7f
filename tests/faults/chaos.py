"""A chaos run: a private Postgres, a private object store behind a proxy that sees the
trainer's publishes and can refuse requests, optionally a private Kafka broker, one
:class:`FaultStack` of services on them, and jobs submitted in turn, each broken at chosen
moments. ``bench/chaos.py`` (``make chaos``) runs every scenario; test_reduced_chaos.py (in ``make test``; alone: ``make chaos-reduced``) a few.

``recovered`` measures the time from a fault until the job made progress again once the
broken part was back: a step finished, a trajectory reached the trainer, a version was
published or the job completed (for a killed trainer: a trajectory or a version).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from temper.db import SKIPPED_JOB_ENDED, SKIPPED_STALE
from tests.faults.harness import (
    Facts,
    FaultStack,
    PrivateKafka,
    PrivateMinio,
    PrivatePostgres,
    Tripwire,
    small_spec,
)

MOMENTS = ("early", "mid-iteration", "publish")
PUBLISH = rb"PUT /[^ ]*/versions/v\d+/"


class JobFinished(Exception):
    """The job ended before the moment came: submit another and try the scenario there."""


@dataclass
class Outcome:
    scenario: str
    recovery_s: float | None = None
    error: str | None = None
    job_ok: bool = False

    @property
    def passed(self) -> bool:
        return self.error is None and self.job_ok and self.recovery_s is not None


@dataclass
class JobCheck:
    episodes_lost: int
    double_scored: int
    double_trained: int
    outbox_lost: int
    problems: list[str]
    summary: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems and self.episodes_lost == 0 and self.outbox_lost == 0


class Chaos:
    """The private servers, one FaultStack of services on them, and the jobs run in turn."""

    def __init__(self, workdir: Path, step_timeout_s: float, *, private_kafka: bool = True) -> None:
        """Without ``private_kafka`` the shared broker serves (and cannot be restarted)."""
        self.timeout = step_timeout_s
        self.pg = PrivatePostgres().start()
        self.s3 = PrivateMinio().start()
        self.kafka = PrivateKafka().start() if private_kafka else None
        # Pass-through proxy in front of the object store: sees the publishes, refuses on demand.
        self.proxy = Tripwire(self.s3.port, PUBLISH, lambda: None, drop=False)
        self.stack = FaultStack(
            workdir,
            small_spec("chaos"),
            db_url=self.pg.url,
            storage={**self.s3.settings(), "TEMPER_STORAGE__ENDPOINT": self.proxy.endpoint},
            bootstrap=self.kafka.bootstrap if self.kafka else None,
        ).prepare()
        self.init = self.stack.spec["policy"]["init"]
        self.stack.start(timeout_s=300)
        self.jobs = 0

    def close(self) -> None:
        self.stack.stop()
        self.proxy.close()
        for server in (self.kafka, self.s3, self.pg):
            if server is not None:
                server.close()

    # --- one job -------------------------------------------------------------------------
    def submit(self, name: str, iterations: int) -> None:
        self.jobs += 1
        spec = small_spec(f"chaos-{self.jobs}-{name}", **{"schedule.iterations": iterations})
        spec["policy"]["init"] = self.init
        self.stack.spec = spec
        self.stack.submit()

    def check_job(self) -> JobCheck:
        """Wait for the job, then count what a fault may have cost."""
        stack = self.stack
        facts = stack.wait_job(self.timeout * 3)
        schedule = stack.spec["schedule"]
        expected = schedule["iterations"] * schedule["episodes_per_iteration"]
        done = {e.id for e in facts.episodes if facts.rewards_done.get(e.id) == 1}
        trained = {e for e, r in facts.ledger.items() if r.step is not None and not r.skipped}
        # dropped by the job's staleness rule: scored once, the drop recorded; not lost
        stale = {e for e, r in facts.ledger.items() if r.skipped == SKIPPED_STALE}
        # the group a stale drop left without a step: recorded when the job completed
        ended = {e for e, r in facts.ledger.items() if r.skipped == SKIPPED_JOB_ENDED}
        lost = expected - len(done & (trained | stale | ended))
        double_scored = sum(1 for n in facts.rewards_done.values() if n > 1)
        trajectories = stack.commands()["trajectories"]
        # One step per version here (``groups_per_step`` groups, ``checkpoint_every: 1``):
        # the samples the published versions trained on, past one per trajectory.
        double_trained = max(0, sum(facts.version_samples.values()) - len(trained))
        outbox = stack.outbox_lost()
        problems = []
        try:
            stack.assert_each_episode_scored_and_trained_once(facts, allow_stale=True)
        except AssertionError as exc:
            problems.append(f"job check: {exc}")
            untrained = [
                (e.id[:8], e.iteration, e.group_id[:8], e.state, getattr(facts.ledger.get(e.id), "step", "-"))
                for e in facts.episodes
                if e.id not in trained
            ]
            problems.append(f"untrained (episode, iteration, group, state, ledger step): {untrained}")
        problems += outbox[:5]
        resent = sum(n - 1 for n in trajectories.values() if n > 1)
        summary = (
            f"job {stack.job_id}: {facts.job.state}, {len(facts.episodes)} episodes, versions "
            f"{facts.versions}, trajectories resent {resent}, skipped as stale {len(stale)}, "
            f"left at the job's end {len(ended)}, "
            f"outbox rows lost {len(outbox)}"
        )
        return JobCheck(lost, double_scored, double_trained, len(outbox), problems, summary)

    # --- moments and progress -------------------------------------------------------------
    def wait_for(self, moment: str, on_publish: Callable[[], None]) -> None:
        """Until ``moment``; for ``publish``, ``on_publish`` runs inside it (in the proxy).
        Raises :class:`JobFinished` if the job ends first."""

        def until(what: str, moment_came: Callable[[Facts], bool]) -> None:
            def check() -> bool:
                f = self.stack.facts()
                if moment_came(f):
                    return True
                if f.job.state in ("completed", "failed", "cancelled"):
                    raise JobFinished(f"job {f.job.id} {f.job.state} before {what}")
                return False

            self.stack.wait(what, check, self.timeout, every_s=0.1)

        if moment == "early":
            until("the first inference results", lambda f: len(f.inference) >= 1)
        elif moment == "mid-iteration":

            def mid(f: Facts) -> bool:
                busy = [e for e in f.episodes if e.state not in ("scored", "trained")]
                return f.job.policy_version >= 1 and bool(busy) and f.job.state == "running"

            until("a version out and episodes in flight", mid)
        else:
            acted = threading.Event()  # on_publish has returned, not just begun

            def trip() -> None:
                try:
                    on_publish()
                finally:
                    acted.set()

            self.proxy.on_trip = trip
            self.proxy.tripped_at = None
            self.proxy.armed = True
            try:
                until("a version upload", lambda f: acted.is_set())
            finally:
                self.proxy.armed = False

    def progress(self, service: str | None = None) -> tuple[int, bool]:
        """Work done so far (what counts for ``service``), and whether the job is over."""
        f = self.stack.facts()
        over = f.job.state in ("completed", "failed", "cancelled")
        if service == "trainer":
            return len(f.ledger) + len(f.versions), over
        return len(f.inference) + sum(f.rewards_done.values()) + len(f.ledger) + len(f.versions), over

    def recovered(self, fault_at: float, service: str | None = None) -> float:
        """Seconds from ``fault_at`` until progress after now (the broken part is back). A
        job that ended meanwhile counts as progress: it has nothing left to do (whether it
        lost anything is :meth:`check_job`'s to say)."""
        base, _ = self.progress(service)

        def moved() -> bool:
            done, over = self.progress(service)
            return done > base or over

        self.stack.wait("progress after the fault", moved, self.timeout, every_s=0.2)
        return time.monotonic() - fault_at

    # --- the faults ------------------------------------------------------------------------
    def kill_and_restart(self, service: str, moment: str) -> float:
        killed: list[float] = []

        def kill() -> None:
            killed.append(time.monotonic())
            self.stack.kill(service, signal.SIGKILL)

        self.wait_for(moment, kill)
        if not killed:
            kill()
        self.stack.start_service(service)
        self.stack.wait_healthy(service, self.timeout)
        return self.recovered(killed[0], service)

    def restart_kafka(self) -> float:
        self.wait_for("mid-iteration", lambda: None)
        assert self.kafka is not None, "the shared broker is not restarted: use private_kafka"
        t0 = time.monotonic()
        self.kafka.stop()
        time.sleep(5)
        self.kafka.start()
        return self.recovered(t0)

    def restart_postgres(self) -> float:
        self.wait_for("mid-iteration", lambda: None)
        t0 = time.monotonic()
        self.pg.restart(down_s=5)
        return self.recovered(t0)

    def restart_object_store(self) -> float:
        self.wait_for("mid-iteration", lambda: None)
        t0 = time.monotonic()
        self.s3.stop()
        time.sleep(5)
        self.s3.start()
        return self.recovered(t0)

    def refuse_object_store(self, seconds: float = 20.0) -> float:
        """503 on every request for ``seconds``, starting as the trainer uploads a version."""
        started: list[float] = []

        def refuse() -> None:
            started.append(time.monotonic())
            self.proxy.refuse(seconds)

        self.wait_for("publish", refuse)
        time.sleep(max(0.0, started[0] + seconds - time.monotonic()))
        return self.recovered(started[0])
