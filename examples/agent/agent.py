"""A small agent written with the openai client, as it would be written for any
OpenAI-compatible server: it gives the model a python tool, runs the calls the model makes
in its working directory, sends back what they printed, and stops when the model answers
without a call, printing that answer.

It knows nothing of Temper. Where the model is comes from the client's own environment
variables, OPENAI_BASE_URL and OPENAI_API_KEY; under `environment.kind: agent` Temper sets
them to the episode's base URL and key, and TEMPER_TASK_PROMPT to the task (elsewhere, pass
the question as the first argument). Run by examples/agent-job.yaml.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from openai import OpenAI

# The tool, as an OpenAI function schema.
PYTHON = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code; what it prints comes back.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}
MAX_STEPS = int(os.environ.get("AGENT_MAX_STEPS", "4"))


def run_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter here; its exit status, time and output."""
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "[killed: took longer than 10s]"
    seconds = time.monotonic() - started
    parts = [f"[exit code {done.returncode}; {seconds:.2f}s]"]
    if done.stdout.strip():
        parts.append(f"stdout:\n{done.stdout.strip()}")
    if done.stderr.strip():
        parts.append(f"stderr:\n{done.stderr.strip()[-2000:]}")
    return "\n".join(parts)


def main() -> int:
    question = os.environ.get("TEMPER_TASK_PROMPT") or " ".join(sys.argv[1:])
    client = OpenAI()
    model = os.environ.get("TEMPER_MODEL", "policy")
    messages: list = [{"role": "user", "content": question}]
    for _ in range(MAX_STEPS):
        reply = client.chat.completions.create(model=model, messages=messages, tools=[PYTHON])
        message = reply.choices[0].message
        if not message.tool_calls:
            print(message.content or "")  # noqa: T201 - the answer is what the program prints
            return 0
        messages.append(message)
        for call in message.tool_calls:
            if call.function.name == "python":
                try:
                    code = json.loads(call.function.arguments).get("code", "")
                except ValueError:
                    code = ""
                output = run_python(code) if code else 'error: python needs {"code": "..."}'
            else:
                output = f"error: unknown tool {call.function.name!r}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    print("no answer")  # noqa: T201
    return 0


if __name__ == "__main__":
    sys.exit(main())
