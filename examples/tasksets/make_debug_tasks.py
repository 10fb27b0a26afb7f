"""Generate the debugging example: a small module with a bug, its tests, and hidden tests.

Each task's workspace holds a module of two functions (``labels.py``: ``currency()`` and
``price(x)``, say) where the first returns the wrong literal, and its tests
(``test_labels.py``), a plain script that prints each failure with the assertion's message
(``FAILED test_labels.py::test_currency - currency() should return 'EUR'``). The first
prompt only names the module and its tests (``environment.hide_files: ["*.py"]``), so the
literal the tests want is written nowhere the policy can read before it runs them: each
family has six literals, the bug is one of them and the fix another, so an agent that edits
without reading the failure is right about one time in six. The hidden tests call the
second function on other inputs; only the right literal passes them.

What the policy has to do, over four turns: run the tests, read the failure, edit the file
(``edit``: replace a line, here line 2, the getter's ``return``), run the tests again,
submit. The warm-start data (:func:`warm_start_examples`) comes from a sloppy teacher: with
probability ``p_careful`` it does exactly that; otherwise it edits first, guessing one of
the five literals, runs the tests and submits whatever they say. A ``reading`` share shows
a run of the tests and its failure as context and trains only the edit that follows it (how
to read a failure: copy the literal it names). So the policy starts out reading the failure
when it has one, but running the tests first only about ``p_careful`` of the time;
reinforcement learning has to make running them first the habit (or going on after a
failed guess).

Two choices make the copying learnable by a 2-layer model in a few minutes of warm start
(measured: with the module shown and the failure printing both literals, or with the
edit's path before its text, the warm-started policy copied the right literal no more often
than chance after 1,600 steps of 16; as here, 0.43 of the time after 2,400 of 8, against
about 0.17 by chance): the failure names one literal, and the edit's arguments put
``text`` before ``path``, so the literal the edit writes sits the same number of tokens
after the one the failure printed in every task. Copying a word (`` '``, ``EUR``, ``'``
as three tokens) still needs an induction step that a 2-layer, 64-wide model forms at a
seed-dependent moment; a warm start that is mostly reading (``reading`` 0.9, nine tenths
of the examples train the copy) at a learning rate of 0.008 brings it early (measured
2026-12-06, teacher-forced on 96 held-out failures: seed 1 copies 0.70 after 1,000 steps,
seed 2 0.80 after 2,000, seed 0 still at chance after 2,000; seed 1 with only one of the
two changes copies 0.29-0.31 after 5,000 steps, the punctuation family alone, and with
neither stays at chance through 3,500).

Run ``python examples/tasksets/make_debug_tasks.py`` to rewrite ``debug-bugs.jsonl``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import NamedTuple

PROMPT = "The tests of {module} fail. Fix the bug in {module}, then submit."


class Family(NamedTuple):
    """A module whose ``getter()`` (line 2 of the module) returns a literal that ``use(arg)``
    builds on."""

    module: str
    getter: str
    use: str  # the second function's name
    arg: str  # its parameter
    body: str  # its return expression, calling getter()
    literals: tuple[str, ...]
    hidden: tuple[str, ...]  # arguments of use() in the hidden tests (Python source)


FAMILIES = (
    Family("labels", "currency", "price", "x", '"%.2f %s" % (x, currency())',
           ("USD", "EUR", "GBP", "JPY", "CHF", "CAD"), ("7", "0.5")),
    Family("greet", "greeting", "greet", "name", 'greeting() + ", " + name + "!"',
           ("Hello", "Howdy", "Hi", "Hey", "Welcome", "Greetings"), ("'bob'", "'eve'")),
    Family("units", "unit", "weight", "n", '"%d %s" % (n, unit())',
           ("kg", "lb", "g", "oz", "ton", "mg"), ("12", "40")),
    Family("paths", "sep", "join", "a", 'a + sep() + "b"',
           ("/", ":", ";", "|", "-", "+"), ("'usr'", "'tmp'")),
    Family("status", "done_word", "report", "n", '"%d tasks %s" % (n, done_word())',
           ("done", "finished", "complete", "ready", "closed", "ok"), ("5", "9")),
    Family("colors", "default_color", "paint", "item", 'item + " is " + default_color()',
           ("red", "blue", "green", "black", "white", "gray"), ("'wall'", "'door'")),
    Family("levels", "level", "log_line", "msg", '"[" + level() + "] " + msg',
           ("INFO", "WARN", "ERROR", "DEBUG", "TRACE", "FATAL"), ("'down'", "'busy'")),
    Family("days", "first_day", "week", "n", 'first_day() + " +" + str(n)',
           ("Mon", "Tue", "Wed", "Thu", "Fri", "Sun"), ("3", "6")),
)  # fmt: skip
GETTER_LINE = 2  # the line of the module that returns the literal


def module_source(f: Family, literal: str) -> str:
    """The module, in the double quotes a formatter writes (the failure prints ``repr``s)."""
    return f'def {f.getter}():\n    return "{literal}"\n\n\ndef {f.use}({f.arg}):\n    return {f.body}\n'


def _value(f: Family, literal: str, call: str) -> object:
    """What ``call`` (source, e.g. ``price(5)``) returns with ``literal`` in the module."""
    space: dict[str, object] = {}
    exec(module_source(f, literal), space)  # noqa: S102 - our own generated source
    return eval(call, space)  # noqa: S307


def cases(f: Family, right: str) -> list[tuple[str, str, object]]:
    """The visible tests: (test name, call, expected value)."""
    return [(f"test_{f.getter}", f"{f.getter}()", right)]


RUNNER = """

def main():
    failed = 0
    for name, call, want in CASES:
        got = eval(call)
        if got != want:
            failed += 1
            print("FAILED %s::%s - %s should return %r" % (__file__.split("/")[-1], name, call, want))
    print("%d failed" % failed if failed else "%d passed" % len(CASES))
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
"""


def test_source(f: Family, right: str) -> str:
    names = f"{f.getter}, {f.use}"
    rows = "".join(f"    ({n!r}, {c!r}, {w!r}),\n" for n, c, w in cases(f, right))
    return f"from {f.module} import {names}\n\nCASES = [\n{rows}]\n" + RUNNER


def test_output(f: Family, right: str, present: str) -> str:
    """What ``python3 test_<module>.py`` prints with ``present`` in the module (its runner, here)."""
    lines, failed = [], 0
    for name, call, want in cases(f, right):
        got = _value(f, present, call)
        if got != want:
            failed += 1
            lines.append(f"FAILED test_{f.module}.py::{name} - {call} should return {want!r}")
    lines.append(f"{failed} failed" if failed else f"{len(cases(f, right))} passed")
    return "\n".join(lines)


def hidden_tests(f: Family, right: str) -> str:
    lines = [f"    assert candidate({a}) == {_value(f, right, f'{f.use}({a})')!r}" for a in f.hidden]
    return "def check(candidate):\n" + "\n".join(lines) + "\n"


def task(f: Family, right: str, bug: str) -> dict:
    return {
        "id": f"debug-{f.module}-{f.literals.index(right)}{f.literals.index(bug)}",
        "kind": "code",
        "prompt": PROMPT.format(module=f"{f.module}.py"),
        "files": {f"{f.module}.py": module_source(f, bug), f"test_{f.module}.py": test_source(f, right)},
        "tests": hidden_tests(f, right),
        "entry_point": f.use,
        "solution_file": f"{f.module}.py",
        "solution": module_source(f, right),
        "metadata": {"source": "temper-example", "tags": ["debugging", f.module]},
    }


def tasks() -> list[dict]:
    """Every family with every (fix, bug) pair of its literals: 8 x 6 x 5 = 240 tasks."""
    return [
        task(f, right, bug) for f in FAMILIES for right in f.literals for bug in f.literals if bug != right
    ]


# --- the sloppy teacher ------------------------------------------------------------------------


def call(name: str, **arguments: str | int) -> str:
    """A Hermes/Qwen tool call, as the ChatML template's tool instructions ask for it."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def run_tests() -> str:
    return call("run_tests")


def edit(f: Family, literal: str) -> str:
    """Line 2 of the module, returning ``literal``."""
    # the line's text before the path: the literal then sits the same number of tokens
    # after the failure that names it in every task (a tiny model copies by position)
    return call("edit", line=GETTER_LINE, text=f"    return {literal!r}", path=f"{f.module}.py")


def observed(exit_code: int, stdout: str, wall_s: float) -> str:
    """What the code environment shows after a command ran (``render_result``)."""
    return f"[exit code {exit_code}; {wall_s:.2f}s]\nstdout:\n{stdout}"


def tests_ran(f: Family, right: str, present: str, rng: random.Random) -> str:
    out = test_output(f, right, present)
    return observed(0 if present == right else 1, out, rng.choice((0.02, 0.03, 0.04, 0.05)))


def edited(f: Family, rng: random.Random) -> str:
    return observed(0, f"{f.module}.py: line {GETTER_LINE} replaced", rng.choice((0.02, 0.03, 0.04)))


def warm_start_examples(
    n: int, *, p_careful: float = 0.25, reading: float = 0.9, seed: int = 0
) -> list[tuple[dict, object]]:
    """(task, turns) pairs from the sloppy teacher (see the module's docstring); a turn given
    as ``{"content": ..., "train": False}`` is context, not trained."""
    rng = random.Random(seed)
    pairs: list[tuple[dict, object]] = []
    for _ in range(n):
        f = rng.choice(FAMILIES)
        right, bug = rng.sample(f.literals, 2)
        t = task(f, right, bug)
        shown = {"prompt": t["prompt"], "files": t["files"]}
        failure = tests_ran(f, right, bug, rng)
        if rng.random() < reading:
            turns: list[object] = [{"content": run_tests(), "train": False}, failure, edit(f, right)]
        elif rng.random() < p_careful:
            turns = [run_tests(), failure, edit(f, right), edited(f, rng), run_tests(),
                     tests_ran(f, right, right, rng), call("submit")]  # fmt: skip
        else:
            guess = rng.choice([x for x in f.literals if x != bug])
            turns = [
                edit(f, guess),
                edited(f, rng),
                run_tests(),
                tests_ran(f, right, guess, rng),
                call("submit"),
            ]
        pairs.append((shown, turns))
    return pairs


if __name__ == "__main__":
    path = Path(__file__).with_name("debug-bugs.jsonl")
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks()))
    print(f"wrote {path}")  # noqa: T201
