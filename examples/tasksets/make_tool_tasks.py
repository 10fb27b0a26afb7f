"""Generate the tool-use example: products of two numbers that a tiny model cannot
compute in its head but can get from the ``python`` tool.

Each task asks for ``A * B``. The warm-start data (:func:`warm_start_examples`) comes
from a sloppy teacher: with probability ``p_tool`` it calls ``python`` with
``print(A * B)``, reads the printed product from the tool's answer and gives it as
``\\boxed{...}``; otherwise it guesses a product in its head and is usually wrong. The
policy starts out calling the tool a fraction of the time; reinforcement learning has to
make the tool call (and the copying of what it printed) the habit.
Run ``python examples/tasksets/make_tool_tasks.py`` to rewrite ``products.jsonl``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def prompt(a: int, b: int) -> str:
    return f"What is {a} * {b}?"


def call(a: int, b: int) -> str:
    """A Hermes/Qwen tool call, as the ChatML template's tool instructions ask for it."""
    args = json.dumps({"code": f"print({a} * {b})"})
    return f'<tool_call>\n{{"name": "python", "arguments": {args}}}\n</tool_call>'


def observation(value: int) -> str:
    """What the math environment shows the model after the call ran (its render_result)."""
    return f"[exit code 0; 0.02s]\nstdout:\n{value}"


def final(value: int) -> str:
    return f"The answer is \\boxed{{{value}}}."


def tasks(n: int = 24, *, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(12, 99), rng.randint(12, 99)
        out.append(
            {
                "id": f"product-{i:02d}",
                "kind": "math",
                "prompt": prompt(a, b),
                "answer": str(a * b),
                "metadata": {"source": "temper-example", "tags": ["tools"]},
            }
        )
    return out


def warm_start_examples(n: int, *, p_tool: float = 0.4, seed: int = 0) -> list[tuple[dict, object]]:
    """(task, turns) pairs: ``[call, observation, final answer]`` with probability
    ``p_tool``, else one turn with a guessed (mostly wrong) product."""
    rng = random.Random(seed)
    pairs: list[tuple[dict, object]] = []
    for _ in range(n):
        a, b = rng.randint(12, 99), rng.randint(12, 99)
        task = {"prompt": prompt(a, b)}
        if rng.random() < p_tool:
            pairs.append((task, [call(a, b), observation(a * b), final(a * b)]))
        else:
            pairs.append((task, final(a * b + rng.choice((-1, 1)) * rng.randint(1, 300))))
    return pairs


if __name__ == "__main__":
    path = Path(__file__).with_name("products.jsonl")
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks()))
    print(f"wrote {path}")  # noqa: T201
