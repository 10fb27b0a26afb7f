"""The test harness. Its source runs inside a fresh scoring sandbox (``python3 -S``,
standard library only), never in the scorer's process; Temper imports it only in its
own tests (nothing runs on import).

It reads its spec from stdin (so the hidden tests are never a file the code under test
could open): ``marshal`` data, base64-encoded, written by the trusted scorer. It first
writes the spec's ``files`` (the task's starting files and the agent's) into the
workspace, so that a score needs one action in the sandbox, not one per file. Then, for
each candidate solution: compiles it, loads it as a module, runs the test prelude in
that module's namespace, then each test with a per-test timer, and writes one result
line per event to the original stdout, tagged with a per-run nonce. The code under test
writes to /dev/null: its prints cannot forge result lines or flood the output.

A HumanEval ``check`` comes as ``program``: the generator ``__temper_check__`` (see
``testsplit.check_program``), defined in the module's namespace like ``check`` and
stepped once per test, so the check's locals stay its own. Other tests come as chunks
run at module level. All the tests run in this one process; each still reports alone
(a test that raises, times out or exits is that test's failure), and a crash or a kill
of the process leaves the tests it did not report to be marked by the scorer.

It starts in a few milliseconds: it imports only modules built into the interpreter
or already loaded by the sandbox's agent (``_signal``, not ``signal``, which imports
``enum``; no ``json``, ``traceback`` or ``linecache``, which import ``re`` and
``tokenize``): result lines are written by the small JSON writer below, and failure
messages are formatted here as ``traceback.format_exception_only`` formats them.

spec = {"nonce", "workspace" ("": the working directory), "files": [[path, text]], "module", "file",
        "candidates": [{"label", "source"|None}], "prelude", "tests": [{"name", "code"}],
        "program"|None, "entry_point", "param", "per_test_s", "max_timeouts", "repeat", "load"}
"""

import _signal
import marshal
import os
import sys
import time
from binascii import a2b_base64

_write = os.write
_clock = time.perf_counter
OUT = -1  # the original stdout, once main() has moved the code under test's to /dev/null
NONCE = ""
PER_TEST_S = 3.0

# --- result lines -------------------------------------------------------------------------
# JSON without the json module: the events hold only str, int, float, bool and None.
_ESCAPE = {i: f"\\u{i:04x}" for i in range(32)}
_INF = float("inf")
_ESCAPE.update({ord('"'): '\\"', ord("\\"): "\\\\", 8: "\\b", 9: "\\t", 10: "\\n", 12: "\\f", 13: "\\r"})


def to_json(value):
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, str):
        return '"' + str.translate(value, _ESCAPE) + '"'
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        if value != value:
            return "NaN"
        if value in (_INF, -_INF):
            return "Infinity" if value > 0 else "-Infinity"
        return float.__repr__(value)
    return to_json(str(value))


def event_line(nonce, event):
    body = ", ".join('"' + key + '": ' + to_json(value) for key, value in event.items())
    return nonce + " {" + body + "}\n"


def emit(**event):
    data = event_line(NONCE, event).encode("utf-8", "replace")
    while data:
        data = data[_write(OUT, data) :]


# --- failure messages ---------------------------------------------------------------------
class TestTimeout(BaseException):
    pass


def _alarm(signum, frame):
    raise TestTimeout()


# code name -> its lines, so that a failing assert can be quoted (a type comment: the
# annotation would be evaluated, and a sandbox image may run an older Python)
SOURCES = {}  # type: dict[str, list[str]]


def _safe_str(value, what):
    try:
        return str(value)
    except:  # noqa: E722 - as traceback._safe_string: anything str() raises
        return f"<{what} str() failed>"


def exception_line(exc):
    """``traceback.format_exception_only(type(exc), exc)[-1].strip()``, without importing
    traceback (which imports linecache, tokenize and re). An exception with notes (rare)
    is left to traceback itself."""
    if getattr(exc, "__notes__", None) is not None:
        import traceback

        return traceback.format_exception_only(type(exc), exc)[-1].strip()
    cls = type(exc)
    stype = cls.__qualname__
    smod = cls.__module__
    if smod not in ("__main__", "builtins"):
        if not isinstance(smod, str):
            smod = "<unknown>"
        stype = smod + "." + stype
    if isinstance(exc, SyntaxError):
        suffix = ""
        if exc.lineno is None and exc.filename is not None:
            suffix = f" ({exc.filename})"
        return "{}: {}{}".format(stype, exc.msg or "<no detail available>", suffix).strip()
    text = _safe_str(exc, "exception")
    return (stype + ": " + text if text else stype).strip()


def failing_line(exc, code_name):
    """The source line of the innermost frame of ``exc``'s traceback in ``code_name``."""
    lineno = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == code_name:
            lineno = tb.tb_lineno
        tb = tb.tb_next
    lines = SOURCES.get(code_name)
    if lineno is None or not lines or not 0 < lineno <= len(lines):
        return ""
    return lines[lineno - 1].strip()


def describe(exc, code_name):
    if isinstance(exc, TestTimeout):
        return f"timeout: the test ran past {PER_TEST_S:.1f}s"
    if isinstance(exc, AssertionError):
        msg = "assertion failed"
        where = failing_line(exc, code_name)
        if where:
            msg += ": " + where
        if exc.args:
            msg += " (" + _safe_str(exc.args[0], "assertion message")[:200] + ")"
        return msg
    return exception_line(exc)[:500]


# --- running ------------------------------------------------------------------------------
def timed(code, glb, limit):
    _signal.setitimer(_signal.ITIMER_REAL, limit)
    try:
        exec(code, glb)
    finally:
        _signal.setitimer(_signal.ITIMER_REAL, 0)


def step(gen, limit):
    """One test of a check generator: raises what the test raised; returns normally when
    it passed or when the check returned before it (as ``check`` would have)."""
    _signal.setitimer(_signal.ITIMER_REAL, limit)
    try:
        error = next(gen, None)
    finally:
        _signal.setitimer(_signal.ITIMER_REAL, 0)
    if error is not None:
        raise error


def read_spec(stream):
    return marshal.loads(a2b_base64(stream.read()))


def write_files(workspace, files):
    """The spec's files, as the sandbox's ``write_file`` writes them; None, or what failed."""
    for rel, text in files:
        path = rel if rel.startswith("/") else os.path.join(workspace, rel)
        try:
            parent = os.path.dirname(path)
            if parent:
                os.makedirs(parent, exist_ok=True)
            data = text.encode("utf-8")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[_write(fd, view) :]
            finally:
                os.close(fd)
        except (OSError, UnicodeError) as exc:
            return rel, f"{type(exc).__name__}: {exc}"
    return None


def main():
    global OUT, NONCE, PER_TEST_S
    spec = read_spec(sys.stdin.buffer)
    NONCE = spec["nonce"]
    PER_TEST_S = spec["per_test_s"]
    OUT = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    _signal.signal(_signal.SIGALRM, _alarm)

    workspace = spec["workspace"] or os.getcwd()  # "": the action's working directory
    failed = write_files(workspace, spec.get("files") or [])
    if failed is not None:
        emit(ev="files", path=failed[0], error=failed[1])
        emit(ev="end")
        return
    os.chdir(workspace)
    sys.path[0:0] = [workspace]
    path = os.path.join(workspace, spec["file"])
    program_source = spec.get("program")
    tests = []
    for i, t in enumerate(spec["tests"]):
        name = "<check>" if program_source else f"<test {i}>"
        code = None
        if not program_source:
            SOURCES[name] = t["code"].splitlines()
            code = compile(t["code"], name, "exec")
        tests.append((t["name"], name, code))
    prelude = compile(spec["prelude"] or "pass", "<tests>", "exec")
    if program_source:
        SOURCES["<check>"] = program_source.splitlines()
        program = compile(program_source, "<check>", "exec")

    for cand in spec["candidates"]:
        label = cand["label"]
        source = cand.get("source")
        if source is None and spec.get("load", True):
            try:
                with open(path, encoding="utf-8") as f:
                    source = f.read()
            except (OSError, UnicodeDecodeError) as exc:
                emit(
                    ev="candidate",
                    label=label,
                    compile="cannot read {}: {}".format(spec["file"], exc),
                    load=None,
                )
                continue
        if not spec.get("load", True):
            # shell tasks: the solution is a workspace file the tests inspect, not a module
            if source is not None:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(source)
            source = "pass"
        try:
            code = compile(source, path, "exec")
        except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
            emit(ev="candidate", label=label, compile=exception_line(exc), load=None)
            continue
        SOURCES[path] = source.splitlines()
        module = type(sys)(spec["module"])
        module.__file__ = path
        sys.modules[spec["module"]] = module
        glb = module.__dict__
        load_error = None
        try:
            timed(code, glb, PER_TEST_S * 2)
            timed(prelude, glb, PER_TEST_S)
            fn = None
            if spec.get("entry_point"):
                fn = glb.get(spec["entry_point"])
                if fn is None:
                    raise NameError("the solution does not define {}".format(spec["entry_point"]))
                if not program_source:
                    glb["candidate"] = fn
                    glb[spec.get("param") or "candidate"] = fn
            check = None
            if program_source:
                # defined where check lives (its globals are the module's), then taken out again
                exec(program, glb)
                check = glb.pop("__temper_check__")
        except BaseException as exc:  # noqa: BLE001 - anything the code under test raises
            load_error = (
                describe(exc, path) if not isinstance(exc, SystemExit) else "the solution called exit()"
            )
        emit(ev="candidate", label=label, compile=None, load=load_error)
        if load_error is not None:
            continue
        timeouts = 0
        total = 0.0
        gen = check(fn) if check is not None else None
        stopped = None
        for i, (name, code_name, chunk) in enumerate(tests):
            if timeouts >= spec["max_timeouts"]:
                emit(
                    ev="test",
                    label=label,
                    i=i,
                    name=name,
                    ok=False,
                    msg="not run: earlier tests timed out",
                    s=0.0,
                )
                continue
            if stopped is not None:
                emit(ev="test", label=label, i=i, name=name, ok=False, msg="not run: " + stopped, s=0.0)
                continue
            t0 = _clock()
            try:
                if gen is not None:
                    try:
                        step(gen, PER_TEST_S)
                    except BaseException as exc:  # noqa: BLE001
                        if gen.gi_frame is None:  # raised outside a test's try: the check is over
                            stopped = "the check stopped at an earlier test"
                        raise exc from None
                else:
                    timed(chunk, glb, PER_TEST_S)
                ok, msg = True, None
            except BaseException as exc:  # noqa: BLE001
                ok = False
                msg = (
                    describe(exc, code_name) if not isinstance(exc, SystemExit) else "the code called exit()"
                )
                if isinstance(exc, TestTimeout):
                    timeouts += 1
            dt = _clock() - t0
            total += dt
            emit(ev="test", label=label, i=i, name=name, ok=ok, msg=msg, s=round(dt, 7))
        best = total
        for _ in range(max(0, spec.get("repeat", 1) - 1)):
            t0 = _clock()
            try:
                again = check(fn) if check is not None else None
                for _name, _cn, chunk in tests:
                    if again is not None:
                        step(again, PER_TEST_S)
                    else:
                        timed(chunk, glb, PER_TEST_S)
            except BaseException:  # noqa: BLE001
                break
            best = min(best, _clock() - t0)
        emit(ev="timing", label=label, best_s=best)
        sys.modules.pop(spec["module"], None)

    emit(ev="end")


if __name__ == "__main__":
    main()
