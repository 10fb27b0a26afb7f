"""Public datasets from local files: HumanEval, MBPP and GSM8K records read from JSONL or
parquet (no hub access), turned into :class:`TaskSpec` objects.

Each format reads named *fields* from columns of the same name by default, the column
names of the public releases; ``columns`` maps a field to another column (sanitized
MBPP's ``prompt`` instead of ``text``: ``{"text": "prompt"}``). A bad record raises
:class:`DatasetError` naming the file, the line (JSONL) or row (parquet) and the column.
"""

from __future__ import annotations

import ast
import builtins
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from temper.tasks.models import TaskKind, TaskMeta, TaskSpec

_BUILTINS = frozenset(dir(builtins))


class DatasetError(ValueError):
    """A record that cannot be imported: ``file: line N: column 'c': what is wrong``."""


@dataclass(frozen=True)
class Record:
    """One row of a dataset file with where it came from (for error messages)."""

    file: str
    where: str  # "line 3" (JSONL) or "row 3" (parquet), 1-based
    values: Mapping[str, Any]
    columns: Mapping[str, str]  # field -> column

    def fail(self, message: str, field: str | None = None) -> DatasetError:
        col = f"column {self.columns.get(field, field)!r}: " if field else ""
        return DatasetError(f"{self.file}: {self.where}: {col}{message}")

    def get(self, field: str, *, required: bool = True) -> Any:
        column = self.columns.get(field, field)
        if column not in self.values:
            if not required:
                return None
            present = ", ".join(sorted(self.values)) or "(none)"
            hint = f"; map it with --columns {field}=COLUMN" if column == field else ""
            raise self.fail(f"missing (the record has: {present}){hint}", field)
        return self.values[column]

    def text(self, field: str, *, required: bool = True, number_ok: bool = False) -> str | None:
        value = self.get(field, required=required)
        if value is None and not required:
            return None
        if number_ok and isinstance(value, int) and not isinstance(value, bool):
            return str(value)  # MBPP's task_id is an integer
        if not isinstance(value, str) or (required and not value.strip()):
            raise self.fail(f"expected non-empty text, got {_shown(value)}", field)
        return value

    def strings(self, field: str) -> list[str]:
        value = self.get(field)
        if hasattr(value, "tolist"):  # a numpy array from parquet
            value = value.tolist()
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fail(f"expected a list of strings, got {_shown(value)}", field)
        return value


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def read_records(path: str | Path, columns: Mapping[str, str] | None = None) -> Iterator[Record]:
    """The records of a ``.jsonl`` / ``.json`` (one object per line) or ``.parquet`` file."""
    path = Path(path)
    cols = dict(columns or {})
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
            raise DatasetError(f"{path.name}: not a readable parquet file: {exc}") from None
        for n, row in enumerate(table.to_pylist(), start=1):
            yield Record(path.name, f"row {n}", row, cols)
        return
    if path.suffix not in (".jsonl", ".json", ".ndjson"):
        raise DatasetError(f"{path.name}: expected a .jsonl or .parquet file")
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            values = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(
                f"{path.name}: line {n}: not valid JSON: {exc.msg} (column {exc.colno})"
            ) from None
        if not isinstance(values, dict):
            raise DatasetError(f"{path.name}: line {n}: expected a JSON object")
        yield Record(path.name, f"line {n}", values, cols)


def _task(rec: Record, **fields: Any) -> TaskSpec:
    try:
        return TaskSpec(**fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "task"
        raise rec.fail(f"the resulting task is invalid: {where}: {err['msg']}") from None


# --- the formats --------------------------------------------------------------------------


def humaneval_task(rec: Record, source: str = "") -> TaskSpec:
    """HumanEval: ``task_id``, ``prompt``, ``canonical_solution``, ``test``, ``entry_point``.
    The reference is the prompt plus the canonical body; the hidden tests are the
    problem's ``check`` function, called with the entry point."""
    prompt = rec.text("prompt") or ""
    return _task(
        rec, id=rec.text("task_id", number_ok=True), kind=TaskKind.code, prompt=prompt, files={"solution.py": prompt},
        tests=rec.text("test"), entry_point=rec.text("entry_point"),
        solution=prompt + (rec.text("canonical_solution") or ""), solution_file="solution.py",
        metadata=TaskMeta(source=source or rec.file, tags=["python", "function"]),
    )  # fmt: skip


def mbpp_task(rec: Record, source: str = "") -> TaskSpec:
    """MBPP: ``task_id``, ``text`` (the problem), ``code`` (the reference), ``test_list``
    (assert statements), ``test_setup_code``. The function under test is the one the
    first assert calls; the prompt shows that assert so the model knows its name."""
    tests = rec.strings("test_list")
    if not tests:
        raise rec.fail("has no tests", "test_list")
    entry = _called_function(tests[0])
    if entry is None:
        raise rec.fail(f"the first test calls no function by name: {tests[0][:80]!r}", "test_list")
    setup = rec.text("test_setup_code", required=False) or ""
    text = rec.text("text") or ""
    prompt = f"{text.strip()}\nYour code should pass this test:\n{tests[0]}\n"
    return _task(
        rec, id=f"mbpp/{rec.text('task_id', number_ok=True)}", kind=TaskKind.code, prompt=prompt,
        tests="\n".join([setup, *tests]).strip() + "\n", entry_point=entry,
        solution=rec.text("code"), solution_file="solution.py",
        metadata=TaskMeta(source=source or rec.file, tags=["python", "function"]),
    )  # fmt: skip


def gsm8k_task(rec: Record, source: str = "") -> TaskSpec:
    """GSM8K: ``question`` and ``answer``, a worked solution whose last line is
    ``#### <number>``; ``id`` if the file has one, else ``gsm8k/<line>``."""
    worked = rec.text("answer") or ""
    if "####" not in worked:
        raise rec.fail("has no '#### <answer>' line", "answer")
    final = worked.rsplit("####", 1)[1].strip()
    if not final:
        raise rec.fail("the '####' line has no answer after it", "answer")
    ident = rec.text("id", required=False, number_ok=True) or f"gsm8k/{rec.where.split()[-1]}"
    return _task(
        rec, id=ident, kind=TaskKind.math, prompt=rec.text("question"), answer=final, solution=worked,
        metadata=TaskMeta(source=source or rec.file, tags=["math", "word-problem"]),
    )  # fmt: skip


def _called_function(test: str) -> str | None:
    try:
        tree = ast.parse(test)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id not in _BUILTINS:
                return node.func.id
    return None


FORMATS: dict[str, Callable[[Record, str], TaskSpec]] = {
    "humaneval": humaneval_task,
    "mbpp": mbpp_task,
    "gsm8k": gsm8k_task,
}
FIELDS: dict[str, tuple[str, ...]] = {
    "humaneval": ("task_id", "prompt", "canonical_solution", "test", "entry_point"),
    "mbpp": ("task_id", "text", "code", "test_list", "test_setup_code"),
    "gsm8k": ("id", "question", "answer"),
}


def parse_columns(text: str, fmt: str) -> dict[str, str]:
    """``field=column,...`` checked against the format's fields."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        field, sep, column = part.partition("=")
        field, column = field.strip(), column.strip()
        if not sep or not field or not column:
            raise DatasetError(f"--columns: {part!r} is not FIELD=COLUMN")
        if field not in FIELDS[fmt]:
            raise DatasetError(f"--columns: {fmt} has no field {field!r} (fields: {', '.join(FIELDS[fmt])})")
        out[field] = column
    return out


def import_file(
    fmt: str, path: str | Path, columns: Mapping[str, str] | None = None, *, limit: int | None = None
) -> list[TaskSpec]:
    """Every record of ``path`` as a task of format ``fmt`` (humaneval, mbpp, gsm8k)."""
    if fmt not in FORMATS:
        raise DatasetError(f"unknown dataset format {fmt!r} (known: {', '.join(FORMATS)})")
    build = FORMATS[fmt]
    tasks: list[TaskSpec] = []
    seen: dict[str, str] = {}
    for rec in read_records(path, columns):
        task = build(rec, "")
        if task.id in seen:
            raise rec.fail(f"duplicate task id {task.id!r} (first at {seen[task.id]})")
        seen[task.id] = rec.where
        tasks.append(task)
        if limit is not None and len(tasks) >= limit:
            break
    if not tasks:
        raise DatasetError(f"{Path(path).name}: no records")
    return tasks
