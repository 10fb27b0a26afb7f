"""examples/agent-job.yaml, shrunk, end to end through ``temper run``: the example's agent
(``examples/agent/agent.py``, written with the ``openai`` client) runs in real bwrap
sandboxes on the Debian image that ``scripts/agent_image.sh`` builds (openai installed
from wheels with ``--no-index``), reaches the gateway only through its allowlist proxy,
and the trainer learns from the calls the gateway recorded. Learning itself is not
checked here (the run is two iterations); what is: every scored episode's trajectory is
the recorded calls token for token, the calls are durable (rows and bodies), the keys
are kept hashed, and the trainer published versions from them."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from sqlalchemy import select

from services.cli import main
from temper.agent_traces import CallRecord
from temper.db import AgentCall, AgentKey, Database, Episode, PolicyVersion
from temper.settings import DatabaseSettings
from temper.storage import LocalStore
from temper.trajectory import Trajectory

pytestmark = [pytest.mark.sandbox, pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
IMAGE = (
    Path(os.environ.get("TEMPER_CACHE_DIR", Path.home() / ".cache" / "temper"))
    / "images"
    / "agent-bookworm.tar.gz"
)


@pytest.fixture(scope="module")
def agent_image() -> Path:
    """The example's image, built by its script when this machine has none yet (about two
    minutes: Debian's packages and the wheels are downloaded)."""
    if not IMAGE.exists():
        done = subprocess.run(
            ["bash", str(ROOT / "scripts" / "agent_image.sh"), str(IMAGE)],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, f"scripts/agent_image.sh failed:\n{done.stderr[-3000:]}"
    return IMAGE


def shrunk(tmp_path: Path, image: Path) -> Path:
    spec = yaml.safe_load((ROOT / "examples" / "agent-job.yaml").read_text())
    spec["tasks"]["group_size"] = 4
    spec["schedule"].update(iterations=2, episodes_per_iteration=8, max_concurrent_episodes=8)
    spec["algorithm"]["groups_per_step"] = 1
    # four groups of four from a barely warm policy can all score alike; the trainer still
    # steps on them, so the check below is on what it trained from, not on reward variance
    spec["algorithm"]["skip_zero_variance"] = False
    local = spec["local"]
    local["taskset_file"] = str(ROOT / "examples" / local["taskset_file"])
    local["agent_dir"] = str(ROOT / "examples" / local["agent_dir"])
    local["image"] = str(image)
    file, _, func = local["warm_start"]["generator"].partition(":")
    # enough warm start that the policy writes its calls in the hermes format
    local["warm_start"].update(generator=f"{ROOT / 'examples' / file}:{func}", steps=400, examples=2000)
    path = tmp_path / "agent-job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_the_agent_example_trains_on_the_calls_its_agent_made(tmp_path, capsys, monkeypatch, agent_image):
    monkeypatch.setenv(
        "TEMPER_SANDBOX__IMAGE_CACHE", "/tmp/temper-image-cache"
    )  # the sandbox uid reaches /tmp
    code = main(
        ["run", str(shrunk(tmp_path, agent_image)), "--runs-dir", str(tmp_path / "runs"), "--run-id", "agent"]
    )
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    run_dir = tmp_path / "runs" / "agent"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "completed" and len(summary["reward_curve"]) == 2, summary
    asyncio.run(_check_records(run_dir))


async def _check_records(run_dir: Path) -> None:
    db = Database(DatabaseSettings(url=f"sqlite+aiosqlite:///{run_dir / 'temper.db'}"))
    store = LocalStore(run_dir / "objects")
    try:
        async with db.session() as s:
            episodes = list((await s.execute(select(Episode))).scalars())
            calls = list((await s.execute(select(AgentCall).order_by(AgentCall.id))).scalars())
            keys = list((await s.execute(select(AgentKey))).scalars())
            versions = list((await s.execute(select(PolicyVersion.version))).scalars())
        scored = [e for e in episodes if e.trajectory_key]
        assert len(episodes) == 16 and len(scored) >= 12, [(e.state, e.state_reason) for e in episodes]
        assert len(keys) == 16 and all(len(k.key_hash) == 64 for k in keys)
        assert max(versions) >= 1, "the trainer published versions from the agents' calls"
        by_episode: dict[str, list[CallRecord]] = {}
        for row in calls:
            by_episode.setdefault(row.episode_id, []).append(
                CallRecord.model_validate_json(await store.get(row.body_key))
            )
        tool_calls = 0
        for ep in scored:
            records = by_episode[ep.id]
            assert 1 <= len(records) <= 3
            traj = Trajectory.model_validate_json(await store.get(str(ep.trajectory_key)))
            model = [s for s in traj.segments if s.role == "model"]
            assert [m.token_ids for m in model] == [r.token_ids for r in records]
            assert [m.logprobs for m in model] == [r.logprobs for r in records]
            for earlier, later in zip(records, records[1:], strict=False):
                if later.extends:  # the agent sent the call and its result back: token for token
                    head = [*earlier.prompt_ids, *earlier.token_ids]
                    assert later.prompt_ids[: len(head)] == head
            tool_calls += sum(bool(r.reply.get("tool_calls")) for r in records)
            if any(r.reply.get("tool_calls") for r in records[:-1]):
                # the agent ran the call in its sandbox and sent back what the run printed;
                # the sampled code may not parse, so stderr is as good as stdout here
                observation = traj.turns[0].observation
                assert "[exit code " in observation, observation
                assert "stdout:" in observation or "stderr:" in observation, observation
        assert tool_calls > 0, "the warm-started policy called the agent's python tool at least once"
    finally:
        await db.dispose()
