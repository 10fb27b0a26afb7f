"""Generate the example task family: tiny code-writing tasks a small model can learn on
a CPU in minutes.

Each task asks for a one-line function ``f(x)`` that adds (or subtracts) a constant;
hidden tests call it on several inputs. The warm-start data (``warm_start_examples``)
teaches the answer *format* with a random constant, so the policy starts out writing
valid code that is usually wrong, and reinforcement learning has to discover which
constant each prompt asks for. Run ``python examples/tasksets/make_add_constant.py`` to
rewrite ``add-constant.jsonl``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OPS = {"add": ("+", "plus"), "sub": ("-", "minus")}
CONSTANTS = range(1, 10)
TEST_INPUTS = (0, 1, 5, 12, -3)


def prompt(op: str, k: int) -> str:
    return f"Write f(x) that returns x {OPS[op][1]} {k}."


def solution(op: str, k: int) -> str:
    return f"def f(x):\n    return x {OPS[op][0]} {k}\n"


def tests(op: str, k: int) -> str:
    sign = 1 if op == "add" else -1
    lines = [f"    assert candidate({x}) == {x + sign * k}" for x in TEST_INPUTS]
    return "def check(candidate):\n" + "\n".join(lines) + "\n"


def tasks(ops: tuple[str, ...] = ("add",)) -> list[dict]:
    out = []
    for op in ops:
        for k in CONSTANTS:
            out.append(
                {
                    "id": f"{op}-{k}",
                    "kind": "code",
                    "prompt": prompt(op, k),
                    "tests": tests(op, k),
                    "entry_point": "f",
                    "solution": solution(op, k),
                    "metadata": {"source": "temper-example", "tags": [op]},
                }
            )
    return out


def warm_start_examples(n: int, seed: int = 0, ops: tuple[str, ...] = ("add",)) -> list[tuple[str, str]]:
    """(prompt, solution) pairs whose constant in the answer is drawn independently of the
    prompt's: they teach the format, not the task."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        op = rng.choice(ops)
        pairs.append((prompt(op, rng.choice(CONSTANTS)), solution(op, rng.choice(CONSTANTS))))
    return pairs


if __name__ == "__main__":
    path = Path(__file__).with_name("add-constant.jsonl")
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks()))
    print(f"wrote {path}")  # noqa: T201
