"""The result lines of a run of hidden tests (the Python harness's, and the runners' of
other languages, ``temper.rewards.polyglot``): one line per event, tagged with the run's
nonce, read back into :class:`CandidateRun` s."""

from __future__ import annotations

import json

from temper.rewards.models import CandidateRun, TestOutcome


class ScoringError(RuntimeError):
    """The sandbox machinery failed (not the code under test)."""


def mark_unfinished(runs: list[CandidateRun], why: str) -> None:
    for run in runs:
        for t in run.tests:
            if t.message == "__missing__":
                t.message = why
                why = "not run: " + why.split(": ", 1)[-1]


def parse_output(stdout: str, nonce: str, labels: list[str], test_names: list[str]) -> list[CandidateRun]:
    """Result lines tagged with the nonce; tests without a line are marked missing."""
    runs = {label: CandidateRun(label=label) for label in labels}
    seen: dict[str, dict[int, TestOutcome]] = {label: {} for label in labels}
    started: set[str] = set()
    prefix = nonce + " "
    for line in stdout.splitlines():
        if not line.startswith(prefix):
            continue
        try:
            ev = json.loads(line[len(prefix) :])
        except json.JSONDecodeError:
            continue
        label = ev.get("label")
        if ev.get("ev") == "end" or label not in runs:
            continue
        run = runs[label]
        if ev["ev"] == "candidate":
            started.add(label)
            run.compile_error = ev.get("compile")
            run.load_error = ev.get("load")
        elif ev["ev"] == "test":
            seen[label][int(ev["i"])] = TestOutcome(
                name=ev.get("name", ""),
                passed=bool(ev["ok"]),
                message=ev.get("msg"),
                seconds=float(ev.get("s", 0)),
            )
        elif ev["ev"] == "timing":
            run.best_s = float(ev["best_s"])
    for label, run in runs.items():
        run.started = label in started
        if run.compile_error or run.load_error:
            reason = (
                f"does not compile: {run.compile_error}"
                if run.compile_error
                else f"load failed: {run.load_error}"
            )
            run.tests = [TestOutcome(name=n, passed=False, message=reason) for n in test_names]
            continue
        outcomes = []
        for i, name in enumerate(test_names):
            outcomes.append(seen[label].get(i) or TestOutcome(name=name, passed=False, message="__missing__"))
        run.tests = outcomes
    return list(runs.values())
