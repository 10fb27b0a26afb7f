"""Run hidden tests against solutions inside fresh sandboxes.

Every run takes a new sandbox from the scorer's own :class:`SandboxManager` (warm, never
used before, destroyed afterwards) and runs the harness (``harness.py``) there in one
action: its spec (stdin) carries the task's starting files and the code under test,
which the harness writes into the workspace before it runs the tests, all of them in
that one process. Nothing the agent's code does can reach the tests of another run or
the scorer's process.
"""

from __future__ import annotations

import asyncio
import binascii
import json
import logging
import marshal
import os
import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from temper.limits import LanguageName
from temper.rewards.models import CandidateRun
from temper.rewards.polyglot.run import LanguageTests, run_in_language
from temper.rewards.results import ScoringError, mark_unfinished, parse_output
from temper.rewards.testsplit import SplitTests, split_tests
from temper.sandbox import Action, ExecResult, SandboxLimits, SandboxManager, SandboxSettings
from temper.tasks.models import TaskKind, TaskSpec

log = logging.getLogger(__name__)

HARNESS_SOURCE = (Path(__file__).parent / "harness.py").read_text()
COVERAGE_JSON = "/tmp/temper_coverage.json"

# A run under coverage, in one process and one action: the harness (its source in argv[2])
# runs under coverage.py's API, then the JSON report goes out as the run's last result
# line. ``config_file=False``: no .coveragerc, setup.cfg, tox.ini or pyproject.toml of the
# agent's workspace (the working directory) can exclude lines from the measure.
COVERAGE_DRIVER = """
import os, sys
import coverage
from coverage.exceptions import NoDataError
include, source, out = sys.argv[1:4]
include = os.path.join(os.getcwd(), include)  # the solution file, relative to the workspace
cov = coverage.Coverage(data_file=None, branch=True, include=[include], config_file=False)
harness = {"__name__": "__main__", "__builtins__": __builtins__}
code = compile(source, "harness.py", "exec")
cov.start()
try:
    exec(code, harness)
finally:
    cov.stop()
try:
    cov.json_report(outfile=out)
    with open(out, encoding="utf-8") as f:
        report = f.read().strip()
except NoDataError:
    report = '{"files": {}}'
data = (harness["NONCE"] + ' {"ev": "coverage", "report": ' + report + "}\\n").encode()
while data:
    data = data[os.write(harness["OUT"], data):]
"""

# Scoring limits when a task names none: generous for tests, tight enough for a loop.
SCORING_LIMITS = SandboxLimits(wall_s=20.0, cpu_s=20.0, memory_mb=512, pids=64)


# Where the scoring sandbox sees the coverage package: a fixed path outside /tmp and the
# workspace, wherever the host's virtualenv lives (a checkout under /tmp would otherwise
# be hidden by the sandbox's own /tmp).
SANDBOX_SITE = "/opt/temper-site"


def coverage_site_dir() -> str | None:
    """The directory holding the ``coverage`` package on this host, if it is installed."""
    try:
        import coverage
    except ImportError:
        return None
    return str(Path(coverage.__file__).resolve().parent.parent)


def scoring_sandbox_settings(base: SandboxSettings) -> SandboxSettings:
    """The sandbox settings of a scoring manager: ``base`` plus a read-only bind of the
    coverage.py package (only that package, not the rest of the host's site-packages)
    at :data:`SANDBOX_SITE`."""
    site = coverage_site_dir()
    binds = list(base.ro_binds)
    if site is not None:
        bind = f"{Path(site) / 'coverage'}:{SANDBOX_SITE}/coverage"
        if bind not in binds:
            binds.append(bind)
    return base.model_copy(update={"ro_binds": binds})


# Run by the sandbox's interpreter once per scorer process: the harness's code object,
# so that a score does not compile ~300 lines again (a few milliseconds of each score).
_COMPILE_HARNESS = (
    "import marshal, sys\n"
    "code = compile(sys.stdin.buffer.read().decode('utf-8'), 'harness.py', 'exec', optimize=2)\n"
    "sys.stdout.buffer.write(sys.implementation.cache_tag.encode() + b'\\n' + marshal.dumps(code))\n"
)


def compile_harness(python: str) -> str | None:
    """The code of a ``run_python`` action that runs the harness from its code object as
    compiled by ``python`` (the sandbox's interpreter), guarded by that interpreter's
    bytecode tag: an interpreter with another tag (a task's image) compiles the source,
    which the code carries too. None when ``python`` cannot compile it here."""
    try:
        out = subprocess.run(
            [python, "-S", "-c", _COMPILE_HARNESS], input=HARNESS_SOURCE.encode(),
            capture_output=True, check=True, timeout=30, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("harness not precompiled (%s): each score compiles it", exc)
        return None
    tag, _, blob = out.partition(b"\n")
    if not tag or not blob:
        return None
    encoded = binascii.b2a_base64(blob, newline=False).decode("ascii")
    return (
        "import sys\n"
        f"if sys.implementation.cache_tag == {tag.decode('ascii', 'replace')!r}:\n"
        "    from binascii import a2b_base64\n"
        "    from marshal import loads\n"
        f"    exec(loads(a2b_base64({encoded!r})))\n"
        "else:\n"
        f"    exec(compile({HARNESS_SOURCE!r}, 'harness.py', 'exec'))\n"
    )


@dataclass
class RunSettings:
    per_test_s: float = 3.0
    max_timeouts: int = 2
    compile_timeout_s: float = 30.0  # tests in a compiled language: the test program's compile
    python: str = "/usr/bin/python3"


class TestRunner:
    __test__ = False  # not a pytest test class

    def __init__(self, manager: SandboxManager, settings: RunSettings | None = None) -> None:
        self.manager = manager
        self.settings = settings or RunSettings(python=manager.settings.python)
        self._splits: dict[tuple[str, str | None], SplitTests] = {}
        self._harness: asyncio.Future[str | None] | None = None
        self.language_tests = LanguageTests()  # tests in other languages than Python, cut

    async def harness_code(self) -> str:
        """The ``run_python`` code that runs the harness: precompiled once (in a thread, the
        first time it is needed), else its source."""
        if self._harness is None:
            self._harness = asyncio.ensure_future(asyncio.to_thread(compile_harness, self.settings.python))
        try:
            code = await asyncio.shield(self._harness)
        except Exception:  # noqa: BLE001 - compiling is an optimisation; never fatal
            code = None
        return code or HARNESS_SOURCE

    def split(self, task: TaskSpec) -> SplitTests:
        """The task's tests cut into chunks, once per distinct tests and entry point (the
        split depends on nothing else; no normalising of the text for the key)."""
        key = (task.tests or "", task.entry_point)
        split = self._splits.get(key)
        if split is None:
            if len(self._splits) > 4096:
                self._splits.clear()
            split = self._splits[key] = split_tests(key[0], task.entry_point)
        return split

    def _limits(self, task: TaskSpec) -> SandboxLimits:
        return task.limits or SCORING_LIMITS

    def _spec(
        self,
        task: TaskSpec,
        split: SplitTests,
        workspace: str,
        candidates: list[tuple[str, str | None]],
        repeat: int,
        files: dict[str, str],
    ) -> tuple[str, dict[str, Any]]:
        nonce = secrets.token_hex(16)
        module = os.path.splitext(os.path.basename(task.solution_file))[0] or "solution"
        spec = {
            "nonce": nonce,
            "workspace": workspace,
            "files": [[path, content] for path, content in files.items()],
            "module": module,
            "file": task.solution_file,
            "candidates": [{"label": label, "source": src} for label, src in candidates],
            "prelude": split.prelude,
            "tests": [{"name": c.name, "code": c.code} for c in split.chunks],
            "program": split.program,
            "entry_point": task.entry_point,
            "param": split.param,
            "per_test_s": self.settings.per_test_s,
            "max_timeouts": self.settings.max_timeouts,
            "repeat": repeat,
            "load": task.kind is TaskKind.code,
        }
        return nonce, spec

    async def run(
        self,
        task: TaskSpec,
        candidates: list[tuple[str, str | None]],
        *,
        files: dict[str, str] | None = None,
        repeat: int = 1,
        coverage: bool = False,
    ) -> tuple[list[CandidateRun], dict[str, Any] | None]:
        """Run each candidate (label, source; ``None`` = the solution file in ``files``)
        against the task's tests in one fresh sandbox. With ``coverage`` the run goes
        under coverage.py (line and branch) and its JSON report is returned too. Tests in
        another language than Python run as that language's test program, one per
        candidate (``temper.rewards.polyglot``); ``repeat`` is one pass there.

        This is one action in the sandbox (with coverage too): the harness gets the files
        with its spec and writes them itself. A run under coverage whose process was
        killed or ended early gives a report with only ``error`` (why) and no files."""
        limits = self._limits(task)
        all_files = {**task.files, **(files or {})}
        check_files(all_files, limits)
        if task.language is not LanguageName.python:
            if coverage:
                raise ScoringError(f"coverage is measured in Python only, not {task.language}")
            runs = await run_in_language(
                self.manager, self.language_tests.statements(task), task, candidates, files=all_files,
                limits=limits, per_test_s=self.settings.per_test_s, max_timeouts=self.settings.max_timeouts,
                compile_timeout_s=self.settings.compile_timeout_s,
            )  # fmt: skip
            return runs, None
        split = self.split(task)
        if coverage and coverage_site_dir() is None:
            raise ScoringError("coverage.py is not installed on the scorer host")
        nonce = ""
        report: dict[str, Any] | None = None

        # The workspace is the action's working directory, wherever the run lands.
        nonce, spec = self._spec(task, split, "", candidates, repeat, all_files)
        stdin = encode_spec(spec)
        if not coverage:
            action = Action(kind="run_python", code=await self.harness_code(), stdin=stdin)
        else:
            action = Action(
                kind="run_command",
                command=[self.settings.python, "-c", COVERAGE_DRIVER, task.solution_file, HARNESS_SOURCE,
                         COVERAGE_JSON],
                stdin=stdin, env={"PYTHONPATH": SANDBOX_SITE},
            )  # fmt: skip
        result = await self._run_once(limits, action)
        failed = files_error(result.stdout, nonce)
        if failed is not None:
            raise ScoringError(f"cannot write {failed[0]} into the scoring sandbox: {failed[1]}")
        stdout = result.stdout
        if coverage:
            stdout, report = coverage_report(stdout, nonce)
        runs = parse_output(stdout, nonce, [c[0] for c in candidates], [c.name for c in split.chunks])
        why = None
        if result.kill_reason is not None:
            for run in runs:
                run.kill_reason = str(result.kill_reason)
            why = f"killed by the sandbox: {result.kill_reason}"
        elif not stdout.rstrip().endswith('"ev": "end"}'):
            detail = (result.stderr.strip().splitlines() or [f"exit status {result.exit_code}"])[-1][:300]
            why = f"the test process ended early: {detail}"
        if why is not None:
            mark_unfinished(runs, why)
        if coverage and report is None:
            report = {"files": {}, "error": why or "the run gave no coverage report"}
        for run in runs:
            run.wall_s = result.wall_s
        return runs, report

    async def _run_once(self, limits: SandboxLimits, action: Action) -> ExecResult:
        """``action`` where no earlier run was (``SandboxManager.run_fresh``: fresh pid,
        mount and IPC namespaces and an empty workspace and /tmp on a zygote, or a sandbox
        of its own). The harness writes the files itself, so a run needs nothing else."""
        try:
            result, _ = await self.manager.run_fresh(limits, {}, action)
        except Exception as exc:  # noqa: BLE001 - any failure to run is the machinery's
            raise ScoringError(f"cannot run in a scoring sandbox: {exc}") from exc
        if result.error:
            raise ScoringError(f"cannot run in a scoring sandbox: {result.error}")
        return result


def check_files(files: dict[str, str], limits: SandboxLimits) -> None:
    """Refuse, as the sandbox's ``write_file`` would, a file it could not write."""
    cap = limits.file_size_mb << 20
    for path, content in files.items():
        if not path:
            raise ScoringError("cannot write a file without a path into the scoring sandbox")
        if len(content) * 4 <= cap:  # at most 4 bytes a character in UTF-8: no need to encode
            continue
        try:
            size = len(content.encode())
        except UnicodeEncodeError as exc:
            raise ScoringError(f"cannot write {path} into the scoring sandbox: {exc}") from exc
        if size > cap:
            raise ScoringError(f"cannot write {path} into the scoring sandbox: file larger than file_size_mb")


def encode_spec(spec: dict[str, Any]) -> str:
    """The harness's stdin: ``marshal`` data (plain values only, format 4, which every
    Python 3.4+ reads), base64 so that it travels as text. The harness decodes it with
    modules built into the interpreter, where ``json`` would cost an import of ``re``."""
    return binascii.b2a_base64(marshal.dumps(spec, 4), newline=False).decode("ascii")


def files_error(stdout: str, nonce: str) -> tuple[str, str] | None:
    """(path, error) when the harness could not write the spec's files. That is its
    first result line, if any: it writes the files before any code under test runs."""
    prefix = nonce + " "
    for line in stdout.splitlines():
        if not line.startswith(prefix):
            continue
        try:
            ev = json.loads(line[len(prefix) :])
        except json.JSONDecodeError:
            return None
        if isinstance(ev, dict) and ev.get("ev") == "files":
            return str(ev.get("path")), str(ev.get("error"))
        return None
    return None


def coverage_report(stdout: str, nonce: str) -> tuple[str, dict[str, Any] | None]:
    """The run's output without its coverage line, and the report that line carries (the
    last result line of a run under coverage), else None."""
    prefix = nonce + ' {"ev": "coverage", "report": '
    lines = stdout.splitlines(keepends=True)
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith(nonce + " "):
            if not lines[i].startswith(prefix):
                return stdout, None
            try:
                ev = json.loads(lines[i][len(nonce) + 1 :])
            except json.JSONDecodeError:
                return stdout, None
            report = ev.get("report") if isinstance(ev, dict) else None
            return "".join(lines[:i] + lines[i + 1 :]), report if isinstance(report, dict) else None
    return stdout, None
