"""One RL job over a task set in every language (Python, C, C++, Java, Go, Rust, JavaScript,
TypeScript, bash; the tasks from examples/tasksets), end to end in one process: the real
dispatcher, sandbox worker and reward scorer on the in-process bus and SQLite; only the model
is scripted. In each task's group one episode writes the reference solution and one a
solution that is wrong on some inputs; every episode is scored by the task's hidden tests in
its own language, each test reported alone."""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid
from pathlib import Path

import pytest
from sqlalchemy import select

from services.dispatcher.component import Dispatcher
from services.reward_scorer.component import RewardScorer
from services.sandbox_worker.component import SandboxWorkerComponent
from temper.db import Episode, Job, Task, Tenant
from temper.db.migrate import upgrade
from temper.jobspec import parse_spec
from temper.limits import LanguageName
from temper.runtime import Runtime
from temper.sandbox import SandboxSettings
from temper.settings import (
    BusKind,
    BusSettings,
    DatabaseSettings,
    DispatcherSettings,
    Settings,
    StorageKind,
    StorageSettings,
)
from temper.tasks import service as tasks
from temper.tasks.models import TaskSpec, parse_tasks
from tests.services.embedded.test_plugin_episodes import ScriptedModel

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(300)]

TASKSETS = Path(__file__).resolve().parents[3] / "examples" / "tasksets"
# task id -> (a solution wrong on some inputs, the tests it passes of how many)
WRONG: dict[str, tuple[str, tuple[int, int]]] = {
    "add": ("def add(a, b):\n    return abs(a) + b\n", (2, 3)),
    "c-add": ("int add(int a, int b) {\n    return (a < 0 ? -a : a) + b;\n}\n", (3, 4)),
    "cpp-sum-of-squares": (
        "#include <vector>\nlong sum_of_squares(const std::vector<long>& xs) {\n    long t = 0;\n"
        "    for (long x : xs) t += x > 0 ? x * x : 0;\n    return t;\n}\n",
        (3, 4),
    ),
    "java-reverse": (
        "public class Solution {\n    public static String reverse(String s) { return s; }\n}\n",
        (2, 3),
    ),
    "go-gcd": (
        "package main\n\nfunc Gcd(a, b int) int {\n\tif a == 0 {\n\t\treturn 0\n\t}\n\tfor b != 0 {\n"
        "\t\ta, b = b, a%b\n\t}\n\treturn a\n}\n",
        (3, 4),
    ),
    "rust-gcd": (
        "fn gcd(a: u64, b: u64) -> u64 {\n    if a == 0 { 0 } else if b == 0 { a } else { gcd(b, a % b) }\n}\n",
        (3, 4),
    ),
    "js-add": ("function add(a, b) {\n  return Math.abs(a) + b;\n}\n", (2, 3)),
    "ts-evens": (
        "function evens(xs: number[]): number[] {\n  return xs.filter((x) => x % 2 === 0 && x > 0);\n}\n",
        (2, 3),
    ),
    "bash-add": ("add() {\n    echo $(( ${1#-} + $2 ))\n}\n", (2, 3)),
}


def example_tasks() -> list[TaskSpec]:
    found: dict[str, TaskSpec] = {}
    for name in ("python", "c", "cpp", "java", "go", "rust", "scripting"):
        path = TASKSETS / f"{name}-basics.yaml"
        for task in parse_tasks(path.read_text(), filename=path.name):
            found[task.id] = task
    return [found[key] for key in WRONG]


async def test_one_job_scores_episodes_in_every_language(tmp_path):
    chosen = example_tasks()
    assert {t.language for t in chosen} == set(LanguageName)
    answered: dict[str, int] = {}

    def model(prompt: str, turn: int) -> str:
        """The first episode of a task's group writes the reference, the second the wrong one."""
        task = next(t for t in chosen if t.prompt.strip() in prompt)
        n = answered[task.id] = answered.get(task.id, 0) + 1
        code = task.solution if n == 1 else WRONG[task.id][0]
        return f"```{task.language} {task.solution_file}\n{code}```\nsubmit"

    root = Path("/tmp") / f"temper-polyglot-{uuid.uuid4().hex[:8]}"  # the sandbox uid must reach it
    db_url = f"sqlite+aiosqlite:///{tmp_path}/temper.db"
    await asyncio.to_thread(upgrade, db_url)
    settings = Settings(
        db=DatabaseSettings(url=db_url),
        bus=BusSettings(kind=BusKind.inprocess, partitions=4, retry_backoff_s=0.01),
        storage=StorageSettings(kind=StorageKind.local, root=tmp_path / "objects"),
        sandbox=SandboxSettings(pool_size=1, zygotes=4, workspace_root=root),
        data_dir=tmp_path,
    )
    runtime = Runtime(settings, service="polyglot-test")
    await runtime.start()
    dispatcher = Dispatcher(
        runtime,
        settings=DispatcherSettings(lease_s=60.0, trainer_attached=False, scheduler_interval_s=0.05,
                                    reaper_interval_s=0.2),
    )  # fmt: skip
    started = [
        SandboxWorkerComponent(runtime),
        RewardScorer(runtime, concurrency=4),
        ScriptedModel(runtime, model),
    ]
    try:
        for component in started:
            await component.start()
        await dispatcher.start()
        started.append(dispatcher)
        assert runtime.db is not None
        async with runtime.db.session() as s:
            s.add(Tenant(id="acme", name="acme"))
        async with runtime.db.session() as s:
            ts = await tasks.create_taskset(s, runtime.store, "acme", "polyglot", chosen)
        spec = parse_spec({
            "name": "polyglot", "policy": {"model": "tiny", "sampling": {"max_tokens": 1024}},
            "environment": {"kind": "code", "max_turns": 1}, "rewards": {"tests_passed": 1.0},
            "tasks": {"taskset": ts.id, "group_size": 2},
            "schedule": {"iterations": 1, "episodes_per_iteration": 2 * len(chosen),
                         "max_concurrent_episodes": 2 * len(chosen)},
        })  # fmt: skip
        job_id = f"job-{uuid.uuid4().hex[:8]}"
        async with runtime.db.session() as s:
            s.add(
                Job(
                    id=job_id,
                    tenant_id="acme",
                    name="polyglot",
                    spec=spec.model_dump(mode="json"),
                    state="pending",
                )
            )
        deadline = time.monotonic() + 240
        state = None
        while time.monotonic() < deadline:
            async with runtime.db.session() as s:
                state = await s.scalar(select(Job.state).where(Job.id == job_id))
            if state in ("completed", "failed", "cancelled"):
                break
            await asyncio.sleep(0.2)
        assert state == "completed"
        async with runtime.db.session() as s:
            episodes = list((await s.execute(select(Episode).where(Episode.job_id == job_id))).scalars())
            keys = dict((await s.execute(select(Task.id, Task.key))).all())
    finally:
        for component in reversed(started):
            await component.stop()
        await runtime.stop()
        shutil.rmtree(root, ignore_errors=True)

    by_task: dict[str, list[Episode]] = {}
    for ep in episodes:
        assert ep.state == "scored", (ep.state, ep.state_reason)
        by_task.setdefault(keys[ep.task_id], []).append(ep)
    assert sorted(by_task) == sorted(WRONG)  # every language's task had its group
    for key, group in by_task.items():
        scores = sorted(
            (ep.rewards["tests_passed"]["value"], ep.rewards["tests_passed"]["details"]) for ep in group
        )
        (low, low_details), (high, high_details) = scores
        passed, total = WRONG[key][1]
        assert high == 1.0 and high_details["passed"] == high_details["total"] == total, (key, high_details)
        assert low == pytest.approx(passed / total), (key, low_details)
        assert low_details["passed"] == passed and low_details["total"] == total
        assert sum(not t["passed"] for t in low_details["tests"]) == total - passed
