"""The debugging example's tasks (examples/tasksets/make_debug_tasks.py): what its tests print
is what the warm-start teacher shows, only the failure names the fix, and the committed task
file is what the generator writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "tasksets"))

import make_debug_tasks as debug  # noqa: E402


def _run_tests(tmp_path: Path, files: dict[str, str]) -> subprocess.CompletedProcess[str]:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    test = next(n for n in files if n.startswith("test_"))
    return subprocess.run([sys.executable, test], cwd=tmp_path, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("family", debug.FAMILIES, ids=lambda f: f.module)
def test_the_tests_print_what_the_teacher_shows_and_only_the_failure_names_the_fix(tmp_path, family):
    right, bug = family.literals[2], family.literals[4]
    task = debug.task(family, right, bug)
    ran = _run_tests(tmp_path, task["files"])
    assert ran.returncode == 1
    assert ran.stdout.strip() == debug.test_output(family, right, bug)
    assert f"should return {right!r}" in ran.stdout
    # the fix is nowhere in what the policy is given before it runs the tests
    given = task["prompt"] + task["files"][f"{family.module}.py"]
    assert f"'{right}'" not in given and f'"{right}"' not in given and f'"{bug}"' in given
    fixed = _run_tests(tmp_path, {**task["files"], f"{family.module}.py": task["solution"]})
    assert fixed.returncode == 0 and fixed.stdout.strip() == "1 passed"
    # the hidden tests pass on the fix and on no other literal of the family
    for literal in family.literals:
        space: dict[str, object] = {}
        exec(debug.module_source(family, literal), space)  # noqa: S102 - the generator's own source
        exec(task["tests"], space)  # noqa: S102
        check = space["check"]
        if literal == right:
            check(space[family.use])  # type: ignore[operator]
        else:
            with pytest.raises(AssertionError):
                check(space[family.use])  # type: ignore[operator]


def test_the_committed_task_file_is_what_the_generator_writes():
    committed = (ROOT / "examples" / "tasksets" / "debug-bugs.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in committed] == debug.tasks()
    assert len(committed) == 8 * 6 * 5
