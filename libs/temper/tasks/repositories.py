"""Repository tasks, graded SWE-bench-style.

A repository task is a directory:

- ``repo/``: the repository's files at the task's commit (what the agent starts with), or
  ``repo.bundle``: a git bundle holding that commit, named by ``commit`` in ``task.json``
  (its tree, checked out when the task is loaded, is what the agent starts with),
- ``issue.md``: the issue text (the prompt),
- ``hidden/``: test files the agent never sees (the tests that show the bug),
- ``gold.patch``: the fix, a unified diff against ``repo/``,
- ``task.json``: ``fail_to_pass`` and ``pass_to_pass``, lists of unittest ids.

:func:`repository_task` turns it into a ``shell`` :class:`TaskSpec`: its hidden tests are one
grading program that writes the hidden test files and the repository's own test files
as they were at the commit (so an agent's edits to tests do not count) over the agent's
final workspace, runs every listed test id with unittest in a subprocess, and passes
only when every ``fail_to_pass`` test passes and every ``pass_to_pass`` test still does
(SWE-bench's "resolved"; no partial credit). The scorer runs it in a fresh grading
sandbox, on the task's image when ``limits.image`` names one. The oracle is
``git apply`` of the gold patch, so oracle validation (``temper.tasks.oracle``) checks
that the gold patch resolves the issue and that the untouched repository does not.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from temper.tasks.models import TaskSpec

COMMIT = re.compile(r"^[0-9a-f]{40}$")
TEST_ID = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")
PROMPT = (
    "You are working in a Python repository (your working directory). Resolve this issue by "
    "editing the repository's code; run its tests with `python3 -m unittest`.\n\n{issue}"
)

# Runs inside the grading sandbox, in a fresh interpreter: each test id on its own, the
# outcome of each as one JSON line after a marker the code under test cannot know.
RUNNER = """
import io, json, sys, unittest
marker, ids = sys.argv[1], sys.argv[2:]
out = {}
for tid in ids:
    try:
        suite = unittest.defaultTestLoader.loadTestsFromName(tid)
    except Exception as e:
        out[tid] = "cannot load: %s: %s" % (type(e).__name__, e)
        continue
    result = unittest.TestResult()
    suite.run(result)
    bad = result.failures + result.errors
    if result.testsRun == 0:
        out[tid] = "no such test"
    elif bad:
        out[tid] = bad[0][1].strip().splitlines()[-1][:300]
    else:
        out[tid] = "ok"
sys.stdout.write(marker + json.dumps(out) + "\\n")
"""


class RepositoryTaskError(ValueError):
    """A repository task directory that is incomplete or malformed."""


def read_tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (relative path -> text), skipping caches."""
    files = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            files[path.relative_to(root).as_posix()] = path.read_text()
    return files


def bundle_tree(bundle: Path, commit: str) -> dict[str, str]:
    """The files of ``commit`` in a git bundle: cloned into a temporary directory (git
    checks the bundle's pack) and the commit checked out, detached."""
    if not COMMIT.match(commit or ""):
        raise RepositoryTaskError(f"{bundle}: commit {commit!r} is not a full 40-hex git commit id")
    with tempfile.TemporaryDirectory(prefix="temper-bundle-") as tmp:
        work = Path(tmp) / "repo"

        def git(*args: str, cwd: Path | None = None) -> None:
            env = {"GIT_CONFIG_NOSYSTEM": "1", "HOME": tmp, "PATH": "/usr/bin:/bin"}
            proc = subprocess.run(
                ["git", *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=60
            )
            if proc.returncode != 0:
                raise RepositoryTaskError(f"{bundle}: git {args[0]} failed: {proc.stderr.strip()[-300:]}")

        git("clone", "--quiet", "--no-checkout", str(Path(bundle).absolute()), str(work))
        try:
            git("checkout", "--quiet", "--detach", commit, cwd=work)
        except RepositoryTaskError as e:
            raise RepositoryTaskError(f"{bundle}: commit {commit} is not in the bundle ({e})") from None
        shutil.rmtree(work / ".git")  # the agent gets the tree at the commit, not the history
        return read_tree(work)


def grading_program(restore: dict[str, str], fail_to_pass: list[str], pass_to_pass: list[str]) -> str:
    """The hidden tests of a repository task: one ``test_resolved`` function."""
    return (
        "import json, os, secrets, subprocess\n\n"
        f"RESTORE = {json.dumps(restore, indent=1)}\n"
        f"FAIL_TO_PASS = {json.dumps(fail_to_pass)}\n"
        f"PASS_TO_PASS = {json.dumps(pass_to_pass)}\n"
        f"RUNNER = {json.dumps(RUNNER)}\n\n\n"
        "def test_resolved():\n"
        "    for path, text in RESTORE.items():\n"
        "        if os.path.dirname(path):\n"
        "            os.makedirs(os.path.dirname(path), exist_ok=True)\n"
        "        with open(path, 'w') as f:\n"
        "            f.write(text)\n"
        "    marker = secrets.token_hex(8) + ' '\n"
        "    proc = subprocess.run(\n"
        "        ['python3', '-B', '-c', RUNNER, marker, *FAIL_TO_PASS, *PASS_TO_PASS],\n"
        "        capture_output=True, text=True, timeout=20,\n"
        "    )\n"
        "    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(marker)]\n"
        "    assert lines, 'the test run produced no results: ' + proc.stderr[-300:]\n"
        "    outcome = json.loads(lines[-1][len(marker):])\n"
        "    broken = {t: outcome.get(t, 'not run') for t in FAIL_TO_PASS + PASS_TO_PASS if outcome.get(t) != 'ok'}\n"
        "    assert not broken, 'not resolved: ' + json.dumps(broken)[:600]\n"
    )


def repository_task(
    directory: Path, *, task_id: str | None = None, limits: dict[str, Any] | None = None
) -> TaskSpec:
    """The task of one repository task directory (see the module's docstring)."""
    directory = Path(directory)
    for need in ("hidden", "issue.md", "gold.patch", "task.json"):
        if not (directory / need).exists():
            raise RepositoryTaskError(f"{directory}: {need} is missing")
    has_tree, has_bundle = (directory / "repo").exists(), (directory / "repo.bundle").exists()
    if has_tree == has_bundle:
        raise RepositoryTaskError(f"{directory}: needs exactly one of repo/ and repo.bundle")
    meta = json.loads((directory / "task.json").read_text())
    f2p, p2p = list(meta.get("fail_to_pass") or []), list(meta.get("pass_to_pass") or [])
    if not f2p:
        raise RepositoryTaskError(f"{directory}: task.json lists no fail_to_pass tests")
    for tid in f2p + p2p:
        if not TEST_ID.match(tid):
            raise RepositoryTaskError(f"{directory}: {tid!r} is not a dotted unittest id")
    if has_bundle:
        files = bundle_tree(directory / "repo.bundle", str(meta.get("commit") or ""))
    else:
        files = read_tree(directory / "repo")
    hidden = read_tree(directory / "hidden")
    tests = {p: t for p, t in files.items() if p.split("/")[0] == "tests" or "/tests/" in f"/{p}"}
    patch = (directory / "gold.patch").read_text()
    if not patch.strip():
        raise RepositoryTaskError(f"{directory}: gold.patch is empty")
    oracle = f"set -e\ngit apply --verbose <<'TEMPER_GOLD_PATCH'\n{patch}TEMPER_GOLD_PATCH\n"
    return TaskSpec.model_validate(
        {
            "id": task_id or directory.name,
            "kind": "shell",
            "prompt": PROMPT.format(issue=(directory / "issue.md").read_text().strip()),
            "files": files,
            "tests": grading_program({**tests, **hidden}, f2p, p2p),
            "oracle": oracle,
            "metadata": {"source": "repo-bugs", "tags": ["repository", "python"], "fail_to_pass": f2p,
                         "pass_to_pass": p2p, **({"commit": meta["commit"]} if has_bundle else {})},
            **({"limits": limits} if limits else {}),
        }
    )  # fmt: skip


def repository_tasks(root: Path, *, limits: dict[str, Any] | None = None) -> list[TaskSpec]:
    """Every repository task directory under ``root`` (those holding ``task.json``), by name."""
    return [
        repository_task(d, limits=limits) for d in sorted(Path(root).iterdir()) if (d / "task.json").exists()
    ]
