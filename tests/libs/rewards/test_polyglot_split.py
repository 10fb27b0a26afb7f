"""Hidden tests in other languages cut into statements (no sandbox): which are tests, which
set-up, which hoisted to file level; comments, strings and literals that hold braces,
semicolons or the word assert; MultiPL-E's whole-program shapes opened; the programs made
from them."""

from __future__ import annotations

import pytest

from temper.limits import LanguageName as L
from temper.rewards.polyglot import build, java_solution, names_of
from temper.rewards.polyglot.statements import split


def kinds(tests: str, language: L) -> list[tuple[str, str]]:
    return [(s.kind, s.text) for s in split(tests, language)]


def test_c_family_statements_strings_comments_and_blocks():
    tests = (
        "#include <string.h>\n"
        "int twice(int x) { return 2 * x; }  // a helper: hoisted\n"
        'const char *s = "a } b; assert(";\n'
        "char c = '}';\n"
        "/* assert(0); in a comment */\n"
        "assert(twice(2) == 4);\n"
        "for (int i = 0; i < 3; i++) {\n    assert(twice(i) == i + i);\n}\n"
        'if (c) { s = 0; }\nelse { s = "x"; }\n'
        'assert(strlen("{;") == 2);\n'
    )
    assert kinds(tests, L.c) == [
        ("hoist", "#include <string.h>"),
        ("hoist", "int twice(int x) { return 2 * x; }"),
        ("setup", 'const char *s = "a } b; assert(";'),
        ("setup", "char c = '}';"),
        ("test", "assert(twice(2) == 4);"),
        ("test", "for (int i = 0; i < 3; i++) {\n    assert(twice(i) == i + i);\n}"),
        ("setup", 'if (c) { s = 0; }\nelse { s = "x"; }'),
        ("test", 'assert(strlen("{;") == 2);'),
    ]


def test_multipl_e_whole_programs_are_opened():
    cpp = (
        "}\nint main() {\n    auto candidate = has_close_elements;\n"
        "    assert(candidate((std::vector<float>({(float)1.0, (float)2.0})), (0.3)) == (true));\n"
        "    assert(candidate((std::vector<float>({(float)1.0})), (0.05)) == (false));\n    return 0;\n}\n"
    ).removeprefix("}\n")
    assert [k for k, _ in kinds(cpp, L.cpp)] == ["setup", "test", "test"]  # the return is dropped
    rust = "fn main() {\n    let candidate = f;\n    assert_eq!(candidate(vec![1]), 1);\n    assert!(candidate(vec![]) == 0);\n}\n"
    assert [k for k, _ in kinds(rust, L.rust)] == ["setup", "test", "test"]
    js = (
        "const assert = require('node:assert');\n\nfunction test() {\n  let candidate = f;\n"
        "  assert.deepEqual(candidate([1, 2]),[2]);\n  assert.deepEqual(candidate([]),[])\n}\n\ntest();\n"
    )
    found = kinds(js, L.nodejs)
    assert [k for k, _ in found] == ["setup", "setup", "test", "test"]  # the call test(); is gone
    assert found[0][1] == "const assert = require('node:assert');"
    sh = (
        'candidate() {\n    f "$@"\n}\n\nset -e\nrun_test() {\n    [[ $(candidate "1 2") = "2" ]]\n'
        '    x=$(candidate "")\n    [ "$x" = "" ]\n}\n\nrun_test\n'
    )
    assert kinds(sh, L.bash) == [
        ("setup", 'candidate() {\n    f "$@"\n}'),
        ("setup", "set -e"),
        ("test", '[[ $(candidate "1 2") = "2" ]]'),
        ("setup", 'x=$(candidate "")'),
        ("test", '[ "$x" = "" ]'),
    ]


def test_go_lines_end_statements_and_literals_do_not():
    go = (
        'import "strings"\ncandidate := Evens\nassertEqual(candidate([]int{1, 2}),\n\t[]int{2})\n'
        "for _, x := range candidate([]int{4, 6}) {\n\tassert(x%2 == 0)\n}\n"
        "func helper() int {\n\treturn 1\n}\n"
        'assert(strings.HasPrefix("go", "g"))\n'
    )
    assert [k for k, _ in kinds(go, L.go)] == ["hoist", "setup", "test", "test", "hoist", "test"]


def test_javascript_without_semicolons_and_template_literals():
    js = "let x = `a ${ {b: 1}.b } }`\nassert.ok(x.length)\nassert\n  .equal(1, 1)\nconst y = [1,\n  2]\n"
    assert kinds(js, L.nodejs) == [
        ("setup", "let x = `a ${ {b: 1}.b } }`"),
        ("test", "assert.ok(x.length)"),
        ("test", "assert\n  .equal(1, 1)"),
        ("setup", "const y = [1,\n  2]"),
    ]


def test_rust_lifetimes_chars_and_raw_strings():
    rust = (
        "fn first<'a>(s: &'a str) -> &'a str { &s[..1] }\n"
        "let brace = '}';\n"
        'let raw = r#"a " } ; assert!(false)"#;\n'
        'assert_eq!(first("xy"), "x");\n'
    )
    assert [k for k, _ in kinds(rust, L.rust)] == ["setup", "setup", "setup", "test"]


def test_java_imports_and_methods_are_hoisted_into_the_program():
    tests = (
        "import java.util.List;\nstatic boolean same(List<Integer> a, List<Integer> b) { return a.equals(b); }\n"
        "boolean eq(int a, int b) { return a == b; }\n"
        'assert same(Solution.evens(List.of(2)), List.of(2)) : "evens";\n'
    )
    statements = split(tests, L.java)
    assert [s.kind for s in statements] == ["hoist", "hoist", "hoist", "test"]
    program = build(L.java, "package x;\npublic final class Solution {}\n", statements, "Solution.java")
    assert "import java.util.List;" in program.code
    assert "static boolean eq(int a, int b)" in program.code  # made static: main is
    assert "package x;" not in program.code and "public final class Solution" not in program.code
    assert "final class Solution {}" in program.code
    assert names_of(statements) == [
        'test 1 (line 4): assert same(Solution.evens(List.of(2)), List.of(2)) : "evens";'
    ]


def test_java_solution_keeps_a_public_inside_a_class():
    code = "public class Solution {\n    public static int f() { return 1; }\n}\n"
    assert java_solution(code) == "class Solution {\n    public static int f() { return 1; }\n}\n"


@pytest.mark.parametrize(
    ("language", "tests", "count"),
    [
        (L.c, "int x = 1;\n", 0),
        (L.java, 'String s = "assert";\n', 0),
        (L.rust, "let assert_eq = 1; // assert!(x)\n", 0),
        (L.bash, "echo '[[ x ]]'\n", 0),
        (L.typescript, "import * as assert from 'assert';\nassert.equal(1, 1);\n", 1),
    ],
)
def test_what_is_not_an_assertion(language, tests, count):
    assert len(names_of(split(tests, language))) == count
