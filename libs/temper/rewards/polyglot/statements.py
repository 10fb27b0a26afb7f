"""Cut hidden tests written in a task's own language into statements, and say which are
tests: the rule of Python's assert-style tests (``temper.rewards.testsplit``) for every
language.

- a statement that holds an assertion (``assert(...)`` in C and C++, ``assert`` in Java,
  ``assert!``/``assert_eq!``/``assert_ne!`` in Rust, ``assert``/``assert.*`` in JavaScript
  and TypeScript, ``assert``/``assertEqual`` (the runner's) or ``panic`` in Go, a
  ``[[ … ]]``, ``[ … ]``, ``test`` or ``(( … ))`` command in bash) is one test; a compound
  statement holding one (a loop over cases) is one test as a whole;
- any other statement (and in JavaScript and TypeScript any declaration, such as
  ``const assert = require('node:assert')``) is set-up: it runs, in order, before the next test, and what it
  declares stays visible to the later tests;
- what cannot stand inside a function in the language (``#include`` and other preprocessor
  lines, C and C++ function definitions, Java imports and methods, Go imports and
  functions, TypeScript imports and ``declare``\\ s) is *hoisted*: written at file level,
  before the tests' function.

Tests written as a whole program, MultiPL-E's way (a ``main`` of C, C++, Rust or Go, a
``function test() { … }`` and its call in JavaScript or TypeScript, a ``run_test`` function
and its call in bash), have that function's body taken as the statements, and everything
else hoisted.

This is a scanner, not a parser: it knows each language's comments, strings, character
literals and brackets, and where a statement may end (``;``; a closing brace not followed
by ``else``, ``catch`` …; a line end in Go, JavaScript, TypeScript and bash). It never
runs anything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from temper.limits import LanguageName

L = LanguageName


@dataclass(frozen=True)
class Statement:
    text: str
    line: int  # 1-based line of its first character in the tests
    kind: str  # "test" | "setup" | "hoist"


ASSERTION = {
    L.c: re.compile(r"\bassert\s*\("),
    L.cpp: re.compile(r"\bassert\s*\("),
    L.java: re.compile(r"\bassert\b"),
    L.go: re.compile(r"\b(?:assert|assertEqual|panic)\s*\("),
    L.rust: re.compile(r"\b(?:debug_)?assert(?:_eq|_ne)?!\s*[(\[{]"),
    L.nodejs: re.compile(r"\bassert\b"),
    L.typescript: re.compile(r"\bassert\b"),
    L.bash: re.compile(r"^\s*(?:!\s*)?(?:\[\[|\[\s|test\s|\(\()"),
}
# Statements that declare a name: set-up, whatever they mention.
DECLARES = {
    L.nodejs: re.compile(r"(?:const|let|var|function|class|import)\b"),
    L.typescript: re.compile(r"(?:const|let|var|function|class|import|type|interface)\b"),
}
# What a test program's main function is called when the tests are a whole program.
WHOLE = {
    L.c: re.compile(r"^\s*(?:int|void)\s+main\s*\("),
    L.cpp: re.compile(r"^\s*(?:int|void|auto)\s+main\s*\("),
    L.rust: re.compile(r"^\s*fn\s+main\s*\(\s*\)"),
    L.go: re.compile(r"^\s*func\s+main\s*\(\s*\)"),
    L.nodejs: re.compile(r"^\s*function\s+test\s*\(\s*\)"),
    L.typescript: re.compile(r"^\s*function\s+test\s*\(\s*\)"),
    L.bash: re.compile(r"^\s*(?:function\s+)?run_test\s*(?:\(\s*\))?\s*\{"),
}
WHOLE_CALL = {
    L.nodejs: re.compile(r"^\s*test\s*\(\s*\)\s*;?\s*$"),
    L.typescript: re.compile(r"^\s*test\s*\(\s*\)\s*;?\s*$"),
    L.bash: re.compile(r"^\s*run_test\s*$"),
}
CONTROL = re.compile(r"^\s*(?:if|for|while|do|switch|try|match|loop|unsafe|else|\{)\b|^\s*\{")
CONTINUES_AFTER_BRACE = frozenset({"else", "catch", "finally", ";", ",", ")", "]", ".", "?", ":", "=", "+", "-",
                                   "*", "/", "%", "&", "|", "^", "<", ">", "!"})  # fmt: skip
# Go: a line ending with one of these tokens ends its statement (the spec's semicolon rule).
GO_ENDS = re.compile(r"(?:[\w\"'`)\]}]|\+\+|--)$")
JS_CONTINUES_LINE = re.compile(r"(?:[,(\[{.=+\-*/%&|^!<>?:]|=>)$")
JS_CONTINUES_NEXT = re.compile(r"^(?:[.?:)\],+*/%&|^=<>]|-(?!-))")
BASH_OPEN = frozenset({"if", "case", "for", "while", "until", "select"})
BASH_CLOSE = frozenset({"fi", "esac", "done"})


class Scanner:
    """Walks ``text`` a character at a time, skipping comments, strings and character
    literals, and keeps the bracket depth."""

    def __init__(self, text: str, language: LanguageName) -> None:
        self.text, self.lang = text, language
        self.braces = language is not L.bash

    def skip(self, i: int) -> int:
        """The index after the comment, string or literal starting at ``i`` (``i`` when none
        starts there)."""
        t, lang = self.text, self.lang
        c = t[i]
        nxt = t[i + 1] if i + 1 < len(t) else ""
        if lang is L.bash:
            if c == "#" and (i == 0 or t[i - 1] in " \t\n;&|("):
                return _to_line_end(t, i)
            if c == "'":
                return _find(t, "'", i + 1) + 1
            if c == '"':
                return _quoted(t, i, '"')
            if c == "\\":
                return i + 2
            return i
        if c == "/" and nxt == "/":
            return _to_line_end(t, i)
        if c == "/" and nxt == "*":
            return _find(t, "*/", i + 2) + 2
        if c == '"':
            return _quoted(t, i, '"')
        if c == "'":
            if lang is L.rust:
                return _rust_quote(t, i)
            return _quoted(t, i, "'")
        if c == "`" and lang is L.go:
            return _find(t, "`", i + 1) + 1
        if c == "`" and lang in (L.nodejs, L.typescript):
            return _template(t, i)
        if lang is L.rust and c in "rb":
            m = re.compile(r'b?r(#*)"').match(t, i)
            if m and (i == 0 or not (t[i - 1].isalnum() or t[i - 1] == "_")):
                end = '"' + m.group(1)
                return _find(t, end, m.end()) + len(end)
        return i


def _to_line_end(t: str, i: int) -> int:
    j = t.find("\n", i)
    return len(t) if j < 0 else j


def _find(t: str, what: str, i: int) -> int:
    j = t.find(what, i)
    return len(t) - len(what) if j < 0 else j


def _quoted(t: str, i: int, quote: str) -> int:
    j = i + 1
    while j < len(t):
        if t[j] == "\\":
            j += 2
            continue
        if t[j] == quote or (t[j] == "\n" and quote == "'"):
            return j + 1
        j += 1
    return len(t)


def _rust_quote(t: str, i: int) -> int:
    """A Rust character literal, or the lifetime ``'a`` (no literal: just the quote)."""
    if i + 1 < len(t) and t[i + 1] == "\\":
        return _quoted(t, i, "'")
    if i + 2 < len(t) and t[i + 2] == "'":
        return i + 3
    return i + 1


def _template(t: str, i: int) -> int:
    """A JavaScript template literal, its ``${…}`` parts included."""
    j = i + 1
    while j < len(t):
        if t[j] == "\\":
            j += 2
        elif t[j] == "`":
            return j + 1
        elif t.startswith("${", j):
            depth, j = 1, j + 2
            while j < len(t) and depth:
                if t[j] in "'\"`":
                    j = _template(t, j) if t[j] == "`" else _quoted(t, j, t[j])
                    continue
                depth += {"{": 1, "}": -1}.get(t[j], 0)
                j += 1
        else:
            j += 1
    return len(t)


def _words_before(t: str, start: int, i: int) -> str:
    return t[start:i].strip()


def _next_token(scan: Scanner, i: int) -> str:
    """The next significant token at or after ``i`` (comments skipped), or ""."""
    t = scan.text
    while i < len(t):
        if t[i].isspace():
            i += 1
            continue
        after = scan.skip(i)
        if after != i and t[i] in "/#":
            i = after
            continue
        m = re.compile(r"[A-Za-z_]\w*").match(t, i)
        return m.group(0) if m else t[i]
    return ""


def _bash_word_at(t: str, i: int) -> str | None:
    """The shell word starting at ``i`` when it is in command position, else None."""
    if i > 0 and not (t[i - 1].isspace() or t[i - 1] in ";&|(){"):
        return None
    m = re.compile(r"[A-Za-z_]+").match(t, i)
    if m is None or (m.end() < len(t) and not (t[m.end()].isspace() or t[m.end()] in ";&|)")):
        return None
    before = t[:i].rstrip(" \t")
    prev_word = re.search(r"(\w+)$", before)
    if before and before[-1] not in "\n;&|({!" and not (prev_word and prev_word.group(1) in
                                                        ("then", "do", "else", "elif", "time")):  # fmt: skip
        return None
    return m.group(0)


def raw_statements(text: str, language: LanguageName) -> list[tuple[int, str]]:
    """``text`` cut into statements: (offset, text) of each, comments inside kept."""
    scan = Scanner(text, language)
    t = text
    out: list[tuple[int, str]] = []
    start: int | None = None
    depth = 0
    i = 0

    def close(end: int) -> None:
        nonlocal start
        if start is not None and t[start:end].strip():
            out.append((start, t[start:end]))
        start = None

    while i < len(t):
        c = t[i]
        if start is None:
            if c.isspace():
                i += 1
                continue
            after = scan.skip(i)
            if after != i and c in "/#":
                i = after  # a comment between statements
                continue
            start = i
            if c == "#" and language in (L.c, L.cpp):  # a preprocessor line, continuations included
                j = i
                while True:
                    j = _to_line_end(t, j)
                    if j > 0 and t[j - 1] == "\\" and j < len(t):
                        j += 1
                        continue
                    break
                close(j)
                i = j
                continue
        after = scan.skip(i)
        if after != i:
            i = after
            continue
        if language is L.bash:
            word = _bash_word_at(t, i)
            if word in BASH_OPEN:
                depth += 1
            elif word in BASH_CLOSE:
                depth -= 1
            if word is not None:
                i += len(word)
                continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if c == "}" and depth == 0 and language is not L.bash:
                # a block's end when nothing but a comment follows on its line (a literal's
                # ``}`` is followed by more of its statement: ``range []int{1, 2} {``)
                assert start is not None
                token = _next_token(scan, i + 1)
                is_do = re.match(r"\s*do\b", t[start:i]) is not None
                rest = t[i + 1 : _to_line_end(t, i)].strip()
                line_ends = not rest or rest.startswith(("//", "/*"))
                if line_ends and token not in CONTINUES_AFTER_BRACE and not (token == "while" and is_do):
                    close(i + 1)
        elif c == ";" and depth == 0:
            if language is L.bash and t.startswith(";;", i):
                i += 2
                continue
            close(i + 1)
        elif c == "\n" and depth == 0 and language in (L.go, L.nodejs, L.typescript, L.bash):
            assert start is not None
            line = t[start:i].rstrip()
            last = line.splitlines()[-1].rstrip() if line else ""
            if language is L.bash:
                ends = not last.endswith(("\\", "&&", "||", "|"))
            elif language is L.go:
                ends = GO_ENDS.search(last) is not None
            else:
                rest = t[i + 1 :].lstrip()
                ends = not JS_CONTINUES_LINE.search(last) and not JS_CONTINUES_NEXT.match(rest)
            if ends:
                close(i)
        i += 1
    close(len(t))
    return out


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _body(stmt: str) -> str:
    """The text inside the outermost braces of a function definition."""
    return stmt[stmt.index("{") + 1 : stmt.rindex("}")]


def _hoisted(text: str, language: LanguageName) -> bool:
    s = text.lstrip()
    if language in (L.c, L.cpp):
        if s.startswith("#") or re.match(r"(?:using\s+namespace|template\b|typedef\b)", s):
            return True
        return s.rstrip().endswith("}") and not CONTROL.match(s) and "=" not in s.split("{", 1)[0]
    if language is L.java:
        if re.match(r"import\s", s):
            return True
        defines = s.rstrip().endswith("}") and not CONTROL.match(s)
        return (
            defines
            and not re.match(r"(?:final\s+)?(?:class|interface|enum|record)\b", s)
            and "=" not in s.split("{", 1)[0]
        )
    if language is L.go:
        return re.match(r"import\b|func\s+\w", s) is not None
    if language is L.typescript:
        return re.match(r"(?:import|declare)\b", s) is not None
    if language is L.rust:
        return s.startswith("#!")
    return False


def split(tests: str, language: LanguageName) -> list[Statement]:
    """The statements of ``tests``, each a test, set-up, or hoisted to file level. Tests
    written as a whole program (see the module's doc) are opened first."""
    pieces = raw_statements(tests, language)
    whole = WHOLE.get(language)
    mains = [(off, s) for off, s in pieces if whole is not None and whole.match(s) and "{" in s]
    if len(mains) == 1:
        off, main = mains[0]
        body_offset = off + main.index("{") + 1
        call = WHOLE_CALL.get(language)
        # what is outside the main function stays where the language allows it, never a test
        outside = [(o, s) for o, s in pieces if o != off and not (call and call.match(s))]

        def around(o: int, s: str) -> Statement:
            return Statement(
                s.strip(), _line_of(tests, o), "hoist" if _hoisted(s.strip(), language) else "setup"
            )

        inner = raw_statements(_body(main), language)
        return [
            *(around(o, s) for o, s in outside if o < off),
            *_classify([(body_offset + o, s) for o, s in inner], tests, language),
            *(around(o, s) for o, s in outside if o > off),
        ]
    return _classify(pieces, tests, language)


def _classify(pieces: list[tuple[int, str]], tests: str, language: LanguageName) -> list[Statement]:
    out = []
    assertion = ASSERTION[language]
    for off, text in pieces:
        body = text.strip()
        if language in (L.c, L.cpp, L.rust, L.go) and re.match(r"return\b", body):
            continue  # a whole program's ``return 0;``: the runner's main returns when every test ran
        if _hoisted(body, language):
            kind = "hoist"
        elif DECLARES.get(language) is not None and DECLARES[language].match(body):
            kind = "setup"  # ``const assert = require('node:assert')`` binds, it does not test
        elif assertion.search(_code_only(body, language)):
            kind = "test"
        else:
            kind = "setup"
        out.append(Statement(body, _line_of(tests, off), kind))
    return out


def _code_only(text: str, language: LanguageName) -> str:
    """``text`` with its comments, strings and literals blanked (an ``assert`` in a string is
    not an assertion)."""
    if language is L.bash:
        return text  # a bash test is told by its first word, which the pattern anchors
    scan = Scanner(text, language)
    out, i = [], 0
    while i < len(text):
        after = scan.skip(i)
        if after != i:
            out.append(" ")
            i = after
            continue
        out.append(text[i])
        i += 1
    return "".join(out)


def short(text: str, limit: int = 80) -> str:
    one = " ".join(text.split())
    return one if len(one) <= limit else one[: limit - 3] + "..."
