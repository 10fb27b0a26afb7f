"""Temper's ``POST /run_code`` as verl's ``sandbox_fusion`` reward code uses SandboxFusion, over
real HTTP on the real bwrap backend.

The requests have the shape verl sends (its ``verl/utils/reward_score/sandbox_fusion/utils.py``,
read at volcengine/verl b178a3c): a JSON body of ``compile_timeout``, ``run_timeout``
(both verl's one ``timeout``), ``code``, ``stdin`` (a string, or null), ``memory_limit_MB``
(verl's default 1024), ``language``, ``files: {}`` and ``fetch_files: []``, with
``Content-Type`` and ``Accept`` both ``application/json``, many at once from a thread pool.
:func:`verdict` is this test's own reading of an answer by the rules verl applies (any HTTP
error is an API error; ``SandboxError`` a sandbox error; ``Failed`` with a compile step that
timed out, errored or exited non-zero a compile error, else a run that timed out, errored or
exited non-zero a timeout or runtime error; ``Success`` with a ``Finished`` run compared with
the expected stdout, trailing newlines dropped), and verl's tool reads ``stdout + stderr`` of a
finished run, so both must be strings."""

from __future__ import annotations

import asyncio
import http.client
import json
import shutil
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import uvicorn

from services.sandbox_worker.app import create_app
from services.sandbox_worker.worker import SandboxWorker
from temper.sandbox import SandboxLimits, SandboxSettings

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(240), pytest.mark.asyncio(loop_scope="module")]

TIMEOUT = 10  # verl's DEFAULT_TIMEOUT: the compile's and the run's
MEMORY_MB = 1024  # verl's default memory_limit_mb


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def port(unused_tcp_port_factory) -> AsyncIterator[int]:
    root = Path("/tmp") / f"temper-fusion-{uuid.uuid4().hex[:8]}"
    limits = SandboxLimits(wall_s=10, cpu_s=10, memory_mb=2048, pids=128, workspace_mb=64)
    worker = SandboxWorker(
        SandboxSettings(pool_size=0, zygotes=4, default_limits=limits, workspace_root=root)
    )
    await worker.start()
    number = unused_tcp_port_factory()
    server = uvicorn.Server(
        uvicorn.Config(create_app(worker=worker), host="127.0.0.1", port=number, log_config=None)
    )
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not serving.done(), "the worker's HTTP server did not start"
            await asyncio.sleep(0.02)
        yield number
    finally:
        server.should_exit = True
        await serving
        await worker.close()
        shutil.rmtree(root, ignore_errors=True)
    assert worker.manager.leaked == 0


def post(port: int, code: str, stdin: str | None, language: str, timeout: int = TIMEOUT,
         memory_mb: int = MEMORY_MB) -> tuple[int, Any]:  # fmt: skip
    """One request as verl makes it: (HTTP status, the decoded JSON answer)."""
    body = json.dumps({
        "compile_timeout": timeout, "run_timeout": timeout, "code": code, "stdin": stdin,
        "memory_limit_MB": memory_mb, "language": language, "files": {}, "fetch_files": [],
    })  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2 * timeout + 10)
    try:
        conn.request(
            "POST", "/run_code", body, {"Content-Type": "application/json", "Accept": "application/json"}
        )
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def verdict(status: int, answer: Any, expected: str | None) -> str:
    """What verl makes of an answer (see the module's doc)."""
    if status >= 400:
        return "api_error"
    run, comp = answer.get("run_result"), answer.get("compile_result")
    if answer["status"] == "SandboxError":
        return "sandbox_error"
    if answer["status"] == "Failed":
        if comp and (comp["status"] in ("Error", "TimeLimitExceeded") or comp["return_code"] != 0):
            return "compile_timeout" if comp["status"] == "TimeLimitExceeded" else "compile_error"
        if run:
            if run["status"] == "TimeLimitExceeded":
                return "timeout"
            if run["status"] == "Error" or run["return_code"] != 0:
                return "runtime_error"
            return "unknown_failure"
        return "unknown_failure_state"
    if answer["status"] == "Success":
        if not run or run["status"] != "Finished":
            return "unexpected_success_state"
        out = run["stdout"] if run["stdout"] is not None else ""
        return "success" if expected is None or out.rstrip("\n") == expected.rstrip("\n") else "wrong_answer"
    return f"unknown_api_status_{answer['status']}"


async def ask(port: int, code: str, stdin: str | None, language: str, expected: str | None,
              **more: int) -> tuple[str, Any]:  # fmt: skip
    status, answer = await asyncio.to_thread(post, port, code, stdin, language, **more)
    found = verdict(status, answer, expected)
    if status == 200 and answer.get("run_result") and answer["run_result"]["status"] == "Finished":
        run = answer["run_result"]
        assert isinstance(run["stdout"] + run["stderr"], str)  # what verl's code tool reads
    return found, answer


# Programs that read two numbers from stdin and print their sum, as verl's stdin/stdout cases do.
SUM = {
    "python": "a, b = map(int, open(0).read().split())\nprint(a + b)\n",
    "cpp": "#include <iostream>\nint main() { long a, b; std::cin >> a >> b; std::cout << a + b << std::endl; }\n",
    "java": "import java.util.*;\npublic class Main {\n  public static void main(String[] x) {\n"
    "    Scanner s = new Scanner(System.in);\n    System.out.println(s.nextLong() + s.nextLong());\n  }\n}\n",
    "go": 'package main\n\nimport "fmt"\n\nfunc main() {\n\tvar a, b int\n\tfmt.Scan(&a, &b)\n\tfmt.Println(a + b)\n}\n',
    "rust": "use std::io::Read;\nfn main() {\n    let mut s = String::new();\n    std::io::stdin().read_to_string(&mut s).unwrap();\n"
    "    let v: Vec<i64> = s.split_whitespace().map(|x| x.parse().unwrap()).collect();\n"
    '    println!("{}", v[0] + v[1]);\n}\n',
    "nodejs": "const [a, b] = require('fs').readFileSync(0, 'utf8').trim().split(/\\s+/).map(Number);\nconsole.log(a + b);\n",
    "typescript": "declare var require: any;\nconst text: string = require('fs').readFileSync(0, 'utf8');\n"
    "const [a, b] = text.trim().split(/\\s+/).map(Number);\nconsole.log(a + b);\n",
    "bash": "read a b\necho $(( a + b ))\n",
}


@pytest.mark.parametrize("language", list(SUM))
async def test_stdin_cases_are_success_or_wrong_answer_in_every_language(port, language):
    found, answer = await ask(port, SUM[language], "40 2\n", language, "42")
    assert found == "success", answer
    assert answer["run_result"]["stdout"] == "42\n" and answer["run_result"]["return_code"] == 0
    assert isinstance(answer["run_result"]["execution_time"], float)
    if language in ("cpp", "java", "go", "rust"):
        assert (
            answer["compile_result"]["status"] == "Finished" and answer["compile_result"]["return_code"] == 0
        )
        assert isinstance(answer["compile_result"]["execution_time"], float)
    else:
        assert answer["compile_result"] is None
    found, _ = await ask(port, SUM[language], "1 1\n", language, "42")
    assert found == "wrong_answer"


async def test_assert_cases_run_as_code_plus_assert_with_no_stdin(port):
    """verl's ``assert_case`` form: the generation, two newlines, the assert; stdin "" and
    no expected output, so a finished run that exits 0 is a pass."""
    generation = "def add(a, b):\n    return a + b\n"
    found, _ = await ask(port, generation + "\n\n" + "assert add(2, 3) == 5", "", "python", None)
    assert found == "success"
    found, answer = await ask(port, generation + "\n\n" + "assert add(2, 3) == 6", "", "python", None)
    assert found == "runtime_error"
    assert answer["run_result"]["return_code"] == 1 and "AssertionError" in answer["run_result"]["stderr"]


async def test_a_function_call_wrapper_with_json_arguments_on_stdin(port):
    """verl wraps a ``fn_name`` case in a program that reads one JSON argument per stdin line,
    calls the function (or ``Solution().fn``) and prints the JSON result: this is such a
    program, written for this test."""
    wrapper = (
        "import json, sys\n"
        "class Solution:\n    def twoSum(self, nums, target):\n"
        "        seen = {}\n        for i, n in enumerate(nums):\n"
        "            if target - n in seen:\n                return [seen[target - n], i]\n"
        "            seen[n] = i\n"
        "args = [json.loads(line) for line in sys.stdin.read().split('\\n') if line.strip()]\n"
        "print(json.dumps(getattr(Solution(), 'twoSum')(*args)))\n"
    )
    found, _ = await ask(port, wrapper, "[2, 7, 11, 15]\n9", "python", "[0, 1]")
    assert found == "success"


async def test_failures_as_verl_tells_them_apart(port):
    found, answer = await ask(port, "def f(:\n    pass\n", None, "python", None)  # stdin null
    assert found == "runtime_error"
    assert answer["run_result"]["stderr"].startswith('  File "/workspace/main.py", line 1')  # the user's file
    assert "agent" not in answer["run_result"]["stderr"]
    found, answer = await ask(port, "raise ValueError('bad input')\n", "", "python", None)
    assert found == "runtime_error" and answer["run_result"]["stderr"].startswith(
        "Traceback (most recent call last):"
    )
    found, answer = await ask(port, "while True:\n    pass\n", "", "python", None, timeout=1)
    assert found == "timeout"
    assert answer["run_result"]["return_code"] is None and 0.9 < answer["run_result"]["execution_time"] < 3
    found, answer = await ask(port, "x = bytearray(200 << 20)\n", "", "python", None, memory_mb=64)
    assert found == "runtime_error"  # SandboxFusion's answer too: run Finished, rc 1, MemoryError
    assert answer["status"] == "Failed" and answer["run_result"]["status"] == "Finished"
    assert answer["run_result"]["return_code"] == 1 and answer["run_result"]["stderr"].rstrip().endswith(
        "MemoryError"
    )
    found, answer = await ask(port, "int main() { return undefined_name; }\n", "", "cpp", None)
    assert found == "compile_error" and answer["run_result"] is None
    assert "undefined_name" in answer["compile_result"]["stderr"]
    found, answer = await ask(
        port, 'fn main() { let v: Vec<i32> = vec![]; println!("{}", v[1]); }\n', "", "rust", None
    )
    assert found == "runtime_error" and answer["run_result"]["return_code"] == 101


async def test_languages_sandboxfusion_does_not_name_are_http_errors(port):
    for language in ("python3", "cobol"):
        found, answer = await ask(port, "print(1)", "", language, None)
        assert found == "api_error" and answer["detail"][0]["loc"] == ["body", "language"]


async def test_many_requests_at_once_from_a_thread_pool(port):
    """verl sends every case of a batch at once (a pool of max(32, 5 × CPUs) threads)."""
    cases = [
        (lang, f"{n} {n}\n", str(2 * n)) for n in range(4) for lang in ("python", "cpp", "nodejs", "bash")
    ]

    def batch() -> list[tuple[int, Any]]:  # in a thread: the server runs on this test's loop
        with ThreadPoolExecutor(max_workers=32) as pool:
            futures = [pool.submit(post, port, SUM[lang], stdin, lang) for lang, stdin, _ in cases]
            return [f.result() for f in futures]

    answers = await asyncio.to_thread(batch)
    found = [
        verdict(status, answer, want) for (status, answer), (_, _, want) in zip(answers, cases, strict=True)
    ]
    assert found == ["success"] * len(cases), [a for _, a in answers]
