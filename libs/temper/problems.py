"""How a validation error reads, wherever one is shown (the API's 422s, ``temper submit``,
task files, settings): the field as a dotted path (``tasks.group_size``), the message on
one line without the library's own prefixes (pydantic's ``Value error, …``) — the same
words everywhere, as the docs show them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

PREFIXES = ("Value error, ", "Assertion failed, ")
MAX_MESSAGE = 300  # characters: never echo a huge input back


def field_path(loc: Iterable[Any], *, root: str = "(root)") -> str:
    """``("tasks", "group_size")`` -> ``tasks.group_size`` (a list index is a part too)."""
    return ".".join(str(part)[:80] for part in loc) or root


def one_line(text: str, *, limit: int = MAX_MESSAGE) -> str:
    """A message on one line: newlines and runs of blanks become one space, clipped."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def clip(value: object, limit: int = 80) -> str:
    """``repr`` of a value, cut so an error never echoes a huge input back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def message(error: Mapping[str, Any]) -> str:
    """One pydantic error's message, without the library's prefix, on one line."""
    text = str(error.get("msg", ""))
    for prefix in PREFIXES:
        text = text.removeprefix(prefix)
    return one_line(text)


def yaml_problem(exc: Exception) -> str:
    """A YAML parse error on one line: where (line, column) and what, without the
    parser's echo of the input and its ``<unicode string>`` name."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return one_line(f"{where}{problem}")
