"""Control groups for sandboxes: memory, pids and CPU accounting, and total kill.

Works with cgroup v2 (unified hierarchy) or v1 (one hierarchy per controller),
whichever the host mounts, detected at runtime. Every sandbox gets its own group
under ``<the worker's own group>/temper-<worker pid>/``; groups left by a worker that
died are swept when the next one starts.

A write the kernel refuses is an error (:class:`CgroupError`), never ignored: a memory
limit that did not take would leave the sandbox with the one before it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "cpuacct", "freezer")


class CgroupError(OSError):
    """The kernel refused a cgroup write (a limit below what the group already uses, a
    freeze that did not take): the group does not have the state asked for."""


@dataclass
class CgroupStats:
    cpu_ns: int = 0
    peak_bytes: int = 0
    oom_kills: int = 0
    pids_max_events: int = 0


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _write(path: Path, value: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError as e:
        code = e.errno or 0
        raise CgroupError(code, f"cannot write {value!r} to {path}: {os.strerror(code)}") from e


def _keyed(text: str, key: str) -> int:
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            return int(parts[1])
    return 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class Cgroup(ABC):
    """One sandbox's group."""

    name: str
    _fds: dict[Path, int] | None

    def _get(self, path: Path) -> str:
        """A counter file's contents, through a descriptor kept open (a read at offset 0
        renders it anew): read twice or more per action, and opening by path cost more
        than the read. Never ``cgroup.procs``: v1 caches its pid list per open file, so a
        kept descriptor would read pids that are gone (and may be reused)."""
        fds = self._fds
        if fds is None:  # closed: the group is being removed
            return _read(path)
        fd = fds.get(path)
        try:
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            return os.pread(fd, 1 << 16, 0).decode()
        except OSError:
            return ""

    def _close_files(self) -> None:
        fds, self._fds = self._fds, None  # one swap: a reader on another thread opens no more
        for fd in (fds or {}).values():
            os.close(fd)

    @abstractmethod
    def join_paths(self) -> list[str]:
        """``cgroup.procs`` files a new process writes ``0`` to, to enter the group."""

    @abstractmethod
    def set_limits(self, *, memory_bytes: int, pids: int) -> None: ...

    @abstractmethod
    def procs(self) -> list[int]: ...

    @abstractmethod
    def stats(self) -> CgroupStats: ...

    @abstractmethod
    def reset_peak(self) -> None: ...

    @abstractmethod
    def resident_bytes(self) -> int:
        """Memory the group holds that it cannot give back without swap: anonymous memory
        and shared memory (tmpfs, SysV and POSIX shm), from ``memory.stat``. Not the usage
        counter, which counts page cache too (reclaimed under pressure, so no leak)."""

    @abstractmethod
    def _freeze(self, frozen: bool) -> None: ...

    @abstractmethod
    def _remove_dirs(self) -> bool: ...

    def kill_except(self, keep: set[int], spare: Callable[[int], bool] | None = None) -> int:
        """SIGKILL every process in the group but ``keep`` (and those ``spare`` says to
        keep). The group is frozen while the list is read and the signals sent, so a fork
        bomb cannot race the kill."""
        killed = 0

        def doomed() -> list[int]:
            return [p for p in self.procs() if p not in keep and not (spare and spare(p))]

        if keep and not doomed():
            return 0  # the common case after an action: nothing to freeze
        for _ in range(20):
            self._freeze(True)
            try:
                victims = doomed()
                for pid in victims:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        killed += 1
                    except ProcessLookupError:
                        pass
            finally:
                self._freeze(False)
            if not victims:
                return killed
            # Killed processes leave the group as they exit, a moment after the thaw:
            # look again soon rather than freezing for another round straight away.
            for _ in range(10):
                time.sleep(0.0002)
                if not doomed():
                    return killed
        return killed

    def destroy(self, timeout_s: float = 5.0) -> int:
        """Kill everything in the group and remove it. Returns how many processes were
        still alive when the timeout passed (0 unless something is badly wrong)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.kill_except(set())
            except CgroupError as e:  # no freeze: kill anyway, and count what survives
                log.error("cgroup %s: %s", self.name, e)
                for pid in self.procs():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            left = self.procs()
            if not left:
                self._close_files()
                if self._remove_dirs():
                    return 0
            if time.monotonic() > deadline:
                log.error("cgroup %s: %d processes survived the kill", self.name, len(left))
                self._close_files()
                return len(left)
            time.sleep(0.0005)


class CgroupV2(Cgroup):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = path.name
        self._fds = {}

    def join_paths(self) -> list[str]:
        return [str(self.path / "cgroup.procs")]

    def set_limits(self, *, memory_bytes: int, pids: int) -> None:
        _write(self.path / "memory.max", str(memory_bytes))
        # Below the usage, the write reclaims and OOM-kills what it can and then succeeds
        # even if what is left (shared memory no process holds) does not fit.
        current = int(_read(self.path / "memory.current").strip() or 0)
        if current > memory_bytes:
            raise CgroupError(
                errno.EBUSY, f"{self.path}: {current} bytes in use, above the new memory.max {memory_bytes}"
            )
        if (self.path / "memory.swap.max").exists():  # only with swap accounting
            _write(self.path / "memory.swap.max", "0")
        _write(self.path / "pids.max", str(pids))

    def resident_bytes(self) -> int:
        stat = self._get(self.path / "memory.stat")
        return _keyed(stat, "anon") + _keyed(stat, "shmem")

    def procs(self) -> list[int]:
        return [int(p) for p in _read(self.path / "cgroup.procs").split()]

    def stats(self) -> CgroupStats:
        return CgroupStats(
            cpu_ns=_keyed(self._get(self.path / "cpu.stat"), "usage_usec") * 1000,
            peak_bytes=int(self._get(self.path / "memory.peak").strip() or 0),
            oom_kills=_keyed(self._get(self.path / "memory.events"), "oom_kill"),
            pids_max_events=_keyed(self._get(self.path / "pids.events"), "max"),
        )

    def reset_peak(self) -> None:
        pass  # memory.peak is reset per open fd only; v2 reports the sandbox's lifetime peak

    def _freeze(self, frozen: bool) -> None:
        _write(self.path / "cgroup.freeze", "1" if frozen else "0")
        if frozen:
            for _ in range(500):
                if "frozen 1" in _read(self.path / "cgroup.events"):
                    return
                time.sleep(0.0002)

    def destroy(self, timeout_s: float = 5.0) -> int:
        if (self.path / "cgroup.kill").exists():  # Linux 5.14 and later
            with contextlib.suppress(CgroupError):  # the freeze-and-kill below still runs
                _write(self.path / "cgroup.kill", "1")
        return super().destroy(timeout_s)

    def _remove_dirs(self) -> bool:
        try:
            self.path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            return False


class CgroupV1(Cgroup):
    def __init__(self, paths: dict[str, Path], name: str) -> None:
        self.paths = paths
        self.name = name
        self._fds = {}
        # the counter files read around every action (paths made once, not per read)
        mem = paths["memory"]
        self._cpu = paths["cpuacct"] / "cpuacct.usage"
        self._peak = mem / "memory.max_usage_in_bytes"
        self._oom = mem / "memory.oom_control"
        self._stat = mem / "memory.stat"
        self._pids_events = paths["pids"] / "pids.events"

    def join_paths(self) -> list[str]:
        return [str(p / "cgroup.procs") for p in self.paths.values()]

    def set_limits(self, *, memory_bytes: int, pids: int) -> None:
        """Raises CgroupError when the kernel refuses a value: on v1, a memory limit below
        the group's usage that reclaim cannot reach (``EBUSY``) leaves the old limit."""
        mem = self.paths["memory"]
        # memsw must stay >= the memory limit: order the two writes by direction.
        cur = int(_read(mem / "memory.limit_in_bytes").strip() or 0)
        files = ["memory.limit_in_bytes"]
        if (mem / "memory.memsw.limit_in_bytes").exists():  # only with swap accounting
            files.append("memory.memsw.limit_in_bytes")
        if memory_bytes > cur:
            files.reverse()
        for f in files:
            _write(mem / f, str(memory_bytes))
        _write(mem / "memory.swappiness", "0")
        _write(self.paths["pids"] / "pids.max", str(pids))

    def resident_bytes(self) -> int:
        stat = self._get(self._stat)
        return _keyed(stat, "total_rss") + _keyed(stat, "total_shmem")

    def procs(self) -> list[int]:
        pids: set[int] = set()
        for p in self.paths.values():
            pids.update(int(x) for x in _read(p / "cgroup.procs").split())
        return sorted(pids)

    def stats(self) -> CgroupStats:
        return CgroupStats(
            cpu_ns=int(self._get(self._cpu).strip() or 0),
            peak_bytes=int(self._get(self._peak).strip() or 0),
            oom_kills=_keyed(self._get(self._oom), "oom_kill"),
            pids_max_events=_keyed(self._get(self._pids_events), "max"),
        )

    def reset_peak(self) -> None:
        _write(self._peak, "0")

    def _freeze(self, frozen: bool) -> None:
        path = self.paths["freezer"]
        _write(path / "freezer.state", "FROZEN" if frozen else "THAWED")
        if frozen:
            for _ in range(500):
                if _read(path / "freezer.state").strip() == "FROZEN":
                    return
                time.sleep(0.0002)

    def _remove_dirs(self) -> bool:
        ok = True
        for p in self.paths.values():
            try:
                p.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                ok = False
        return ok


class CgroupManager(ABC):
    """Creates sandbox groups under this worker's parent group."""

    version: int

    @abstractmethod
    def create(self, name: str) -> Cgroup: ...

    @abstractmethod
    def parents(self) -> list[Path]:
        """The per-worker parent directories (for cleanup checks)."""

    def leftovers(self) -> list[Path]:
        return [
            child
            for parent in self.parents()
            if parent.exists()
            for child in parent.iterdir()
            if child.is_dir()
        ]

    def close(self) -> None:
        for parent in self.parents():
            try:
                parent.rmdir()
            except OSError:
                pass


def _own_paths() -> dict[str, str]:
    """controller (or '' for v2) -> this process's group path."""
    out: dict[str, str] = {}
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            out[""] = path
        for c in controllers.split(","):
            if c:
                out[c] = path
    return out


def _sweep_dead(parent_dir: Path, make: Callable[[str, str], Cgroup]) -> None:
    """Remove groups of workers that are gone (temper-<pid> whose pid is dead)."""
    if not parent_dir.exists():
        return
    for d in parent_dir.glob("temper-*"):
        try:
            pid = int(d.name.split("-", 1)[1])
        except ValueError:
            continue
        if pid == os.getpid() or _pid_alive(pid):
            continue
        for child in [c for c in d.iterdir() if c.is_dir()]:
            make(child.name, d.name).destroy(timeout_s=1.0)
        try:
            d.rmdir()
        except OSError:
            pass


class CgroupV2Manager(CgroupManager):
    version = 2

    def __init__(self) -> None:
        own = _own_paths().get("", "/")
        base = CGROUP_ROOT / own.lstrip("/")
        wanted = ("memory", "pids", "cpu")
        enabled = _read(base / "cgroup.subtree_control").split()
        if not all(c in enabled for c in wanted):
            # "No internal processes": a group with processes cannot hand controllers down.
            # Move this process into a leaf first, then enable them on the base.
            if base != CGROUP_ROOT and (base / "cgroup.procs").exists():
                leaf = base / "temper-worker"
                leaf.mkdir(exist_ok=True)
                _write(leaf / "cgroup.procs", "0")
            _write(base / "cgroup.subtree_control", " ".join("+" + c for c in wanted))
        self.base = base
        _sweep_dead(base, lambda name, parent: CgroupV2(base / parent / name))
        self.parent = base / f"temper-{os.getpid()}"
        self.parent.mkdir(exist_ok=True)
        _write(self.parent / "cgroup.subtree_control", " ".join("+" + c for c in wanted))
        if not (self.parent / "memory.max").exists() and not _read(self.parent / "cgroup.subtree_control"):
            raise OSError("cgroup v2 controllers memory/pids are not delegated to this worker")

    def create(self, name: str) -> Cgroup:
        path = self.parent / name
        path.mkdir()
        return CgroupV2(path)

    def parents(self) -> list[Path]:
        return [self.parent]


class CgroupV1Manager(CgroupManager):
    version = 1

    def __init__(self) -> None:
        mounts: dict[str, Path] = {}
        for line in _read(Path("/proc/self/mounts")).splitlines():
            parts = line.split()
            if len(parts) >= 4 and parts[2] == "cgroup":
                for opt in parts[3].split(","):
                    if opt in V1_CONTROLLERS:
                        mounts[opt] = Path(parts[1])
        missing = [c for c in V1_CONTROLLERS if c not in mounts]
        if missing:
            raise OSError(f"cgroup v1 controllers not mounted: {', '.join(missing)}")
        own = _own_paths()
        self.bases = {c: mounts[c] / own.get(c, "/").lstrip("/") for c in V1_CONTROLLERS}
        for base in self.bases.values():
            _sweep_dead(
                base,
                lambda name, parent: CgroupV1({k: b / parent / name for k, b in self.bases.items()}, name),
            )
        self.parent_name = f"temper-{os.getpid()}"
        self.parent_paths = {c: b / self.parent_name for c, b in self.bases.items()}
        for c, p in self.parent_paths.items():
            p.mkdir(exist_ok=True)
            if c == "memory":
                _write(p / "memory.use_hierarchy", "1")

    def create(self, name: str) -> Cgroup:
        paths = {c: p / name for c, p in self.parent_paths.items()}
        for p in paths.values():
            p.mkdir()
        return CgroupV1(paths, name)

    def parents(self) -> list[Path]:
        return list(self.parent_paths.values())


def detect() -> CgroupManager | None:
    """The cgroup manager this host allows, or None (no cgroups: rlimits only)."""
    try:
        if (CGROUP_ROOT / "cgroup.controllers").exists():
            return CgroupV2Manager()
        return CgroupV1Manager()
    except OSError as e:
        log.warning("sandbox cgroups unavailable (%s): memory and pids are limited by rlimits only", e)
        return None
