"""Generate the tool-use example: a word that only the sandbox knows.

Each task's workspace holds ``secret.py``, which prints one of 32 words; the prompt asks
which word it prints. Nothing in the prompt tells the words apart, so a policy that does
not run the file is right one time in 32. The tool call is the same for every task
(``exec(open('secret.py').read())``), so what has to be learned is the decision to call
``python`` and the copying of what it printed into ``\\boxed{...}``.

The warm-start data (:func:`warm_start_examples`) comes from a sloppy teacher: with
probability ``p_tool`` it runs the file and answers with what it printed; otherwise it
guesses a word. The policy starts out calling the tool that fraction of the time;
reinforcement learning has to make the call the habit.
Run ``python examples/tasksets/make_tool_tasks.py`` to rewrite ``secret-words.jsonl``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = (
    "apple", "river", "stone", "cloud", "tiger", "maple", "piano", "candle",
    "orbit", "lemon", "tulip", "falcon", "harbor", "pepper", "violet", "walnut",
    "copper", "meadow", "rocket", "saddle", "timber", "velvet", "anchor", "basket",
    "castle", "dragon", "garden", "island", "jacket", "kitten", "ladder", "mirror",
)  # fmt: skip
PROMPT = "Which word does secret.py print?"
CODE = "exec(open('secret.py').read())"


def secret_file(word: str) -> str:
    return f"print({word!r})\n"


def call() -> str:
    """A Hermes/Qwen tool call, as the ChatML template's tool instructions ask for it."""
    args = json.dumps({"code": CODE})
    return f'<tool_call>\n{{"name": "python", "arguments": {args}}}\n</tool_call>'


def observation(word: str, wall_s: float = 0.02) -> str:
    """What the math environment shows the model after the call ran (its render_result)."""
    return f"[exit code 0; {wall_s:.2f}s]\nstdout:\n{word}"


def final(word: str) -> str:
    return f"The answer is \\boxed{{{word}}}."


def tasks() -> list[dict]:
    """One task per word."""
    return [
        {
            "id": f"secret-{i:02d}",
            "kind": "math",
            "prompt": PROMPT,
            "answer": word,
            "files": {"secret.py": secret_file(word)},
            "metadata": {"source": "temper-example", "tags": ["tools"]},
        }
        for i, word in enumerate(WORDS)
    ]


def warm_start_examples(
    n: int, *, p_tool: float = 0.3, reading: float = 0.5, seed: int = 0
) -> list[tuple[dict, object]]:
    """(task, turns) pairs from the sloppy teacher. A ``reading`` share shows the call and
    its output as context and trains only the answer (how to read a tool's output; the
    call's fixed tokens would otherwise swamp the one token that needs attention). Of the
    rest, ``p_tool`` call the tool and answer, the others guess a word (right one time in
    32): the trained first turns set how often the policy starts out calling the tool."""
    rng = random.Random(seed)
    pairs: list[tuple[dict, object]] = []
    for _ in range(n):
        word = rng.choice(WORDS)
        task = {"prompt": PROMPT, "files": {"secret.py": secret_file(word)}}
        shown = observation(word, rng.choice((0.01, 0.02, 0.03, 0.05)))
        if rng.random() < reading:
            pairs.append((task, [{"content": call(), "train": False}, shown, final(word)]))
        elif rng.random() < p_tool:
            pairs.append((task, [call(), shown, final(word)]))
        else:
            pairs.append((task, final(rng.choice(WORDS))))
    return pairs


if __name__ == "__main__":
    path = Path(__file__).with_name("secret-words.jsonl")
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks()))
    print(f"wrote {path}")  # noqa: T201
