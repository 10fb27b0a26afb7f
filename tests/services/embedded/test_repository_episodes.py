"""A repository task (examples/tasksets/repo-bugs/pager) through the full stack in one
process — dispatcher, sandbox worker, reward scorer on the in-process bus and SQLite,
every sandbox on the Debian task image — with a scripted multi-turn agent that explores
with bash (ls, cat, runs the tests), edits the code and reruns the tests before it
submits; the hidden tests grade its final workspace. An agent that only looks scores 0."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

import tests.services.embedded.test_plugin_episodes as stack
from temper.sandbox import SandboxSettings
from temper.sandbox.images import publish
from temper.storage.local import LocalStore
from temper.tasks.repositories import repository_task
from tests.libs.sandbox.conftest import IMAGE_CACHE, debian_blob, debian_image, image_store  # noqa: F401

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(180)]
PAGER = Path(__file__).resolve().parents[3] / "examples" / "tasksets" / "repo-bugs" / "pager"
JOB = {
    "name": "repo", "policy": {"model": "tiny", "sampling": {"max_tokens": 64}},
    "environment": {"kind": "shell", "max_turns": 6}, "rewards": {"tests_passed": 1.0},
    "schedule": stack.SCHEDULE,
}  # fmt: skip
FIXING = [
    # bwrap is on the host's /usr, not in the image: which root the sandbox has
    "```bash\nls -R; test -e /usr/bin/bwrap && echo ON-HOST-USR || echo ON-THE-IMAGE\n```",
    "```bash\ncat pager/pages.py\n```",
    "```bash\npython3 -m unittest 2>&1 | tail -1\n```",
    "```bash\nsed -i 's|return total // per_page|return -(-total // per_page)|' pager/pages.py\n```",
    "```bash\npython3 -c 'from pager import page_count; print(page_count(11, 5))'; python3 -m unittest 2>&1 | tail -1\n```",
    "submit",
]


@pytest.mark.parametrize(
    ("script", "reward"), [(FIXING, 1.0), ([*FIXING[:3], "submit"], 0.0)], ids=["fix", "look"]
)
async def test_a_multi_turn_agent_fixes_a_repository_on_the_image(
    tmp_path,
    monkeypatch,
    debian_image,  # noqa: F811 - the imported fixture
    script,
    reward,
) -> None:
    monkeypatch.setattr(stack, "SandboxSettings", functools.partial(SandboxSettings, image_cache=IMAGE_CACHE))
    # The job's object store holds the image (the worker would pull it from there).
    await publish(LocalStore(tmp_path / "objects"), debian_blob(), source={"test": "repo-episodes"})
    task = repository_task(PAGER, limits={"image": debian_image, "wall_s": 20, "cpu_s": 20})
    seen: list[tuple[int, str]] = []

    def model(prompt: str, turn: int) -> str:
        seen.append((turn, prompt))
        return script[min(turn, len(script) - 1)]

    db = f"sqlite+aiosqlite:///{tmp_path}/temper.db"
    episodes = await stack.run_job(tmp_path, db, task, JOB, model)
    assert len(episodes) == 2
    for ep in episodes:
        assert ep.state == "scored" and ep.reward == reward, (ep.state, ep.state_reason, ep.rewards)
        assert ep.turn == len(script) - 1
    last = max(seen)[1]
    assert "pager/pages.py" in last and "def page_count" in last  # ls and cat ran in the sandbox
    assert "ON-THE-IMAGE" in last and "ON-HOST-USR" not in last.replace("echo ON-HOST-USR", "")
    if reward:
        assert "\n3\n" in last and "OK" in last  # the edit took, and the repository's own tests pass
    else:
        assert "OK" in last  # its visible tests pass before the fix: only the hidden ones find the bug
