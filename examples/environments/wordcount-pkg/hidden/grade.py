"""The grader: runs in a fresh sandbox with the final workspace and hidden/. Reads the task
as JSON on stdin and prints the rubric's components as one JSON object."""

import json
import os
import sys

task = json.load(sys.stdin)
with open(os.path.join(os.path.dirname(__file__), "expected.json")) as f:
    expected = json.load(f)[task["id"]]
try:
    with open("answer.txt") as f:
        given = f.read().strip()
except FileNotFoundError:
    given = None
try:
    with open("out/tool.log") as f:
        used = any(line.startswith("count ") for line in f)
except FileNotFoundError:
    used = False
print(f"expected {expected}, given {given}", file=sys.stderr)
print(json.dumps({"correct": float(given == str(expected)), "used_tool": float(used)}))
