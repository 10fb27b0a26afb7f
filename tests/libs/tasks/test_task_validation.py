"""The validation pipeline on real sandboxes (a HumanEval sample; all 164 run in
bench/agreement.py)."""

from __future__ import annotations

import pytest

from temper.db import Tenant
from temper.rewards import Scorer
from temper.rewards.runner import TestRunner
from temper.tasks import service
from temper.tasks.importers import arithmetic_tasks, humaneval
from temper.tasks.models import TaskSpec
from temper.tasks.validation import check_task, trivial_variants, validate_taskset

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(120)]

WEAK = TaskSpec(
    id="weak", prompt="is_positive", entry_point="is_positive",
    solution="def is_positive(x):\n    return x > 0\n",
    tests="def check(candidate):\n    assert candidate(5) == True\n    assert candidate(7)\n",
)  # fmt: skip
WRONG_REF = WEAK.model_copy(update={"id": "wrongref", "solution": "def is_positive(x):\n    return x < 0\n"})
GOOD = WEAK.model_copy(update={"id": "good", "prompt": "is_positive, really",
                               "tests": WEAK.tests + "    assert candidate(-1) == False\n"})  # fmt: skip
DUP = GOOD.model_copy(update={"id": "dup", "prompt": "IS_POSITIVE,   really"})


def test_trivial_variants_keep_the_docstring_and_helpers():
    src = 'def helper():\n    return 1\n\ndef f(x):\n    """Doc."""\n    return helper() + x\n'
    variants = dict(trivial_variants(src, "f"))
    assert "return None" in variants and "def helper" in variants["return None"]
    assert "Doc." in variants["empty body (pass)"] and "helper() + x" not in variants["return 0"]


async def test_reference_must_pass_and_trivial_solutions_must_fail(scoring_manager):
    runner = TestRunner(scoring_manager)
    assert await check_task(runner, GOOD) == []
    (reason,) = await check_task(runner, WEAK)
    assert reason.startswith("tests too weak") and "return True" in reason
    reasons = await check_task(runner, WRONG_REF)
    assert any(r.startswith("reference solution fails 2 of 2 tests") for r in reasons)
    math = arithmetic_tasks(3)
    assert [await check_task(runner, t) for t in math] == [[], [], []]
    bad_math = math[0].model_copy(update={"solution": "#### 1"})
    assert "disagrees" in (await check_task(runner, bad_math))[0]


async def test_a_humaneval_sample_is_valid(scoring_manager):
    runner = TestRunner(scoring_manager)
    tasks = humaneval()
    sample = [tasks[i] for i in (0, 10, 32, 38, 50, 53, 80, 107, 130, 163)]
    assert [(t.id, await check_task(runner, t)) for t in sample] == [(t.id, []) for t in sample]


async def test_validate_a_taskset_writes_statuses_progress_and_duplicates(database, scoring_manager):
    async with database.session() as s:
        s.add(Tenant(id="acme", name="acme"))
    async with database.session() as s:
        row = await service.create_taskset(s, None, "acme", "v", [GOOD, WEAK, DUP, *arithmetic_tasks(2)])
    seen: list[tuple[int, int]] = []
    counts = await validate_taskset(
        database, Scorer(scoring_manager), row.id, progress=lambda c, t: seen.append((c, t))
    )
    assert counts == {"valid": 3, "invalid": 2}
    assert seen[0] == (0, 5) and seen[-1] == (5, 5)
    async with database.session() as s:
        rows = {r.key: r for r in await service.task_rows(s, row.id)}
        assert (await service.get_taskset(s, row.id)).status == "validated"
        sampleable = {t.key for t in await service.sampleable_tasks(s, row.id)}
    # of two duplicates, the first by id is kept
    assert rows["good"].status == "invalid" and rows["good"].status_reasons[:2] == [
        "duplicate prompt of dup", "duplicate tests of dup"]  # fmt: skip
    assert rows["weak"].status == "invalid"
    assert sampleable == {"dup", "arith/000", "arith/001"}
