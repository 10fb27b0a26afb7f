"""An episode's budgets (``environment.max_episode_s``, ``environment.max_episode_tokens``)
enforced by the dispatcher: each turn asks for at most the tokens left, a spent budget or a
passed deadline ends the episode and scores what it left (``ended_by`` on its trajectory),
a step still out at the deadline is cut by its lease instead of retried, and the sandbox
steps ask the worker to keep the session until the deadline."""

from __future__ import annotations

import time

import pytest
from episode_peers import FENCE, episodes_of, job_spec, seed, start_harness, steps_of, submit_job, wait_for

from temper.events import InferenceRequest, SandboxRequest
from temper.trajectory import Trajectory

pytestmark = pytest.mark.timeout(60)


def echo(req: InferenceRequest) -> str:
    """Never submits: one short command a turn (18 characters + the stop token = 19 tokens)."""
    return f"{FENCE}bash\necho {req.turn}\n{FENCE}"


async def trajectory(h, ep) -> Trajectory:  # noqa: ANN001
    assert ep.trajectory_key is not None
    return Trajectory.model_validate_json(await h.runtime.store.get(ep.trajectory_key))


async def test_the_token_budget_caps_each_turn_and_ends_the_episode_scored(tmp_path, database_url):
    h = await start_harness(tmp_path, database_url, peers={"script": echo})
    try:
        await seed(h.db, tasks={"t1": {}})
        spec = job_spec(environment__max_turns=6, environment__max_episode_tokens=40,
                        schedule__episodes_per_iteration=2)  # fmt: skip
        job = await submit_job(h.db, spec)
        await wait_for(lambda: _all(h.db, job, "scored", 2), what="2 episodes scored")
        ep = (await episodes_of(h.db, job))[0]
        asked = [m.sampling.max_tokens for m in h.peers.requests["inference"] if m.episode_id == ep.id]
        # 40 tokens, then what the turns before left: 40 - 19, then 40 - 38 (the fake gateway
        # answers 19 tokens whatever it is asked; an engine stops at max_tokens)
        assert asked == [40, 21, 2]
        assert ep.model_tokens == 57 and ep.turn == 2
        kinds = [(s.turn, s.kind, s.state) for s in await steps_of(h.db, ep.id)]
        assert kinds[-2:] == [(2, "sandbox", "done"), (2, "reward", "done")], (
            "the last action ran, then scoring"
        )
        traj = await trajectory(h, ep)
        assert traj.ended_by == "max_episode_tokens" and len(traj.turns) == 3 and traj.reward == 1.0
    finally:
        await h.stop()


async def test_a_step_still_out_at_the_deadline_ends_the_episode_without_a_retry(tmp_path, database_url):
    # the second turn's model call is never answered; the lease (10 s) would retry it
    never_second = {"script": echo, "drop": lambda m: m.kind == "inference" and m.turn == 1}
    h = await start_harness(tmp_path, database_url, peers=never_second)
    try:
        await seed(h.db, tasks={"t1": {}})
        spec = job_spec(environment__max_turns=6, environment__max_episode_s=1.5,
                        schedule__episodes_per_iteration=2)  # fmt: skip
        job = await submit_job(h.db, spec)
        started = time.monotonic()
        await wait_for(lambda: _all(h.db, job, "scored", 2), what="2 episodes scored")
        assert time.monotonic() - started < 6, "ended at the deadline, not after the step's lease"
        for ep in await episodes_of(h.db, job):
            assert ep.deadline_at is not None and ep.updated_at >= ep.deadline_at
            turn1 = [m for m in h.peers.requests["inference"] if m.episode_id == ep.id and m.turn == 1]
            assert [m.attempt for m in turn1] == [0], "cut, not retried"
            steps = {(s.turn, s.kind): s.state for s in await steps_of(h.db, ep.id)}
            assert steps[(1, "inference")] == "failed" and steps[(1, "reward")] == "done"
            assert (await trajectory(h, ep)).ended_by == "max_episode_s"
            # the sandbox step asked the worker to keep the session until the deadline at least
            (sandbox,) = [m for m in h.peers.requests["sandbox"] if m.episode_id == ep.id]
            assert isinstance(sandbox, SandboxRequest) and sandbox.keep_s is not None
            left = (ep.deadline_at - sandbox.occurred_at).total_seconds()
            assert left <= sandbox.keep_s <= left + h.dispatcher.settings.reaper_interval_s + 5.0 + 0.01
    finally:
        await h.stop()


async def test_without_a_deadline_the_session_is_kept_as_long_as_a_step_may_be_waited_on(
    tmp_path, database_url
):
    h = await start_harness(tmp_path, database_url)
    try:
        await seed(h.db, tasks={"t1": {}})
        job = await submit_job(h.db, job_spec(schedule__episodes_per_iteration=2))
        await wait_for(lambda: _all(h.db, job, "scored", 2), what="2 episodes scored")
        s = h.dispatcher.settings
        keeps = {m.keep_s for m in h.peers.requests["sandbox"]}
        assert keeps == {s.max_step_attempts * s.lease_s + s.reaper_interval_s + 5.0}
        eps = await episodes_of(h.db, job)
        for e in eps:
            assert e.deadline_at is None and (await trajectory(h, e)).ended_by is None
    finally:
        await h.stop()


async def _all(db, job, state, n) -> bool:  # noqa: ANN001
    eps = await episodes_of(db, job)
    return len(eps) >= n and all(e.state == state for e in eps)
