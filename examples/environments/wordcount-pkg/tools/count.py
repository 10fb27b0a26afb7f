"""count_words: the number of words of a file (and a line in the log setup made)."""

import sys

path = sys.argv[1]
with open(path) as f:
    n = len(f.read().split())
with open("out/tool.log", "a") as log:  # fails if setup did not run first
    log.write(f"count {path} {n}\n")
print(n)
