"""Task directories in the Harbor / Terminal-Bench layout, as ``shell`` tasks.

    task-dir/
      instruction.md            the instruction (Harbor), or task.yaml's ``instruction:`` (Terminal-Bench)
      task.toml | task.yaml     optional metadata: difficulty (easy/medium/hard), tags
      solution/solve.sh | solution.sh     the oracle: a bash script that solves the task
      tests/test_*.py           the hidden tests: Python ``test_*`` functions (run-tests.sh / test.sh ignored)
      environment/Dockerfile | Dockerfile   optional; see below

Temper runs every task in its own sandbox image, so a task imports only when its
environment is that sandbox plus files: a Dockerfile may hold ``FROM`` (any base),
``WORKDIR``, ``COPY``/``ADD`` of files of the task directory, comments and blank lines.
Anything else (``RUN apt-get ...``, ``ENV``, a multi-container docker-compose) needs its
own image, and the task is refused naming the line. The copied files become the task's
starting files; the ``WORKDIR`` path (``/app``) in the instruction, the tests and the
oracle is rewritten to the workspace, where all of them run.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import yaml
from pydantic import ValidationError

from temper.tasks.models import TaskKind, TaskMeta, TaskSpec

DIFFICULTY = {"easy": 0.25, "medium": 0.5, "hard": 0.75}
ALLOWED = {"FROM", "WORKDIR", "COPY", "ADD", "LABEL", "MAINTAINER"}
IGNORED_TESTS = {"test.sh", "run-tests.sh"}
MAX_FILE_BYTES = 1 << 20


class HarborError(ValueError):
    """A task directory that cannot be imported, with the file (and line) why."""


def _read(path: Path) -> str:
    if path.stat().st_size > MAX_FILE_BYTES:
        raise HarborError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise HarborError(f"{path}: not UTF-8 text (binary files are not supported)") from None


def _first(root: Path, *names: str) -> Path | None:
    return next((root / n for n in names if (root / n).is_file()), None)


def _instruction(root: Path, meta: dict[str, Any]) -> str:
    md = root / "instruction.md"
    if md.is_file():
        return _read(md)
    text = meta.get("instruction")
    if isinstance(text, str) and text.strip():
        return text
    raise HarborError(f"{root}: no instruction (instruction.md, or 'instruction:' in task.yaml)")


def _metadata(root: Path) -> dict[str, Any]:
    if (root / "task.yaml").is_file():
        try:
            data = yaml.safe_load(_read(root / "task.yaml")) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            line = f": line {mark.line + 1}" if mark else ""
            raise HarborError(f"{root / 'task.yaml'}{line}: not valid YAML") from None
        if not isinstance(data, dict):
            raise HarborError(f"{root / 'task.yaml'}: expected a mapping")
        return data
    if (root / "task.toml").is_file():
        try:
            data = tomllib.loads(_read(root / "task.toml"))
        except tomllib.TOMLDecodeError as exc:
            raise HarborError(f"{root / 'task.toml'}: not valid TOML: {exc}") from None
        return {**data.get("metadata", {}), **{k: v for k, v in data.items() if not isinstance(v, dict)}}
    return {}


def _environment(root: Path) -> tuple[str | None, dict[str, str]]:
    """(WORKDIR, starting files) from the Dockerfile, refusing what needs its own image."""
    compose = _first(root, "docker-compose.yaml", "docker-compose.yml", "environment/docker-compose.yaml")
    if compose is not None:
        try:
            services = (yaml.safe_load(_read(compose)) or {}).get("services") or {}
        except (yaml.YAMLError, AttributeError):
            raise HarborError(f"{compose}: not a valid docker-compose file") from None
        if len(services) > 1:
            raise HarborError(
                f"{compose}: the task needs {len(services)} containers ({', '.join(services)}); "
                "Temper runs a task in one sandbox"
            )
    dockerfile = _first(root, "environment/Dockerfile", "Dockerfile")
    if dockerfile is None:
        return None, {}
    context = dockerfile.parent
    workdir: str | None = None
    files: dict[str, str] = {}
    for number, text in _logical_lines(_read(dockerfile)):
        word, _, rest = text.partition(" ")
        op = word.upper()
        if op not in ALLOWED:
            raise HarborError(
                f"{dockerfile}: line {number}: {text[:80]!r} needs its own Docker image; Temper can only "
                f"import tasks whose environment is its sandbox plus files (FROM, WORKDIR, COPY)"
            )
        if op == "WORKDIR":
            workdir = rest.strip()
        elif op in ("COPY", "ADD"):
            args = [a for a in shlex.split(rest) if not a.startswith("--")]
            if any(a.startswith("--from") for a in shlex.split(rest)) or len(args) < 2:
                raise HarborError(f"{dockerfile}: line {number}: unsupported {op}: {text[:80]!r}")
            *sources, dest = args
            for src in sources:
                if "://" in src:
                    raise HarborError(f"{dockerfile}: line {number}: {op} from a URL needs network access")
                files.update(_copied(root, context, src, dest, workdir, f"{dockerfile}: line {number}"))
    return workdir, files


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Dockerfile instructions with their first line number (continuations joined)."""
    out: list[tuple[int, str]] = []
    buf, start = "", 0
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        out.append((start, (buf + line).strip()))
        buf = ""
    if buf:
        out.append((start, buf.strip()))
    return out


def _copied(
    root: Path, context: Path, src: str, dest: str, workdir: str | None, where: str
) -> dict[str, str]:
    base = (context / src).resolve()
    if not base.is_relative_to(context.resolve()) or not base.exists():
        raise HarborError(f"{where}: {src!r} is not a file of the task directory")
    target = PurePosixPath(dest if dest.startswith("/") else f"{workdir or '/'}/{dest}")
    if workdir and target.is_relative_to(workdir):
        rel = target.relative_to(workdir)
    else:
        raise HarborError(f"{where}: copies to {dest!r}, outside the WORKDIR ({workdir or 'none'})")
    if base.is_file():
        name = rel / base.name if dest.endswith("/") or str(rel) == "." else rel
        sources = {name: base}
    else:
        sources = {rel / p.relative_to(base): p for p in sorted(base.rglob("*")) if p.is_file()}
    hidden = [root.resolve() / n for n in ("tests", "solution", "solution.sh")]
    for path in sources.values():
        if any(path == h or path.is_relative_to(h) for h in hidden):
            raise HarborError(
                f"{where}: copies {path.relative_to(root.resolve())}, which the agent must not see"
            )
    return {str(name): _read(path) for name, path in sources.items()}


def _relocate(text: str, workdir: str | None, *, alone: str = ".") -> str:
    """The WORKDIR's absolute path made relative: the agent, the tests and the oracle all
    run in the workspace. ``alone`` replaces the bare directory (``/app``)."""
    if not workdir or workdir == "/":
        return text
    wd = re.escape(workdir.rstrip("/"))
    text = re.sub(wd + r"/(?=\S)", "", text)
    return re.sub(wd + r"/?(?![\w.-])", alone, text)


def import_task_dir(path: str | Path, *, task_id: str | None = None) -> TaskSpec:
    """One task directory as a ``shell`` task."""
    root = Path(path)
    if not root.is_dir():
        raise HarborError(f"{root}: not a directory")
    meta = _metadata(root)
    instruction = _instruction(root, meta)
    oracle = _first(root, "solution/solve.sh", "solution.sh")
    if oracle is None:
        raise HarborError(f"{root}: no oracle solution (solution/solve.sh or solution.sh)")
    tests_dir = root / "tests"
    if not tests_dir.is_dir():
        raise HarborError(f"{root}: no tests/ directory")
    test_files = sorted(p for p in tests_dir.rglob("test_*.py") if p.is_file())
    if not test_files:
        raise HarborError(
            f"{tests_dir}: no Python test file (test_*.py); Temper grades shell tasks with them"
        )
    others = [
        p for p in tests_dir.rglob("*")
        if p.is_file() and p not in test_files and p.name not in IGNORED_TESTS and "__pycache__" not in p.parts
    ]  # fmt: skip
    if others:
        raise HarborError(
            f"{others[0]}: hidden files beside the Python tests are not supported (only test_*.py)"
        )
    workdir, files = _environment(root)
    tests = "\n\n".join(_read(p) for p in test_files)
    difficulty = meta.get("difficulty")
    tags = meta.get("tags")
    try:
        return TaskSpec(
            id=task_id or root.name,
            kind=TaskKind.shell,
            prompt=_relocate(instruction, workdir, alone="the current directory"),
            files=files,
            tests=_relocate(tests, workdir),
            oracle=_relocate(_read(oracle), workdir),
            metadata=TaskMeta(
                source=f"harbor:{root.name}",
                tags=[str(t) for t in tags] if isinstance(tags, list) else ["shell"],
                difficulty=DIFFICULTY.get(str(difficulty).lower()) if difficulty is not None else None,
            ),
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "task"
        raise HarborError(f"{root}: the resulting task is invalid: {where}: {err['msg']}") from None


def import_task_dirs(path: str | Path) -> list[TaskSpec]:
    """A task directory, or a directory of task directories (each with tests/)."""
    root = Path(path)
    if (root / "tests").is_dir():
        return [import_task_dir(root)]
    dirs = sorted(p for p in root.iterdir() if p.is_dir() and (p / "tests").is_dir()) if root.is_dir() else []
    if not dirs:
        raise HarborError(f"{root}: neither a task directory nor a directory of them (none has tests/)")
    return [import_task_dir(d) for d in dirs]
