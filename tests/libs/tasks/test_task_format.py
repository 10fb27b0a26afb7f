from __future__ import annotations

import json

import pytest

from temper.tasks.importers import arithmetic_tasks, gsm8k, humaneval
from temper.tasks.models import TaskFormatError, TaskKind, normalise_prompt, parse_tasks

GOOD = {"id": "t1", "kind": "code", "prompt": "Write f", "tests": "assert f() == 1", "entry_point": "f"}


def jsonl(*records: object) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def test_a_valid_jsonl_file_parses_every_line():
    tasks = parse_tasks(
        jsonl(GOOD, {**GOOD, "id": "t2"}, {"id": "m1", "kind": "math", "prompt": "1+1?", "answer": "2"})
    )
    assert [t.id for t in tasks] == ["t1", "t2", "m1"]
    assert tasks[2].kind is TaskKind.math


def test_bad_lines_are_reported_with_their_line_number_and_field():
    text = jsonl(
        GOOD,
        {**GOOD, "id": "t2", "kind": "poetry"},
        "{not json",
        "",
        {**GOOD, "id": "t3", "limits": {"wall_s": -1}},
        {"id": "m", "kind": "math", "prompt": "2+2?"},
        {**GOOD, "id": "t1"},
        {**GOOD, "id": "t9", "surprise": 1},
    )
    with pytest.raises(TaskFormatError) as err:
        parse_tasks(text, filename="set.jsonl")
    got = {(line, field) for line, field, _ in err.value.errors}
    assert (2, "kind") in got
    assert (3, "(line)") in got
    assert (5, "limits.wall_s") in got
    assert (6, "(task)") in got  # a math task needs an answer
    assert (7, "id") in got  # duplicate id
    assert (8, "surprise") in got
    assert "line 2: kind" in str(err.value)
    messages = {(line, field): msg for line, field, msg in err.value.errors}
    assert "needs an answer" in messages[(6, "(task)")]
    assert "first on line 1" in messages[(7, "id")]


def test_yaml_task_sets_report_the_line_of_the_bad_item():
    text = """tasks:
  - id: ok
    prompt: p
    tests: "assert True"
  - id: bad
    kind: code
    prompt: p
"""
    with pytest.raises(TaskFormatError) as err:
        parse_tasks(text, filename="set.yaml")
    assert err.value.errors[0][0] == 5
    assert "hidden tests" in err.value.errors[0][2]


def test_file_paths_must_stay_inside_the_workspace():
    with pytest.raises(TaskFormatError, match="files"):
        parse_tasks(jsonl({**GOOD, "files": {"../etc/passwd": "x"}}))


def test_prompt_normalisation_ignores_case_and_spacing_but_not_punctuation():
    assert normalise_prompt("Add two  numbers!\n") == normalise_prompt("add two numbers!")
    assert normalise_prompt('brackets "<" and ">"') != normalise_prompt('brackets "(" and ")"')


def test_humaneval_imports_164_tasks_with_tests_and_reference_solutions():
    tasks = humaneval()
    assert len(tasks) == 164
    first = tasks[0]
    assert first.id == "HumanEval/0" and first.entry_point == "has_close_elements"
    assert "def check(candidate)" in (first.tests or "")
    assert first.solution and first.solution.startswith(first.prompt)
    assert len({t.prompt_hash for t in tasks}) == 164


def test_gsm8k_format_and_the_shipped_arithmetic_set(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps({"question": "2 apples and 3 more?", "answer": "2 + 3 = 5\n#### 5"}) + "\n")
    (task,) = gsm8k(path)
    assert task.answer == "5" and task.kind is TaskKind.math
    tasks = arithmetic_tasks(50)
    assert len(tasks) == 50 and len({t.prompt_hash for t in tasks}) == 50
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[3] / "examples" / "tasksets" / "arithmetic.jsonl"
    assert len(parse_tasks(shipped.read_text(), filename="a.jsonl")) == 50
