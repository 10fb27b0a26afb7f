"""The harness without a sandbox: its JSON lines, its failure messages (the same as
``traceback`` formats them, without importing it), its cheap start, and the precompiled
form the scorer runs. Whole runs go through a plain ``python3 -S`` here; the sandboxed
runs are in test_runner.py."""

from __future__ import annotations

import json
import subprocess
import traceback
from pathlib import Path

import pytest

from temper.rewards import harness
from temper.rewards.runner import HARNESS_SOURCE, TestRunner, compile_harness, encode_spec
from temper.sandbox import SandboxSettings
from temper.tasks.models import TaskSpec

PYTHON = SandboxSettings().python

TASK = TaskSpec(
    id="abs",
    prompt="Write absdiff(a, b)",
    entry_point="absdiff",
    solution="def absdiff(a, b):\n    return abs(a - b)\n",
    tests="def check(candidate):\n    assert candidate(3, 1) == 2\n    assert candidate(1, 3) == 2\n"
    "    assert candidate(2, 2) == 0\n",
)


@pytest.mark.parametrize(
    "value",
    ["", "plain", 'quote " and \\ backslash', "\x00\x01\x1f\x7f tab\t nl\n cr\r ff\f bs\b", "é ünï 中文 \u2028", 0, -7,
     10**30, 0.1, 1e-07, 2.5e300, True, False, None],
)  # fmt: skip
def test_result_lines_are_json_that_the_scorer_reads_back(value):
    line = harness.event_line("n0nce", {"ev": "test", "msg": value, "i": 3})
    assert line.startswith("n0nce {") and line.endswith("}\n")
    assert json.loads(line[len("n0nce ") :]) == {"ev": "test", "msg": value, "i": 3}
    # the scorer's end-of-run check reads the separators json.dumps writes
    assert harness.event_line("n", {"ev": "end"}) == "n " + json.dumps({"ev": "end"}) + "\n"


def test_non_finite_floats_are_written_as_json_dumps_writes_them():
    for value in (float("inf"), float("-inf")):
        assert json.loads(harness.to_json(value)) == value
    assert harness.to_json(float("nan")) == "NaN"


class Custom(Exception):
    pass


class BrokenStr(Exception):
    def __str__(self):
        raise RuntimeError("no")


class Unmodule(Exception):
    pass


Unmodule.__module__ = None  # type: ignore[assignment]


def _raised(make):
    try:
        raise make()
    except BaseException as exc:  # noqa: BLE001
        return exc


def _syntax(source):
    try:
        compile(source, "solution.py", "exec")
    except SyntaxError as exc:
        return exc
    raise AssertionError("compiled")


EXCEPTIONS = [
    lambda: ValueError("no"),
    lambda: ValueError(),
    lambda: ValueError(""),
    lambda: KeyError("k"),
    lambda: ZeroDivisionError("division by zero"),
    lambda: Custom("mine"),
    lambda: Custom(),
    lambda: BrokenStr("x"),
    lambda: Unmodule("who"),
    lambda: json.JSONDecodeError("bad", "doc", 0),
    lambda: OSError(2, "No such file", "x.txt"),
    lambda: ValueError("line one\nline two\n"),
    lambda: SyntaxError("custom", ("f.py", None, None, None)),
    lambda: SyntaxError("no place"),
    lambda: SyntaxError(),
]


@pytest.mark.parametrize("make", EXCEPTIONS)
def test_exception_lines_match_traceback(make):
    exc = _raised(make)
    assert harness.exception_line(exc) == traceback.format_exception_only(type(exc), exc)[-1].strip()


@pytest.mark.parametrize(
    "source",
    ["def f(a, b) return 1\n", "x = (\n", "def f():\nreturn 1\n", "x = 1 +\n", "a\0b", "\tif x:\n  pass\n"],
)
def test_compile_errors_match_traceback(source):
    try:
        compile(source, "solution.py", "exec")
    except (SyntaxError, ValueError) as exc:
        assert harness.exception_line(exc) == traceback.format_exception_only(type(exc), exc)[-1].strip()
    else:
        raise AssertionError("compiled")


def test_an_exception_with_notes_is_left_to_traceback():
    exc = _raised(lambda: ValueError("v"))
    exc.add_note("a note")
    assert harness.exception_line(exc) == traceback.format_exception_only(type(exc), exc)[-1].strip()


def test_a_failing_assert_is_quoted_from_its_own_source():
    source = "x = 1\nassert x == 1\nassert x == 2, 'two'\n"
    harness.SOURCES["<test 9>"] = source.splitlines()
    try:
        exec(compile(source, "<test 9>", "exec"), {})
    except AssertionError as exc:
        assert harness.describe(exc, "<test 9>") == "assertion failed: assert x == 2, 'two' (two)"
        assert harness.describe(exc, "<elsewhere>") == "assertion failed (two)"
    finally:
        harness.SOURCES.pop("<test 9>")


def _spec(tmp_path: Path, files: dict[str, str]) -> tuple[str, str]:
    class _Manager:
        settings = SandboxSettings()

    runner = TestRunner(_Manager())  # type: ignore[arg-type]
    nonce, spec = runner._spec(TASK, runner.split(TASK), str(tmp_path), [("agent", None)], 1, files)
    return nonce, encode_spec(spec)


def _run(code: str, stdin: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, *flags, "-c", code], input=stdin, capture_output=True, text=True, timeout=60, check=False
    )


def _events(out: str, nonce: str) -> list[dict[str, object]]:
    return [json.loads(line[len(nonce) + 1 :]) for line in out.splitlines() if line.startswith(nonce + " ")]


def test_the_harness_writes_the_files_then_runs_every_test_in_one_process(tmp_path):
    files = {"solution.py": TASK.solution or "", "data/notes.txt": "kept"}
    nonce, stdin = _spec(tmp_path, files)
    out = _run(HARNESS_SOURCE, stdin, "-S")
    events = _events(out.stdout, nonce)
    assert [e["ev"] for e in events] == ["candidate", "test", "test", "test", "timing", "end"], out
    assert all(e["ok"] for e in events if e["ev"] == "test")
    assert (tmp_path / "data" / "notes.txt").read_text() == "kept"


def test_a_file_that_cannot_be_written_is_reported_before_any_code_runs(tmp_path):
    (tmp_path / "blocked").write_text("a file, not a directory")
    nonce, stdin = _spec(tmp_path, {"blocked/solution.py": "x = 1\n", "solution.py": TASK.solution or ""})
    events = _events(_run(HARNESS_SOURCE, stdin, "-S").stdout, nonce)
    assert [e["ev"] for e in events] == ["files", "end"]
    assert events[0]["path"] == "blocked/solution.py" and "Error" in str(events[0]["error"])
    assert not (tmp_path / "solution.py").exists()


def test_the_harness_imports_nothing_that_python_s_does_not_load_already(tmp_path):
    nonce, stdin = _spec(tmp_path, {"solution.py": TASK.solution or ""})
    report = tmp_path / "imported.txt"
    probe = (
        "import sys, os, time, marshal, select, resource\n"  # what the sandbox's agent has loaded
        "before = set(sys.modules)\n"
        f"exec(compile({HARNESS_SOURCE!r}, 'harness.py', 'exec'), {{'__name__': '__main__'}})\n"
        f"open({str(report)!r}, 'w').write(' '.join(sorted(set(sys.modules) - before)))\n"
    )
    proc = _run(probe, stdin, "-S")
    assert _events(proc.stdout, nonce)[-1] == {"ev": "end"}, proc
    imported = set(report.read_text().split())
    # not json, traceback, linecache, signal (enum), re: tens of milliseconds of each score
    assert imported <= {"_signal", "binascii"}, imported


def test_the_precompiled_harness_runs_and_falls_back_to_its_source_on_another_interpreter(tmp_path):
    code = compile_harness(PYTHON)
    assert code is not None and f"exec(compile({HARNESS_SOURCE!r}" in code
    tag = code.split("cache_tag == ", 1)[1].split(":", 1)[0]
    for variant in (code, code.replace(tag, repr("another-tag"), 1)):
        nonce, stdin = _spec(tmp_path, {"solution.py": TASK.solution or ""})
        events = _events(_run(variant, stdin, "-S").stdout, nonce)
        assert [e["ok"] for e in events if e["ev"] == "test"] == [True, True, True]
    assert compile_harness("/nonexistent/python3") is None


def test_nothing_runs_when_the_harness_is_imported():
    assert harness.OUT == -1 and harness.NONCE == "" and harness.__name__ != "__main__"
