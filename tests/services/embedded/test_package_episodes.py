"""A tenant environment package end to end, with nothing of it in libs/ or services/: the
example package (examples/environments/wordcount-pkg) is uploaded over REST, a job names
it over REST, and its episodes run through the real dispatcher, sandbox worker and
reward scorer (in one process, on the in-process bus and on the real Kafka) against the
real Postgres and the real S3 server; only the model is scripted. The package's setup,
tools and grader run in sandboxes; another tenant cannot list, read or use it; a grader
that misbehaves gives a recorded ``reward_error`` with its stderr in the episode log; a
hostile grader finds neither the platform's environment nor another tenant's files."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from services.dispatcher.app import create_app
from services.reward_scorer.component import RewardScorer
from services.sandbox_worker.component import SandboxWorkerComponent
from temper.db import Episode
from temper.db.migrate import upgrade
from temper.envpkg.archive import pack
from temper.episode_log import log_key, read_episode_log
from temper.runtime import Runtime
from temper.sandbox import SandboxSettings
from temper.settings import BusKind, BusSettings, DatabaseSettings, DispatcherSettings, Settings
from temper.tenants import create_tenant
from tests.services.embedded.test_plugin_episodes import ScriptedModel

pytestmark = [pytest.mark.sandbox, pytest.mark.postgres, pytest.mark.s3, pytest.mark.timeout(120)]

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "environments"
PACKAGE = EXAMPLES / "wordcount-pkg"
TASKS = EXAMPLES / "wordcount-tasks.yaml"
PROBE = f"probe-{uuid.uuid4().hex}"  # a platform secret the hostile grader must not see


def package_files(root: Path = PACKAGE) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def call(name: str, **arguments: str) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def counting_agent(prompt: str, turn: int) -> str:
    """Counts with the package's tool, records what the tool printed, submits."""
    if turn == 0:
        return call("count_words", path="text.txt")
    if turn == 1:
        return call("write_answer", value=re.findall(r"\b(\d+)\b", prompt)[-1])  # what the tool printed
    return call("submit")


@dataclass
class Platform:
    api: httpx.AsyncClient
    runtime: Runtime
    keys: dict[str, str]  # tenant id -> API key

    def as_(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}


@asynccontextmanager
async def platform(
    tmp_path: Path, db_url: str, s3: Any, script: Callable[[str, int], str], kafka: str | None = None
) -> AsyncIterator[Platform]:
    """The dispatcher's app with the sandbox worker, the reward scorer and a scripted model
    in its process, started by its own lifespan; two tenants with keys."""
    await asyncio.to_thread(upgrade, db_url)
    root = Path("/tmp") / f"temper-pkg-{uuid.uuid4().hex[:8]}"  # the sandbox uid must reach it
    settings = Settings(
        db=DatabaseSettings(url=db_url),
        bus=BusSettings(kind=BusKind.kafka, bootstrap=kafka, partitions=2, namespace=f"pkg{uuid.uuid4().hex[:8]}.")
        if kafka
        else BusSettings(kind=BusKind.inprocess, partitions=4, retry_backoff_s=0.01),
        storage=s3,
        sandbox=SandboxSettings(pool_size=1, workspace_root=root),
        dispatcher=DispatcherSettings(lease_s=30.0, trainer_attached=False, scheduler_interval_s=0.05,
                                      reaper_interval_s=0.2, models=["tiny"]),
        data_dir=tmp_path,
    )  # fmt: skip
    app = create_app(
        settings,
        executors=lambda rt: [
            SandboxWorkerComponent(rt),
            RewardScorer(rt, concurrency=2),
            ScriptedModel(rt, script),
        ],
    )
    runtime: Runtime = app.state.runtime
    async with app.router.lifespan_context(app):
        assert runtime.db is not None
        keys = {}
        async with runtime.db.session() as s:
            for who in ("a", "b"):
                tenant_id = f"{who}-{uuid.uuid4().hex[:8]}"
                _, issued = await create_tenant(s, name=tenant_id, tenant_id=tenant_id)
                keys[who] = issued.key
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://temper", timeout=30) as api:
            yield Platform(api, runtime, keys)


async def push(p: Platform, tenant: str, files: dict[str, str]) -> httpx.Response:
    return await p.api.post(
        "/v1/environments", content=pack(files), headers={**p.as_(tenant), "Content-Type": "application/gzip"}
    )


async def run_job(p: Platform, tenant: str, name: str, version: str = "1.0.0") -> list[Episode]:
    r = await p.api.post(
        "/v1/tasksets", params={"name": "words", "validate": "false"}, content=TASKS.read_text(),
        headers={**p.as_(tenant), "Content-Type": "application/yaml"},
    )  # fmt: skip
    assert r.status_code == 201, r.text
    spec = {
        "name": f"pkg-{name}", "policy": {"model": "tiny", "sampling": {"max_tokens": 64}},
        "tasks": {"taskset": r.json()["id"], "group_size": 2},
        "environment": {"kind": "package", "name": name, "version": version},
        "schedule": {"iterations": 1, "episodes_per_iteration": 2, "max_concurrent_episodes": 2},
    }  # fmt: skip
    r = await p.api.post("/v1/jobs", json=spec, headers=p.as_(tenant))
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["spec"]["rewards"] == json.loads(json.dumps(job["spec"]["environment"]["package"]["rubric"]))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = (await p.api.get(f"/v1/jobs/{job['id']}", headers=p.as_(tenant))).json()["state"]
        if state in ("completed", "failed", "cancelled"):
            break
        await asyncio.sleep(0.2)
    assert state == "completed", state
    assert p.runtime.db is not None
    async with p.runtime.db.session() as s:
        return list((await s.execute(select(Episode).where(Episode.job_id == job["id"]))).scalars())


async def episode_log(p: Platform, ep: Episode) -> list[dict[str, Any]]:
    assert p.runtime.store is not None
    return read_episode_log(await p.runtime.store.get(log_key(ep.tenant_id, ep.job_id, ep.id)))


@pytest.mark.parametrize("bus", ["inprocess", pytest.param("kafka", marks=pytest.mark.kafka)])
async def test_an_uploaded_package_runs_a_job_and_only_its_tenant_sees_it(
    tmp_path, postgres_database_url, s3_settings, bus, request
):
    kafka = request.getfixturevalue("kafka_bootstrap") if bus == "kafka" else None
    seen: list[str] = []

    def agent(prompt: str, turn: int) -> str:
        seen.append(prompt)
        return counting_agent(prompt, turn)

    async with platform(tmp_path, postgres_database_url, s3_settings, agent, kafka) as p:
        r = await push(p, "a", package_files())
        assert r.status_code == 201, r.text
        assert r.json()["hidden_files"] == 2 and "hidden/grade.py" not in r.json()["public_files"]
        assert (await push(p, "a", package_files())).status_code == 200  # the same archive again
        changed = {**package_files(), "tools/count.py": "print(0)\n"}
        assert (await push(p, "a", changed)).status_code == 409  # a version is immutable

        bad = {**package_files(), "environment.yaml": package_files()["environment.yaml"].replace(
            "network: none", "network: host")}  # fmt: skip
        r = await push(p, "a", bad)
        assert r.status_code == 422, r.text
        line = next(
            i for i, t in enumerate(bad["environment.yaml"].splitlines(), 1) if t.startswith("network:")
        )
        assert r.json()["errors"][0]["field"] == "network" and r.json()["errors"][0]["line"] == line, r.text
        assert (
            f"network (line {line}): network 'host' is not one a package may ask for" in r.json()["detail"]
        ), r.text

        listed = (await p.api.get("/v1/environments", headers=p.as_("a"))).json()
        assert [(m["name"], m["version"]) for m in listed] == [("wordcount-pkg", "1.0.0")]
        # the other tenant: nothing listed, 404 on read, and a job naming it is refused
        assert (await p.api.get("/v1/environments", headers=p.as_("b"))).json() == []
        r = await p.api.get("/v1/environments/wordcount-pkg/1.0.0", headers=p.as_("b"))
        assert r.status_code == 404, r.text
        r = await p.api.post("/v1/tasksets", params={"name": "w", "validate": "false"}, content=TASKS.read_text(),
                             headers={**p.as_("b"), "Content-Type": "application/yaml"})  # fmt: skip
        spec = {"name": "steal", "policy": {"model": "tiny"}, "tasks": {"taskset": r.json()["id"], "group_size": 2},
                "environment": {"kind": "package", "name": "wordcount-pkg", "version": "1.0.0"},
                "schedule": {"episodes_per_iteration": 2}}  # fmt: skip
        r = await p.api.post("/v1/jobs", json=spec, headers=p.as_("b"))
        assert r.status_code == 422 and "no environment package 'wordcount-pkg'" in r.text, r.text

        spec["environment"]["max_turns"] = 9  # the package decides its turns
        r = await p.api.post("/v1/jobs", json=spec, headers=p.as_("b"))
        assert (
            r.status_code == 422 and "invalid job spec: environment.max_turns: set by the package" in r.text
        ), r.text

        episodes = await run_job(p, "a", "wordcount-pkg")
        assert len(episodes) == 2
        for ep in episodes:
            assert ep.state == "scored", (ep.state, ep.state_reason, ep.rewards)
            assert ep.rewards["correct"]["value"] == 1.0 and ep.rewards["used_tool"]["value"] == 1.0, (
                ep.rewards
            )
            assert ep.reward == pytest.approx(1.25)
        first = seen[0]
        assert "sandboxed workspace" in first and "Record the number with write_answer" in first
        assert "count_words" in first  # the tools' schemas, rendered by the chat template
        assert not any("expected.json" in s or "hidden/grade.py" in s for s in seen)
        # the tool ran after setup (it appends to the log setup made) and printed the count
        assert any("9" in s for s in seen[1:])


GRADERS = {
    "crash": ("import sys\nprint('grader blew up: no such table', file=sys.stderr)\nsys.exit(3)\n",
              "exited with status 3", "grader blew up"),
    "garbage": ("print('all good!')\n", "last line is not JSON", None),
    "wrong": ("import json, sys\nprint('wrong keys', file=sys.stderr)\nprint(json.dumps({'correct': 1}))\n",
              "missing ['used_tool']", "wrong keys"),
    "hang": ("import sys, time\nprint('thinking', file=sys.stderr, flush=True)\ntime.sleep(60)\n",
             "killed (timeout)", "thinking"),
}  # fmt: skip


async def test_a_grader_that_misbehaves_is_a_recorded_reward_error(
    tmp_path, postgres_database_url, s3_settings
):
    async with platform(tmp_path, postgres_database_url, s3_settings, counting_agent) as p:
        for case, (source, reason, stderr) in GRADERS.items():
            files = package_files()
            files["hidden/grade.py"] = source
            files["environment.yaml"] = (
                files["environment.yaml"]
                .replace("name: wordcount-pkg", f"name: bad-{case}")
                .replace("grade_limits: {wall_s: 10, cpu_s: 10}", "grade_limits: {wall_s: 2, cpu_s: 2}")
            )
            assert (await push(p, "a", files)).status_code == 201
            episodes = await run_job(p, "a", f"bad-{case}")
            for ep in episodes:
                assert ep.state == "scored", (case, ep.state, ep.state_reason)
                for name in ("correct", "used_tool"):
                    comp = ep.rewards[name]
                    assert comp["ok"] is False and comp["reason"].startswith("reward_error:"), (case, comp)
                    assert reason in comp["reason"], (case, comp["reason"])
                reward_line = next(line for line in await episode_log(p, ep) if line["kind"] == "reward")
                kept = reward_line["components"]["correct"]["details"]["stderr"]
                assert stderr is None or stderr in kept, (case, kept)


HOSTILE_GRADER = """
import json, os, subprocess, sys
probe = {probe!r}[::-1]  # reversed in the source, so that a search does not find this file
other = {other!r}[::-1]
token = {token!r}[::-1]
env_leak = any(probe in v for v in os.environ.values()) or any(k.startswith("TEMPER_") for k in os.environ)
for pid in os.listdir("/proc"):
    try:
        env_leak = env_leak or probe.encode() in open(f"/proc/{{pid}}/environ", "rb").read()
    except (OSError, ValueError):
        pass
# another tenant's package: its archive, its hidden file by name, or its secret in plain text anywhere
def search(needle, name):
    return subprocess.run(("find / \\( -path /proc -o -path /sys -o -path /dev -o -path /usr \\) -prune -o "
          "\\( -name package.tar.gz -o -name " + name + " \\) -print 2>/dev/null | head -5; "
          "timeout 8 grep -rl --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev --exclude-dir=usr "
          "'" + needle + "' / 2>/dev/null | head -5"), shell=True, capture_output=True, text=True).stdout
found = search(other, "secret.txt")
# the control: the same search finds this package's own hidden token (so it can find a file)
own = open("hidden/own.txt").read().strip() == "mine" and "own-token.txt" in search(token, "own-token.txt")
print("env", sorted(os.environ), "found", found, file=sys.stderr)
print(json.dumps({{"env_leak": float(env_leak), "file_leak": float(bool(found.strip())), "own_hidden": float(own)}}))
"""


async def test_a_package_grader_reads_neither_the_platform_env_nor_another_tenants_files(
    tmp_path, postgres_database_url, s3_settings, monkeypatch
):
    monkeypatch.setenv("TEMPER_PROBE_SECRET", PROBE)  # in the scorer's environment, as a real secret is
    other_secret = f"other-tenant-{uuid.uuid4().hex}"
    async with platform(tmp_path, postgres_database_url, s3_settings, counting_agent) as p:
        theirs = {**package_files(), "hidden/secret.txt": other_secret}
        theirs["environment.yaml"] = theirs["environment.yaml"].replace("name: wordcount-pkg", "name: theirs")
        assert (await push(p, "b", theirs)).status_code == 201
        files = package_files()
        token = f"own-{uuid.uuid4().hex}"
        files["hidden/grade.py"] = HOSTILE_GRADER.format(
            probe=PROBE[::-1], other=other_secret[::-1], token=token[::-1]
        )
        files["hidden/own.txt"] = "mine\n"
        files["hidden/own-token.txt"] = token
        files["environment.yaml"] = (
            files["environment.yaml"]
            .replace("name: wordcount-pkg", "name: hostile")
            .replace(
                "  correct: 1.0\n  used_tool: 0.25", "  env_leak: -1.0\n  file_leak: -1.0\n  own_hidden: 1.0"
            )
            .replace("grade_limits: {wall_s: 10, cpu_s: 10}", "grade_limits: {wall_s: 20, cpu_s: 20}")
        )
        assert (await push(p, "a", files)).status_code == 201, "the hostile package uploads"
        episodes = await run_job(p, "a", "hostile")
        for ep in episodes:
            assert ep.state == "scored", (ep.state, ep.state_reason)
            # it ran, read its own hidden files, and its search finds a file that is there
            assert ep.rewards["own_hidden"]["value"] == 1.0, ep.rewards
            assert ep.rewards["env_leak"]["value"] == 0.0, ep.rewards
            assert ep.rewards["file_leak"]["value"] == 0.0, ep.rewards
