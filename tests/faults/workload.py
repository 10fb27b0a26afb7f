"""The chaos workload: multi-turn code episodes in which every turn runs an action in the
episode's sandbox session, whose workspace carries state from turn to turn, and whose
last workspace is scored by hidden tests in fresh sandboxes.

Each task's workspace starts with ``step.py``. The policy calls the ``python`` tool with
``k = <a digit>; exec(open('step.py').read())``: step.py prints the SHA-256 of the
workspace as it found it (its first 16 hex digits; :func:`workspace_digest` computes the
same from a snapshot), appends a random line to ``journal.txt`` and writes
``solution.py`` with ``scale(x) = x * k``. The hidden tests want ``x * 2``; the teacher
picks ``k`` from 2 to 7, so about one episode in six passes at first and RL has something
to learn. The reward weights ``tests_passed`` and ``efficiency`` (the other
always-computed components, ``compiles``, ``format`` and ``turn_penalty``, come with them).

The digit is the one token of a turn the policy is unsure of: the call's other tokens
have probabilities within 1e-4 of 1 under every version, so it is what tells versions
apart when the content check recomputes a turn's logprobs.

So a turn's printed digest says which workspace the action ran in: the one the previous
turn left (its snapshot), or another one (a session recreated empty, or restored from
an older snapshot) after a sandbox worker died.

The policy is a small random Qwen2 with a byte-level BPE tokenizer and the ChatML
template, built and warm-started the way ``temper run`` builds the tool example
(``local.build``, ``local.warm_start``: :func:`warm_start_examples` is the teacher), so
that it calls the tool on every turn. :func:`build_policy` makes it for the fault harness.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any

STEP_PY = """\
import hashlib, os
ws = b''.join(n.encode() + b'\\0' + open(n, 'rb').read() + b'\\0' for n in sorted(os.listdir('.')))
print('workspace', hashlib.sha256(ws).hexdigest()[:16])
open('journal.txt', 'a').write(os.urandom(4).hex() + '\\n')
open('solution.py', 'w').write('def scale(x):\\n    return x * %d\\n' % k)
"""
CODE = "k = {k}; exec(open('step.py').read())"
DIGITS = (2, 3, 4, 5, 6, 7)
PROMPT = (
    "Set k and run step.py with the python tool on every turn; hidden tests check scale(x) in solution.py."
)
TESTS = """\
def check(candidate):
    assert candidate(3) == 6
    assert candidate(-4) == -8
    assert candidate(21) == 42
"""
SOLUTION = "def scale(x):\n    return x * 2\n"
TASKS = 4
MAX_TURNS = 3
# |efficiency - its re-score| the content check accepts: the value is a ratio of two
# measured run times (reference over agent, both best of three, 1 ms added to each), so
# two measurements of the same code differ by the machine's timing noise.
EFFICIENCY_TOLERANCE = 0.15
REWARDS = {"tests_passed": 1.0, "efficiency": 0.2}
DIGEST_LINE = "workspace "


def tasks() -> list[dict[str, Any]]:
    """The task set: the same step program in each, told apart by a comment."""
    return [
        {
            "id": f"chaos-{i}",
            "kind": "code",
            "prompt": PROMPT,
            "files": {"step.py": f"# task {i}\n{STEP_PY}"},
            "entry_point": "scale",
            "solution": SOLUTION,
            "tests": TESTS,
            "metadata": {"source": "temper-chaos", "tags": ["tools"]},
        }
        for i in range(TASKS)
    ]


def taskset_bytes() -> bytes:
    return "".join(json.dumps(t) + "\n" for t in tasks()).encode()


def call(k: int) -> str:
    """The policy's every turn: one Hermes/Qwen call of the python tool."""
    arguments = json.dumps({"code": CODE.format(k=k)})
    return f'<tool_call>\n{{"name": "python", "arguments": {arguments}}}\n</tool_call>'


def _observation(rng: random.Random) -> str:
    digest = f"{rng.getrandbits(64):016x}"
    return f"[exit code 0; {rng.choice((0.01, 0.02, 0.05))}s]\nstdout:\n{DIGEST_LINE}{digest}"


def warm_start_examples(n: int, *, seed: int = 0) -> list[tuple[dict[str, Any], list[str]]]:
    """(task, turns): the call on every turn, after one to ``MAX_TURNS`` - 1 earlier calls
    and their (made-up) outputs."""
    rng = random.Random(seed)
    all_tasks = tasks()
    pairs: list[tuple[dict[str, Any], list[str]]] = []
    for _ in range(n):
        task = rng.choice(all_tasks)
        turns: list[str] = []
        for _ in range(rng.randrange(MAX_TURNS)):
            turns += [call(rng.choice(DIGITS)), _observation(rng)]
        pairs.append(({"prompt": task["prompt"], "files": task["files"]}, [*turns, call(rng.choice(DIGITS))]))
    return pairs


def spec(name: str, *, iterations: int, episodes: int, lora: bool, group_size: int = 4) -> dict[str, Any]:
    """A job of this workload (``policy.init`` and ``tasks.taskset`` are the caller's)."""
    algorithm: dict[str, Any] = {
        "learning_rate": 0.001,
        # every step moves the weights, a step of groups without reward variance too (the
        # digit's entropy has a gradient): no two versions of a job are the same weights
        "entropy_coef": 0.01,
        "groups_per_step": max(1, episodes // group_size // 2),
        "checkpoint_every": 1,
        "skip_zero_variance": False,
    }
    if lora:
        algorithm["lora"] = {"rank": 4, "alpha": 16}
    return {
        "name": name,
        "policy": {"model": "chaos-policy", "sampling": {"temperature": 0.7, "max_tokens": 40}},
        "tasks": {"taskset": "local", "group_size": group_size, "curriculum": "uniform"},
        "environment": {
            "kind": "code",
            "max_turns": MAX_TURNS,
            "action_format": "hermes",
            "system_prompt": "",
            "tools": [{"function": {"name": "python"}}],
            "limits": {"wall_s": 10, "memory_mb": 256},
        },
        "rewards": dict(REWARDS),
        "algorithm": algorithm,
        "schedule": {
            "iterations": iterations,
            "episodes_per_iteration": episodes,
            "max_concurrent_episodes": episodes,
            "max_staleness": 1,
        },
    }


LOCAL = {
    "build": {
        "architecture": "qwen2",
        "template": "chatml",
        "vocab_size": 768,
        "hidden_size": 64,
        "layers": 2,
    },
    "warm_start": {
        "examples": 600,
        "steps": 200,
        "batch_size": 8,
        "learning_rate": 0.004,
        "betas": [0.9, 0.99],
    },
}


def build_policy(directory: Path) -> Path:
    """The workload's policy, built and warm-started as ``temper run`` does, saved as a
    model directory under ``directory`` (returned)."""
    from services.embedded import localrun
    from services.embedded.runner import Progress, make_policy
    from temper.jobspec import parse_spec

    directory.mkdir(parents=True, exist_ok=True)
    taskset = directory / "tasks.jsonl"
    taskset.write_bytes(taskset_bytes())
    local = localrun.LocalRun.model_validate(
        {
            "taskset_file": taskset,
            "build": LOCAL["build"],
            "warm_start": {
                **LOCAL["warm_start"],
                "generator": f"{Path(__file__).resolve()}:warm_start_examples",
            },
        }
    )
    job = parse_spec(spec("build", iterations=1, episodes=4, lora=False))
    made = make_policy(job, local, directory, Progress(io.StringIO()))
    assert made.policy.init is not None
    return Path(made.policy.init)


ROOT = Path(__file__).resolve().parents[2]
# The code the policy is built with: a change to it (or to what it is built from) builds it again.
BUILT_BY = (
    ROOT / "libs" / "temper" / "policy" / "build.py",
    ROOT / "libs" / "temper" / "training" / "sft.py",
    ROOT / "services" / "embedded" / "runner.py",
)


def cached_policy(cache_dir: Path) -> Path:
    """:func:`build_policy`'s model directory, built once per machine under ``cache_dir``
    (keyed by what it is built from, the code that builds it and the torch and transformers
    versions; the build takes about 30 s of CPU). Safe when several processes ask at once."""
    import fcntl

    import torch
    import transformers

    h = hashlib.sha256(f"{torch.__version__} {transformers.__version__}".encode())
    h.update(taskset_bytes() + json.dumps(LOCAL, sort_keys=True).encode())
    h.update(json.dumps(warm_start_examples(int(LOCAL["warm_start"]["examples"]))).encode())
    h.update(json.dumps(spec("build", iterations=1, episodes=4, lora=False)["environment"]).encode())
    for path in BUILT_BY:
        h.update(path.read_bytes())
    root = cache_dir / "chaos-policy"
    done = root / h.hexdigest()[:16]
    if (done / "config.json").is_file():
        return done
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{done.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (done / "config.json").is_file():
            scratch = Path(tempfile.mkdtemp(dir=root, prefix=".build-"))
            try:
                built = build_policy(scratch)
                built.rename(done)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    return done


def workspace_digest(files: dict[str, bytes]) -> str:
    """What step.py prints for a workspace holding ``files`` (name -> bytes; the workspace
    is flat): the first 16 hex digits of the SHA-256 of each name and content in order."""
    data = b"".join(name.encode() + b"\0" + files[name] + b"\0" for name in sorted(files))
    return hashlib.sha256(data).hexdigest()[:16]


def snapshot_files(data: bytes) -> dict[str, bytes]:
    """The regular files of a workspace snapshot (gzip'd tar), by relative path."""
    out: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar:
            if member.isreg():
                handle = tar.extractfile(member)
                assert handle is not None
                out[member.name.removeprefix("./")] = handle.read()
    return out


def printed_digest(stdout: str) -> str | None:
    """The digest a turn's step.py printed, or None (the turn ran something else)."""
    for line in stdout.splitlines():
        if line.startswith(DIGEST_LINE):
            return line[len(DIGEST_LINE) :].strip()
    return None
