"""Where the time of ``temper run`` goes: runs one embedded job in this process with a
sampling profiler beside it, and writes what each part of the process used.

The event loop's thread is measured exactly: every callback it runs (a task's step, a
future's callback) is timed with the thread's CPU clock and charged to the part of the
code it ran: for a task, the innermost coroutine of the chain it is suspended in when
the step ends; what the thread uses outside callbacks is "event loop (selector, scheduling)".
The other threads (the runner's, the trainer's ``to_thread`` workers, aiosqlite's) are
sampled: every ``--interval-ms`` a thread of its own reads each one's stack
(``sys._current_frames``; these threads mostly sit in torch or SQLite with the GIL
released, so a sample finds them where they work) and its CPU clock
(``time.pthread_getcpuclockid``), and charges the CPU it used since the last sample to
the part its stack is in. In both, the innermost frame of a known file decides
(``PARTS``: SQLAlchemy under the scheduler is the database, the scheduler's own code is
the scheduler). The processes the run starts (the engine's, apart; sandboxes, zygotes, the
harness's runs) are read from ``/proc`` through ``psutil`` every half second. Only what falls between the job's first episode and its
last trained version counts (the window ``bench/learn.py`` calls the RL time).

    python bench/learn_profile.py SPEC RUNS_DIR RUN_ID OUT.json [--interval-ms 5]

Used by ``python bench/learn.py --profile``; its table goes into docs/training.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "libs")]

# (part, path fragments or function names); the first part whose fragment is in the
# innermost matching frame's file (or whose name is that frame's function) wins.
PARTS: list[tuple[str, tuple[str, ...]]] = [
    ("generation", ("inference_gateway/cpu_server/",)),
    ("checkpoints", ("temper/registry", "publish_version", "save_checkpoint", "trainer/publishing", "safetensors/")),
    ("trainer step", ("temper/training/", "torch/optim/", "torch/autograd/")),
    ("sandbox session/action", ("temper/sandbox/", "services/sandbox_worker/")),
    ("scoring", ("temper/rewards/", "services/reward_scorer/")),
    ("database", ("sqlalchemy/", "aiosqlite/", "sqlite3/", "temper/db/")),
    ("in-process bus, outbox", ("temper/bus/", "temper/outbox")),
    ("scheduler", ("dispatcher/scheduler.py", "dispatcher/sampling.py", "dispatcher/fairshare.py",
                   "dispatcher/placement.py", "dispatcher/leader.py")),
    ("episodes (dispatcher)", ("services/dispatcher/",)),
    ("gateway", ("services/inference_gateway/",)),
    ("trainer (other)", ("services/trainer/",)),
    ("logs, metrics", ("logging/", "temper/logs", "prometheus_client/")),
    ("object store", ("temper/storage/",)),
    ("progress display, report", ("services/embedded/", "temper/cli/")),
]  # fmt: skip
IDLE = ("selectors.py", "threading.py", "queue.py")
# The policy's engine in a child process (local.engine: process): its CPU is generation.
ENGINE_MODULE = "services.inference_gateway.cpu_server"
ENGINE_PART = "generation (the engine's process)"


SHARED = ("database", "logs, metrics", "object store", "in-process bus, outbox")


def _known(code: CodeType) -> str | None:
    path = code.co_filename.replace("\\", "/")
    for part, marks in PARTS:
        if any(m in path or m == code.co_name for m in marks):
            return part
    return None


def part_of_codes(codes: list[CodeType], *, caller: bool = False) -> str | None:
    """The part of the innermost code (first in ``codes``) of a known file, or None. With
    ``caller``, a part every other part uses (the database, logs, the object store, the bus)
    is named with the first other part outward that called it: "database <- scheduler"."""
    found = None
    for code in codes:
        part = _known(code)
        if part is None:
            continue
        if found is None:
            found = part
            if not caller or part not in SHARED:
                return part
        elif part != found and part not in SHARED:
            return f"{found} <- {part}"
    return found


def part_of(frame: FrameType | None) -> str:
    """The part of ``frame``'s stack (innermost frames first); "waiting" for a thread that
    sits in a selector, a lock or a queue; "other" when no frame is known."""
    codes = []
    innermost = frame
    while frame is not None:
        codes.append(frame.f_code)
        frame = frame.f_back
    part = part_of_codes(codes)
    if part is not None:
        return part
    if innermost is not None and innermost.f_code.co_filename.endswith(IDLE):
        return "waiting"
    return "other"


def _awaited_codes(coro: Any) -> list[CodeType]:
    """The codes of a suspended coroutine's await chain, innermost first."""
    codes: list[CodeType] = []
    while coro is not None and len(codes) < 200:
        code = (
            getattr(coro, "cr_code", None) or getattr(coro, "gi_code", None) or getattr(coro, "ag_code", None)
        )
        if code is not None:
            codes.append(code)
        coro = (
            getattr(coro, "cr_await", None)
            or getattr(coro, "gi_yieldfrom", None)
            or getattr(coro, "ag_await", None)
        )
    return codes[::-1]


class LoopMeter:
    """CPU of the event loop's thread by part: each callback timed and charged."""

    def __init__(self) -> None:
        self.used: dict[str, float] = defaultdict(float)
        self.ident = 0
        self._orig: Any = None

    def install(self) -> None:
        self._orig = asyncio.events.Handle._run
        orig, used, clock = self._orig, self.used, time.thread_time

        def timed(handle: asyncio.Handle) -> None:
            c0 = clock()
            try:
                orig(handle)
            finally:
                used[_part_of_handle(handle)] += clock() - c0

        asyncio.events.Handle._run = timed  # type: ignore[method-assign]

    def uninstall(self) -> None:
        if self._orig is not None:
            asyncio.events.Handle._run = self._orig  # type: ignore[method-assign]


def _part_of_handle(handle: asyncio.Handle) -> str:
    callback = handle._callback  # type: ignore[attr-defined]
    owner = getattr(callback, "__self__", None)
    if isinstance(owner, asyncio.Task):
        part = part_of_codes(_awaited_codes(owner.get_coro()), caller=True)
    else:
        code = getattr(getattr(callback, "__func__", callback), "__code__", None)
        part = part_of_codes([code]) if code is not None else None
    return part or "other (event loop)"


class Sampler:
    """CPU seconds by part, in time buckets of the sampling interval (so a window can be cut
    out afterwards), and the CPU of child processes by half-second buckets."""

    def __init__(self, interval_s: float, loop: LoopMeter) -> None:
        self.interval_s = interval_s
        self.loop = loop
        self.ticks: list[tuple[float, dict[str, float]]] = []
        # (time, cumulative CPU of the engine's process, of every other child)
        self.children: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._clocks: dict[int, float] = {}
        self._loop_seen: dict[str, float] = {}
        self._loop_counted = 0.0
        self._thread = threading.Thread(target=self._run, name="learn-profiler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        proc = psutil.Process()
        next_children = 0.0
        while not self._stop.wait(self.interval_s):
            now = time.time()
            used: dict[str, float] = defaultdict(float)
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                if ident == self.loop.ident:  # measured by its callbacks; the rest is the loop's own
                    cpu = time.clock_gettime(time.pthread_getcpuclockid(ident))
                    before = self._clocks.get(ident, cpu)
                    self._clocks[ident] = cpu
                    counted = sum(self.loop.used.values())
                    for part, total in list(self.loop.used.items()):
                        used[part] += total - self._loop_seen.get(part, 0.0)
                        self._loop_seen[part] = total
                    used["event loop (selector, scheduling)"] += max(
                        0.0, (cpu - before) - (counted - self._loop_counted)
                    )
                    self._loop_counted = counted
                    continue
                try:
                    cpu = time.clock_gettime(time.pthread_getcpuclockid(ident))
                except OSError:  # the thread ended meanwhile
                    continue
                before = self._clocks.get(ident, cpu)
                self._clocks[ident] = cpu
                if cpu > before:
                    used[part_of(frame)] += cpu - before
            self.ticks.append((now, dict(used)))
            if now >= next_children:
                next_children = now + 0.5
                self.children.append((now, *self._children_cpu(proc)))

    @staticmethod
    def _children_cpu(proc: psutil.Process) -> tuple[float, float]:
        """CPU used so far by the processes this one started: the engine's (``local.engine:
        process``: the policy's generation), and every other (sandboxes, the harness's runs:
        the live ones with what they reaped of their own children, and those reaped here)."""
        own = os.times()
        engine, others = 0.0, own.children_user + own.children_system
        for child in proc.children(recursive=True):
            try:
                t = child.cpu_times()
                is_engine = ENGINE_MODULE in " ".join(child.cmdline())
            except psutil.Error:  # gone meanwhile: its parent has reaped it, or will
                continue
            used = t.user + t.system + t.children_user + t.children_system
            if is_engine:
                engine += used
            else:
                others += used
        return engine, others


def window(
    ticks: list[tuple[float, dict[str, float]]],
    children: list[tuple[float, float, float]],
    start: float,
    end: float,
) -> dict[str, float]:
    """CPU seconds by part between two unix times; the engine's process and the other child
    processes (sandboxes, scoring) over the same window."""
    total: dict[str, float] = defaultdict(float)
    for t, used in ticks:
        if start <= t <= end:
            for part, s in used.items():
                total[part] += s
    inside = [(engine, others) for t, engine, others in children if start <= t <= end]
    if len(inside) >= 2:
        total[ENGINE_PART] = inside[-1][0] - inside[0][0]
        total["sandbox and scoring processes"] = inside[-1][1] - inside[0][1]
    return dict(total)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec")
    ap.add_argument("runs_dir")
    ap.add_argument("run_id")
    ap.add_argument("out")
    ap.add_argument("--interval-ms", type=float, default=5.0)
    args = ap.parse_args()
    from services.embedded import runner

    meter = LoopMeter()
    meter.install()
    meter.ident = threading.get_ident()  # asyncio.run's loop runs in this thread
    sampler = Sampler(args.interval_ms / 1000, meter)
    sampler.start()
    result = asyncio.run(runner.run(Path(args.spec), runs_dir=Path(args.runs_dir), run_id=args.run_id))
    sampler.stop()
    meter.uninstall()
    out: dict[str, Any] = {
        "run_dir": str(result.run_dir),
        "state": result.state,
        "ticks": sampler.ticks,
        "children": sampler.children,
        "interval_s": sampler.interval_s,
        "pid": os.getpid(),
    }
    Path(args.out).write_text(json.dumps(out))
    from temper.runtime import exit_after_stop

    exit_after_stop(0 if result.state == "completed" else 1)


if __name__ == "__main__":
    main()
