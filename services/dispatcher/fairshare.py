"""Sharing the fleets between tenants: weights, quotas, and what each tenant consumed.

Every episode uses the inference fleet and the sandbox fleet from its first turn to its
last, so the dispatcher shares both where it admits episodes. With
``fleet_max_episodes`` set, at most that many episodes are in flight across all tenants;
each free slot goes to the tenant (of those with live jobs) with the fewest episodes in
flight per unit of weight. At weights 2:1 the first tenant then holds two
thirds of the fleet, and as episodes finish two thirds of the admitted ones are its.

Usage is counted on the episode row by the transaction that accepts each result (so a
redelivered result counts once), trainer time on each policy version row by the
trainer's publish, and summed per tenant here. A tenant at or over a quota
starts nothing more: the scheduler pauses its jobs with the quota as the reason, and
resumes them once the quota is raised (or lifted).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from temper.db import Episode, Job, PolicyVersion, Tenant
from temper.events import InferenceResult, SandboxResult
from temper.lifecycle import EpisodeState

E = EpisodeState
IN_FLIGHT = (E.pending, E.awaiting_action, E.acting, E.scoring)
QUOTA_REASON = "quota "  # how a job paused for a quota's reason starts


def inference_tokens(prompt_tokens: int, msg: InferenceResult) -> int:
    """Tokens one inference step used: its prompt and what was sampled."""
    return prompt_tokens + len(msg.token_ids)


def sandbox_cpu_s(msg: SandboxResult) -> float:
    """CPU-seconds of all the actions of one sandbox step (the sandbox's cgroup measures them)."""
    return sum(float(r.get("cpu_s") or 0.0) for r in [msg.result, *msg.more_results])


def sandbox_memory_gb_s(msg: SandboxResult) -> float:
    """Memory the actions of one sandbox step held, in GB-seconds: each action's peak
    (the cgroup's high-water mark) times its wall time. A sandbox's memory is reserved
    for as long as it runs, so its peak, not its average, is what the fleet gives up."""
    return sum(
        float(r.get("peak_memory_mb") or 0.0) / 1024 * float(r.get("wall_s") or 0.0)
        for r in [msg.result, *msg.more_results]
    )


@dataclass(frozen=True)
class Usage:
    sandbox_cpu_s: float = 0.0
    sandbox_memory_gb_s: float = 0.0
    inference_tokens: int = 0
    trainer_s: float = 0.0


# each quota (a Tenant column) and the usage it limits (a Usage field), in the order checked
QUOTAS: dict[str, str] = {
    "quota_sandbox_cpu_s": "sandbox_cpu_s",
    "quota_sandbox_memory_gb_s": "sandbox_memory_gb_s",
    "quota_inference_tokens": "inference_tokens",
    "quota_trainer_s": "trainer_s",
}


async def tenant_usage(session: AsyncSession, tenant_ids: Iterable[str]) -> dict[str, Usage]:
    """What each tenant consumed over all its jobs: its episodes' sandbox and inference
    use (the dispatcher counts it), its policy versions' trainer time (the trainer's)."""
    ids = list(tenant_ids)
    found: dict[str, dict[str, float]] = {t: {} for t in ids}
    episodes = await session.execute(
        select(
            Episode.tenant_id,
            func.coalesce(func.sum(Episode.sandbox_cpu_s), 0.0),
            func.coalesce(func.sum(Episode.sandbox_memory_gb_s), 0.0),
            func.coalesce(func.sum(Episode.inference_tokens), 0),
        )
        .where(Episode.tenant_id.in_(ids))
        .group_by(Episode.tenant_id)
    )
    for tenant_id, cpu, memory, tokens in episodes:
        found[tenant_id].update(sandbox_cpu_s=cpu, sandbox_memory_gb_s=memory, inference_tokens=tokens)
    versions = await session.execute(
        select(Job.tenant_id, func.coalesce(func.sum(PolicyVersion.train_s), 0.0))
        .join(Job, Job.id == PolicyVersion.job_id)
        .where(Job.tenant_id.in_(ids))
        .group_by(Job.tenant_id)
    )
    for tenant_id, seconds in versions:
        found[tenant_id]["trainer_s"] = seconds
    return {
        t: Usage(
            sandbox_cpu_s=float(u.get("sandbox_cpu_s", 0.0)),
            sandbox_memory_gb_s=float(u.get("sandbox_memory_gb_s", 0.0)),
            inference_tokens=int(u.get("inference_tokens", 0)),
            trainer_s=float(u.get("trainer_s", 0.0)),
        )
        for t, u in found.items()
    }


def has_quota(tenant: Tenant) -> bool:
    return any(getattr(tenant, quota) is not None for quota in QUOTAS)


def quota_exceeded(tenant: Tenant, usage: Usage) -> str | None:
    """Why ``tenant`` may start no more episodes, or None while it is within its quotas."""
    for quota, used_name in QUOTAS.items():
        limit, used = getattr(tenant, quota), getattr(usage, used_name)
        if limit is not None and used >= limit:
            shown = f"{used}" if isinstance(used, int) else f"{used:.3f}"
            return f"{QUOTA_REASON}{used_name} exceeded: used {shown} of {limit:g}"
    return None


class FleetShare:
    """Weighted admission to a fleet of ``capacity`` concurrent episodes (None: no limit).

    One object lives as long as the scheduler. :meth:`begin_tick` reads the episodes in
    flight per tenant and plans the free room among the tenants with live jobs, one slot
    at a time: the slot goes to the tenant admitted the fewest episodes per unit of weight
    (start-time fair queueing: a tenant that starts contending begins level with those
    already contending, banking nothing from its absence), among those holding less than
    ``SLACK`` times their weighted share of the fleet, so a tenant whose episodes run long
    cannot take the fleet over; when every tenant holds that much, the slot goes to the
    one with the fewest in flight per unit of weight. :meth:`admit` then answers for each
    group a job wants to start. A tenant that was given room and asked for none is *idle*
    until it asks again, so room no one wants is not held back tick after tick.
    """

    SLACK = 1.25

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.active: Counter[str] = Counter()
        self.weights: dict[str, float] = {}
        self.plan: Counter[str] = Counter()
        self.free = 0
        self.idle: set[str] = set()
        self.contending: set[str] = set()
        self.served: dict[str, float] = {}  # episodes admitted per unit of weight, lifted as above
        self._asked: set[str] = set()
        self.admitted: Counter[str] = Counter()  # episodes admitted per tenant since start

    async def begin_tick(self, session: AsyncSession, tenants: Iterable[str]) -> None:
        """Plan this tick's room for ``tenants`` (those with live jobs)."""
        if self.capacity is None:
            return
        live = set(tenants)
        weights = await session.execute(select(Tenant.id, Tenant.weight).where(Tenant.id.in_(live)))
        active = await session.execute(
            select(Episode.tenant_id, func.count())
            .where(Episode.state.in_([s.value for s in IN_FLIGHT]))
            .group_by(Episode.tenant_id)
        )
        self.replan(
            live,
            active={t: int(n) for t, n in active},
            weights={t: float(w or 1.0) for t, w in weights},
        )

    def replan(self, live: set[str], *, active: dict[str, int], weights: dict[str, float]) -> None:
        """Plan a tick's room from the episodes in flight per tenant."""
        assert self.capacity is not None
        self.idle |= {t for t, room in self.plan.items() if room > 0 and t not in self._asked}
        self._asked = set()
        self.weights.update(weights)
        self.active = Counter(active)
        self.free = max(0, self.capacity - sum(self.active.values()))
        contending = live - self.idle
        stayed = contending & self.contending
        floor = min((self.served.get(t, 0.0) for t in stayed), default=0.0)
        for t in contending - self.contending:
            self.served[t] = max(self.served.get(t, 0.0), floor)
        self.contending = contending
        self.plan = self._fill(sorted(contending), self.free)

    def _fill(self, tenants: list[str], slots: int) -> Counter[str]:
        plan: Counter[str] = Counter()
        if not tenants:
            return plan
        assert self.capacity is not None
        total = sum(self._w(t) for t in tenants)
        cap = {t: self.SLACK * self.capacity * self._w(t) / total for t in tenants}
        for _ in range(slots):
            under = [t for t in tenants if self.active[t] + plan[t] < cap[t]]
            if under:
                t = min(under, key=lambda t: (self.served.get(t, 0.0) + plan[t] / self._w(t), t))
            else:
                t = min(tenants, key=lambda t: ((self.active[t] + plan[t]) / self._w(t), t))
            plan[t] += 1
        return plan

    def _w(self, tenant_id: str) -> float:
        return self.weights.get(tenant_id, 1.0)

    def need(self, tenant_id: str) -> float:
        """Episodes in flight per unit of weight."""
        return self.active[tenant_id] / self._w(tenant_id)

    def why_not(self, tenant_id: str) -> str:
        """Why :meth:`admit` refused ``tenant_id`` (said in the job's reason)."""
        if self.free <= 0:
            return f"the fleet runs its fleet_max_episodes ({self.capacity})"
        return f"the fleet's {self.free} free slots are planned for tenants with a smaller share"

    def admit(self, tenant_id: str, size: int) -> bool:
        """May ``tenant_id`` start a group of ``size`` episodes now? A group may pass its
        tenant's planned room by less than one group; the next tick's plan evens it out."""
        if self.capacity is not None:
            self._asked.add(tenant_id)
            self.idle.discard(tenant_id)
            spare = self.free - sum(self.plan.values())
            if size > self.free or (self.plan[tenant_id] <= 0 and spare < size):
                return False
            self.plan[tenant_id] = max(0, self.plan[tenant_id] - size)
            self.free -= size
            self.served[tenant_id] = self.served.get(tenant_id, 0.0) + size / self._w(tenant_id)
        self.active[tenant_id] += size
        self.admitted[tenant_id] += size
        return True
