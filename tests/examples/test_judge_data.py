"""The judge example's training data (examples/tasksets/make_judge_conversations.py): its
rubric is judge-job.yaml's word for word, each grade is what the job's code environment and
hidden tests make of the answer (a mangled path writes no solution), and the committed file
is what the generator writes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "tasksets"))

import make_judge_conversations as judge_data  # noqa: E402
from make_offset_tasks import answer, solution  # noqa: E402


def test_the_rubric_is_the_judge_jobs():
    spec = yaml.safe_load((ROOT / "examples" / "judge-job.yaml").read_text())
    assert judge_data.RUBRIC == spec["rewards"]["judge"]["prompt"]


def test_grades_follow_what_the_environment_writes_and_the_tests_say():
    right = answer(solution())
    assert judge_data.passes(right, 4)
    assert not judge_data.passes(answer(solution("abs(x) + K")), 4)
    assert not judge_data.passes(answer(solution("int(x) + K")), 4)
    # the right code, but the block runs as a script or writes another file: nothing in solution.py
    assert not judge_data.passes(right.replace("```python solution.py", "```python"), 4)
    assert not judge_data.passes(right.replace("solution.py", "solutio.py"), 4)
    # an unclosed block is refused by the environment
    assert not judge_data.passes(right.removesuffix("```"), 4)
    assert not judge_data.passes(right.replace("return x + K", "return x + K)"), 4)


def test_the_committed_conversations_are_what_the_generator_writes():
    text = (ROOT / "examples" / "tasksets" / "judge-conversations.jsonl").read_text()
    committed = [json.loads(line) for line in text.splitlines()]
    assert committed == judge_data.conversations()
    grades = [c["messages"][1]["content"] for c in committed]
    assert set(grades) == {"Score: 0", "Score: 1"} and 0.3 < grades.count("Score: 1") / len(grades) < 0.6


def test_the_policy_answers_are_graded_by_the_tests_not_by_the_runs_that_wrote_them():
    answers = judge_data.policy_answers()
    assert len(answers) == 4320 and all(1 <= k <= 9 for _, k in answers)
    # the misspelling an RL policy found a teacher-only judge passing is among them, failing
    fooled = [reply for reply, _ in answers if "x rurn x + K" in reply]
    assert fooled and not any(judge_data.passes(reply, 3) for reply in fooled)
    graded = judge_data.conversations(n=0)
    assert len(graded) == len(answers)
    truth = sorted(str(judge_data.passes(reply, k)) for reply, k in answers)
    assert sorted(str(c["messages"][1]["content"] == "Score: 1") for c in graded) == truth
