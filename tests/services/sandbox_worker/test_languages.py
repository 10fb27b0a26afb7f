"""Every language through SandboxFusion's ``POST /run_code`` on the real bwrap backend:
hello world, a passing and a failing assert, a compile error; what each answer means as
SandboxFusion's clients read it (status, compile_result, run_result, return_code,
execution_time); runtimes sized from the run's limit (the JVM's and Node's own
out-of-memory errors); compiles under their own limits; tracebacks of the user's file."""

from __future__ import annotations

import asyncio
import base64
import posixpath
import shutil
import uuid
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from services.sandbox_worker.app import create_app
from services.sandbox_worker.worker import SandboxWorker
from temper.sandbox import SandboxLimits, SandboxSettings
from temper.sandbox.compile_cache import SANDBOX_CACHE
from temper.sandbox.languages import LanguageName
from temper.settings.sandbox import CompileLimits

# One worker for the module (its zygotes and compile caches warm once): the tests share its loop.
pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(180), pytest.mark.asyncio(loop_scope="module")]

LIMITS = SandboxLimits(wall_s=10, cpu_s=10, memory_mb=512, pids=64, output_bytes=64 << 10, workspace_mb=64)

# language -> (hello world, a passing test, a failing test, what the failure prints, a compile error or None)
PROGRAMS: dict[str, tuple[str, str, str, str, str | None]] = {
    "python": (
        "print('hello')",
        "def add(a, b):\n    return a + b\n\nassert add(2, 3) == 5\n",
        "def add(a, b):\n    return a + b\n\nassert add(2, 3) == 6\n",
        "AssertionError",
        None,
    ),
    "bash": (
        "echo hello",
        'add() { echo $(($1 + $2)); }\n[ "$(add 2 3)" = 5 ]\n',
        'add() { echo $(($1 + $2)); }\n[ "$(add 2 3)" = 6 ] || { echo "add 2 3 != 6" >&2; exit 1; }\n',
        "add 2 3 != 6",
        None,
    ),
    "c": (
        '#include <stdio.h>\nint main(void) { printf("hello\\n"); return 0; }\n',
        "#include <assert.h>\nint add(int a, int b) { return a + b; }\nint main(void) { assert(add(2, 3) == 5); }\n",
        "#include <assert.h>\nint add(int a, int b) { return a + b; }\nint main(void) { assert(add(2, 3) == 6); }\n",
        "Assertion `add(2, 3) == 6' failed",
        "int main(void) { return undefined_name; }\n",
    ),
    "cpp": (
        '#include <iostream>\nint main() { std::cout << "hello" << std::endl; }\n',
        "#include <bits/stdc++.h>\nint add(int a, int b) { return a + b; }\nint main() { assert(add(2, 3) == 5); }\n",
        "#include <bits/stdc++.h>\nint add(int a, int b) { return a + b; }\nint main() { assert(add(2, 3) == 6); }\n",
        "Assertion `add(2, 3) == 6' failed",
        "#include <vector>\nint main() { std::vector<int> v; v.push(1); }\n",
    ),
    "java": (
        'public class Main { public static void main(String[] a) { System.out.println("hello"); } }\n',
        "public class Main {\n  static int add(int a, int b) { return a + b; }\n"
        "  public static void main(String[] args) { assert add(2, 3) == 5; }\n}\n",
        "public class Main {\n  static int add(int a, int b) { return a + b; }\n"
        '  public static void main(String[] args) { assert add(2, 3) == 6 : "add(2, 3) != 6"; }\n}\n',
        "java.lang.AssertionError: add(2, 3) != 6",
        'public class Main { public static void main(String[] a) { int x = "no"; } }\n',
    ),
    "go": (
        'package main\n\nimport "fmt"\n\nfunc main() { fmt.Println("hello") }\n',
        'package main\n\nfunc add(a, b int) int { return a + b }\n\nfunc main() {\n\tif add(2, 3) != 5 {\n\t\tpanic("add(2, 3) != 5")\n\t}\n}\n',
        'package main\n\nfunc add(a, b int) int { return a + b }\n\nfunc main() {\n\tif add(2, 3) != 6 {\n\t\tpanic("add(2, 3) != 6")\n\t}\n}\n',
        "panic: add(2, 3) != 6",
        "package main\n\nfunc main() { x := 1 }\n",
    ),
    "rust": (
        'fn main() { println!("hello"); }\n',
        "fn add(a: i32, b: i32) -> i32 { a + b }\nfn main() { assert_eq!(add(2, 3), 5); }\n",
        "fn add(a: i32, b: i32) -> i32 { a + b }\nfn main() { assert_eq!(add(2, 3), 6); }\n",
        "assertion failed: `(left == right)`",
        'fn main() { let x: i32 = "no"; }\n',
    ),
    "nodejs": (
        'console.log("hello")\n',
        "const assert = require('assert');\nfunction add(a, b) { return a + b; }\nassert.strictEqual(add(2, 3), 5);\n",
        "const assert = require('assert');\nfunction add(a, b) { return a + b; }\nassert.strictEqual(add(2, 3), 6);\n",
        "AssertionError",
        None,
    ),
    "typescript": (
        'const greeting: string = "hello";\nconsole.log(greeting);\n',
        "import * as assert from 'assert';\nfunction add(a: number, b: number): number { return a + b; }\n"
        "assert.strictEqual(add(2, 3), 5);\n",
        "import * as assert from 'assert';\nfunction add(a: number, b: number): number { return a + b; }\n"
        "assert.strictEqual(add(2, 3), 6);\n",
        "AssertionError",
        None,
    ),
}
COMPILED = {"c", "cpp", "java", "go", "rust"}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client():
    root = Path("/tmp") / f"temper-langs-{uuid.uuid4().hex[:8]}"
    # Compile caches of its own, made from nothing as on a new host: the first runs of each
    # language go without them, later ones with them.
    settings = SandboxSettings(
        pool_size=0, zygotes=4, default_limits=LIMITS, workspace_root=root, compile_cache=root / "langs"
    )
    worker = SandboxWorker(settings, worker_id="langs")
    await worker.start()
    app = create_app(worker=worker)
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://w", timeout=120
        ) as c:
            c.worker = worker  # type: ignore[attr-defined]
            yield c
    finally:
        await worker.close()
        shutil.rmtree(root, ignore_errors=True)
    assert worker.manager.leaked == 0


async def run(client: httpx.AsyncClient, language: str, code: str, **more: object) -> dict:
    r = await client.post("/run_code", json={"code": code, "language": language, **more})
    assert r.status_code == 200, r.text
    return r.json()


async def test_every_sandboxfusion_language_of_the_issue_is_served() -> None:
    assert {n.value for n in LanguageName} == set(PROGRAMS)


@pytest.mark.parametrize("language", list(PROGRAMS))
async def test_hello_a_passing_and_a_failing_test(client, language: str) -> None:
    hello, passing, failing, says, broken = PROGRAMS[language]
    r = await run(client, language, hello)
    assert r["status"] == "Success", r
    assert r["run_result"]["status"] == "Finished" and r["run_result"]["return_code"] == 0
    assert r["run_result"]["stdout"] == "hello\n"
    assert 0 < r["run_result"]["execution_time"] < 10
    if language in COMPILED:
        compiled = r["compile_result"]
        assert compiled["status"] == "Finished" and compiled["return_code"] == 0, compiled
        assert 0 < compiled["execution_time"] < 10
    else:
        assert r["compile_result"] is None  # as SandboxFusion: no compile step (TypeScript included)
    r = await run(client, language, passing)
    assert r["status"] == "Success" and r["run_result"]["return_code"] == 0, r
    r = await run(client, language, failing)
    assert r["status"] == "Failed", r
    assert r["run_result"]["status"] == "Finished" and r["run_result"]["return_code"] != 0
    assert says in r["run_result"]["stderr"], r["run_result"]["stderr"]
    if broken is not None:
        r = await run(client, language, broken)
        assert r["status"] == "Failed" and r["run_result"] is None, r
        compiled = r["compile_result"]
        assert compiled["status"] == "Finished" and compiled["return_code"] != 0
        source = client.worker.manager.languages[language].source  # type: ignore[attr-defined]
        assert source in compiled["stderr"], compiled  # the compiler's message names the file


async def test_stdin_files_and_fetch_in_a_compiled_language(client) -> None:
    code = (
        '#include <fstream>\n#include <iostream>\nint main() { int a; std::cin >> a; std::ifstream in("k.txt");'
        ' int k; in >> k; std::ofstream("out.txt") << a * k; std::cout << a + k << std::endl; }\n'
    )
    files = {"k.txt": base64.b64encode(b"6\n").decode()}
    r = await run(client, "cpp", code, stdin="7\n", files=files, fetch_files=["out.txt", "main"])
    assert r["status"] == "Success" and r["run_result"]["stdout"] == "13\n", r
    assert base64.b64decode(r["files"]["out.txt"]) == b"42"
    assert base64.b64decode(r["files"]["main"])[:4] == b"\x7fELF"  # the compiled program was in the workspace


async def test_run_tests_compiles_code_and_tests_as_one_program(client) -> None:
    """Temper's own route: the solution and its tests as one program of the language;
    passed only when it compiled and exited 0; a compile error is the result (nothing ran)."""
    solution = "fn add(a: i32, b: i32) -> i32 { a + b }\n"
    for tests, passed in (
        ("fn main() { assert_eq!(add(2, 3), 5); }", True),
        ("fn main() { assert_eq!(add(2, 3), 6); }", False),
    ):
        r = await client.post("/v1/run_tests", json={"code": solution, "tests": tests, "language": "rust"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["passed"] is passed and body["compile"]["exit_code"] == 0, body
        assert body["result"]["exit_code"] == (0 if passed else 101), body["result"]
    r = await client.post(
        "/v1/run_tests", json={"code": solution, "tests": "fn main() { add(1) }", "language": "rust"}
    )
    body = r.json()
    assert (
        body["passed"] is False and body["result"] == body["compile"] and body["result"]["exit_code"] != 0
    ), body
    assert "main.rs" in body["result"]["stderr"]


async def test_the_jvm_and_node_get_their_heap_from_the_runs_limit(client) -> None:
    """A heap sized from the host's memory would let these grow until the cgroup kills
    them; sized from the limit, each program meets its own language's error."""
    java = (
        "import java.util.*;\npublic class Main { public static void main(String[] a) {\n"
        "  List<byte[]> keep = new ArrayList<>();\n  while (true) keep.add(new byte[1 << 20]);\n} }\n"
    )
    r = await run(client, "java", java, memory_limit_MB=256)
    assert r["run_result"]["status"] == "Finished" and r["run_result"]["return_code"] == 1, r
    assert "java.lang.OutOfMemoryError: Java heap space" in r["run_result"]["stderr"]
    assert r["run_result"]["kill_reason"] is None
    node = "const keep = []; while (true) keep.push(new Array(1 << 16).fill(1.5));\n"
    for language in ("nodejs", "typescript"):
        r = await run(client, language, node, memory_limit_MB=256)
        assert r["run_result"]["status"] == "Finished" and r["run_result"]["return_code"] != 0, r
        assert "JavaScript heap out of memory" in r["run_result"]["stderr"], r["run_result"]["stderr"][-500:]
        assert r["run_result"]["kill_reason"] in (None, "signal"), r  # Node aborts itself


async def test_a_compile_has_its_own_time_and_memory(client) -> None:
    # A constant evaluated at compile time for minutes: TimeLimitExceeded, nothing ran.
    slow = (
        "constexpr long f() { long s = 0; for (long i = 0; i < 100000; ++i)\n"
        "  for (long j = 0; j < 100000; ++j) s += i ^ j; return s; }\n"
        "constexpr long v = f();\nint main() { return v == 0; }\n"
    )
    r = await run(client, "cpp", slow, compile_timeout=1)
    assert r["status"] == "Failed" and r["run_result"] is None, r
    assert r["compile_result"]["status"] == "TimeLimitExceeded" and r["compile_result"]["return_code"] is None
    # The run's small memory limit does not starve the compile: javac gets its own.
    java = 'public class Main { public static void main(String[] a) { System.out.println("ok"); } }\n'
    r = await run(client, "java", java, memory_limit_MB=96)
    assert r["compile_result"]["return_code"] == 0, r["compile_result"]
    worker = client.worker  # type: ignore[attr-defined]
    assert worker.settings.compile_limits == CompileLimits()


async def test_a_python_traceback_names_the_users_file_and_no_frame_of_temper(client) -> None:
    r = await run(client, "python", "def f():\n    return 1 / 0\n\nf()\n")
    stderr = r["run_result"]["stderr"]
    assert stderr.startswith(
        'Traceback (most recent call last):\n  File "/workspace/main.py", line 4, in <module>'
    )
    assert "ZeroDivisionError: division by zero" in stderr and "agent" not in stderr, stderr
    r = await run(client, "python", "def (:\n")
    assert r["run_result"]["stderr"].startswith('  File "/workspace/main.py", line 1\n'), r["run_result"][
        "stderr"
    ]
    assert "SyntaxError" in r["run_result"]["stderr"] and "agent" not in r["run_result"]["stderr"]
    r = await run(client, "python", "import sys\nprint(__file__, sys.argv[0])\n")
    assert r["run_result"]["stdout"] == "/workspace/main.py /workspace/main.py\n"


async def test_typescript_strips_types_without_checking_them_as_sandboxfusion_does(client) -> None:
    r = await run(client, "typescript", 'const n: number = "not a number";\nconsole.log(n);\n')
    assert r["status"] == "Success" and r["run_result"]["stdout"] == "not a number\n", r
    r = await run(client, "typescript", "const x = ;\n")
    assert r["status"] == "Failed" and "error TS" in r["run_result"]["stderr"], r


async def test_compiled_programs_are_killed_by_the_runs_time_and_memory_limits(client) -> None:
    """A compiled program gets the same limits and kill reasons as Python: its time runs
    out (TimeLimitExceeded, no exit status) or the cgroup kills it for memory (Finished,
    -SIGKILL, reason memory: its program failed, the sandbox did not)."""
    spin = {
        "c": "int main(void) { volatile unsigned long i = 0; for (;;) ++i; }\n",
        "go": "package main\n\nfunc main() {\n\tfor i := 0; ; i++ {\n\t}\n}\n",
        "rust": "fn main() { let mut i: u64 = 1; while i != 0 { i = i.wrapping_add(1); } }\n",
    }
    for language, code in spin.items():
        r = await run(client, language, code, run_timeout=1)
        assert r["status"] == "Failed" and r["compile_result"]["return_code"] == 0, r["compile_result"][
            "stderr"
        ]
        ran = r["run_result"]
        assert ran["status"] == "TimeLimitExceeded" and ran["return_code"] is None, (language, ran)
        assert ran["kill_reason"] in ("timeout", "cpu"), (language, ran)
        assert f"killed: {ran['kill_reason']}" in r["message"]
    # 256 MB touched page by page under a 64 MB limit: the cgroup's kill, not malloc's NULL.
    hog = (
        "#include <stdio.h>\n#include <stdlib.h>\n#include <string.h>\n"
        "int main(void) { for (int i = 0; i < 64; ++i) { char *p = malloc(4 << 20);"
        ' if (!p) return 3; memset(p, 1, 4 << 20); } puts("survived"); }\n'
    )
    r = await run(client, "c", hog, memory_limit_MB=64)
    assert r["status"] == "Failed" and "survived" not in r["run_result"]["stdout"], r
    assert r["run_result"]["status"] == "Finished" and r["run_result"]["return_code"] == -9, r
    assert r["run_result"]["kill_reason"] == "memory" and "killed: memory" in r["message"], r


async def test_a_language_whose_toolchain_is_missing_is_refused_naming_it(client, monkeypatch) -> None:
    """Every toolchain scripts/setup_system.sh installs is there (the tests above ran
    them); one taken away is a 422 naming ``language`` and the package, before any run,
    on both routes, and the worker goes on serving."""
    worker = client.worker  # type: ignore[attr-defined]
    go = worker.manager.languages[LanguageName.go]
    assert go.missing() == []
    monkeypatch.setattr(type(go), "version", ("/usr/bin/no-such-go", "version"))
    assert go.missing() == ["/usr/bin/no-such-go"]
    for route, body in (
        ("/run_code", {"code": PROGRAMS["go"][0], "language": "go"}),
        ("/v1/run_tests", {"code": PROGRAMS["go"][0], "language": "go"}),
    ):
        r = await client.post(route, json=body)
        assert r.status_code == 422, (route, r.text)
        (detail,) = r.json()["detail"]
        assert detail["loc"] == ["body", "language"], detail
        assert detail["msg"].startswith("language go is not installed: /usr/bin/no-such-go missing"), detail
        assert "golang-go" in detail["msg"]
    monkeypatch.undo()
    r = await run(client, "go", PROGRAMS["go"][0])
    assert r["status"] == "Success" and r["run_result"]["stdout"] == "hello\n", r


async def test_compile_caches_are_made_once_and_read_only_to_every_run(client) -> None:
    """Each cache is made in the background on first need (the tests above needed them)
    and bound read-only: a run can read it, cannot change what the next run's compiler
    uses, and a program compiled or run with it gives the same answers."""
    manager = client.worker.manager  # type: ignore[attr-defined]
    caches = manager.compile_caches
    wanted = {"cpp": 1024, "java": 1024, "go": 1024, "typescript": LIMITS.memory_mb}
    deadline = asyncio.get_running_loop().time() + 150
    made: dict[str, str] = {}
    while len(made) < len(wanted):
        for cache, memory_mb in wanted.items():
            where = caches.ready(cache, manager.spawn_background, memory_mb=memory_mb)
            if where is not None:
                made[cache] = where
        assert caches.failed == {}, caches.failed
        assert asyncio.get_running_loop().time() < deadline, f"caches not made: {set(wanted) - set(made)}"
        await asyncio.sleep(0.5)
    assert all(where.startswith(SANDBOX_CACHE + "/") for where in made.values()), made
    listing = f"awk '$5 == \"{SANDBOX_CACHE}\" {{print $6}}' /proc/self/mountinfo; ls {SANDBOX_CACHE}"
    r = await run(client, "bash", f"{listing}; touch {made['cpp']}/x 2>&1 || echo refused")
    lines = r["run_result"]["stdout"].splitlines()
    assert lines[0].split(",")[0] == "ro", lines  # the bind's own mount options
    assert {posixpath.basename(where) for where in made.values()} <= set(lines[1:]), lines
    assert lines[-1] == "refused" and "Read-only file system" in lines[-2], lines
    for language in ("cpp", "java", "go", "typescript"):
        r = await run(client, language, PROGRAMS[language][1])  # the passing test, with its cache ready now
        assert r["status"] == "Success", (language, r)
        r = await run(client, language, PROGRAMS[language][2])
        assert r["status"] == "Failed" and PROGRAMS[language][3] in r["run_result"]["stderr"], (language, r)
