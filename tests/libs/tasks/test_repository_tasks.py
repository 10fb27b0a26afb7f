"""Repository tasks (examples/tasksets/repo-bugs): each loads as a shell task graded
SWE-bench-style, and validation through real sandboxes shows the gold patch resolving
every issue (1.0) and the untouched repository resolving none (0.0) — on the host's /usr
and on the Debian task image."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from temper.db import Tenant
from temper.rewards import Scorer
from temper.rewards.models import Submission
from temper.rewards.scorer import DEFAULT_WEIGHTS
from temper.tasks import service
from temper.tasks.repositories import RepositoryTaskError, repository_task, repository_tasks
from temper.tasks.validation import validate_taskset
from tests.libs.sandbox.conftest import IMAGE_CACHE, debian_image, image_store  # noqa: F401 - fixtures

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(300)]
REPO_BUGS = Path(__file__).resolve().parents[3] / "examples" / "tasksets" / "repo-bugs"


def test_every_repo_bug_loads_as_a_graded_shell_task(tmp_path: Path) -> None:
    tasks = repository_tasks(REPO_BUGS)
    assert len(tasks) >= 10
    for task in tasks:
        assert task.kind == "shell" and task.oracle and "git apply" in task.oracle
        assert "tests/__init__.py" in task.files and "tests/test_issue.py" not in task.files  # hidden
        assert task.metadata.model_extra["fail_to_pass"]
    broken = tmp_path / "broken"
    shutil.copytree(REPO_BUGS / "pager", broken)
    (broken / "task.json").write_text(json.dumps({"fail_to_pass": ["not an id"]}))
    with pytest.raises(RepositoryTaskError, match="not a dotted unittest id"):
        repository_task(broken)
    (broken / "gold.patch").unlink()
    with pytest.raises(RepositoryTaskError, match="gold.patch is missing"):
        repository_task(broken)


async def validate(database, scorer: Scorer, limits: dict | None) -> dict[str, dict]:
    async with database.session() as s:
        s.add(Tenant(id="acme", name="acme"))
    async with database.session() as s:
        row = await service.create_taskset(
            s, None, "acme", "repo-bugs", repository_tasks(REPO_BUGS, limits=limits)
        )
    counts = await validate_taskset(database, scorer, row.id, concurrency=2)
    async with database.session() as s:
        rows = {r.key: r for r in await service.task_rows(s, row.id)}
    assert counts == {"valid": len(rows)}, {k: r.status_reasons for k, r in rows.items()}
    for key, r in rows.items():
        assert r.validation["oracle"]["reward"] == 1.0, (key, r.validation)
        assert r.validation["null"]["reward"] == 0.0, (key, r.validation)
    return rows


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_repo_bugs_validate_on_the_host(database, scoring_manager) -> None:
    await validate(database, Scorer(scoring_manager), None)


@pytest.fixture
async def image_scoring_manager(image_store, debian_image):  # noqa: F811 - the imported fixtures
    import uuid

    from temper.sandbox import SandboxManager, SandboxSettings

    root = Path("/tmp") / f"temper-score-{uuid.uuid4().hex[:8]}"
    settings = SandboxSettings(
        pool_size=2, workspace_root=root, image_cache=IMAGE_CACHE, default_image=debian_image
    )
    manager = SandboxManager(settings, store=image_store[0])
    await manager.start()
    yield manager
    await manager.close()
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_repo_bugs_validate_on_the_debian_image(database, image_scoring_manager) -> None:
    digest = image_scoring_manager.settings.default_image
    scorer = Scorer(image_scoring_manager)
    await validate(database, scorer, {"image": digest})
    # An agent that edits the tests instead of the code does not resolve the issue:
    # the grading sandbox restores the repository's tests and adds the hidden ones.
    task = repository_task(REPO_BUGS / "pager", limits={"image": digest})
    cheat = {**task.files, "tests/test_pages.py": "", "pager/pages.py": task.files["pager/pages.py"]}
    reward, comps = await scorer.score(task, Submission(files=cheat), DEFAULT_WEIGHTS[task.kind])
    assert reward == 0.0 and "not resolved" in (comps["tests_passed"].reason or ""), comps


def test_import_cli_writes_the_repo_bugs_with_an_image(tmp_path: Path, capsys) -> None:
    from temper.cli import main
    from temper.tasks.models import parse_tasks

    out = tmp_path / "repo-bugs.jsonl"
    digest = "sha256:" + "e" * 64
    assert main(["tasksets", "import", "repo", str(REPO_BUGS), "--image", digest, "--output", str(out)]) == 0
    tasks = parse_tasks(out.read_text(), filename=out.name)
    assert len(tasks) >= 10 and {t.limits.image for t in tasks} == {digest}
    assert {t.limits.wall_s for t in tasks} == {10.0}  # the rest of the limits stay the defaults
    assert (
        main(["tasksets", "import", "repo", str(REPO_BUGS), "--image", "latest", "--output", str(out)]) == 2
    )
    assert "image" in capsys.readouterr().err
    assert main(["tasksets", "import", "repo", str(tmp_path / "nothing"), "--output", str(out)]) == 2


def bundled(src: Path, dest: Path) -> str:
    """``src`` (a repo-bugs task) with its repo/ made into repo.bundle; returns the commit."""
    import subprocess

    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))
    env = {"HOME": str(dest.parent), "PATH": "/usr/bin:/bin", "GIT_CONFIG_NOSYSTEM": "1"}

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=dest / "repo", env=env, check=True, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip

    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "the task's commit")
    commit = git("rev-parse", "HEAD")
    (dest / "repo" / "later.txt").write_text("after the task's commit\n")
    git("add", "-A")
    git("commit", "-qm", "a later commit the task must not see")
    git("bundle", "create", str(dest / "repo.bundle"), "--all")
    shutil.rmtree(dest / "repo")
    meta = json.loads((dest / "task.json").read_text())
    (dest / "task.json").write_text(json.dumps({**meta, "commit": commit}))
    return commit


def test_a_repo_task_carried_as_a_git_bundle_loads_at_its_commit(tmp_path: Path) -> None:
    commit = bundled(REPO_BUGS / "pager", tmp_path / "pager")
    task, plain = repository_task(tmp_path / "pager"), repository_task(REPO_BUGS / "pager")
    assert task.files == plain.files and task.tests == plain.tests  # the commit, not the later one
    assert task.metadata.model_extra["commit"] == commit
    meta = json.loads((tmp_path / "pager" / "task.json").read_text())
    (tmp_path / "pager" / "task.json").write_text(json.dumps({**meta, "commit": "f" * 40}))
    with pytest.raises(RepositoryTaskError, match="is not in the bundle"):
        repository_task(tmp_path / "pager")
    (tmp_path / "pager" / "task.json").write_text(json.dumps({**meta, "commit": "HEAD"}))
    with pytest.raises(RepositoryTaskError, match="not a full 40-hex"):
        repository_task(tmp_path / "pager")
    (tmp_path / "pager" / "repo.bundle").write_bytes(b"# v2 git bundle\nnot really\n")
    (tmp_path / "pager" / "task.json").write_text(json.dumps(meta))
    with pytest.raises(RepositoryTaskError, match="git clone failed"):
        repository_task(tmp_path / "pager")
    (tmp_path / "pager" / "repo").mkdir()
    with pytest.raises(RepositoryTaskError, match="exactly one of repo/ and repo.bundle"):
        repository_task(tmp_path / "pager")


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_bundled_repo_task_validates_oracle_1_nothing_0(
    tmp_path: Path, database, scoring_manager
) -> None:
    bundled(REPO_BUGS / "ledger", tmp_path / "ledger")
    async with database.session() as s:
        s.add(Tenant(id="acme", name="acme"))
    async with database.session() as s:
        row = await service.create_taskset(s, None, "acme", "bundled", [repository_task(tmp_path / "ledger")])
    assert await validate_taskset(database, Scorer(scoring_manager), row.id) == {"valid": 1}
    async with database.session() as s:
        [r] = await service.task_rows(s, row.id)
    assert r.validation["oracle"]["reward"] == 1.0 and r.validation["null"]["reward"] == 0.0, r.validation
