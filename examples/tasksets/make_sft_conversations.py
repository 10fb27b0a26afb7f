"""Writes tool-conversations.jsonl, the data of examples/sft-job.yaml: OpenAI fine-tuning
lines in which the assistant calls a `lookup` tool for a word's colour and answers with
what it returned. The first, wrong answer of some conversations is shown with weight 0:
context the loss skips.

    python examples/tasksets/make_sft_conversations.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ["apple", "river", "stone", "cloud", "ember", "maple", "frost", "coral", "amber", "slate",
         "lemon", "ocean", "grass", "cedar", "plum", "sand"]  # fmt: skip
COLOURS = ["red", "blue", "grey", "white", "orange", "green", "silver", "pink"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "The colour of a word.",
            "parameters": {
                "type": "object",
                "properties": {"word": {"type": "string"}},
                "required": ["word"],
            },
        },
    }
]


def conversation(word: str, colour: str, rng: random.Random) -> dict:
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "lookup", "arguments": json.dumps({"word": word})},
    }
    messages = [{"role": "user", "content": f"What colour is {word}?"}]
    if rng.random() < 0.5:  # a guess first, shown as context only
        messages += [
            {"role": "assistant", "content": rng.choice(COLOURS), "weight": 0},
            {"role": "user", "content": "Look it up."},
        ]
    messages += [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": colour},
        {"role": "assistant", "content": colour},
    ]
    return {"messages": messages, "tools": TOOLS}


def main() -> None:
    rng = random.Random(7)
    lines = [conversation(w, rng.choice(COLOURS), rng) for w in WORDS for _ in range(4)]
    out = Path(__file__).with_name("tool-conversations.jsonl")
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))


if __name__ == "__main__":
    main()
