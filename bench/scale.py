"""Thousands of live episodes on one machine, through real Kafka and Postgres.

The real dispatcher (in this process) runs one job of ``--episodes`` episodes, all allowed
in flight at once, against the stub peers of bench/dispatch.py in a process of their own:
a policy that answers each turn after 20-30 s (as a long LLM call does), a no-op sandbox
and a constant reward. Every 2 s it samples the live episodes (started, not yet scored),
the resident memory of the dispatcher's process and of the peers' process, the database
(rows, size, connections, rows written), the dispatcher's consumer lag and CPU. From the
plateau (the samples where at least 95 % of the target is live) it reports:

- memory per live episode: the growth of each process's RSS over its idle baseline,
  divided by the live episodes;
- Postgres: rows and bytes per episode, connections, rows written and transactions per
  second;
- transitions per second (steps finished: one inference and one sandbox result a turn,
  one reward an episode) and the dispatcher's CPU per transition;
- the dispatcher's consumer lag on the result topics (median and largest).

    python bench/scale.py                 # make bench-scale: 2,000 live episodes
    python bench/scale.py --episodes 500  # a quicker look

Writes bench/results/scale.json (flat JSON). docs/capacity.md builds on these figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "libs"), str(ROOT)]

import asyncpg  # noqa: E402
from sqlalchemy import func, select  # noqa: E402

from bench.dispatch import Bench, bench_stack, metric_table, pct, replica_stats, run_loop, spec  # noqa: E402
from temper import metrics  # noqa: E402
from temper.db import Episode, Job, Step  # noqa: E402
from temper.lifecycle import EpisodeState as E  # noqa: E402

LIVE = (E.awaiting_action, E.acting, E.scoring)
TABLES = ("episodes", "steps", "outbox")


@dataclass
class Sample:
    t: float
    live: int
    finished_steps: int
    scored: int
    dispatcher_rss_mb: float
    peers_rss_mb: float
    cpu_s: float
    lag: int
    rows: dict[str, int]
    db_bytes: int
    connections: int
    tuples_written: int
    commits: int
    wal_bytes: int
    replicas: list[dict]


def rss_mb(pid: int) -> float:
    """A process's resident memory (Linux: VmRSS in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def consumer_lag(group: str) -> int:
    """The dispatcher's lag on its result topics, from its own gauge (it runs here)."""
    total = 0.0
    for family in metrics.BUS_CONSUMER_LAG.collect():
        for s in family.samples:
            if s.labels.get("group") == group:
                total += s.value
    return int(total)


async def sample(bench: Bench, pg: asyncpg.Connection, job_id: str, t0: float) -> Sample:
    """One look at everything; with replicas, the dispatcher's figures are their sums."""
    async with bench.runtime.db.session() as s:
        states = dict(
            (
                await s.execute(
                    select(Episode.state, func.count())
                    .where(Episode.job_id == job_id)
                    .group_by(Episode.state)
                )
            ).all()
        )
        finished = await s.scalar(
            select(func.count())
            .select_from(Step)
            .join(Episode, Episode.id == Step.episode_id)
            .where(Episode.job_id == job_id, Step.state == "done")
        )
    rows = {t: int(await pg.fetchval(f"SELECT count(*) FROM {t}")) for t in TABLES}  # noqa: S608 - fixed names
    stat = await pg.fetchrow(
        "SELECT tup_inserted + tup_updated + tup_deleted AS written, xact_commit,"
        " pg_database_size(datname) AS size,"
        " (SELECT count(*) FROM pg_stat_activity a WHERE a.datname = d.datname) AS connections"
        " FROM pg_stat_database d WHERE datname = $1",
        bench.database,
    )
    wal = int(await pg.fetchval("SELECT wal_bytes FROM pg_stat_wal"))
    replicas = replica_stats(bench)
    return Sample(
        t=time.perf_counter() - t0,
        live=sum(states.get(state, 0) for state in LIVE),
        finished_steps=int(finished or 0),
        scored=states.get(E.scored, 0),
        dispatcher_rss_mb=sum(r["rss_mb"] for r in replicas) if replicas else rss_mb(os.getpid()),
        peers_rss_mb=rss_mb(bench.peers.pid),
        cpu_s=sum(r["cpu_s"] for r in replicas) if replicas else time.process_time(),
        lag=int(sum(r["lag"] for r in replicas)) if replicas else consumer_lag(bench.results_group),
        rows=rows,
        db_bytes=int(stat["size"]),
        connections=int(stat["connections"]),
        tuples_written=int(stat["written"]),
        commits=int(stat["xact_commit"]),
        wal_bytes=wal,
        replicas=replicas,
    )


def rate(samples: list[Sample], attr: str) -> float:
    first, last = samples[0], samples[-1]
    return (getattr(last, attr) - getattr(first, attr)) / max(1e-9, last.t - first.t)


async def exactly_once(pg: asyncpg.Connection, job_id: str) -> dict:
    """What shows a result taken twice or a lease that expired: retried steps, failed
    episodes, and commands per step (each step's command is written once, plus once per
    retry). Every outbox row of the bench's fresh database is this job's."""
    return {
        "steps_retried": int(await pg.fetchval("SELECT count(*) FROM steps WHERE attempt > 0")),
        "episodes_failed": int(
            await pg.fetchval("SELECT count(*) FROM episodes WHERE job_id = $1 AND state = 'failed'", job_id)
        ),
        "step_rows": int(await pg.fetchval("SELECT count(*) FROM steps")),
        "command_rows": int(
            await pg.fetchval(
                "SELECT count(*) FROM outbox WHERE topic IN"
                " ('inference.requests', 'sandbox.requests', 'reward.requests')"
            )
        ),
    }


async def run(args: argparse.Namespace) -> dict:
    logging.disable(logging.WARNING)
    load_start = os.getloadavg()[0]
    async with bench_stack(
        "scale",
        partitions=args.partitions,
        max_turns=args.turns,
        policy_delay_s=(args.turn_s_min, args.turn_s_max),
        # a turn takes up to turn_s_max and may wait in the peers' queue: no retry by lease here
        lease_s=2 * args.turn_s_max + 300,
        scheduler_interval_s=args.scheduler_interval_s,
        replicas=args.replicas,
        replica_pool_size=args.pool_size,
        fleet_max_episodes=args.fleet_max_episodes,
    ) as bench:
        pg = await asyncpg.connect(bench.admin_url.rsplit("/", 1)[0] + f"/{bench.database}")
        try:
            idle = await sample(bench, pg, "-", time.perf_counter())
            job_id = f"{bench.prefix}scale"
            async with bench.runtime.db.session() as s:
                s.add(
                    Job(
                        id=job_id,
                        tenant_id="bench",
                        name="bench-scale",
                        spec=spec(args.episodes, args.episodes, args.turns),
                        state="pending",
                    )
                )
            t0 = time.perf_counter()
            samples: list[Sample] = []
            while True:
                samples.append(await sample(bench, pg, job_id, t0))
                cur = samples[-1]
                print(  # noqa: T201 - progress a person watches
                    f"  t={cur.t:6.1f}s live {cur.live:5d} scored {cur.scored:5d} lag {cur.lag:5d} "
                    f"dispatcher {cur.dispatcher_rss_mb:6.0f} MB peers {cur.peers_rss_mb:5.0f} MB",
                    flush=True,
                )
                async with bench.runtime.db.session() as s:
                    state = await s.scalar(select(Job.state).where(Job.id == job_id))
                if state in ("completed", "failed", "cancelled"):
                    break
                if args.observe_s and cur.t > args.observe_s:
                    break  # past capacity: what admission does is seen by now
                if cur.t > args.timeout_s:
                    raise TimeoutError(f"job {job_id} did not finish in {args.timeout_s} s")
                await asyncio.sleep(2.0)
            checks = await exactly_once(pg, job_id)
            for table in ("episodes", "steps", "outbox"):  # indexes and TOAST included
                checks[f"pg_{table}_bytes"] = int(
                    await pg.fetchval("SELECT pg_total_relation_size($1::regclass)", table)
                )
            async with bench.runtime.db.session() as s:
                checks["job_state_reason"] = await s.scalar(select(Job.state_reason).where(Job.id == job_id))
        finally:
            await pg.close()
    # the replicas write their final stats (with the episodes they took) as they stop, at the block's end
    final_replicas = replica_stats(bench)
    target = min(args.episodes, args.fleet_max_episodes or args.episodes)
    peak = max(samples, key=lambda x: x.live)
    plateau = [x for x in samples if x.live >= 0.95 * target] or [peak]
    at_peak = max(plateau, key=lambda x: x.dispatcher_rss_mb)
    live = max(1, peak.live)
    transitions = rate(plateau, "finished_steps") if len(plateau) > 1 else float("nan")
    cpu_per_transition = (
        (plateau[-1].cpu_s - plateau[0].cpu_s)
        * 1000
        / max(1, plateau[-1].finished_steps - plateau[0].finished_steps)
        if len(plateau) > 1
        else float("nan")
    )
    ramp = next((x.t for x in samples if x.live >= 0.95 * target), None)
    last = samples[-1]
    third = max(1, len(plateau) // 3)
    replicas = {}
    if final_replicas:
        ids = [set(r.get("episode_ids", [])) for r in final_replicas]
        shared = set().union(*(a & b for i, a in enumerate(ids) for b in ids[i + 1 :]))
        replicas = {
            "replicas": len(final_replicas),
            "replica_results_taken": ", ".join(str(r["taken"]) for r in final_replicas),
            "replica_episodes": ", ".join(str(r["episodes"]) for r in final_replicas),
            "replica_cpu_s": ", ".join(str(round(r["cpu_s"], 1)) for r in final_replicas),
            "replica_rss_mb": ", ".join(str(round(r["rss_mb"], 1)) for r in final_replicas),
            # aiokafka's round-robin assignment deals each result topic's partitions out on
            # its own, so one episode's inference and sandbox results may go to two replicas
            # (each result to one); what must never happen is a result taken twice
            "episodes_on_two_replicas": len(shared),
            "results_taken_twice": sum(r["taken"] for r in final_replicas) - checks["step_rows"],
            "pool_size_per_replica": args.pool_size,
        }
    return {
        **replicas,
        **checks,
        "episodes": args.episodes,
        "state": state,
        "live_episodes_peak": peak.live,
        "live_at_target_s": round(plateau[-1].t - plateau[0].t, 1) if len(plateau) > 1 else 0.0,
        "ramp_to_target_s": round(ramp, 1) if ramp is not None else None,
        "job_wall_s": round(last.t, 1),
        "turns_per_episode": args.turns,
        "turn_s_min": args.turn_s_min,
        "turn_s_max": args.turn_s_max,
        "dispatcher_rss_idle_mb": round(idle.dispatcher_rss_mb, 1),
        "dispatcher_rss_peak_mb": round(at_peak.dispatcher_rss_mb, 1),
        "dispatcher_kb_per_live_episode": round(
            (at_peak.dispatcher_rss_mb - idle.dispatcher_rss_mb) * 1024 / live, 1
        ),
        "policy_stub_rss_idle_mb": round(idle.peers_rss_mb, 1),
        "policy_stub_kb_per_live_episode": round(
            (max(x.peers_rss_mb for x in plateau) - idle.peers_rss_mb) * 1024 / live, 1
        ),
        "transitions_per_s": round(transitions, 1),
        "dispatcher_cpu_ms_per_transition": round(cpu_per_transition, 2),
        "lag": round(statistics.median(x.lag for x in plateau), 1),
        "lag_max": max(x.lag for x in samples),
        "pg_connections_max": max(x.connections for x in samples),
        "pg_rows_written_per_s": round(rate(plateau, "tuples_written"), 1) if len(plateau) > 1 else None,
        "pg_commits_per_s": round(rate(plateau, "commits"), 1) if len(plateau) > 1 else None,
        "pg_wal_mb_per_s": round(rate(plateau, "wal_bytes") / 2**20, 2) if len(plateau) > 1 else None,
        "lag_first_third_p50": round(statistics.median(x.lag for x in plateau[:third]), 1),
        "lag_last_third_p50": round(statistics.median(x.lag for x in plateau[-third:]), 1),
        "fleet_max_episodes": args.fleet_max_episodes,
        "load_avg_1m_start": round(load_start, 2),
        "load_avg_1m_end": round(os.getloadavg()[0], 2),
        "pg_db_mb_end": round(last.db_bytes / 2**20, 1),
        "pg_bytes_per_episode": round((last.db_bytes - idle.db_bytes) / args.episodes),
        "pg_episode_rows": last.rows["episodes"],
        "pg_step_rows": last.rows["steps"],
        "pg_outbox_rows": last.rows["outbox"],
        "pg_step_rows_per_episode": round(last.rows["steps"] / args.episodes, 2),
        **{
            f"pg_bytes_per_{row}_row": round(checks[f"pg_{table}_bytes"] / max(1, last.rows[table]))
            for table, row in (("episodes", "episode"), ("steps", "step"), ("outbox", "outbox"))
        },
        "live_episodes_p50_on_plateau": round(pct([x.live for x in plateau], 0.5)),
        "partitions": args.partitions,
        "scheduler_interval_s": args.scheduler_interval_s,
        "cpus": os.cpu_count(),
    }


def table(r: dict) -> str:
    rows = [
        ("live episodes at the peak", r["live_episodes_peak"], f"target {r['episodes']}"),
        ("seconds with >= 95 % of the target live", r["live_at_target_s"], ""),
        ("ramp to the target (s)", r["ramp_to_target_s"], ""),
        (
            "dispatcher RSS idle -> peak (MB)",
            f"{r['dispatcher_rss_idle_mb']} -> {r['dispatcher_rss_peak_mb']}",
            "",
        ),
        ("dispatcher memory per live episode (KB)", r["dispatcher_kb_per_live_episode"], ""),
        (
            "policy stub memory per live episode (KB)",
            r["policy_stub_kb_per_live_episode"],
            "a stub, not the gateway",
        ),
        ("transitions per second on the plateau", r["transitions_per_s"], ""),
        ("dispatcher CPU per transition (ms)", r["dispatcher_cpu_ms_per_transition"], ""),
        ("dispatcher consumer lag p50 / max", f"{r['lag']} / {r['lag_max']}", "messages"),
        ("Postgres connections (max)", r["pg_connections_max"], ""),
        ("Postgres rows written per second", r["pg_rows_written_per_s"], ""),
        ("Postgres commits per second", r["pg_commits_per_s"], ""),
        ("Postgres WAL written (MB/s)", r["pg_wal_mb_per_s"], "the whole server's"),
        (
            "lag p50, first -> last third of the plateau",
            f"{r['lag_first_third_p50']} -> {r['lag_last_third_p50']}",
            "not growing?",
        ),
        (
            "steps retried / episodes failed",
            f"{r['steps_retried']} / {r['episodes_failed']}",
            "0 / 0: no lease expired",
        ),
        ("step rows / command rows", f"{r['step_rows']} / {r['command_rows']}", "equal: each command once"),
        ("job state reason", r["job_state_reason"], ""),
        (
            "load average (1 min) start -> end",
            f"{r['load_avg_1m_start']} -> {r['load_avg_1m_end']}",
            f"{r['cpus']} cores",
        ),
        ("Postgres bytes per episode", r["pg_bytes_per_episode"], f"{r['pg_db_mb_end']} MB in all"),
        ("step rows per episode", r["pg_step_rows_per_episode"], ""),
        (
            "bytes per episode / step / outbox row",
            f"{r['pg_bytes_per_episode_row']} / {r['pg_bytes_per_step_row']} / {r['pg_bytes_per_outbox_row']}",
            "indexes included",
        ),
        ("job wall time (s)", r["job_wall_s"], r["state"]),
    ]
    if r.get("replicas"):
        rows += [
            ("replicas: results taken", r["replica_results_taken"], "each busy?"),
            ("replicas: CPU s / RSS MB", f"{r['replica_cpu_s']} / {r['replica_rss_mb']}", ""),
            ("results taken twice", r["results_taken_twice"], "0"),
            ("episodes with results on two replicas", r["episodes_on_two_replicas"], "round robin per topic"),
        ]
    return metric_table(rows, "note", value_width=16)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="thousands of live episodes through real Kafka and Postgres")
    parser.add_argument("--episodes", type=int, default=2000, help="all of them allowed live at once")
    parser.add_argument("--turns", type=int, default=3, help="turns per episode")
    parser.add_argument("--turn-s-min", type=float, default=20.0)
    parser.add_argument("--turn-s-max", type=float, default=30.0)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument(
        "--scheduler-interval-s", type=float, default=0.5, help="the dispatcher's tick (its default: 0.5)"
    )
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument(
        "--replicas", type=int, default=0, help="dispatcher processes (0: one, in this process)"
    )
    parser.add_argument("--pool-size", type=int, default=10, help="Postgres connections per replica")
    parser.add_argument("--fleet-max-episodes", type=int, default=None, help="the fleet's admission limit")
    parser.add_argument(
        "--observe-s", type=float, default=0, help="stop after this many seconds (0: at the job's end)"
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "scale.json"))
    args = parser.parse_args()
    result = run_loop(run(args))
    print(table(result))  # noqa: T201
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")  # noqa: T201
