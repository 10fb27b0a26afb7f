"""Oracle validation on real sandboxes: every imported task's reference (or solution.sh)
scores full marks through the reward scorer's Scorer, a do-nothing agent does not, and
both runs are stored per task."""

from __future__ import annotations

import pytest

from temper.db import Tenant
from temper.rewards import Scorer
from temper.tasks import service
from temper.tasks.datasets import import_file
from temper.tasks.harbor import import_task_dir
from temper.tasks.oracle import run_oracle
from temper.tasks.validation import validate_taskset
from tests.libs.tasks.fixtures import (
    GSM8K,
    HUMANEVAL,
    MBPP,
    harbor_task,
    terminal_bench_task,
    write_jsonl,
    write_parquet,
)

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(180)]


def imported(tmp_path):
    return [
        *import_file("humaneval", write_jsonl(tmp_path / "he.jsonl", HUMANEVAL)),
        *import_file("mbpp", write_parquet(tmp_path / "mbpp.parquet", MBPP)),
        *import_file("gsm8k", write_jsonl(tmp_path / "gsm.jsonl", GSM8K)),
        import_task_dir(harbor_task(tmp_path)),
        import_task_dir(terminal_bench_task(tmp_path)),
    ]


async def test_oracles_score_full_marks_and_doing_nothing_fails(scoring_manager, tmp_path):
    scorer = Scorer(scoring_manager)
    for task in imported(tmp_path):
        runs, reasons = await run_oracle(scorer, task)
        assert reasons == [], (task.id, reasons, runs)
        assert runs["oracle"]["reward"] == runs["full_marks"] == 1.0 and runs["oracle"]["passed"], task.id
        assert runs["null"]["passed"] is False and runs["null"]["reward"] < 1.0, (task.id, runs)


async def test_a_broken_oracle_and_a_task_solved_by_doing_nothing_are_invalid(
    database, scoring_manager, tmp_path
):
    async with database.session() as s:
        s.add(Tenant(id="acme", name="acme"))
    wrong = harbor_task(tmp_path, "wrong-oracle")
    (wrong / "solution" / "solve.sh").write_text("echo 'Hello, moon!' > /app/hello.txt\n")
    crashing = harbor_task(tmp_path, "crashing-oracle")
    (crashing / "solution" / "solve.sh").write_text("cat /app/missing.txt\n")
    he = import_file("humaneval", write_jsonl(tmp_path / "he.jsonl", HUMANEVAL[:1]))[0]
    # the starting file already holds the solution: an agent that does nothing passes
    presolved = he.model_copy(
        update={
            "id": "presolved",
            "prompt": "strlen again",
            "files": {"solution.py": he.solution},
            "tests": he.tests + "    assert candidate('ab') == 2\n",
        }
    )
    tasks = [he, presolved, import_task_dir(wrong), import_task_dir(crashing), *imported(tmp_path)[-1:]]
    async with database.session() as s:
        row = await service.create_taskset(s, None, "acme", "oracles", tasks)
    counts = await validate_taskset(database, Scorer(scoring_manager), row.id)
    assert counts == {"valid": 2, "invalid": 3}
    async with database.session() as s:
        rows = {r.key: r for r in await service.task_rows(s, row.id)}
    assert rows["HumanEval/23"].validation["oracle"] == {"reward": 1.0, "passed": True, "failure": None}
    assert rows["HumanEval/23"].validation["null"]["passed"] is False
    assert rows["count-lines"].status == "valid" and rows["count-lines"].validation["oracle"]["passed"]
    assert rows["presolved"].status_reasons == [
        "a do-nothing agent passes (reward 1): the tests are too weak"
    ]
    # (the two Harbor tasks share instruction and tests: the later one is also a duplicate)
    assert rows["wrong-oracle"].status_reasons[0] == "duplicate prompt of crashing-oracle"
    why = rows["wrong-oracle"].status_reasons[-1]
    assert why.startswith("the oracle solution scores 0.5 of 1: tests_passed: test_hello_file_content:"), why
    (why,) = rows["crashing-oracle"].status_reasons
    assert why.startswith("the oracle script failed: exit status 1: cat: missing.txt: No such file"), why
    assert rows["crashing-oracle"].validation["oracle"]["passed"] is False
