"""Sandbox backends: an enum of names (``BackendKind``) and one interface.

A backend only decides how the in-sandbox agent is started: which namespaces,
mounts and credentials wrap it. Limits (cgroups, rlimits), the workspace and the
agent protocol are shared by all backends (``temper.sandbox.sandbox``).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from abc import ABC, abstractmethod
from pathlib import Path

from temper.limits import NetworkPolicy, SandboxLimits
from temper.sandbox import seccomp
from temper.sandbox.images import Image
from temper.sandbox.proxy import SANDBOX_SOCKET
from temper.settings.sandbox import BackendKind, IsolationPiece, SandboxSettings

log = logging.getLogger(__name__)

AGENT_SOURCE = (Path(__file__).parent / "agent.py").read_text()
SANDBOX_WORKSPACE = "/workspace"
SANDBOX_AGENT = "/.temper-agent.pyc"  # where a prepared (compiled) agent is bound in the sandbox
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
# Top-level entries of an image a sandbox does not see: it gets its own /dev, /proc, /tmp
# and /workspace; the rest is the kernel's or boot's.
IMAGE_SKIP = frozenset(
    {"dev", "proc", "sys", "tmp", "workspace", "run", "boot", "lost+found", "mnt", "media"}
)


def shm_mb(limits: SandboxLimits) -> int:
    """The size of a sandbox's (or a zygote run's) /dev/shm: half its memory, as the kernel
    gives a tmpfs half the RAM. Its pages are charged to the sandbox's memory cgroup."""
    return max(1, limits.memory_mb // 2)


class Backend(ABC):
    kind: BackendKind
    isolated: bool
    pid_namespace: bool  # the agent is PID 1 of its own pid namespace

    def __init__(self, settings: SandboxSettings) -> None:
        self.settings = settings
        # HOST:SANDBOX binds the manager adds to the operator's ro_binds (the compile caches)
        self.extra_binds: list[str] = []

    @abstractmethod
    def agent_argv(
        self,
        workspace: Path,
        limits: SandboxLimits,
        image: Image | None = None,
        proxy: Path | None = None,
        *,
        zygote: bool = False,
        seccomp_fd: int | None = None,
    ) -> list[str]:
        """The command line that starts the agent for a sandbox on ``workspace`` (on
        ``image``'s root filesystem when one is given; with ``proxy``, the egress proxy's
        socket, for ``network: allowlist``; with ``zygote``, an agent that runs each action
        in namespaces of its own, see ``temper.sandbox.zygote``; ``seccomp_fd``: the fd
        the sandbox's system-call filter (``seccomp_program``) will be read from)."""

    @property
    def seccomp_program(self) -> bytes | None:
        """The BPF filter a sandbox starts under (None: this backend has none)."""
        return None

    def piece_on(self, piece: IsolationPiece) -> bool:
        """False only where a benchmark switched ``piece`` off (``bench_pieces_off``)."""
        return piece not in self.settings.bench_pieces_off

    @abstractmethod
    def inner_workspace(self, workspace: Path) -> str:
        """Where the workspace is, seen from inside the sandbox."""

    def check(self) -> None:  # noqa: B027 - optional hook
        """Raise if this backend cannot run on this host."""

    def prepare(self, directory: Path) -> None:  # noqa: B027 - optional hook
        """Write what the sandboxes share (the compiled agent) into ``directory``."""

    def base_env(self, workspace: Path) -> dict[str, str]:
        home = self.inner_workspace(workspace)
        return {
            "PATH": SANDBOX_PATH,
            "HOME": home,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "TMPDIR": "/tmp",
        }


class BwrapBackend(Backend):
    """bubblewrap: user, pid, mount, net, ipc, uts and cgroup namespaces; read-only
    system mounts and /dev; the workspace is the only writable place besides a small /tmp
    and /dev/shm; the system-call filter of :mod:`temper.sandbox.seccomp`."""

    kind = BackendKind.bwrap
    isolated = True
    pid_namespace = True

    def __init__(self, settings: SandboxSettings) -> None:
        super().__init__(settings)
        self.bwrap = shutil.which(settings.bwrap) or settings.bwrap
        self.agent_pyc: Path | None = None
        self._seccomp: bytes | None = None

    def check(self) -> None:
        if not os.path.exists(self.bwrap):
            raise RuntimeError(f"bwrap not found ({self.settings.bwrap}); run scripts/setup_system.sh")
        if self.piece_on(IsolationPiece.seccomp):
            # Built here, once: a host that cannot build it runs no sandbox at all.
            self._seccomp = seccomp.build_filter()

    @property
    def seccomp_program(self) -> bytes | None:
        return self._seccomp

    def prepare(self, directory: Path) -> None:
        """Compile the agent once, with the sandbox's own interpreter, to a ``.pyc`` that
        every sandbox runs (bound read-only): a start then skips compiling ~10 KB of
        source. On failure sandboxes fall back to ``python3 -S -c <source>``."""
        src, pyc = directory / "agent.py", directory / "agent.pyc"
        src.write_text(AGENT_SOURCE)
        compile_it = (
            "import py_compile, sys; py_compile.compile(sys.argv[1], cfile=sys.argv[2], doraise=True)"
        )
        try:
            subprocess.run(
                [self.settings.python, "-S", "-c", compile_it, str(src), str(pyc)],
                check=True, capture_output=True, timeout=30, env={"PATH": "/usr/bin:/bin"},
            )  # fmt: skip
            pyc.chmod(0o644)
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("cannot precompile the sandbox agent (%s): sandboxes compile it at start", e)
            return
        self.agent_pyc = pyc

    def inner_workspace(self, workspace: Path) -> str:
        return SANDBOX_WORKSPACE

    def image_args(self, image: Image, limits: SandboxLimits) -> list[str]:
        """The image's top-level directories bound read-only (its links recreated) on the
        empty root: the image's own /usr, /etc, /var… and never a writable path into it."""
        args: list[str] = []
        for name in sorted(os.listdir(image.rootfs)):
            if name in IMAGE_SKIP:
                continue
            path = image.rootfs / name
            if path.is_symlink():
                args += ["--symlink", os.readlink(path), f"/{name}"]
            elif path.is_dir():
                args += ["--ro-bind", str(path), f"/{name}"]
        if limits.network is NetworkPolicy.host:
            for name in ("resolv.conf", "hosts"):
                if os.path.lexists(image.rootfs / "etc" / name):
                    args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        return args

    def mount_args(self, workspace: Path, limits: SandboxLimits, image: Image | None = None) -> list[str]:
        extra: list[str] = []
        for entry in self.extra_binds:
            source, _, target = entry.partition(":")
            extra += ["--ro-bind-try", source, target or source]
        if image is not None:
            return self.image_args(image, limits) + extra + self._own_mounts(workspace, limits)
        args: list[str] = []
        for entry in self.settings.ro_binds:
            source, _, target = entry.partition(":")
            args += ["--ro-bind-try", source, target or source]
        args += extra
        for link, target in (
            ("/bin", "usr/bin"),
            ("/lib", "usr/lib"),
            ("/lib64", "usr/lib64"),
            ("/sbin", "usr/sbin"),
        ):
            if os.path.islink(link):
                args += ["--symlink", target, link]
            elif os.path.isdir(link):
                args += ["--ro-bind", link, link]
        if limits.network is NetworkPolicy.host:
            for path in ("/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf"):
                args += ["--ro-bind-try", path, path]
        return args + self._own_mounts(workspace, limits)

    def _own_mounts(self, workspace: Path, limits: SandboxLimits) -> list[str]:
        """What every sandbox gets of its own; the read-only remount of / comes last.
        /dev is bwrap's (the device nodes bound in, the fd/stdin/stdout/stderr links, a
        devpts) made read-only once /dev/shm, a tmpfs of its own, is on it: nothing in the
        sandbox can add an entry or point a link elsewhere (a zygote's runs each mount a
        /dev/shm and /dev/pts of their own over these)."""
        dev = ["--dev", "/dev"]
        if self.piece_on(IsolationPiece.dev):
            dev += ["--size", str(shm_mb(limits) << 20), "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
        return [
            *dev,
            "--proc", "/proc",
            "--size", str(16 << 20), "--tmpfs", "/tmp",
            "--bind", str(workspace), SANDBOX_WORKSPACE,
            "--chdir", SANDBOX_WORKSPACE,
            "--remount-ro", "/",
        ]  # fmt: skip

    def namespace_args(self, limits: SandboxLimits, *, zygote: bool = False) -> list[str]:
        args = [
            "--unshare-all", "--unshare-user", "--disable-userns",
            "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--hostname", "sandbox", "--clearenv",
        ]  # fmt: skip
        if zygote:
            # Capabilities of the sandbox's own user namespace only (nothing on the host):
            # the agent unshares and mounts for each run, which drops all of them.
            args += ["--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_SETPCAP"]
        if limits.network is NetworkPolicy.host:
            args.append("--share-net")
        # none, loopback, allowlist: a network namespace of its own, in which bubblewrap
        # brings up the loopback (0.8 always does); allowlist adds the proxy socket.
        return args

    def agent_argv(
        self,
        workspace: Path,
        limits: SandboxLimits,
        image: Image | None = None,
        proxy: Path | None = None,
        *,
        zygote: bool = False,
        seccomp_fd: int | None = None,
    ) -> list[str]:
        mounts = self.mount_args(workspace, limits, image)
        mode = ["zygote"] if zygote else []
        if zygote and (limits.network is NetworkPolicy.allowlist or limits.services):
            raise ValueError("a zygote runs without a proxy or services")
        if limits.network is NetworkPolicy.allowlist:
            if proxy is None:
                raise ValueError("network: allowlist needs the worker's proxy socket")
            # Bound before the root is remounted read-only (the last mount argument).
            mounts[-2:-2] = ["--ro-bind", str(proxy), SANDBOX_SOCKET]
            mode = ["proxy"]
        same_python = image is None or image.python_name() == self.host_python_name
        if same_python and self.agent_pyc is not None and self.agent_pyc.exists():
            # Bound before the root is remounted read-only (the last mount argument).
            mounts[-2:-2] = ["--ro-bind", str(self.agent_pyc), SANDBOX_AGENT]
            agent = [SANDBOX_AGENT]
        else:
            agent = ["-c", AGENT_SOURCE]
        if self._seccomp is not None and seccomp_fd is None:
            raise ValueError("a bwrap sandbox starts under the system-call filter: pass its fd")
        # bwrap installs the filter last, just before it execs the agent.
        filtered = ["--seccomp", str(seccomp_fd)] if self._seccomp is not None else []
        return [
            self.bwrap,
            *self.namespace_args(limits, zygote=zygote),
            "--as-pid-1",
            *mounts,
            *filtered,
            self.settings.python, "-S", *agent, SANDBOX_WORKSPACE, "pidns", *mode,
        ]  # fmt: skip

    @property
    def host_python_name(self) -> str:
        """The interpreter the agent was compiled by: an image whose python3 is another
        version gets the agent's source instead of the ``.pyc``."""
        return os.path.basename(os.path.realpath(self.settings.python))

    def floor_argv(self, workspace: Path, limits: SandboxLimits, image: Image | None = None) -> list[str]:
        """A bare bwrap with the same namespaces and mounts running ``python3 -S -c pass``
        (the benchmark's floor)."""
        return [
            self.bwrap, *self.namespace_args(limits), *self.mount_args(workspace, limits, image),
            self.settings.python, "-S", "-c", "pass",
        ]  # fmt: skip


class ProcessBackend(Backend):
    """No isolation: the agent runs as a plain child process. Limits that cgroups and
    rlimits give still hold, but the code sees the host's files, network and processes."""

    kind = BackendKind.process
    isolated = False
    pid_namespace = False

    def __init__(self, settings: SandboxSettings) -> None:
        super().__init__(settings)
        log.warning(
            "SANDBOX BACKEND 'process' HAS NO ISOLATION: code it runs can read host files, "
            "use the network and signal host processes. Use it only on a trusted dev box."
        )

    def inner_workspace(self, workspace: Path) -> str:
        return str(workspace)

    def agent_argv(
        self,
        workspace: Path,
        limits: SandboxLimits,
        image: Image | None = None,
        proxy: Path | None = None,
        *,
        zygote: bool = False,
        seccomp_fd: int | None = None,
    ) -> list[str]:
        if zygote:
            raise ValueError("the process backend cannot run a zygote (it has no namespaces)")
        if limits.network is NetworkPolicy.allowlist:
            raise ValueError(
                "the process backend cannot run network: allowlist (it has no network namespace)"
            )
        if image is not None:
            raise ValueError(
                "the process backend cannot run a sandbox on an image (it has no mount namespace)"
            )
        return [self.settings.python, "-S", "-c", AGENT_SOURCE, str(workspace), "nopidns"]


BACKENDS: dict[BackendKind, type[Backend]] = {
    BackendKind.bwrap: BwrapBackend,
    BackendKind.process: ProcessBackend,
}


def make_backend(settings: SandboxSettings, *, distributed: bool = False) -> Backend:
    if settings.backend is BackendKind.process and distributed and not settings.allow_unsafe:
        raise ValueError(
            "the 'process' sandbox backend has no isolation and is refused in distributed mode; "
            "set TEMPER_SANDBOX__ALLOW_UNSAFE=true to run it anyway"
        )
    if settings.bench_pieces_off and distributed and not settings.allow_unsafe:
        off = ", ".join(settings.bench_pieces_off)
        raise ValueError(
            f"TEMPER_SANDBOX__BENCH_PIECES_OFF ({off}) switches isolation off for benchmarks and "
            "is refused in distributed mode"
        )
    backend = BACKENDS[settings.backend](settings)
    backend.check()
    return backend
