"""Fault points: moments at which a chaos run can hold an operation until its process is
killed.

An adapter load, an optimizer step, a publish or a score takes 5-25 ms here, so a kill
timed from outside almost never lands inside one. The services mark those moments with a
one-line call, ``await faults.hold("trainer.publish", job_id=..., version=...)``, and a
chaos run (``tests/faults``) arms the point it wants to kill in:

- **Off** unless the process starts with ``TEMPER_FAULTS`` set to a directory. Then
  :func:`hold` is bound, when this module is imported, to a coroutine that returns at
  once: nothing is read or checked per call. ``TEMPER_FAULTS`` is not a setting; no route,
  message or setting reaches a fault point.
- **Armed**: with ``TEMPER_FAULTS=<dir>``, an operation that reaches point ``P`` while
  ``<dir>/P.arm`` exists writes ``<dir>/held/P.<pid>.<n>.json`` (its ids, how much work it
  carries, when it arrived) and waits until the arm file is gone, then goes on. The chaos
  run arms a point (:func:`arm`), waits for held operations (:func:`held`), kills the
  process, and disarms it (:func:`disarm`), which also lets go of anything still held.

:data:`POINTS` names every point and what is in flight while it holds.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

POINTS = {
    "sandbox.act": "a sandbox worker ran an agent's action in its session; no result or snapshot yet",
    "scorer.score": "the reward scorer computed a score; its record is not stored, its result not sent",
    "gateway.generate": "the gateway has a generation's tokens; its result is not tagged or sent",
    "gateway.load": "the gateway fetched a policy version and is about to load it on its backends",
    "trainer.step": "the trainer took an optimizer step; nothing of it is recorded or published",
    "trainer.publish": "the trainer uploaded a version's files; no row, no policy update yet",
    "dispatcher.batch": "the dispatcher took a batch of results in an open transaction; not committed",
}
POLL_S = 0.02

DIRECTORY = os.environ.get("TEMPER_FAULTS") or None
ON = DIRECTORY is not None
_serial = itertools.count()


async def _off(point: str, *, work: int = 1, **ids: Any) -> None:
    return None


async def _armed(point: str, *, work: int = 1, **ids: Any) -> None:
    """Hold while ``point`` is armed; ``work``: the units of work this operation carries
    (results in a batch, trajectories in a step)."""
    assert DIRECTORY is not None
    if point not in POINTS:
        raise ValueError(f"no fault point {point!r}; the points are {sorted(POINTS)}")
    root = Path(DIRECTORY)
    if not (root / f"{point}.arm").exists():
        return
    marker = root / "held" / f"{point}.{os.getpid()}.{next(_serial)}.json"
    marker.parent.mkdir(parents=True, exist_ok=True)
    doc = {"point": point, "pid": os.getpid(), "work": work, "at": time.time(), "ids": ids}
    marker.write_text(json.dumps(doc, default=str))
    try:
        while (root / f"{point}.arm").exists():  # noqa: ASYNC110 - the chaos run's process removes it
            await asyncio.sleep(POLL_S)
    finally:
        marker.unlink(missing_ok=True)


hold = _armed if ON else _off


# --- the chaos run's side ---------------------------------------------------------------------


def arm(directory: Path, point: str) -> None:
    """From now on, operations reaching ``point`` in processes started with
    ``TEMPER_FAULTS=directory`` wait until :func:`disarm`."""
    if point not in POINTS:
        raise ValueError(f"no fault point {point!r}; the points are {sorted(POINTS)}")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{point}.arm").write_text("")


def held(directory: Path, point: str) -> list[dict[str, Any]]:
    """The operations waiting at ``point`` now (one document each, see the module docstring)."""
    out = []
    for marker in sorted((directory / "held").glob(f"{point}.*.json")):
        try:
            out.append(json.loads(marker.read_text()))
        except (OSError, json.JSONDecodeError):  # released meanwhile, or being written
            continue
    return out


def disarm(directory: Path, point: str) -> None:
    """Let operations at ``point`` go on, and forget those of processes that died holding."""
    (directory / f"{point}.arm").unlink(missing_ok=True)
    for marker in (directory / "held").glob(f"{point}.*.json"):
        pid = int(marker.name.split(".")[-3])
        if not _alive(pid):
            marker.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
