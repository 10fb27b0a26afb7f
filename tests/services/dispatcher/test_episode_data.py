"""An sft job on a finished job's episodes (``tasks.from_job``): at ``POST /v1/jobs`` the
episodes are filtered (reward floor, each task's best N, ties by id), made into a task set
of conversations as the policy saw them, and the spec is pinned to that set; what cannot
be used is refused with the field."""

from __future__ import annotations

import pytest

from temper.db import Database, Task
from tests.services.dispatcher.conftest import FIRST_PROMPT

pytestmark = pytest.mark.timeout(60)


async def add_tasks(settings) -> None:
    """Task rows for the seeded episodes (their task_id is the row id)."""
    db = Database(settings.db)
    try:
        async with db.session() as s:
            for key in ("add-1", "add-2"):
                s.add(Task(id=key, task_set_id="ts-acme", key=key, kind="code", prompt=FIRST_PROMPT,
                           spec={"tests": "assert add(1, 2) == 3"}, meta={}, status="valid"))  # fmt: skip
    finally:
        await db.dispose()


def sft(**tasks) -> dict:
    return {"name": "filtered", "policy": {"model": "tiny"}, "tasks": tasks, "algorithm": {"name": "sft"}}


async def test_the_best_episodes_of_each_task_become_the_sft_data(client, env):
    settings, _ = env
    await add_tasks(settings)
    r = await client.post("/v1/jobs", json=sft(from_job="job-finished", best_of=2, min_reward=0.5))
    assert r.status_code == 201, r.text
    tasks = r.json()["spec"]["tasks"]
    assert tasks["from_job"] == "job-finished" and tasks["best_of"] == 2 and tasks["min_reward"] == 0.5
    # the stored tasks, submitted again (a rerun), train on the same set: nothing new is made
    pinned = {k: tasks[k] for k in ("taskset", "from_job", "best_of", "min_reward")}
    again = await client.post("/v1/jobs", json=sft(**pinned))
    assert again.status_code == 201, again.text
    assert again.json()["spec"]["tasks"]["taskset"] == tasks["taskset"]
    made = await client.get(f"/v1/tasksets/{tasks['taskset']}")
    assert made.status_code == 200, made.text
    assert made.json()["name"] == "job-finished-best-of-2"
    rows = (await client.get(f"/v1/tasksets/{tasks['taskset']}/tasks")).json()
    keys = sorted(t["key"] for t in (rows["tasks"] if isinstance(rows, dict) else rows))
    # rewards (conftest.reward_of): add-1 1.0 twice at iteration 2; add-2 1.0, then 0.5 twice
    # (ep-1-add-2-0 before ep-2-add-2-1 by id); nothing under 0.5
    assert keys == ["add-1/ep-2-add-1-0", "add-1/ep-2-add-1-1", "add-2/ep-1-add-2-0", "add-2/ep-2-add-2-0"]

    db = Database(settings.db)
    try:
        async with db.session() as s:
            row = await s.get(Task, f"{tasks['taskset']}:add-1/ep-2-add-1-0")
    finally:
        await db.dispose()
    assert row is not None and row.kind == "chat"
    roles = [(m["role"], m["content"][:20]) for m in row.spec["messages"]]
    # the code environment's system prompt and the task, then each turn's reply and result
    assert roles[0][0] == "system" and roles[1] == ("user", FIRST_PROMPT[:20])
    assert roles[2:] == [("assistant", "```python\ndef add(a,"), ("tool", "[exit 0]\nwrote solut"),
                         ("assistant", "```bash\npython -m py")]  # fmt: skip
    assert row.meta["reward"] == 1.0 and row.meta["source"] == "episode:ep-2-add-1-0"


async def test_the_default_is_each_tasks_best_episode(client, env):
    settings, _ = env
    await add_tasks(settings)
    r = await client.post("/v1/jobs", json=sft(from_job="job-finished"))
    assert r.status_code == 201, r.text
    rows = (await client.get(f"/v1/tasksets/{r.json()['spec']['tasks']['taskset']}/tasks")).json()
    keys = sorted(t["key"] for t in (rows["tasks"] if isinstance(rows, dict) else rows))
    assert keys == ["add-1/ep-2-add-1-0", "add-2/ep-2-add-2-0"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (sft(from_job="nobody"), "no job of yours has the id or handle 'nobody'"),
        (sft(from_job="job-running"), "job job-running is running: its episodes are taken once it has ended"),
        (
            sft(from_job="job-finished", min_reward=2.0),
            "job job-finished has no scored episode with reward at least 2",
        ),
        (
            {**sft(from_job="job-finished"), "algorithm": {"name": "grpo"}},
            "a job's episodes are data for sft jobs",
        ),
        (sft(taskset="ts-acme", best_of=2), "best_of and min_reward apply with from_job"),
        (sft(taskset="ts-acme", from_job="job-finished"), "give tasks.from_job or tasks.taskset, not both"),
    ],
)
async def test_what_cannot_be_used_is_refused(client, env, body, message):
    settings, _ = env
    await add_tasks(settings)
    r = await client.post("/v1/jobs", json=body)
    assert r.status_code == 422 and message in r.text, r.text
