"""Partial rollouts through the episode machine: an episode's switch (the job's
``schedule.partial_rollouts``) rides on every inference request it sends, and the version
of each token the gateway answers with comes out in its trajectory, beside the logprobs."""

from __future__ import annotations

import pytest
from episode_peers import episodes_of, job_spec, seed, start_harness, steps_of, submit_job, wait_for

from temper.events import InferenceRequest, TrajectoryReady
from temper.trajectory import Trajectory

pytestmark = pytest.mark.timeout(60)


def interrupted_on_the_second_turn(req: InferenceRequest, n: int) -> list[int]:
    """Turn 0 sampled by version 0; turn 1 begun on version 0 and finished on version 1."""
    return [0] * n if req.turn == 0 else [0, 0] + [1] * (n - 2)


@pytest.mark.parametrize("partial", [True, False])
async def test_an_episodes_switch_and_each_tokens_version_reach_its_trajectory(
    tmp_path, database_url, partial
):
    h = await start_harness(tmp_path, database_url, peers={"token_versions": interrupted_on_the_second_turn})
    try:
        await seed(h.db)
        job = await submit_job(h.db, job_spec(schedule__partial_rollouts=partial))
        await wait_for(lambda: _scored(h.db, job, 4), what="4 episodes scored")
        requests = [m for m in h.peers.requests["inference"] if m.job_id == job]
        assert requests and all(
            isinstance(m, InferenceRequest) and m.partial_rollout is partial for m in requests
        )
        eps = await episodes_of(h.db, job)
        assert all(e.partial_rollouts is partial and e.behaviour_version == 0 for e in eps)
        ep = eps[0]
        second = [s for s in await steps_of(h.db, ep.id) if s.kind == "inference" and s.turn == 1][0]
        assert second.result["token_versions"][:3] == [0, 0, 1]
        assert ep.trajectory_key is not None
        traj = Trajectory.model_validate_json(await h.runtime.store.get(ep.trajectory_key))  # type: ignore[union-attr]
        model = [s for s in traj.segments if s.role == "model"]
        assert model[0].token_versions == [0] * len(model[0].token_ids)
        assert model[1].token_versions == [0, 0] + [1] * (len(model[1].token_ids) - 2)
        assert model[1].policy_version == 1 and traj.versions_spanned == [0, 1]
        await wait_for(lambda: _ready(h.peers.trajectories, 4), what="4 trajectory messages")
        # the trainer's staleness bound reads the oldest token
        assert {m.behaviour_version for m in h.peers.trajectories if isinstance(m, TrajectoryReady)} == {0}
    finally:
        await h.stop()


async def _scored(db, job, n) -> bool:  # noqa: ANN001
    eps = await episodes_of(db, job)
    return sum(e.state == "scored" for e in eps) >= n


async def _ready(items, n) -> bool:  # noqa: ANN001
    return len(items) >= n
