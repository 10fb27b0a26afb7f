"""Generate the example task family: small code tasks in a workspace that a tiny model
can learn on a CPU in minutes.

Each task describes a situation where a fixed amount is added to a value; the amount
is the constant ``K`` in the workspace's ``constants.py`` (a different value per task).
The agent writes ``f(x)`` in ``solution.py``. The hidden tests call it on negative and
fractional inputs, which is where plausible but wrong implementations
(``abs(x) + K``, ``int(x) + K``, ``round(x) + K``) fail.

The warm-start data (:func:`warm_start_examples`) comes from a sloppy teacher: it
always writes valid code that imports ``K``, but picks the correct implementation only
a quarter of the time. So the policy starts out writing code that often fails the
hidden tests, and reinforcement learning has to find the implementation that passes.
Run ``python examples/tasksets/make_offset_tasks.py`` to rewrite ``offset.jsonl``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SITUATIONS = (
    "A shop adds a fixed fee to every price.",
    "A thermometer always reads a fixed amount too low.",
    "A clock runs a fixed number of minutes behind.",
    "Every exam score gets a fixed bonus.",
    "Every parcel gets a fixed handling charge.",
    "A sensor needs a fixed calibration offset added to each reading.",
    "Every account earns a fixed monthly credit.",
    "Every timestamp must be shifted by a fixed time-zone offset.",
    "Every player starts a fixed number of points ahead.",
)
# Inputs where the wrong implementations below disagree with x + K.
TEST_INPUTS = (-2.5, -7.25, -1.5, 3)
CORRECT = "x + K"
SLOPPY = ("abs(x) + K", "int(x) + K", "round(x) + K")


def prompt(situation: str) -> str:
    return f"{situation} The amount is K in constants.py. Write f(x) in solution.py that returns x plus K."


def solution(body: str = CORRECT) -> str:
    return f"from constants import K\n\ndef f(x):\n    return {body}\n"


def answer(code: str) -> str:
    """The agent's reply that writes ``code`` to solution.py (the code environment's format)."""
    return f"```python solution.py\n{code}```"


def tests(k: int) -> str:
    lines = [f"    assert candidate({x}) == {x + k}" for x in TEST_INPUTS]
    return "def check(candidate):\n" + "\n".join(lines) + "\n"


def tasks() -> list[dict]:
    return [
        {
            "id": f"offset-{i}",
            "kind": "code",
            "prompt": prompt(situation),
            "files": {"constants.py": f"K = {k}\n"},
            "tests": tests(k),
            "entry_point": "f",
            "solution": solution(),
            "metadata": {"source": "temper-example", "tags": ["offset"]},
        }
        for i, (situation, k) in enumerate(zip(SITUATIONS, (3, 7, 5, 2, 9, 4, 8, 6, 1), strict=True), start=1)
    ]


def warm_start_examples(n: int, *, p_correct: float = 0.25, seed: int = 0) -> list[tuple[dict, str]]:
    """(task, reply) pairs from the sloppy teacher, for tasks like the real ones (a
    situation, a constants.py): the right implementation with probability
    ``p_correct``, else one of :data:`SLOPPY`."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        task = {
            "prompt": prompt(rng.choice(SITUATIONS)),
            "files": {"constants.py": f"K = {rng.randint(1, 9)}\n"},
        }
        body = CORRECT if rng.random() < p_correct else rng.choice(SLOPPY)
        pairs.append((task, answer(solution(body))))
    return pairs


if __name__ == "__main__":
    path = Path(__file__).with_name("offset.jsonl")
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks()))
    print(f"wrote {path}")  # noqa: T201
