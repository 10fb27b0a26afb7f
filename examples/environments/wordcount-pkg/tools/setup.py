"""Runs once in the agent's sandbox before its first action: the log the tools write to."""

import os

os.makedirs("out", exist_ok=True)
with open("out/tool.log", "w") as log:
    log.write("setup\n")
