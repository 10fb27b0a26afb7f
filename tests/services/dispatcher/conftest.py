"""Fixtures for the dispatcher: a migrated SQLite database, a local object store, two
tenants with keys, and a finished job whose episodes and trajectories are stored through
the library, as the episode state machine would leave them."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import httpx
import pytest

from temper.clock import utcnow
from temper.db import Database, Episode, Job, Step, TaskOutcome, TaskSet
from temper.db.migrate import upgrade
from temper.jobspec import parse_spec
from temper.policy import default_tokenizer
from temper.settings import DatabaseSettings, Settings, StorageSettings
from temper.storage import LocalStore, object_key
from temper.tenants import create_tenant
from temper.trajectory import Segment, Trajectory, TurnRecord

SPEC = {
    "name": "add-numbers",
    "policy": {"model": "tiny", "sampling": {"temperature": 0.7, "max_tokens": 64}},
    "tasks": {"taskset": "ts-acme", "group_size": 2},
    "environment": {"kind": "code", "max_turns": 3},
    "rewards": {"tests_passed": 1.0},
    "schedule": {"iterations": 3, "episodes_per_iteration": 4, "max_staleness": 1},
}
TASKS = ("add-1", "add-2")
FIRST_PROMPT = "Write a function add(a, b) that returns the sum of a and b."
KILLED_EPISODE = "ep-0-add-2-1"


@dataclass
class Seeded:
    key: str
    other_key: str
    admin_key: str
    job_id: str
    running_job_id: str
    episodes: list[str] = field(default_factory=list)
    rewards: dict[int, list[float]] = field(default_factory=dict)


def make_settings(tmp: Path, **api: object) -> Settings:
    return Settings(
        data_dir=tmp,
        db=DatabaseSettings(url=f"sqlite+aiosqlite:///{tmp}/temper.db"),
        storage=StorageSettings(root=tmp / "objects"),
        **({"api": api} if api else {}),
    )


def reward_of(iteration: int, task: str, sample: int) -> float:
    """Rewards that rise with the iteration; task add-1 is easier than add-2."""
    base = {0: 0.0, 1: 0.5, 2: 1.0}[iteration]
    if task == "add-2" and sample == 1:
        base = max(0.0, base - 0.5)
    return base


def trajectory_for(
    job_id: str, episode_id: str, task: str, iteration: int, reward: float, killed: bool
) -> Trajectory:
    tok = default_tokenizer()
    action1 = "```python\ndef add(a, b):\n    return a + b\n```"
    obs1 = "[exit 0]\nwrote solution.py" if not killed else "[killed: timeout after 2.0s]\n"
    action2 = "```bash\npython -m pytest -q\n```"
    obs2 = "1 passed in 0.01s"

    def seg(role: str, text: str, version: int | None = None) -> Segment:
        ids = tok.encode(text)
        if role == "model":
            return Segment(
                role="model", token_ids=ids, logprobs=[-0.5] * len(ids), policy_version=version, text=text
            )
        return Segment(role=role, token_ids=ids, text=text)  # type: ignore[arg-type]

    return Trajectory(
        job_id=job_id,
        episode_id=episode_id,
        task_id=task,
        group_id=f"g-{iteration}-{task}",
        iteration=iteration,
        segments=[
            seg("prompt", FIRST_PROMPT),
            seg("model", action1, iteration),
            seg("observation", obs1),
            seg("model", action2, iteration),
            seg("observation", obs2),
        ],
        turns=[
            TurnRecord(
                turn=0,
                action_text=action1,
                action={"kind": "code_block", "language": "python"},
                observation=obs1,
                exit_code=None if killed else 0,
                kill_reason="timeout" if killed else None,
                policy_version=iteration,
                timings={"inference_s": 0.12, "sandbox_s": 2.0 if killed else 0.03},
            ),
            TurnRecord(
                turn=1,
                action_text=action2,
                action={"kind": "code_block", "language": "bash"},
                observation=obs2,
                exit_code=0,
                policy_version=iteration,
                timings={"inference_s": 0.1, "sandbox_s": 0.4},
            ),
        ],
        reward=reward,
        rewards={
            "tests_passed": {
                "value": reward,
                "ok": True,
                "reason": None,
                "details": {"passed": int(reward * 2), "total": 2},
            }
        },
        timings={"total_s": 3.1},
    )


async def seed(db: Database, store: LocalStore) -> Seeded:
    async with db.session() as s:
        _, acme = await create_tenant(s, name="Acme", tenant_id="acme", max_concurrent_episodes=8)
        _, other = await create_tenant(s, name="Other Co", tenant_id="other")
        _, admin = await create_tenant(s, name="Ops", tenant_id="ops", admin=True)
        s.add(TaskSet(id="ts-acme", tenant_id="acme", name="adders", status="valid", task_count=2))
        s.add(TaskSet(id="ts-other", tenant_id="other", name="theirs", status="valid", task_count=1))
    spec = parse_spec(SPEC).model_dump(mode="json")
    start = utcnow() - timedelta(minutes=10)
    seeded = Seeded(
        key=acme.key,
        other_key=other.key,
        admin_key=admin.key,
        job_id="job-finished",
        running_job_id="job-running",
    )
    async with db.session() as s:
        s.add(
            Job(
                id="job-finished",
                tenant_id="acme",
                name="add-numbers",
                spec=spec,
                state="completed",
                iteration=3,
                policy_version=3,
                created_at=start,
                finished_at=start + timedelta(minutes=6),
            )
        )
        s.add(
            Job(
                id="job-running",
                tenant_id="acme",
                name="still-going",
                spec=spec,
                state="running",
                iteration=1,
                policy_version=1,
                created_at=start + timedelta(minutes=1),
            )
        )
        await s.flush()
        n = 0
        for it in range(3):
            seeded.rewards[it] = []
            for task in TASKS:
                for sample in range(2):
                    eid = f"ep-{it}-{task}-{sample}"
                    r = reward_of(it, task, sample)
                    seeded.rewards[it].append(r)
                    killed = eid == KILLED_EPISODE
                    key = object_key("acme", "job-finished", "trajectories", f"{eid}.json")
                    await store.put(
                        key,
                        trajectory_for("job-finished", eid, task, it, r, killed).model_dump_json().encode(),
                    )
                    created = start + timedelta(seconds=30 * n)
                    s.add(
                        Episode(
                            id=eid,
                            job_id="job-finished",
                            tenant_id="acme",
                            task_id=task,
                            group_id=f"g-{it}-{task}",
                            iteration=it,
                            state="trained",
                            turn=2,
                            behaviour_version=it,
                            reward=r,
                            rewards={"tests_passed": {"value": r, "ok": True}},
                            trajectory_key=key,
                            created_at=created,
                            updated_at=created + timedelta(seconds=20),
                        )
                    )
                    # the outcome the scoring transaction records beside a scored episode
                    s.add(
                        TaskOutcome(
                            episode_id=eid,
                            task_id=task,
                            job_id="job-finished",
                            policy_version=it,
                            passed=r >= 1.0,
                            reward=r,
                            created_at=created + timedelta(seconds=20),
                        )
                    )
                    seeded.episodes.append(eid)
                    n += 1
        # the running job: one episode mid-turn, known only from its steps
        tok = default_tokenizer()
        s.add(
            Episode(
                id="ep-live",
                job_id="job-running",
                tenant_id="acme",
                task_id="add-1",
                group_id="g-live",
                iteration=1,
                state="acting",
                turn=0,
                behaviour_version=1,
            )
        )
        s.add(
            Episode(
                id="ep-live-2",
                job_id="job-running",
                tenant_id="acme",
                task_id="add-2",
                group_id="g-live",
                iteration=1,
                state="pending",
            )
        )
        await s.flush()
        prompt = tok.encode(FIRST_PROMPT)
        s.add(
            Step(
                episode_id="ep-live",
                turn=0,
                kind="inference",
                state="done",
                request={"prompt_ids": prompt},
                result={
                    "token_ids": tok.encode("```bash\nls\n```"),
                    "text": "```bash\nls\n```",
                    "policy_version": 1,
                },
            )
        )
        s.add(
            Step(
                episode_id="ep-live",
                turn=0,
                kind="sandbox",
                state="leased",
                request={"action": {"kind": "shell", "command": "ls"}},
            )
        )
    return seeded


@pytest.fixture(scope="session")
def migrated_template(tmp_path_factory) -> Path:
    """One migrated SQLite file per session; each test starts from a copy (migrating is slow)."""
    path = tmp_path_factory.mktemp("template") / "temper.db"
    upgrade(f"sqlite+aiosqlite:///{path}")
    return path


@pytest.fixture
async def env(tmp_path, migrated_template):
    """Settings, database and store of one test, seeded."""
    settings = make_settings(tmp_path)
    shutil.copyfile(migrated_template, tmp_path / "temper.db")
    db = Database(settings.db)
    store = LocalStore(settings.storage.root)
    seeded = await seed(db, store)
    await db.dispose()
    return settings, seeded


@pytest.fixture
async def app(env):
    from services.dispatcher.app import create_app

    settings, _ = env
    app = create_app(settings, run_episodes=False)
    async with app.router.lifespan_context(app):
        yield app


@pytest.fixture
def seeded(env) -> Seeded:
    return env[1]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
async def client(app, seeded):
    """An httpx client over the app, authenticated as tenant acme."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://dispatcher", headers=bearer(seeded.key)
    ) as c:
        yield c
