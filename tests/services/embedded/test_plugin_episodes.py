"""Episodes end to end in one process, with the real sandbox worker, reward scorer and
dispatcher on the in-process bus and SQLite (and the real Postgres under its marker);
only the model is scripted. One job runs
an operator's plugin (the example ``temper-wordcount`` distribution, installed into a
directory on ``sys.path`` as pip would: no change to libs/ or services/), the other
Temper's ``shell`` environment."""

from __future__ import annotations

import asyncio
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from services.dispatcher.component import Dispatcher
from services.reward_scorer.component import RewardScorer
from services.sandbox_worker.component import SandboxWorkerComponent
from temper.db import Episode, Job, Tenant
from temper.db.migrate import upgrade
from temper.events import InferenceRequest, InferenceResult, Topics, decode
from temper.jobspec import parse_spec
from temper.policy.tokenizer import default_tokenizer
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
from temper.tasks.models import TaskSpec
from tests.plugindist import WORDCOUNT, on_path, project_dist

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(120)]

TOK = default_tokenizer()
TEXT = "the quick brown fox jumps over the lazy dog\n"  # nine words


class ScriptedModel:
    """The gateway's place on the bus: each inference request is answered by ``script``
    (the decoded prompt and the turn -> the model's text)."""

    def __init__(self, runtime: Runtime, script: Any) -> None:
        self.runtime, self.script, self.consumer = runtime, script, None

    async def start(self) -> None:
        assert self.runtime.bus is not None
        self.consumer = await self.runtime.bus.subscribe(
            [Topics.INFERENCE_REQUESTS], f"model-{uuid.uuid4().hex[:6]}", self.on_request, concurrency=4
        )

    async def stop(self) -> None:
        if self.consumer is not None:
            await self.consumer.stop()

    async def on_request(self, record: Any) -> None:
        req = decode(record.value)
        assert isinstance(req, InferenceRequest)
        text = self.script(TOK.decode(req.prompt_ids), req.turn)
        ids = [*TOK.encode(text), TOK.stop_ids[0]]
        result = InferenceResult(
            job_id=req.job_id, episode_id=req.episode_id, turn=req.turn, attempt=req.attempt,
            token_ids=ids, logprobs=[-0.5] * len(ids), text=text, finish_reason="stop",
            policy_version=0, backend="scripted",
        )  # fmt: skip
        assert self.runtime.bus is not None
        await self.runtime.bus.send_message(Topics.INFERENCE_RESULTS, result)


async def run_job(
    tmp_path: Path, db_url: str, task: TaskSpec, spec: dict[str, Any], script: Any
) -> list[Episode]:
    """Start the services, run one job over ``task``, return its episodes once it ends."""
    root = Path("/tmp") / f"temper-plugin-{uuid.uuid4().hex[:8]}"  # the sandbox uid must reach it
    await asyncio.to_thread(upgrade, db_url)
    settings = Settings(
        db=DatabaseSettings(url=db_url),
        bus=BusSettings(kind=BusKind.inprocess, partitions=4, retry_backoff_s=0.01),
        storage=StorageSettings(kind=StorageKind.local, root=tmp_path / "objects"),
        sandbox=SandboxSettings(pool_size=1, workspace_root=root),
        data_dir=tmp_path,
    )
    runtime = Runtime(settings, service="plugin-test")
    await runtime.start()
    dispatcher = Dispatcher(
        runtime,
        settings=DispatcherSettings(lease_s=30.0, trainer_attached=False, scheduler_interval_s=0.05,
                                    reaper_interval_s=0.2),
    )  # fmt: skip
    started = [
        SandboxWorkerComponent(runtime),
        RewardScorer(runtime, concurrency=2),
        ScriptedModel(runtime, script),
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
            ts = await tasks.create_taskset(s, runtime.store, "acme", "plugin", [task])
        job_spec = parse_spec({**spec, "tasks": {"taskset": ts.id, "group_size": 2}})  # validated here
        job_id = f"job-{uuid.uuid4().hex[:8]}"
        async with runtime.db.session() as s:
            s.add(Job(id=job_id, tenant_id="acme", name="plugin", spec=job_spec.model_dump(mode="json"),
                      state="pending"))  # fmt: skip
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            async with runtime.db.session() as s:
                state = await s.scalar(select(Job.state).where(Job.id == job_id))
            if state in ("completed", "failed", "cancelled"):
                break
            await asyncio.sleep(0.1)
        async with runtime.db.session() as s:
            assert await s.scalar(select(Job.state).where(Job.id == job_id)) == "completed"
            return list((await s.execute(select(Episode).where(Episode.job_id == job_id))).scalars())
    finally:
        for component in reversed(started):
            await component.stop()
        await runtime.stop()
        shutil.rmtree(root, ignore_errors=True)


SCHEDULE = {"iterations": 1, "episodes_per_iteration": 2, "max_concurrent_episodes": 2}


async def test_an_installed_plugin_environment_and_reward_run_an_episode(tmp_path, database_url):
    task = TaskSpec(id="fox", kind="math", prompt="How many words are in text.txt?", files={"text.txt": TEXT},
                    answer="9")  # fmt: skip

    def model(prompt: str, turn: int) -> str:
        if turn == 0:
            return "```sh\nwc -w < text.txt\n```"
        counted = re.findall(r"\b(\d+)\b", prompt)[-1]  # what the sandbox printed
        return f"ANSWER: {counted}"

    with on_path(tmp_path / "site", "temper_wordcount"):
        project_dist(tmp_path / "site", WORDCOUNT)
        spec = {
            "name": "wordcount", "policy": {"model": "tiny", "sampling": {"max_tokens": 64}},
            "environment": {"kind": "wordcount", "max_turns": 3},
            "rewards": {"close_count": 1.0, "answer_match": 0.5}, "schedule": SCHEDULE,
        }  # fmt: skip
        episodes = await run_job(tmp_path, database_url, task, spec, model)
    assert len(episodes) == 2
    for ep in episodes:
        assert ep.state == "scored" and ep.turn == 1, (ep.state, ep.state_reason)
        assert ep.rewards["close_count"]["value"] == 1.0, ep.rewards  # the plugin's reward, scored
        assert ep.rewards["answer_match"]["details"]["given"] == "9"  # counted in the sandbox
        assert ep.reward == pytest.approx(1.5)


COUNT_LINES = TaskSpec(
    id="count-lines", kind="shell", prompt="Create count.txt holding the number of lines of data.txt.",
    files={"data.txt": "a\nb\nc\n"}, solution_file="count.txt", solution="3\n",
    tests='def test_count():\n    assert open("count.txt").read().strip() == "3"\n',
)  # fmt: skip
SHELL_JOB = {
    "name": "shell", "policy": {"model": "tiny", "sampling": {"max_tokens": 64}},
    "environment": {"kind": "shell", "max_turns": 3}, "rewards": {"tests_passed": 1.0},
    "schedule": SCHEDULE,
}  # fmt: skip


async def test_the_shell_environment_is_graded_by_the_tasks_tests_after_submit(tmp_path):
    task = COUNT_LINES
    seen: list[str] = []

    def model(prompt: str, turn: int) -> str:
        seen.append(prompt)
        if turn == 0:
            return "```python\nprint(1)\n```"  # not a tool here: an observation, not a crash
        return "```bash\nwc -l < data.txt > count.txt\n```\nsubmit"

    episodes = await run_job(tmp_path, f"sqlite+aiosqlite:///{tmp_path}/temper.db", task, SHELL_JOB, model)
    assert len(episodes) == 2
    for ep in episodes:
        assert ep.state == "scored" and ep.reward == 1.0, (ep.state, ep.state_reason, ep.rewards)
        assert ep.format_errors == 1
    assert any("only ```bash blocks run here" in p for p in seen)
    assert "hidden tests check the workspace" in seen[0] and "data.txt" in seen[0]


async def test_the_shell_environment_is_graded_at_max_turns_without_a_submit(tmp_path):
    def model(prompt: str, turn: int) -> str:  # works in the workspace over two turns, never submits
        return (
            "```bash\ncp data.txt copy.txt\n```"
            if turn == 0
            else "```bash\nwc -l < copy.txt > count.txt\n```"
        )

    spec = {**SHELL_JOB, "environment": {"kind": "shell", "max_turns": 2}}
    episodes = await run_job(tmp_path, f"sqlite+aiosqlite:///{tmp_path}/temper.db", COUNT_LINES, spec, model)
    assert len(episodes) == 2
    for ep in episodes:
        # the workspace persisted from turn 0 to turn 1, and the tests graded what was left
        assert ep.state == "scored" and ep.turn == 1 and ep.reward == 1.0, (ep.state, ep.rewards)


async def test_several_tool_calls_in_one_turn_run_in_order_each_with_its_own_observation(tmp_path):
    """Hermes calls: the second reads what the first wrote (so they ran in order, in one
    session), and the next prompt holds one tool message per call."""
    call = '<tool_call>{{"name": "bash", "arguments": {{"command": "{}"}}}}</tool_call>'.format
    seen: list[str] = []

    def model(prompt: str, turn: int) -> str:
        seen.append(prompt)
        if turn == 0:
            return call("wc -l < data.txt > count.txt") + "\n" + call("cat count.txt; echo second-call")
        return '<tool_call>{"name": "submit", "arguments": {}}</tool_call>'

    spec = {**SHELL_JOB, "environment": {"kind": "shell", "max_turns": 3, "action_format": "hermes"}}
    episodes = await run_job(tmp_path, f"sqlite+aiosqlite:///{tmp_path}/temper.db", COUNT_LINES, spec, model)
    for ep in episodes:
        assert ep.state == "scored" and ep.reward == 1.0 and ep.turn == 1, (ep.state, ep.rewards)
        assert ep.format_errors == 0
    second = next(p for p in seen if "second-call" in p)
    first_out, second_out = second.index("(no output)"), second.index("3\nsecond-call")
    assert first_out < second_out, "the calls' observations follow the calls' order"
