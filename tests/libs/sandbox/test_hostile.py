# ruff: noqa: ASYNC240 - the tests inspect the host file system on purpose
"""The hostile suite: attacks run through the real bwrap backend. Each must end contained,
with the right kill reason, and the sandbox (and so the worker) must keep serving. The
``manager`` fixture checks on close that no process, mount or cgroup is left behind."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from temper import metrics
from temper.sandbox import Action, ExecResult, KillReason, SandboxManager
from tests.libs.sandbox.conftest import SMALL, cgroup_members

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(60)]


def py(code: str, **kw: object) -> Action:
    return Action(kind="run_python", code=code, **kw)


def sh(cmd: str, **kw: object) -> Action:
    return Action(kind="run_command", command=cmd, **kw)


async def attack(manager: SandboxManager, action: Action, **limits: object) -> ExecResult:
    """Run ``action`` in a session, then prove the session still serves."""
    sid = await manager.create_session(SMALL.model_copy(update=limits))
    result = await manager.act(sid, action)
    after = await manager.act(sid, py("print('alive')"))
    assert after.ok and after.stdout == "alive\n", f"sandbox stopped serving: {after}"
    sb = manager.sessions[sid]
    assert set(sb.cgroup.procs()) == sb.keep, "action processes outlived the action"
    await manager.destroy_session(sid)
    return result


async def test_fork_bomb(manager: SandboxManager) -> None:
    # The run ends at its wall limit either way; the reason is pids if the limit was hit at
    # all. 5 s, not 1: on a loaded machine an interpreter may take over a second to start.
    r = await attack(
        manager, Action(kind="run_command", command=["bash", "-c", ":(){ :|:& };:"]), pids=32, wall_s=5
    )
    assert r.kill_reason is KillReason.pids
    r = await attack(
        manager, py("import os\nwhile True:\n    try: os.fork()\n    except OSError: pass"), pids=32, wall_s=5
    )
    assert r.kill_reason is KillReason.pids


async def test_memory_bomb(manager: SandboxManager) -> None:
    r = await attack(manager, py("x = bytearray(1 << 30)"), memory_mb=64)
    assert r.kill_reason is KillReason.memory
    r = await attack(manager, py("a = []\nwhile True: a.append(b'x' * (4 << 20))"), memory_mb=96)
    assert r.kill_reason is KillReason.memory and r.peak_memory_mb >= 90


async def test_infinite_loop(manager: SandboxManager) -> None:
    r = await attack(manager, py("while True: pass"), cpu_s=30, wall_s=1)
    assert r.kill_reason is KillReason.timeout and 0.9 < r.wall_s < 2.5
    r = await attack(manager, sh("while :; do :; done"), cpu_s=0.5, wall_s=10)
    assert r.kill_reason is KillReason.cpu


async def test_cpu_spin_in_threads_and_processes(manager: SandboxManager) -> None:
    # killed by the 1 s CPU limit long before the 10 s wall limit: on an idle machine ~0.5 s
    # of wall (2 cores), on a loaded one the spinners get less of them (3.5 s was seen)
    threads = "import threading\ndef spin():\n    while True: pass\nfor _ in range(4): threading.Thread(target=spin).start()"
    r = await attack(manager, py(threads), cpu_s=1, wall_s=10)
    assert r.kill_reason is KillReason.cpu and r.wall_s < 8
    procs = "import os\nfor _ in range(4):\n    if os.fork() == 0:\n        while True: pass\nos.wait()"
    r = await attack(manager, py(procs), cpu_s=1, wall_s=10)
    assert r.kill_reason is KillReason.cpu and r.wall_s < 8


async def test_sleep_forever(manager: SandboxManager) -> None:
    r = await attack(manager, sh("sleep infinity"), wall_s=0.5)
    assert r.kill_reason is KillReason.timeout and r.wall_s < 2


async def test_output_flood(manager: SandboxManager) -> None:
    # Gigabytes if nothing stopped it; the cap (64 KiB per stream) ends it in milliseconds.
    r = await attack(manager, sh("yes 'flood flood flood' | head -c 4000000000"))
    assert r.kill_reason is KillReason.output and r.stdout_truncated
    assert len(r.stdout) == SMALL.output_bytes and r.wall_s < 1
    r = await attack(manager, py("import os\nwhile True: os.write(2, b'e' * 1000000)"))
    assert r.kill_reason is KillReason.output and r.stderr_truncated and not r.stdout_truncated


async def test_disk_fill(manager: SandboxManager) -> None:
    fill = "i = 0\nwhile True:\n    try:\n        open(f'f{i}', 'wb').write(b'x' * 100000)\n    except OSError:\n        pass\n    i += 1"
    r = await attack(manager, py(fill), workspace_mb=4, wall_s=5)
    assert r.kill_reason is KillReason.disk and r.wall_s < 3
    r = await attack(manager, sh("cat /dev/zero > blob"), workspace_mb=4, file_size_mb=64, wall_s=5)
    assert r.kill_reason is KillReason.disk
    # /tmp is a separate small tmpfs counted against the sandbox's memory; filling it ends too.
    r = await attack(manager, sh("cat /dev/zero > /tmp/blob; echo done"), wall_s=5, file_size_mb=64)
    assert r.exit_code == 0 and "No space left" in r.stderr


async def test_huge_file(manager: SandboxManager) -> None:
    r = await attack(manager, py("f = open('sparse', 'wb'); f.truncate(1 << 40)"), file_size_mb=4)
    assert r.kill_reason is KillReason.disk
    r = await attack(manager, sh("dd if=/dev/zero of=big bs=1M count=100"), file_size_mb=2, workspace_mb=32)
    assert r.kill_reason is KillReason.disk


async def test_network_connect_to_a_host_port(manager: SandboxManager) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    accepted: list[object] = []

    def accept() -> None:
        try:
            accepted.append(listener.accept())
        except OSError:
            pass

    t = threading.Thread(target=accept)
    t.start()
    code = (
        "import socket\n"
        f"for host in ('127.0.0.1', '10.0.2.2', '8.8.8.8'):\n"
        "    try:\n"
        f"        socket.create_connection((host, {port}), timeout=0.5); print('CONNECTED', host)\n"
        "    except OSError as e:\n"
        "        print('blocked', host, type(e).__name__)\n"
        "try:\n    socket.getaddrinfo('pypi.org', 443); print('RESOLVED')\nexcept OSError:\n    print('no dns')"
    )
    r = await attack(manager, py(code))
    t.join()
    listener.close()
    assert "CONNECTED" not in r.stdout and "RESOLVED" not in r.stdout, r.stdout
    assert r.stdout.count("blocked") == 3 and accepted == []


@pytest.fixture
def hostile_settings(sandbox_root):
    """Settings of a manager that a test starts itself (test_hostile_image.py puts it on an image)."""
    from tests.libs.sandbox.conftest import make_settings

    return make_settings(sandbox_root)


async def test_reading_host_files_and_worker_environment(sandbox_root, hostile_settings, monkeypatch) -> None:
    from tests.libs.sandbox.conftest import assert_clean_close

    monkeypatch.setenv("TEMPER_TEST_SECRET", "hunter2-must-not-leak")
    m = SandboxManager(hostile_settings)
    await m.start()
    try:
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        code = (
            "import os, glob\n"
            f"for p in ['/etc/shadow', '/etc/passwd', '/root', '{repo}/pyproject.toml', '/proc/1/environ', '{sandbox_root}']:\n"
            "    try:\n"
            "        print('READ', p, open(p, 'rb').read(200) if os.path.isfile(p) else os.listdir(p))\n"
            "    except OSError as e:\n"
            "        print('denied', p, type(e).__name__)\n"
            "print(sorted(os.environ))\n"
            "for f in glob.glob('/proc/*/environ'):\n"
            "    try: print(open(f, 'rb').read())\n"
            "    except OSError: pass\n"
        )
        async with m.sandbox() as sb:
            r = await sb.act(py(code))
            r2 = await sb.act(sh("env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'; ls /"))
        assert "hunter2" not in r.stdout + r.stderr + r2.stdout + r2.stderr
        reads = [line for line in r.stdout.splitlines() if line.startswith("READ ")]
        if hostile_settings.default_image is None:
            assert reads == [], r.stdout
        else:  # the image's own /etc/passwd is there to read (its bytes, not the host's); nothing else
            assert [line.split()[1] for line in reads] == ["/etc/passwd"], r.stdout
            digest = hostile_settings.default_image.split(":")[1]
            image_passwd = (
                Path(hostile_settings.image_cache) / f"sha256-{digest}" / "etc/passwd"
            ).read_bytes()
            assert repr(image_passwd[:200]) in reads[0]
        assert "work" not in r2.stdout.split()  # the host's /work (this checkout) is not there
        if hostile_settings.default_image is None:
            assert "root" not in r2.stdout.split()
    finally:
        await assert_clean_close(m)


async def test_writing_outside_the_workspace(manager: SandboxManager) -> None:
    marker = f"/tmp/temper-escape-{os.getpid()}"
    code = (
        "import os\n"
        f"for p in ['/usr/evil', '/etc/evil', '/evil', '/proc/evil', '/dev/evil', '{marker}', '/workspace/../evil']:\n"
        "    try:\n"
        "        open(p, 'w').write('x'); print('WROTE', p)\n"
        "    except OSError as e:\n"
        "        print('denied', p, type(e).__name__)\n"
        "os.system('mount -t tmpfs none /usr 2>&1; mount -o remount,rw /usr 2>&1; unshare -U true 2>&1 || echo nouserns')\n"
    )
    r = await attack(manager, py(code))
    for denied in ("/usr/evil", "/etc/evil", "/evil", "/workspace/../evil", "/proc/evil", "/dev/evil"):
        assert f"denied {denied}" in r.stdout, r.stdout
    # /tmp and /dev/shm are the sandbox's own small tmpfs mounts: writable, private, gone
    # with it; /dev itself is read-only.
    assert "nouserns" in r.stdout
    assert not os.path.exists("/usr/evil") and not os.path.exists("/etc/evil") and not os.path.exists(marker)


async def test_killing_the_parent(manager: SandboxManager) -> None:
    code = "import os, signal\nfor sig in (9, 15, 2, 19):\n    os.kill(os.getppid(), sig)\n    os.kill(1, sig)\nprint('parent still there')"
    r = await attack(manager, py(code))
    assert r.ok and r.stdout == "parent still there\n"
    r = await attack(manager, sh("kill -9 -1; kill -9 0; echo after"))
    assert r.kill_reason is KillReason.signal  # it killed itself, nothing else


async def test_setsid_and_double_fork_escape(manager: SandboxManager) -> None:
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        while True:\n"
        "            open('beacon', 'a').write('x'); time.sleep(0.05)\n"
        "    os._exit(0)\n"
        "time.sleep(0.2)\nprint('parent exits')"
    )
    sid = await manager.create_session()
    r = await manager.act(sid, py(code))
    assert r.ok
    sb = manager.sessions[sid]
    size = os.path.getsize(sb.workspace.path / "beacon")
    await asyncio.sleep(0.3)
    assert os.path.getsize(sb.workspace.path / "beacon") == size, "the daemon outlived its action"
    assert set(sb.cgroup.procs()) == sb.keep
    r = await manager.act(sid, sh("nohup sleep 1000 > /dev/null 2>&1 & setsid sleep 1000 & disown; echo bg"))
    assert r.ok and set(sb.cgroup.procs()) == sb.keep
    await manager.destroy_session(sid)


async def test_zombies_and_orphans(manager: SandboxManager) -> None:
    code = (
        "import os, time\n"
        "for _ in range(10):\n"
        "    if os.fork() == 0: os._exit(0)\n"  # zombies: never waited for
        "for _ in range(10):\n"
        "    if os.fork() == 0:\n"
        "        if os.fork() == 0: time.sleep(100)\n"  # orphans: their parent exits at once
        "        os._exit(0)\n"
        "time.sleep(0.1)\n"
        "print(len([p for p in os.listdir('/proc') if p.isdigit()]))"
    )
    r = await attack(manager, py(code))
    assert r.ok and int(r.stdout) >= 11
    code = "import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()) == [1, os.getpid()])"
    r = await attack(manager, py(code))
    assert r.stdout == "True\n", "only the agent and this process are in a fresh action"


async def test_signals_to_other_sandboxes(manager: SandboxManager) -> None:
    victim = await manager.create_session()
    attacker = await manager.create_session()
    host_pids = manager.sessions[victim].cgroup.procs()
    slow = asyncio.create_task(manager.act(victim, py("import time; time.sleep(1); print('survived')")))
    await asyncio.sleep(0.2)
    code = (
        "import os\nhits = 0\n"
        f"for pid in list(range(1, 4096)) + {host_pids}:\n"
        "    if pid == os.getpid(): continue\n"
        "    try:\n        os.kill(pid, 9); hits += 1\n    except OSError:\n        pass\n"
        "print('visible', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()) == [1, os.getpid()])"
    )
    r = await manager.act(attacker, py(code))
    v = await slow
    assert v.ok and v.stdout == "survived\n", v
    assert "visible True" in r.stdout
    for sid in (victim, attacker):
        await manager.destroy_session(sid)


async def test_worker_keeps_serving_after_the_suite(manager: SandboxManager) -> None:
    r = await attack(manager, py("print(sum(range(10)))"))
    assert r.ok and r.stdout == "45\n"
    assert cgroup_members("no-such-tag") == []


HOSTILE_PACKAGE_GRADER = """
import json, os
leak = {probe!r}[::-1]  # reversed here, so that this file is not what it finds
env_leak = any(leak in v for v in os.environ.values()) or any(k.startswith("TEMPER_") for k in os.environ)
for pid in os.listdir("/proc"):
    try:
        env_leak = env_leak or leak.encode() in open("/proc/" + pid + "/environ", "rb").read()
    except (OSError, ValueError):
        pass
file_leak = 0.0
for path in {paths!r}:  # the other tenant's stored package, by its exact host paths
    try:
        open(path, "rb").read()
        file_leak = 1.0
    except OSError:
        pass
print(json.dumps({{"env_leak": float(env_leak), "file_leak": file_leak, "own": float(os.path.exists("hidden/own.txt"))}}))
"""


async def test_a_tenant_package_grader_reads_neither_the_platform_env_nor_another_tenants_files(
    scoring_manager: SandboxManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tenant package's grade program (temper.envpkg.grader) in its grading sandbox: the
    scorer's secrets are not in its environment (nor readable from /proc), and another
    tenant's package, stored on this very host, cannot be opened even by its exact path."""
    import shutil
    import uuid

    from temper.envpkg import grader, service
    from temper.envpkg.archive import pack
    from temper.storage import LocalStore
    from temper.tasks.models import TaskSpec

    probe = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("TEMPER_STORAGE__SECRET_KEY", probe)  # the scorer's own environment
    root = (
        Path("/tmp") / f"temper-pkgstore-{uuid.uuid4().hex[:8]}"
    )  # world-readable: only the sandbox stops it
    root.mkdir(mode=0o755)
    try:
        store = LocalStore(root)
        manifest = (
            Path(__file__).resolve().parents[3] / "examples/environments/wordcount-pkg/environment.yaml"
        ).read_text()
        theirs = {"environment.yaml": manifest.replace("name: wordcount-pkg", "name: theirs"),
                  "hidden/grade.py": "print(1)\n", "hidden/secret.txt": "theirs\n"}  # fmt: skip
        await service.upload(store, tenant_id="other", data=pack(theirs))
        paths = [str(p) for p in root.rglob("*") if p.is_file()]
        for p in root.rglob("*"):
            p.chmod(0o755 if p.is_dir() else 0o644)
        assert paths, "the other tenant's package is on this host"
        mine_manifest = manifest.replace("name: wordcount-pkg", "name: mine").replace(
            "  correct: 1.0\n  used_tool: 0.25", "  env_leak: -1.0\n  file_leak: -1.0\n  own: 1.0"
        )
        mine = {"environment.yaml": mine_manifest, "hidden/own.txt": "mine\n",
                "hidden/grade.py": HOSTILE_PACKAGE_GRADER.format(probe=probe[::-1], paths=paths)}  # fmt: skip
        meta, _ = await service.upload(store, tenant_id="me", data=pack(mine))
        submission = {"kind": "package", "snapshot_key": None,
                      "package": {"key": meta["archive_key"], "rubric": meta["rubric"]}}  # fmt: skip
        task = TaskSpec(id="t", kind="math", prompt="p", answer="1")
        reward, components = await grader.grade(scoring_manager, store, task, submission)
        values = {n: c.value for n, c in components.items()}
        assert all(c.ok for c in components.values()), components
        assert values == {"env_leak": 0.0, "file_leak": 0.0, "own": 1.0}, values
        assert reward == 1.0
    finally:
        shutil.rmtree(root, ignore_errors=True)


# --- runs on one zygote: nothing a run leaves reaches the next (issue 27) -----------------
# Each check is a first run that leaves something where a run can write or register it,
# and a second run on the same zygote (TEMPER_SANDBOX__ZYGOTES=1) that shows it is gone.
# test_every_writable_mount_has_a_check lists the run's writable mounts from its own
# /proc/self/mountinfo and fails on one that no check below covers.

# Writable mount point -> the check that covers it.
CHECKED_MOUNTS = {
    "/workspace": "test_files_in_every_writable_mount",
    "/tmp": "test_files_in_every_writable_mount",
    "/dev/shm": "test_files_in_every_writable_mount",
    "/dev/pts": "test_devices",
    "/proc": "test_processes",
    **{f"/dev/{node}": "test_devices" for node in ("null", "zero", "full", "random", "urandom", "tty")},
}
FILE_MOUNTS = ("/workspace", "/tmp", "/dev/shm")

WRITABLE_MOUNTS = r"""
import json
mounts = {}
for line in open('/proc/self/mountinfo'):
    fields = line.split()
    point, options = fields[4], fields[5].split(',')
    mounts.setdefault(point, []).append('rw' in options)
print(json.dumps(sorted(p for p, rw in mounts.items() if any(rw))))
"""

# Programs that take values from the test start with the lines that assign them.
TOPS = f"TOPS = {FILE_MOUNTS!r}\n"

LISTING = (
    TOPS
    + r"""
import json, os, stat
out = {}
for top in TOPS:
    st = os.lstat(top)
    entries = [(".", stat.S_IFMT(st.st_mode), oct(st.st_mode & 0o7777), st.st_uid)]
    for root, dirs, files in os.walk(top):
        for name in sorted(dirs + files):
            st = os.lstat(os.path.join(root, name))
            entries.append((os.path.relpath(os.path.join(root, name), top), stat.S_IFMT(st.st_mode), st.st_size))
    out[top] = entries
print(json.dumps(out))
"""
)

LEAVE_FILES = (
    TOPS
    + r"""
import os, socket
for top in TOPS:
    open(f'{top}/left.txt', 'w').write('from the first run')
    open(f'{top}/.hidden', 'w').write('x')
    os.makedirs(f'{top}/d/e', exist_ok=True)
    open(f'{top}/d/e/deep', 'wb').write(b'z' * 65536)
    os.mkfifo(f'{top}/fifo')
    os.symlink('/etc/passwd', f'{top}/link')
    socket.socket(socket.AF_UNIX).bind(f'{top}/sock')
    os.chmod(top, 0o700)
print('left')
"""
)

DEVICES = r"""
import json, os, stat
dev = {}
for name in sorted(os.listdir('/dev')):
    st = os.lstat('/dev/' + name)
    link = os.readlink('/dev/' + name) if stat.S_ISLNK(st.st_mode) else None
    dev[name] = (stat.S_IFMT(st.st_mode), oct(st.st_mode & 0o7777), st.st_rdev, link)
print(json.dumps({"dev": dev, "pts": sorted(os.listdir('/dev/pts'))}))
"""

LEAVE_DEVICES = r"""
import os, pty, time
tried = []
for attempt in (
    lambda: os.symlink('/dev/shm/out', '/dev/stdout.new') or os.rename('/dev/stdout.new', '/dev/stdout'),
    lambda: os.unlink('/dev/stdin'),
    lambda: open('/dev/planted', 'w').write('x'),
    lambda: os.mkdir('/dev/planted.d'),
    lambda: os.chmod('/dev/null', 0o600),
    lambda: os.chmod('/dev', 0o777),
    lambda: os.utime('/dev/zero', (0, 0)),
):
    try:
        attempt()
        tried.append('CHANGED')
    except OSError as e:
        tried.append(type(e).__name__)
open('/dev/null', 'w').write('into the void')
leader, follower = pty.openpty()  # a pty: /dev/pts/0, held by a daemon below
if os.fork() == 0:
    os.setsid()
    time.sleep(300)
print(tried, sorted(os.listdir('/dev/pts')))
"""

LEAVE_IPC = r"""
import ctypes, os, socket, subprocess, time
libc = ctypes.CDLL(None, use_errno=True)
librt = ctypes.CDLL('librt.so.1', use_errno=True)
subprocess.run(['ipcmk', '-M', '4096'], check=True, capture_output=True)
subprocess.run(['ipcmk', '-Q'], check=True, capture_output=True)
subprocess.run(['ipcmk', '-S', '2'], check=True, capture_output=True)
mq = librt.mq_open(b'/temper-leak', os.O_CREAT | os.O_RDWR, 0o600, None)
assert mq >= 0, ctypes.get_errno()
assert librt.mq_send(mq, b'from the first run', 18, 0) == 0
fd = libc.shm_open(b'/temper-leak', os.O_CREAT | os.O_RDWR, 0o600)
assert fd >= 0 and os.write(fd, b'from the first run') == 18
abstract = socket.socket(socket.AF_UNIX)
abstract.bind('\0temper-leak')
abstract.listen()
if os.fork() == 0:  # a daemon holds them all
    os.setsid()
    time.sleep(300)
print('left')
"""

CHECK_IPC = r"""
import ctypes, errno, os, socket
librt = ctypes.CDLL('librt.so.1', use_errno=True)
libc = ctypes.CDLL(None, use_errno=True)
sysv = {kind: len(open(f'/proc/sysvipc/{kind}').read().splitlines()) - 1 for kind in ('shm', 'msg', 'sem')}
mq = librt.mq_open(b'/temper-leak', os.O_RDONLY, 0, None)
mq_gone = mq < 0 and ctypes.get_errno() == errno.ENOENT
shm = libc.shm_open(b'/temper-leak', os.O_RDONLY, 0)
shm_gone = shm < 0 and ctypes.get_errno() == errno.ENOENT
try:
    socket.socket(socket.AF_UNIX).connect('\0temper-leak')
    abstract = 'CONNECTED'
except ConnectionRefusedError:
    abstract = 'refused'
print(sysv, mq_gone, shm_gone, abstract, '@temper-leak' in open('/proc/net/unix').read())
"""

KEYRINGS = r"""
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *args):
    return 'ok' if libc.syscall(nr, *args) >= 0 else errno.errorcode[ctypes.get_errno()]
added = call(248, b'user', b'temper-leak', b'from the first run', 18, -4)  # add_key to @u
found = call(250, 10, -4, b'user', b'temper-leak', 0)  # KEYCTL_SEARCH @u
session = call(250, 0, -3, 1)  # KEYCTL_GET_KEYRING_ID of the session keyring, create it
print(added, found, session, open('/proc/key-users').read() == KEY_USERS, open('/proc/keys').read())
"""

LEAVE_SOCKETS = r"""
import os, socket, time
tcp = socket.create_server(('127.0.0.1', 4000))
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.bind(('127.0.0.1', 4001))
tcp6 = socket.socket(socket.AF_INET6)
tcp6.bind(('::1', 4002))
tcp6.listen()
named = socket.socket(socket.AF_UNIX)
named.bind('\0temper-socket')
named.listen()
if os.fork() == 0:  # a daemon keeps them open
    os.setsid()
    time.sleep(300)
print('left')
"""

CHECK_SOCKETS = r"""
import socket
def bound(family, kind, address):
    s = socket.socket(family, kind)
    try:
        s.bind(address)
        return 'free'
    except OSError as e:
        return type(e).__name__
    finally:
        s.close()
try:
    socket.create_connection(('127.0.0.1', 4000), timeout=1)
    connect = 'CONNECTED'
except ConnectionRefusedError:
    connect = 'refused'
# Sockets left in /proc/net: 0A is LISTEN, 01 ESTABLISHED (TIME_WAIT and the counters of
# the shared loopback are not content of a run: see docs/sandbox.md).
left = [line.split()[3] for name in ('tcp', 'tcp6', 'udp', 'udp6') for line in open('/proc/net/' + name).read().splitlines()[1:]]
print(connect, bound(socket.AF_INET, socket.SOCK_STREAM, ('127.0.0.1', 4000)),
      bound(socket.AF_INET, socket.SOCK_DGRAM, ('127.0.0.1', 4001)),
      bound(socket.AF_INET6, socket.SOCK_STREAM, ('::1', 4002)),
      bound(socket.AF_UNIX, socket.SOCK_STREAM, '\0temper-socket'),
      [s for s in left if s != '06'])
"""

LEAVE_PROCESSES = r"""
import os, signal, time
def daemon(body):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            body()
        os._exit(0)
def ignore_everything():
    for sig in range(1, 32):
        try:
            signal.signal(sig, signal.SIG_IGN)
        except (OSError, ValueError, RuntimeError):
            pass
    time.sleep(300)
daemon(lambda: time.sleep(300))
daemon(ignore_everything)
daemon(lambda: os.kill(os.getpid(), signal.SIGSTOP))
for _ in range(5):  # zombies: never waited for
    if os.fork() == 0:
        os._exit(0)
open('/proc/self/comm', 'w').write('temper-leftover')
time.sleep(0.2)
print(len([p for p in os.listdir('/proc') if p.isdigit()]))
"""

CHECK_PROCESSES = r"""
import os
pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
names = [open(f'/proc/{p}/comm').read().strip() for p in pids]
print(pids == [1, os.getpid()], names)
"""


@pytest.fixture
async def one_zygote(hostile_settings) -> AsyncIterator[SandboxManager]:
    """One zygote serves every run (TEMPER_SANDBOX__ZYGOTES=1): whatever a run could leave
    for the next, the next is there to find it."""
    from tests.libs.sandbox.conftest import assert_clean_close

    m = SandboxManager(hostile_settings.model_copy(update={"zygotes": 1, "pool_size": 0}))
    await m.start()
    yield m
    await assert_clean_close(m)


class TestCrossRun:
    async def run(self, manager: SandboxManager, action: Action, **limits: object) -> ExecResult:
        before = manager.zygotes.started, metrics.SANDBOX_FRESH_RUNS.labels("zygote")._value.get()
        r, _ = await manager.run_fresh(SMALL.model_copy(update=limits), {}, action)
        after = manager.zygotes.started, metrics.SANDBOX_FRESH_RUNS.labels("zygote")._value.get()
        assert after == (1, before[1] + 1), "every run of this class is on the one zygote"
        return r

    async def test_every_writable_mount_has_a_check(self, one_zygote: SandboxManager) -> None:
        r = await self.run(one_zygote, py(WRITABLE_MOUNTS))
        assert r.ok, r
        writable = json.loads(r.stdout)
        assert set(FILE_MOUNTS) <= set(writable), writable  # the listing itself works
        unchecked = [m for m in writable if m not in CHECKED_MOUNTS]
        assert unchecked == [], f"writable mounts with no cross-run check: {unchecked}"
        for test in set(CHECKED_MOUNTS.values()):
            assert callable(getattr(self, test)), test

    async def test_files_in_every_writable_mount(self, one_zygote: SandboxManager) -> None:
        fresh = await self.run(one_zygote, py(LISTING))
        assert fresh.ok, fresh
        left = await self.run(one_zygote, py(LEAVE_FILES))
        assert left.ok and left.stdout == "left\n", left
        again = await self.run(one_zygote, py(LISTING))
        assert again.ok and json.loads(again.stdout) == json.loads(fresh.stdout), again.stdout

    async def test_devices(self, one_zygote: SandboxManager) -> None:
        fresh = await self.run(one_zygote, py(DEVICES))
        assert fresh.ok and json.loads(fresh.stdout)["pts"] == ["ptmx"], fresh
        left = await self.run(one_zygote, py(LEAVE_DEVICES))
        assert left.ok, left
        tried, pts = left.stdout.rsplit("] [", 1)
        assert "CHANGED" not in tried and "'0'" in pts, left.stdout
        again = await self.run(one_zygote, py(DEVICES))
        assert again.ok and json.loads(again.stdout) == json.loads(fresh.stdout), again.stdout
        # Its standard streams are its own: nothing of the first run's stands in for them.
        streams = (
            "cat /dev/stdin; echo out > /dev/stdout; echo err > /dev/stderr; head -c 4 /dev/zero | wc -c"
        )
        mine = await self.run(one_zygote, sh(streams, stdin="in\n"))
        assert mine.ok and (mine.stdout, mine.stderr) == ("in\nout\n4\n", "err\n"), mine

    async def test_ipc_of_each_kind(self, one_zygote: SandboxManager) -> None:
        left = await self.run(one_zygote, py(LEAVE_IPC))
        assert left.ok and left.stdout == "left\n", left
        again = await self.run(one_zygote, py(CHECK_IPC))
        assert again.ok, again
        assert again.stdout == "{'shm': 0, 'msg': 0, 'sem': 0} True True refused False\n", again.stdout

    async def test_keyrings(self, one_zygote: SandboxManager) -> None:
        fresh = await self.run(one_zygote, sh("cat /proc/key-users"))
        assert fresh.ok, fresh
        for _ in range(2):  # the first run's attempt leaves nothing the second can find
            r = await self.run(one_zygote, py(f"KEY_USERS = {fresh.stdout!r}\n" + KEYRINGS))
            assert r.ok and r.stdout == "EPERM EPERM EPERM True \n", r

    async def test_sockets(self, one_zygote: SandboxManager) -> None:
        left = await self.run(one_zygote, py(LEAVE_SOCKETS))
        assert left.ok and left.stdout == "left\n", left
        again = await self.run(one_zygote, py(CHECK_SOCKETS))
        assert again.ok and again.stdout == "refused free free free free []\n", again

    async def test_processes(self, one_zygote: SandboxManager) -> None:
        left = await self.run(one_zygote, py(LEAVE_PROCESSES))
        assert left.ok and int(left.stdout) >= 6, left
        (zygote,) = one_zygote.zygotes._idle
        assert zygote.cgroup is not None and set(zygote.cgroup.procs()) == zygote.keep
        again = await self.run(one_zygote, py(CHECK_PROCESSES))
        assert again.ok and again.stdout.startswith("True ") and "temper-leftover" not in again.stdout, again

    async def test_memory(self, one_zygote: SandboxManager) -> None:
        await self.run(one_zygote, py("pass"))
        (zygote,) = one_zygote.zygotes._idle
        assert zygote.cgroup is not None and zygote.baseline_bytes is not None
        recycled = metrics.SANDBOX_ZYGOTE_RECYCLES.labels("memory")._value.get()
        leave = (
            "import mmap, os, time\n"
            "open('/dev/shm/pinned', 'wb').write(b'p' * (48 << 20))\n"
            "memfd = os.memfd_create('pinned'); os.write(memfd, b'm' * (16 << 20))\n"
            "anon = mmap.mmap(-1, 16 << 20); anon.write(b'a' * (16 << 20))\n"
            "if os.fork() == 0:\n    os.setsid(); time.sleep(300)\n"
            "print('left')"
        )
        left = await self.run(one_zygote, py(leave), memory_mb=256, file_size_mb=128)
        assert left.ok and left.stdout == "left\n", left
        # The isolation gave it all back (no recycle needed): resident memory at the baseline.
        assert zygote.cgroup.resident_bytes() < zygote.baseline_bytes + (2 << 20)
        assert metrics.SANDBOX_ZYGOTE_RECYCLES.labels("memory")._value.get() == recycled
        again = await self.run(one_zygote, py("x = b'y' * (160 << 20); print('allocated')"), memory_mb=48)
        assert again.kill_reason is KillReason.memory and "allocated" not in again.stdout, again
        fits = await self.run(one_zygote, py("x = b'y' * (24 << 20); print('fits')"), memory_mb=48)
        assert fits.ok and fits.stdout == "fits\n", fits
