"""Hello world in every language through ``POST /run_code`` (part of ``make bench-sandbox``):
requests per second at 4 clients and the median latency, for a compiled language with its
compile (each request compiles its program in a fresh run of its own, then runs it in
another), beside Python's, on one worker started with its default settings (bench/run_code.py's),
with the same plain keep-alive client. The compile caches are made before the figures are
taken (a first round of every language, not counted).

    python bench/languages.py            # prints the table; bench/sandbox.py merges the figures
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "libs"), str(ROOT)]

from bench import run_code  # noqa: E402

CLIENTS = 4
HELLO: dict[str, str] = {
    "python": "print('hello')\n",
    "bash": "echo hello\n",
    "c": '#include <stdio.h>\nint main(void) { puts("hello"); return 0; }\n',
    "cpp": '#include <iostream>\nint main() { std::cout << "hello" << std::endl; }\n',
    "java": 'public class Main { public static void main(String[] a) { System.out.println("hello"); } }\n',
    "go": 'package main\n\nimport "fmt"\n\nfunc main() { fmt.Println("hello") }\n',
    "rust": 'fn main() { println!("hello"); }\n',
    "nodejs": "console.log('hello');\n",
    "typescript": "const greeting: string = 'hello';\nconsole.log(greeting);\n",
}
COMPILED = ("c", "cpp", "java", "go", "rust")


async def measure(requests: int = 80, compiled_requests: int = 16) -> dict[str, float | int]:
    """``run_code_rps_<language>`` and ``run_code_ms_<language>`` for every language, and the
    failures."""
    root = Path("/tmp") / f"temper-bench-langs-{uuid.uuid4().hex[:8]}"
    root.mkdir(parents=True)
    root.chmod(0o711)
    proc, base = run_code._start_worker(root / "w")
    out: dict[str, float | int] = {}
    failures = 0
    try:
        await run_code._wait_ready(base, proc)
        for language, code in HELLO.items():  # warm: toolchains in the page cache, the compile caches made
            for _ in range(3):
                await run_code._load(base, 1, 1, {"code": code, "language": language})
                await asyncio.sleep(0.5 if language in COMPILED else 0)
        for language, code in HELLO.items():
            n = compiled_requests if language in COMPILED else requests
            rps, latencies, failed = await run_code._load(
                base, CLIENTS, n, {"code": code, "language": language}
            )
            out[f"run_code_rps_{language}"] = round(rps, 2)
            out[f"run_code_ms_{language}"] = round(statistics.median(latencies), 1)
            failures += failed
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)
    out["run_code_languages_clients"] = CLIENTS
    out["run_code_languages_failed"] = failures
    return out


def table(res: dict[str, float | int]) -> list[tuple[str, str, str]]:
    python = float(res["run_code_rps_python"])
    return [
        (f"hello world, {language} ({CLIENTS} clients, req/s)", f"{res[f'run_code_rps_{language}']}",
         f"p50 {res[f'run_code_ms_{language}']} ms; {float(res[f'run_code_rps_{language}']) / python:.3f} of Python's"
         + ("; with its compile" if language in COMPILED else ""))
        for language in HELLO
    ]  # fmt: skip


def main() -> None:
    res = asyncio.run(measure())
    rows = table(res)
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>8}  {note}")
    print(f"failed requests: {res['run_code_languages_failed']}")


if __name__ == "__main__":
    main()
