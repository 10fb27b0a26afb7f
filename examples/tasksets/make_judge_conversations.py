"""Writes judge-conversations.jsonl, the data of examples/judge-sft.yaml: a judge learns to
grade the offset tasks' answers (examples/tasksets/make_offset_tasks.py) the way their
hidden tests do, so that examples/judge-job.yaml can train a policy on its verdicts alone.

Each line is one conversation: the rubric of judge-job.yaml with an answer filled in (what
the judge component sends, ``temper.rewards.judge.render_rubric``), and the grade,
``Score: 1`` when the answer's code passes the task's hidden tests and ``Score: 0`` when
it does not. Every grade comes from running the code against the tests, not from knowing
how the answer was made. The answers:

- 4000 of the sloppy teacher's (the right implementation 60 % of the time here), half of
  them with one or two characters dropped, doubled, replaced or inserted anywhere;
- the answers policies wrote in three earlier runs of judge-job.yaml
  (``judge-policy-answers.jsonl``: each answer and its task's K), which is where a judge
  trained on the teacher's alone was wrong: an RL policy finds the misspellings a judge
  passes and writes more of them (``x rurn x + K``). Collecting a judge's data from the
  policies it is used on, round after round, is how reward models are kept ahead of the
  policy; the runs' own verdicts are not used, the tests grade them again here.

    python examples/tasksets/make_judge_conversations.py
    python examples/tasksets/make_judge_conversations.py --policy-answers-from RUN_DIR...
"""

from __future__ import annotations

import json
import random
import sys
import types
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from make_offset_tasks import TEST_INPUTS, warm_start_examples  # noqa: E402

# judge-job.yaml's rubric, word for word (tests/examples/test_judge_data.py checks it)
RUBRIC = "Will this answer pass the hidden tests?\n{reply}\nGrade:"
CONVERSATIONS = 4000
POLICY_ANSWERS = HERE / "judge-policy-answers.jsonl"
CORRUPTED = 0.5  # share of answers with a character dropped, doubled, replaced or inserted
# A judge trained on answers edited with a few symbols only was fooled by the policy's
# misspelt keywords (``reeurn x + K``, ``from conintans import K``): edits use letters too.
EDIT_CHARS = "abcdefghijklmnopqrstuvwxyzK+()1 .:_`"


def corrupt(reply: str, rng: random.Random) -> str:
    """One random edit anywhere in the reply: the fence line with its path and the closing
    fence count as much as the code (a policy that mangles ``solution.py`` writes no
    solution, and a judge that never saw that happen grades it as the code reads)."""
    at = rng.randrange(0, len(reply))
    edit = rng.choice(("drop", "double", "replace", "insert"))
    if edit == "drop":
        return reply[:at] + reply[at + 1 :]
    if edit == "double":
        return reply[:at] + reply[at] + reply[at:]
    if edit == "insert":
        return reply[:at] + rng.choice(EDIT_CHARS) + reply[at:]
    return reply[:at] + rng.choice(EDIT_CHARS) + reply[at + 1 :]


def written_solution(reply: str) -> str | None:
    """What the job's code environment writes to solution.py from this reply in its one
    turn (``temper.envs.code``: the first block that acts runs; a block without the path
    runs as a script and writes nothing), or None."""
    from temper.envs import make_environment

    action = make_environment("code", {"id": "judge", "prompt": ""}, max_turns=1).parse(reply, turn=0)
    command = action.command or {}
    if (
        action.kind != "sandbox"
        or command.get("kind") != "write_file"
        or command.get("path") != "solution.py"
    ):
        return None
    return str(command["content"])


def passes(reply: str, k: int) -> bool:
    """The hidden tests' verdict on the reply, as the job reaches it: the code the
    environment writes to solution.py, with constants.py holding K = k."""
    code = written_solution(reply)
    if code is None:
        return False
    constants = types.ModuleType("constants")
    constants.K = k  # type: ignore[attr-defined]
    saved = sys.modules.get("constants")
    sys.modules["constants"] = constants
    try:
        namespace: dict = {}
        exec(compile(code, "solution.py", "exec"), namespace)  # noqa: S102 - the generator's own text
        f = namespace["f"]
        return all(f(x) == x + k for x in TEST_INPUTS)
    except Exception:  # noqa: BLE001 - any failure of the code is a failing answer
        return False
    finally:
        if saved is None:
            sys.modules.pop("constants", None)
        else:
            sys.modules["constants"] = saved


def graded(reply: str, k: int) -> dict:
    from temper.rewards.judge import render_rubric

    question = render_rubric(RUBRIC, transcript="", task="", reply=reply)
    grade = 1 if passes(reply, k) else 0
    return {
        "messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": f"Score: {grade}"},
        ]
    }


def teacher_answers(n: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    answers = []
    for task, reply in warm_start_examples(n, p_correct=0.6, seed=seed):
        if rng.random() < CORRUPTED:
            for _ in range(1 if rng.random() < 0.8 else 2):
                reply = corrupt(reply, rng)
        answers.append((reply, int(task["files"]["constants.py"].split("=")[1])))
    return answers


def policy_answers() -> list[tuple[str, int]]:
    lines = POLICY_ANSWERS.read_text().splitlines()
    return [(row["reply"], row["k"]) for row in map(json.loads, lines)]


def conversations(n: int = CONVERSATIONS, seed: int = 1, *, with_policy_answers: bool = True) -> list[dict]:
    answers = teacher_answers(n, seed) + (policy_answers() if with_policy_answers else [])
    random.Random(seed).shuffle(answers)  # one epoch mixes both kinds in every batch
    return [graded(reply, k) for reply, k in answers]


def answers_of_runs(run_dirs: list[Path]) -> list[dict]:
    """Each episode's answer in finished ``temper run`` directories of judge-job.yaml, with
    its task's K (from the run's database and objects; in the order the episodes ran)."""
    import asyncio

    from sqlalchemy import select

    from temper.db import Database, Episode
    from temper.settings import DatabaseSettings
    from temper.storage import LocalStore
    from temper.trajectory import Trajectory

    constants = {
        t["id"]: int(t["files"]["constants.py"].split("=")[1])
        for t in map(json.loads, (HERE / "offset.jsonl").read_text().splitlines())
    }

    async def one(run: Path) -> list[dict]:
        db = Database(DatabaseSettings(url=f"sqlite+aiosqlite:///{run / 'temper.db'}"))
        store = LocalStore(run / "objects")
        try:
            async with db.session() as s:
                query = (
                    select(Episode)
                    .where(Episode.trajectory_key.is_not(None))
                    .order_by(Episode.created_at, Episode.id)
                )
                episodes = list((await s.execute(query)).scalars())
            rows = []
            for e in episodes:
                trajectory = Trajectory.model_validate_json(await store.get(e.trajectory_key))
                rows.append(
                    {"reply": trajectory.turns[0].action_text, "k": constants[e.task_id.split(":", 1)[1]]}
                )
            return rows
        finally:
            await db.dispose()

    return [row for run in run_dirs for row in asyncio.run(one(run))]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--policy-answers-from"]:
        rows = answers_of_runs([Path(d) for d in sys.argv[2:]])
        POLICY_ANSWERS.write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(f"wrote {POLICY_ANSWERS}: {len(rows)} answers")  # noqa: T201
        sys.exit(0)
    path = HERE / "judge-conversations.jsonl"
    lines = conversations()
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    passed = sum(line["messages"][1]["content"] == "Score: 1" for line in lines)
    print(f"wrote {path}: {len(lines)} conversations, {passed} graded 1")  # noqa: T201
