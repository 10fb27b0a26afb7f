"""write_answer: record the agent's answer in answer.txt."""

import sys

with open("answer.txt", "w") as f:
    f.write(sys.argv[1].strip() + "\n")
print("recorded")
