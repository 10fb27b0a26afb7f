"""The episode state machine end to end on the in-process bus (SQLite, and Postgres under the
``postgres`` marker), with test doubles of the gateway, sandbox worker and scorer."""

from __future__ import annotations

import asyncio
import json

import pytest
from episode_peers import (
    FENCE,
    TOK,
    episode_states,
    episodes_of,
    job_spec,
    job_state,
    seed,
    start_harness,
    steps_of,
    submit_job,
    wait_for,
)
from sqlalchemy import select

from temper.clock import utcnow
from temper.db import Job, PolicyVersion, TaskOutcome, TrainedTrajectory
from temper.episode_log import read_episode_log
from temper.events import PolicyUpdate, RewardRequest, SandboxRequest, Topics, TrajectoryReady
from temper.storage import object_key
from temper.tasks.service import task_totals
from temper.trajectory import Trajectory

pytestmark = pytest.mark.timeout(60)


async def test_multi_turn_code_episodes_run_to_scored_with_token_exact_trajectories(tmp_path, database_url):
    h = await start_harness(tmp_path, database_url)
    try:
        await seed(h.db)
        job = await submit_job(h.db, job_spec(schedule__iterations=2))
        await wait_for(lambda: _is(h.db, job, "completed"), what="job completed")
        eps = await episodes_of(h.db, job)
        assert len(eps) == 8 and {e.state for e in eps} == {"scored"}
        assert sorted({e.iteration for e in eps}) == [0, 1]
        groups: dict[str, set[str]] = {}
        for e in eps:
            groups.setdefault(e.group_id, set()).add(e.task_id)
        assert len(groups) == 4 and all(len(tasks) == 1 for tasks in groups.values()), (
            "a group shares its task"
        )

        ep = eps[0]
        steps = await steps_of(h.db, ep.id)
        assert [(s.turn, s.kind, s.state) for s in steps] == [
            (0, "inference", "done"),
            (0, "sandbox", "done"),
            (1, "inference", "done"),
            (1, "sandbox", "done"),
            (1, "reward", "done"),
        ]
        assert ep.reward == 1.0 and ep.snapshot_key == f"snapshots/{ep.id}/1.tar.gz" and ep.format_errors == 0

        # The sandbox session is the episode; the first command brings the task's files, the
        # next one the snapshot to restore from.
        sandbox = [m for m in h.peers.requests["sandbox"] if m.episode_id == ep.id]
        assert isinstance(sandbox[0], SandboxRequest) and sandbox[0].session_id == ep.id
        assert (
            sandbox[0].files == {"add.py": "def add(a, b):\n    return a - b\n"}
            and sandbox[0].snapshot_key is None
        )
        assert sandbox[1].files == {} and sandbox[1].snapshot_key == f"snapshots/{ep.id}/0.tar.gz"
        assert sandbox[1].action == {
            "kind": "write_file",
            "path": "add.py",
            "content": "def add(a, b):\n    return a + b\n",
        }
        reward = next(m for m in h.peers.requests["reward"] if m.episode_id == ep.id)
        assert isinstance(reward, RewardRequest) and reward.format_ok and reward.turns_used == 2
        assert reward.submission["snapshot_key"] == ep.snapshot_key and reward.weights == {
            "tests_passed": 1.0
        }

        # Trajectory: stored under the tenant/job prefix, token-exact across turns.
        key = object_key("acme", job, "trajectories", f"{ep.id}.json")
        assert ep.trajectory_key == key
        traj = Trajectory.model_validate_json(await h.runtime.store.get(key))  # type: ignore[union-attr]
        assert [s.role for s in traj.segments] == ["prompt", "model", "observation", "model"]
        ids, mask, logprobs = traj.flat()
        second_prompt = next(
            m.prompt_ids for m in h.peers.requests["inference"] if m.episode_id == ep.id and m.turn == 1
        )
        assert ids[: len(second_prompt)] == second_prompt, "turn 1's prompt extends turn 0's conversation"
        assert sum(mask) == len(traj.segments[1].token_ids) + len(traj.segments[3].token_ids)
        assert all(lp == -0.5 for lp, m in zip(logprobs, mask, strict=True) if m)
        obs_text = TOK.decode(traj.segments[2].token_ids)
        assert "ran run_command" in obs_text
        assert [t.turn for t in traj.turns] == [0, 1] and traj.turns[1].observation.startswith("Wrote add.py")
        assert traj.reward == 1.0 and traj.rewards["format_ok"] is True and traj.timings["total_s"] > 0

        # The episode's log beside it: one JSON line per step, sandbox output and reward included.
        lines = read_episode_log(await h.runtime.store.get(object_key("acme", job, "logs", f"{ep.id}.jsonl")))  # type: ignore[union-attr]
        assert [(x["turn"], x["kind"], x["state"]) for x in lines] == [
            (s.turn, s.kind, s.state) for s in steps
        ]
        assert all(x["episode_id"] == ep.id and x["attempt"] == 0 and x["duration_s"] >= 0 for x in lines)
        assert lines[0]["finish_reason"] == "stop" and lines[0]["policy_version"] == 0
        assert (
            lines[1]["exit_code"] == 0
            and lines[1]["stdout"] == "ran run_command"
            and lines[1]["kill_reason"] is None
        )
        assert lines[1]["stdout_truncated"] is None and lines[1]["worker"]
        assert lines[4]["reward"] == 1.0 and lines[4]["components"]["tests_passed"]["value"] == 1.0

        await wait_for(lambda: _count(h.peers.trajectories, 8), what="8 trajectory messages")
        ready = [m for m in h.peers.trajectories if isinstance(m, TrajectoryReady)]
        assert sorted(m.episode_id for m in ready) == sorted(e.id for e in eps)
        async with h.db.session() as s:
            outcomes = list((await s.execute(select(TaskOutcome))).scalars())
            totals = await task_totals(s, "ts1")
        # one outcome per scored episode, exactly, each with the episode's policy version
        assert sorted(o.episode_id for o in outcomes) == sorted(e.id for e in eps)
        assert all(o.passed and o.reward == 1.0 and o.policy_version == 0 for o in outcomes)
        assert sum(a for a, _ in totals.values()) == 8 and all(a == p for a, p in totals.values())
        await wait_for(lambda: _has_event(h.peers.events, "job.state", "completed"), what="job event")
        assert sum(1 for m in h.peers.events if getattr(m, "event", "") == "episode.reward") == 8
    finally:
        await h.stop()


async def test_duplicate_results_are_acknowledged_and_ignored(tmp_path, database_url):
    h = await start_harness(tmp_path, database_url, peers={"duplicate": True})
    try:
        await seed(h.db)
        job = await submit_job(h.db, job_spec())
        await wait_for(lambda: _is(h.db, job, "completed"), what="job completed")
        eps = await episodes_of(h.db, job)
        for ep in eps:
            steps = await steps_of(h.db, ep.id)
            assert len(steps) == 5 and len({(s.turn, s.kind) for s in steps}) == 5
        await wait_for(lambda: _count(h.peers.trajectories, 4), what="trajectories")
        await asyncio.sleep(0.3)
        assert len(h.peers.trajectories) == 4, "each episode scored once though every result came twice"
        assert h.dispatcher.machine.ignored >= 5 * 4  # type: ignore[union-attr]
        # A request answered twice must not have produced a second command either.
        assert len(h.peers.requests["reward"]) == 4
        # nor a second outcome: one scored episode is one attempt on its task
        async with h.db.session() as s:
            totals = await task_totals(s, "ts1")
        assert sum(attempts for attempts, _ in totals.values()) == 4
    finally:
        await h.stop()


async def test_expired_lease_is_retried_with_a_new_attempt_and_old_attempts_are_ignored(
    tmp_path, database_url
):
    # The sandbox "worker" dies on every first attempt: its command is lost.
    def lost(msg) -> bool:
        return msg.kind == "sandbox" and msg.attempt == 0

    h = await start_harness(tmp_path, database_url, lease_s=0.4, peers={"drop": lost})
    try:
        await seed(h.db, tasks={"t1": {}})
        job = await submit_job(h.db, job_spec(tasks__group_size=1, schedule__episodes_per_iteration=1))
        await wait_for(lambda: _is(h.db, job, "completed"), what="job completed")
        (ep,) = await episodes_of(h.db, job)
        sandbox = [m for m in h.peers.requests["sandbox"] if m.turn == 0]
        assert [m.attempt for m in sandbox] == [0, 1]
        assert sandbox[1].files == sandbox[0].files, "a retry carries what a fresh worker needs"
        steps = {(s.turn, s.kind): s for s in await steps_of(h.db, ep.id)}
        assert steps[(0, "sandbox")].attempt == 1 and steps[(1, "sandbox")].attempt == 1

        # A late answer to the lost attempt 0 changes nothing.
        before = len(h.peers.requests["reward"])
        late = h.peers.reply(sandbox[0])
        await h.runtime.bus.send_message(Topics.SANDBOX_RESULTS, late)  # type: ignore[union-attr, arg-type]
        await asyncio.sleep(0.3)
        assert len(h.peers.requests["reward"]) == before and (await episode_states(h.db, job)) == {
            "scored": 1
        }
    finally:
        await h.stop()


async def test_a_step_that_never_answers_fails_the_episode_with_the_reason(tmp_path, database_url):
    h = await start_harness(
        tmp_path,
        database_url,
        lease_s=0.3,
        max_step_attempts=2,
        peers={"drop": lambda m: m.kind == "sandbox"},
    )
    try:
        await seed(h.db, tasks={"t1": {}})
        job = await submit_job(h.db, job_spec(tasks__group_size=1, schedule__episodes_per_iteration=1))
        # its one episode failed: nothing to learn from, so the job fails too, saying why
        await wait_for(lambda: _is(h.db, job, "failed"), what="job failed (its episode failed)")
        (ep,) = await episodes_of(h.db, job)
        assert ep.state == "failed"
        assert ep.state_reason == "lease_expired: sandbox step of turn 0 (after 2 attempts)"
        async with h.db.session() as s:
            reason = (await s.get(Job, job)).state_reason
        assert (
            reason == "every episode failed (1): 1 x lease_expired: sandbox step of turn 0 (after 2 attempts)"
        )
        assert [m.attempt for m in h.peers.requests["sandbox"]] == [0, 1]
        await wait_for(lambda: _has_event(h.peers.events, "episode.state", "failed"), what="failed event")
    finally:
        await h.stop()


async def test_malformed_output_becomes_an_observation_and_clears_the_format_flag(tmp_path, database_url):
    def script(req):
        if req.turn == 0:
            return "I think the answer is four"
        if req.turn == 1:
            return f"{FENCE}python\nprint(2 + 2)\n{FENCE}"
        return "So \\boxed{4}"

    h = await start_harness(tmp_path, database_url, peers={"script": script})
    try:
        await seed(h.db, tasks={"m1": {"kind": "math", "prompt": "2+2?", "spec": {"answer": "4"}}})
        spec = job_spec(
            environment__kind="math",
            tasks__group_size=1,
            schedule__episodes_per_iteration=1,
            environment__max_turns=4,
        )
        job = await submit_job(h.db, spec)
        await wait_for(lambda: _is(h.db, job, "completed"), what="job completed")
        (ep,) = await episodes_of(h.db, job)
        assert ep.state == "scored" and ep.format_errors == 1
        steps = [(s.turn, s.kind) for s in await steps_of(h.db, ep.id)]
        assert steps == [(0, "inference"), (1, "inference"), (1, "sandbox"), (2, "inference"), (2, "reward")]
        second = next(m for m in h.peers.requests["inference"] if m.turn == 1)
        assert "Error: no final answer found" in TOK.decode(second.prompt_ids)
        (reward,) = h.peers.requests["reward"]
        assert isinstance(reward, RewardRequest) and reward.format_ok is False
        assert reward.submission == {"kind": "math", "answer": "4", "final_text": "So \\boxed{4}"}
    finally:
        await h.stop()


async def test_max_turns_scores_the_last_state(tmp_path, database_url):
    h = await start_harness(tmp_path, database_url, peers={"script": lambda r: f"{FENCE}bash\nls\n{FENCE}"})
    try:
        await seed(h.db, tasks={"t1": {}})
        job = await submit_job(
            h.db, job_spec(tasks__group_size=1, schedule__episodes_per_iteration=1, environment__max_turns=2)
        )
        await wait_for(lambda: _is(h.db, job, "completed"), what="job completed")
        (ep,) = await episodes_of(h.db, job)
        assert ep.state == "scored" and ep.turn == 1
        (reward,) = h.peers.requests["reward"]
        assert reward.submission["snapshot_key"] == f"snapshots/{ep.id}/1.tar.gz"
    finally:
        await h.stop()


async def test_groups_curriculum_and_tenant_quota(tmp_path, database_url):
    tasks = {
        "solved": {"attempts": 10, "passes": 10},
        "hopeless": {"attempts": 10, "passes": 0},
        "learnable": {"attempts": 10, "passes": 4},
        "broken": {"status": "invalid"},
    }
    h = await start_harness(tmp_path, database_url, peers={"hold": True})
    try:
        past = await seed(h.db, tasks=tasks, quota=2)
        spec = job_spec(
            tasks__group_size=2, tasks__prior_from_job=past,
            schedule__episodes_per_iteration=4, schedule__iterations=2,
        )  # fmt: skip
        job = await submit_job(h.db, spec)
        await wait_for(lambda: _held(h, 2), what="first group")
        await asyncio.sleep(0.3)
        assert len(await episodes_of(h.db, job)) == 2, "the tenant's quota of 2 holds back the second group"
        while (await job_state(h.db, job)) != "completed":
            await h.peers.release()
            await asyncio.sleep(0.05)
            h.peers.hold = True
        eps = await episodes_of(h.db, job)
        assert len(eps) == 8
        by_group: dict[str, list[str]] = {}
        for e in eps:
            by_group.setdefault(e.group_id, []).append(e.task_id)
        assert all(len(v) == 2 and len(set(v)) == 1 for v in by_group.values())
        sampled = [v[0] for v in by_group.values()]
        assert "broken" not in sampled
        # Sampling is random (seeded per job); the preference itself is tested exactly in
        # test_curriculum_prefers_tasks_with_a_pass_rate_strictly_between_0_and_1.
        assert "learnable" in sampled, f"the learnable task is sampled: {sampled}"
    finally:
        h.peers.hold = False
        await h.stop()


async def test_staleness_bound_holds_the_next_iteration_until_the_policy_catches_up(tmp_path, database_url):
    h = await start_harness(tmp_path, database_url, trainer_attached=True, wait_for_training=False)
    try:
        await seed(h.db, tasks={"t1": {}})
        spec = job_spec(
            tasks__group_size=2,
            schedule__episodes_per_iteration=2,
            schedule__iterations=2,
            schedule__max_staleness=0,
        )
        job = await submit_job(h.db, spec)
        await wait_for(lambda: _states(h.db, job, {"scored": 2}), what="iteration 0 scored")
        await asyncio.sleep(0.4)
        assert await episode_states(h.db, job) == {"scored": 2}, "iteration 1 waits for policy version 1"
        # playing the trainer, the only writer of a job's policy version: in one transaction the
        # ledger's rows with the step that trained them, the version, then the update
        async with h.db.session() as s:
            for ep in await episodes_of(h.db, job):
                s.add(TrainedTrajectory(episode_id=ep.id, job_id=job, trajectory_key=f"t/{ep.id}",
                                        group_id=ep.group_id, step=1))  # fmt: skip
            (await s.get(Job, job)).policy_version = 1  # type: ignore[union-attr]
            s.add(PolicyVersion(job_id=job, version=1, checkpoint_key="ckpt/1", step=1))
        await h.runtime.bus.send_message(  # type: ignore[union-attr]
            Topics.POLICY_UPDATES, PolicyUpdate(job_id=job, version=1, checkpoint_key="ckpt/1", step=1)
        )
        # the update marks iteration 0 trained (when the dispatcher gets to it: a loaded
        # machine may take more than a moment), and then nothing more starts
        await wait_for(lambda: _states(h.db, job, {"trained": 2}), what="iteration 0 trained")
        await asyncio.sleep(0.4)
        assert await episode_states(h.db, job) == {"trained": 2}, (
            "the trainer's word is not enough: iteration 1 waits until the gateway serves version 1"
        )
        # playing the gateway: every backend serving the job confirmed version 1
        h.peers.policy_version = 1
        async with h.db.session() as s:
            row = await s.get(PolicyVersion, (job, 1))
            row.served_at, row.served_by = utcnow(), ["fake"]  # type: ignore[union-attr]
        await wait_for(lambda: _is(h.db, job, "completed"), what="job completed")
        eps = await episodes_of(h.db, job)
        assert sorted((e.iteration, e.behaviour_version) for e in eps) == [(0, 0), (0, 0), (1, 1), (1, 1)]
        async with h.db.session() as s:
            assert (await s.get(Job, job)).policy_version == 1  # type: ignore[union-attr]
        # the dispatcher reads the version and announces nothing: the event is the trainer's
        assert not await _has_event(h.peers.events, "policy.version", None)
        # nor does it write one: an update the trainer did not commit leaves the job as it was
        await h.runtime.bus.send_message(  # type: ignore[union-attr]
            Topics.POLICY_UPDATES, PolicyUpdate(job_id=job, version=9, checkpoint_key="ckpt/9", step=9)
        )
        await asyncio.sleep(0.3)
        async with h.db.session() as s:
            assert (await s.get(Job, job)).policy_version == 1  # type: ignore[union-attr]
    finally:
        await h.stop()


async def test_cancelled_job_cancels_its_episodes_and_ignores_late_results(tmp_path, database_url):
    h = await start_harness(tmp_path, database_url, peers={"hold": True})
    try:
        await seed(h.db, tasks={"t1": {}})
        job = await submit_job(h.db, job_spec())
        await wait_for(lambda: _held(h, 4), what="episodes started")
        from temper.lifecycle import JobState, transition_job

        async with h.db.session() as s:
            await transition_job(s, await s.get(Job, job), JobState.cancelled, reason="user")  # type: ignore[arg-type]
        # in the same transaction: no scheduler pass needed
        assert await episode_states(h.db, job) == {"cancelled": 4}
        steps = [st for ep in await episodes_of(h.db, job) for st in await steps_of(h.db, ep.id)]
        assert {(st.kind, st.state) for st in steps} == {("inference", "cancelled")}
        assert all(st.lease_expires_at is None for st in steps)
        await h.peers.release()
        await asyncio.sleep(0.3)
        assert await episode_states(h.db, job) == {"cancelled": 4}
        assert not h.peers.requests["sandbox"]
    finally:
        await h.stop()


async def test_a_spec_that_does_not_validate_fails_the_job(tmp_path, database_url):
    h = await start_harness(tmp_path, database_url)
    try:
        await seed(h.db)
        bad = json.loads(json.dumps(job_spec()))
        bad["schedule"]["iterations"] = 0
        job = await submit_job(h.db, bad)
        await wait_for(lambda: _is(h.db, job, "failed"), what="job failed")
        async with h.db.session() as s:
            reason = (await s.get(Job, job)).state_reason  # type: ignore[union-attr]
        assert reason and reason.startswith("invalid spec: schedule.iterations")
    finally:
        await h.stop()


# --- helpers -----------------------------------------------------------------------------------
async def _is(db, job, state) -> bool:
    return await job_state(db, job) == state


async def _states(db, job, expected) -> bool:
    return dict(await episode_states(db, job)) == expected


async def _count(items, n) -> bool:
    return len(items) >= n


async def _held(h, n) -> bool:
    return len(h.peers.held) >= n


async def _has_event(events, kind, state) -> bool:
    return any(getattr(m, "event", None) == kind and (state is None or m.state == state) for m in events)


def test_curriculum_prefers_tasks_with_a_pass_rate_strictly_between_0_and_1():
    from services.dispatcher.scheduler import task_weight
    from temper.jobspec import Curriculum

    learnable = task_weight(10, 4, Curriculum.learnable)
    assert learnable > 10 * task_weight(10, 10, Curriculum.learnable)
    assert learnable > 10 * task_weight(10, 0, Curriculum.learnable)
    assert task_weight(0, 0, Curriculum.learnable) == learnable, "an unmeasured task counts as learnable"
    assert task_weight(10, 10, Curriculum.uniform) == task_weight(10, 4, Curriculum.uniform)


async def test_a_lone_write_that_ends_the_episode_is_scored_without_a_session(tmp_path, database_url):
    """A one-turn code episode whose reply only writes a file: the reward request carries the
    workspace a session would have held (the task's starting files and that file), and no
    session is started. A command, or a write that is not the episode's last action, takes
    the session as before."""
    scripts = {
        "write": f"{FENCE}python ./add.py\ndef add(a, b):\n    return a + b\n{FENCE}",
        "command": f"{FENCE}bash\nls\n{FENCE}",
        # below a starting file: the scorer could not write it (the sandbox's write fails
        # and says so; without a session the episode would fail in scoring)
        "collide": f"{FENCE}python add.py/x.py\nx = 1\n{FENCE}",
    }
    h = await start_harness(
        tmp_path, database_url, peers={"script": lambda r: scripts[r.job_id.split("-")[0]]}
    )
    try:
        await seed(
            h.db,
            tasks={
                "t1": {"spec": {"files": {"add.py": "def add(a, b):\n    return a - b\n", "README": "x"}}}
            },
        )
        one_turn = {
            "tasks__group_size": 1,
            "schedule__episodes_per_iteration": 1,
            "environment__max_turns": 1,
        }
        write = await submit_job(h.db, job_spec(**one_turn), job_id="write-1")
        command = await submit_job(h.db, job_spec(**one_turn), job_id="command-1")
        collide = await submit_job(h.db, job_spec(**one_turn), job_id="collide-1")
        two_turns = await submit_job(
            h.db, job_spec(**{**one_turn, "environment__max_turns": 2}), job_id="write-2"
        )
        for job in (write, command, two_turns, collide):
            await wait_for(lambda job=job: _is(h.db, job, "completed"), what=f"{job} completed")
        by_job = {m.job_id: m for m in h.peers.requests["reward"] if m.job_id != two_turns}
        assert by_job[write].submission["files"] == {
            "add.py": "def add(a, b):\n    return a + b\n",  # the reply's file over the starting one
            "README": "x",
        }
        assert by_job[write].submission["snapshot_key"] is None
        (ep,) = await episodes_of(h.db, write)
        assert ep.timings.get("scored_without_session") is True
        assert [(s.turn, s.kind) for s in await steps_of(h.db, ep.id)] == [(0, "inference"), (0, "reward")]
        sandboxed = {m.job_id for m in h.peers.requests["sandbox"]}
        assert sandboxed == {command, two_turns, collide}, (
            "a command, a write with turns left or one the scorer cannot make, run in a session"
        )
        assert [e.state for e in await episodes_of(h.db, collide)] == ["scored"]
        assert "files" not in by_job[command].submission
    finally:
        await h.stop()
