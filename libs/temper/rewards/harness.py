"""The test harness. NOT imported by Temper: its source runs inside a fresh scoring
sandbox (``python3 -S``, standard library only), never in the scorer's process.

It reads its spec as JSON from stdin (so the hidden tests are never a file the code
under test could open), then for each candidate solution: compiles it, loads it as a
module, runs the test prelude in that module's namespace, then each test with a
per-test timer, and writes one result line per event to the original stdout, tagged
with a per-run nonce. The code under test writes to /dev/null: its prints cannot
forge result lines or flood the output.

A HumanEval ``check`` comes as ``program``: the generator ``__temper_check__`` (see
``testsplit.check_program``), defined in the module's namespace like ``check`` and
stepped once per test, so the check's locals stay its own. Other tests come as chunks
run at module level.

spec = {"nonce", "workspace", "module", "file", "candidates": [{"label", "source"|None}],
        "prelude", "tests": [{"name", "code"}], "program"|None, "entry_point", "param",
        "per_test_s", "max_timeouts", "repeat"}
"""

import json
import linecache
import os
import signal
import sys
import time
import traceback

spec = json.loads(sys.stdin.read())
NONCE = spec["nonce"]
OUT = os.dup(1)
_null = os.open(os.devnull, os.O_WRONLY)
os.dup2(_null, 1)
os.dup2(_null, 2)
sys.stdout = open(1, "w", closefd=False)
sys.stderr = open(2, "w", closefd=False)
_write = os.write
_dumps = json.dumps
_clock = time.perf_counter


def emit(**event):
    data = (NONCE + " " + _dumps(event) + "\n").encode("utf-8", "replace")
    while data:
        data = data[_write(OUT, data) :]


class TestTimeout(BaseException):
    pass


def _alarm(signum, frame):
    raise TestTimeout()


signal.signal(signal.SIGALRM, _alarm)


def describe(exc, code_name):
    if isinstance(exc, TestTimeout):
        return "timeout: the test ran past {:.1f}s".format(spec["per_test_s"])
    if isinstance(exc, AssertionError):
        tb = traceback.extract_tb(exc.__traceback__)
        frame = next((f for f in reversed(tb) if f.filename == code_name), None)
        where = (frame.line or "").strip() if frame else ""
        msg = "assertion failed"
        if where:
            msg += ": " + where
        if exc.args:
            msg += " (" + str(exc.args[0])[:200] + ")"
        return msg
    last = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return last[:500]


def timed(code, glb, limit):
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        exec(code, glb)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def step(gen, limit):
    """One test of a check generator: raises what the test raised; returns normally when
    it passed or when the check returned before it (as ``check`` would have)."""
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        error = next(gen, None)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if error is not None:
        raise error


def source_lines(name, text):
    # so that a failing assert's traceback can quote its line
    linecache.cache[name] = (len(text), None, text.splitlines(True), name)


os.chdir(spec["workspace"])
sys.path[0:0] = [spec["workspace"]]
path = os.path.join(spec["workspace"], spec["file"])
PROGRAM = spec.get("program")
tests = []
for i, t in enumerate(spec["tests"]):
    name = "<check>" if PROGRAM else f"<test {i}>"
    code = None
    if not PROGRAM:
        source_lines(name, t["code"])
        code = compile(t["code"], name, "exec")
    tests.append((t["name"], name, code))
prelude = compile(spec["prelude"] or "pass", "<tests>", "exec")
if PROGRAM:
    source_lines("<check>", PROGRAM)
    program = compile(PROGRAM, "<check>", "exec")

for cand in spec["candidates"]:
    label = cand["label"]
    source = cand.get("source")
    if source is None and spec.get("load", True):
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            emit(
                ev="candidate", label=label, compile="cannot read {}: {}".format(spec["file"], exc), load=None
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
        emit(
            ev="candidate",
            label=label,
            compile=traceback.format_exception_only(type(exc), exc)[-1].strip(),
            load=None,
        )
        continue
    module = type(sys)(spec["module"])
    module.__file__ = path
    sys.modules[spec["module"]] = module
    glb = module.__dict__
    load_error = None
    try:
        timed(code, glb, spec["per_test_s"] * 2)
        timed(prelude, glb, spec["per_test_s"])
        fn = None
        if spec.get("entry_point"):
            fn = glb.get(spec["entry_point"])
            if fn is None:
                raise NameError("the solution does not define {}".format(spec["entry_point"]))
            if not PROGRAM:
                glb["candidate"] = fn
                glb[spec.get("param") or "candidate"] = fn
        check = None
        if PROGRAM:
            # defined where check lives (its globals are the module's), then taken out again
            exec(program, glb)
            check = glb.pop("__temper_check__")
    except BaseException as exc:  # noqa: BLE001 - anything the code under test raises
        load_error = describe(exc, path) if not isinstance(exc, SystemExit) else "the solution called exit()"
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
                    step(gen, spec["per_test_s"])
                except BaseException as exc:  # noqa: BLE001
                    if gen.gi_frame is None:  # raised outside a test's try: the check is over
                        stopped = "the check stopped at an earlier test"
                    raise exc from None
            else:
                timed(chunk, glb, spec["per_test_s"])
            ok, msg = True, None
        except BaseException as exc:  # noqa: BLE001
            ok = False
            msg = describe(exc, code_name) if not isinstance(exc, SystemExit) else "the code called exit()"
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
                    step(again, spec["per_test_s"])
                else:
                    timed(chunk, glb, spec["per_test_s"])
        except BaseException:  # noqa: BLE001
            break
        best = min(best, _clock() - t0)
    emit(ev="timing", label=label, best_s=best)
    sys.modules.pop(spec["module"], None)

emit(ev="end")
