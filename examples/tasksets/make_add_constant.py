"""Generate the example task family: tiny code-writing tasks a small model can learn on
a CPU in minutes.

Each task asks for a one-line function ``f(x)`` that adds a constant to ``x``. The
hidden tests call it on negative numbers and fractions, which is where plausible but
wrong implementations (``abs(x) + k``, ``int(x) + k``, ``round(x) + k``) fail.

The warm-start data (:func:`warm_start_examples`) comes from a sloppy teacher: it
always copies the right constant but picks the correct implementation only some of
the time. So the policy starts out writing valid code that often fails the hidden
tests, and reinforcement learning has to find out which implementation passes them.
Run ``python examples/tasksets/make_add_constant.py`` to rewrite ``add-constant.jsonl``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CONSTANTS = range(1, 10)
# Inputs where the wrong implementations below disagree with x + k.
TEST_INPUTS = (-2.5, -7.25, -1.5, 3)
CORRECT = "x + {k}"
SLOPPY = ("abs(x) + {k}", "int(x) + {k}", "round(x) + {k}")


def prompt(k: int) -> str:
    return f"Write f(x) that returns x plus {k}."


def solution(k: int, body: str = CORRECT) -> str:
    return f"def f(x):\n    return {body.format(k=k)}\n"


def tests(k: int) -> str:
    lines = [f"    assert candidate({x}) == {x + k}" for x in TEST_INPUTS]
    return "def check(candidate):\n" + "\n".join(lines) + "\n"


def tasks() -> list[dict]:
    return [
        {
            "id": f"add-{k}",
            "kind": "code",
            "prompt": prompt(k),
            "tests": tests(k),
            "entry_point": "f",
            "solution": solution(k),
            "metadata": {"source": "temper-example", "tags": ["add"]},
        }
        for k in CONSTANTS
    ]


def answer(code: str) -> str:
    """The agent's reply that writes ``code`` to solution.py (the code environment's format)."""
    return f"```python solution.py\n{code}```"


def warm_start_examples(n: int, *, p_correct: float = 0.25, seed: int = 0) -> list[tuple[str, str]]:
    """(prompt, reply) pairs from the sloppy teacher: the right constant always, the
    right implementation with probability ``p_correct``, else one of :data:`SLOPPY`."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        k = rng.choice(CONSTANTS)
        body = CORRECT if rng.random() < p_correct else rng.choice(SLOPPY)
        pairs.append((prompt(k), answer(solution(k, body))))
    return pairs


if __name__ == "__main__":
    path = Path(__file__).with_name("add-constant.jsonl")
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks()))
    print(f"wrote {path}")  # noqa: T201
