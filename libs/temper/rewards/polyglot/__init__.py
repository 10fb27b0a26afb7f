"""Hidden tests in a task's own language: the program that runs them against a solution and
reports each test alone, as the Python harness (``temper.rewards.harness``) does.

The tests are cut into statements (:mod:`.statements`); the program is the solution, Temper's
runner for the language (``runners/``: a few helpers written in that language) and a main
function that runs the set-up statements in order and each test statement in a guard of the
language's own (a ``try``, ``catch_unwind``, ``recover``, a subshell, ``sigsetjmp``), so a
failing assertion or an exception ends only its test. The runner reads a nonce from stdin,
silences the program's own output, and writes one line per event, tagged with the nonce,
in the harness's format: ``temper.rewards.runner.parse_output`` reads both.

The program is compiled and run like any other (``temper.sandbox.programs.run_program``:
the compile in a fresh run of its own, the tests in another).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from temper.limits import LanguageName
from temper.rewards.polyglot.statements import Statement, raw_statements, short, split

L = LanguageName
RUNNERS = Path(__file__).parent / "runners"
LABEL = "run"  # the runners report every test under this label

# What a fenced block of code in the language may be labelled (```cpp, ```c++ …).
FENCE_NAMES = {
    L.python: ("python", "py", "python3"),
    L.bash: ("bash", "sh", "shell"),
    L.c: ("c",),
    L.cpp: ("cpp", "c++", "cxx", "cc"),
    L.java: ("java",),
    L.go: ("go", "golang"),
    L.rust: ("rust", "rs"),
    L.nodejs: ("javascript", "js", "nodejs", "node"),
    L.typescript: ("typescript", "ts"),
}
JAVA_IMPORTS = (
    "import java.util.*;\nimport java.util.function.*;\nimport java.util.stream.*;\nimport java.math.*;\n"
    "import org.javatuples.*;\n"
)


TEMPER_ASSERT = (
    "#undef assert\n#define assert(...) ((__VA_ARGS__) ? (void)0 : temper_assert_failed(#__VA_ARGS__))"
)


@cache
def runner_source(name: str) -> str:
    return (RUNNERS / name).read_text()


@dataclass
class TestProgram:
    """What :func:`build` makes: the code for the language's source file, other files to
    write beside it, the files its compile step takes with it (Go), and the tests' names."""

    __test__ = False  # not a pytest test class
    code: str
    names: list[str]
    files: dict[str, str] = field(default_factory=dict)
    sources: tuple[str, ...] = ()


def names_of(statements: list[Statement]) -> list[str]:
    tests = [s for s in statements if s.kind == "test"]
    return [f"test {n} (line {s.line}): {short(s.text)}" for n, s in enumerate(tests, 1)]


def build(
    language: LanguageName, solution: str, statements: list[Statement], solution_file: str
) -> TestProgram:
    """The test program of ``solution`` against ``statements`` (from :func:`split`)."""
    # C and C++ compilers name the tests' own lines in their messages
    where = (lambda s: f'#line {s.line} "tests"\n') if language in (L.c, L.cpp) else (lambda s: "")
    hoisted = [where(s) + s.text for s in statements if s.kind == "hoist"]
    body: list[str] = []
    index = 0
    for s in statements:
        if s.kind == "setup":
            body.append(where(s) + s.text)
        elif s.kind == "test":
            body.append(GUARD[language](index, where(s) + s.text))
            index += 1
    names = names_of(statements)
    make = MAKERS[language]
    return make(solution, hoisted, body, names, solution_file)


def _c_family(solution: str, hoisted: list[str], body: list[str], names: list[str], solution_file: str,
              cpp: bool) -> TestProgram:  # fmt: skip
    code = "\n".join([
        "#define main temper_solution_main",
        f'#line 1 "{solution_file}"',
        solution,
        '#line 1 "temper-runner"',
        runner_source("runner.c"),
        *hoisted,
        TEMPER_ASSERT,  # again: a hoisted #include <assert.h> defines the standard one
        "int main(void) {" if not cpp else "int main() {",
        "temper_start();",
        *body,
        "temper_finish();",
        "return 0;",
        "}",
        "",
    ])  # fmt: skip
    return TestProgram(code, names)


def _c(
    solution: str, hoisted: list[str], body: list[str], names: list[str], solution_file: str
) -> TestProgram:
    return _c_family(solution, hoisted, body, names, solution_file, cpp=False)


def _cpp(
    solution: str, hoisted: list[str], body: list[str], names: list[str], solution_file: str
) -> TestProgram:
    return _c_family(solution, hoisted, body, names, solution_file, cpp=True)


def _java(
    solution: str, hoisted: list[str], body: list[str], names: list[str], solution_file: str
) -> TestProgram:
    imports = [h for h in hoisted if h.startswith("import")]
    methods = [h if re.search(r"\bstatic\b", h.split("(", 1)[0]) else "static " + h for h in hoisted
               if not h.startswith("import")]  # fmt: skip
    code = "\n".join([
        JAVA_IMPORTS,
        *imports,
        java_solution(solution),
        "public class Main {",
        *methods,
        "public static void main(String[] temperArgs) throws Exception {",
        "TemperRunner.start();",
        *body,
        "TemperRunner.finish();",
        "System.exit(0);",
        "}",
        "}",
        runner_source("TemperRunner.java"),
    ])  # fmt: skip
    return TestProgram(code, names)


def _go(
    solution: str, hoisted: list[str], body: list[str], names: list[str], solution_file: str
) -> TestProgram:
    imports = "\n".join(h for h in hoisted if h.startswith("import"))
    funcs = [h for h in hoisted if not h.startswith("import")]
    runner = runner_source("runner.go").replace("//@IMPORTS@", imports)
    code = "\n".join([runner, *funcs, "func main() {", "temperStart()", *body, "temperFinish()", "}", ""])
    return TestProgram(code, names, files={"solution.go": go_solution(solution)}, sources=("solution.go",))


def _rust(
    solution: str, hoisted: list[str], body: list[str], names: list[str], solution_file: str
) -> TestProgram:
    code = "\n".join([
        rename_main(solution, r"^(\s*)(?:pub\s+)?fn\s+main\s*\(\s*\)", r"\1#[allow(dead_code)] fn temper_solution_main()"),
        *hoisted,
        runner_source("runner.rs"),
        "fn main() {",
        "let mut temper_r = temper_runner::start();",
        *body,
        "temper_r.finish();",
        "}",
        "",
    ])  # fmt: skip
    return TestProgram(code, names)


def _javascript(solution: str, hoisted: list[str], body: list[str], names: list[str],
                solution_file: str) -> TestProgram:  # fmt: skip
    code = "\n".join([
        solution,
        ";",
        *hoisted,
        runner_source("runner.js"),
        "function __temperMain() {",
        *body,
        "__temper.finish();",
        "}",
        "__temperMain();",
        "",
    ])  # fmt: skip
    return TestProgram(code, names)


def _bash(
    solution: str, hoisted: list[str], body: list[str], names: list[str], solution_file: str
) -> TestProgram:
    code = "\n".join([runner_source("runner.sh"), solution, *hoisted, *body, "__temper_finish", ""])
    return TestProgram(code, names)


def _guard_c(i: int, stmt: str) -> str:
    return f"if (temper_begin()) {{ if (sigsetjmp(temper_jump, 1) == 0) {{\n{stmt}\n}} }} temper_end({i});"


def _guard_cpp(i: int, stmt: str) -> str:
    return (
        f"if (temper_begin()) {{ if (sigsetjmp(temper_jump, 1) == 0) {{ try {{\n{stmt}\n}} "
        "catch (const temper_failure &) {} "
        "catch (const std::exception &temper_e) { temper_fail_what(temper_e.what()); } "
        'catch (...) { temper_fail("threw something that is not a std::exception"); } } } '
        f"temper_end({i});"
    )


def _guard_java(i: int, stmt: str) -> str:
    return (
        f"TemperRunner.begin(); try {{\n{stmt}\n}} catch (Throwable temperError) "
        f"{{ TemperRunner.fail(temperError); }} TemperRunner.end({i});"
    )


GUARD = {
    L.c: _guard_c,
    L.cpp: _guard_cpp,
    L.java: _guard_java,
    L.go: lambda i, stmt: f"temperTest({i}, func() {{\n{stmt}\n}})",
    L.rust: lambda i, stmt: f"temper_r.test({i}, || {{\n{stmt}\n}});",
    L.nodejs: lambda i, stmt: f"__temper.test({i}, () => {{\n{stmt}\n}});",
    L.typescript: lambda i, stmt: f"__temper.test({i}, () => {{\n{stmt}\n}});",
    L.bash: lambda i, stmt: (
        f'__temper_t0=$(__temper_now); if (\n{stmt}\n); then __temper_end {i} 0 "$__temper_t0"; '
        f'else __temper_end {i} "$?" "$__temper_t0"; fi'
    ),
}
MAKERS = {
    L.c: _c,
    L.cpp: _cpp,
    L.java: _java,
    L.go: _go,
    L.rust: _rust,
    L.nodejs: _javascript,
    L.typescript: _javascript,
    L.bash: _bash,
}


def rename_main(code: str, pattern: str, replacement: str) -> str:
    return re.sub(pattern, replacement, code, count=1, flags=re.M)


def java_solution(code: str) -> str:
    """The solution as a part of Main.java: no ``package`` line, and its top-level types not
    ``public`` (only Main may be, in a file of that name)."""
    out = []
    last = 0
    for offset, text in raw_statements(code, L.java):
        stripped = text.lstrip()
        start = offset + len(text) - len(stripped)
        if re.match(r"package\s", stripped):
            out.append(code[last:start])
            last = offset + len(text)
            continue
        m = re.match(
            r"public\s+(?=(?:(?:abstract|final|sealed|non-sealed|strictfp|static)\s+)*(?:class|interface|enum|record|@interface)\b)",
            stripped,
        )
        if m:
            out.append(code[last:start])
            last = start + m.end()
    out.append(code[last:])
    return "".join(out)


def go_solution(code: str) -> str:
    """The solution as a file of package main (the clause added or changed), its own ``main``
    renamed so the runner's is the program's."""
    if re.search(r"^\s*package\s+\w+", code, re.M):
        code = re.sub(r"^(\s*)package\s+\w+", r"\1package main", code, count=1, flags=re.M)
    else:
        code = "package main\n\n" + code
    return rename_main(code, r"^func\s+main\s*\(\s*\)", "func temperSolutionMain()")


__all__ = ["FENCE_NAMES", "LABEL", "TestProgram", "build", "split", "names_of"]
