"""One-shot runs on zygotes (``SandboxManager.run_fresh``): each run in pid, mount and IPC
namespaces of its own, on a fresh workspace and /tmp, without a capability; one zygote
(``zygotes=1``) serves every run here, so anything a run could leave for the next would
be found."""

from __future__ import annotations

from pathlib import Path

import pytest

from temper import metrics
from temper.sandbox import Action, KillReason, NetworkPolicy, Sandbox, SandboxManager
from tests.libs.sandbox.conftest import SMALL, assert_clean_close, make_settings
from tests.libs.sandbox.test_sandbox import KILLS

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(60)]


def py(code: str, **kw: object) -> Action:
    return Action(kind="run_python", code=code, **kw)


def sh(cmd: str, **kw: object) -> Action:
    return Action(kind="run_command", command=cmd, **kw)


@pytest.fixture
async def zygote(sandbox_root):
    m = SandboxManager(make_settings(sandbox_root, pool_size=0, zygotes=1))
    await m.start()
    yield m
    await assert_clean_close(m)


def fresh_runs(path: str) -> float:
    return metrics.SANDBOX_FRESH_RUNS.labels(path)._value.get()


async def test_each_run_starts_on_an_empty_workspace_and_tmp(zygote: SandboxManager) -> None:
    before = fresh_runs("zygote")
    r, _ = await zygote.run_fresh(
        None,
        {"a.txt": b"one", "sub/b.py": b"X = 2\n"},
        py(
            "import os, sub.b\n"
            "print(sorted(os.listdir('.')), open('a.txt').read(), sub.b.X, os.listdir('/tmp'))\n"
            "open('left.txt', 'w').write('x'); open('/tmp/left', 'w').write('x')"
        ),
    )
    assert r.ok and r.stdout == "['a.txt', 'sub'] one 2 []\n", r
    r, _ = await zygote.run_fresh(None, {}, sh("ls -A /workspace /tmp"))
    assert r.ok and r.stdout == "/tmp:\n\n/workspace:\n", r
    assert fresh_runs("zygote") - before == 2
    assert zygote.zygotes.started == 1


async def test_a_run_sees_only_its_own_processes_and_none_outlives_it(zygote: SandboxManager) -> None:
    # Escapes a process group cannot hold: setsid and a double fork, both sleeping on.
    r, _ = await zygote.run_fresh(
        None, {}, sh("setsid sleep 300 & (sleep 301 &) ; ls /proc | grep -c '^[0-9]'; echo pid $$")
    )
    assert r.ok, r
    count, pid = r.stdout.split("\n")[:2]
    # The namespace's init (1), the shell (2), both sleepers, ls and grep: nothing of the zygote.
    assert pid == "pid 2" and int(count) <= 6, r.stdout
    zy = next(iter(zygote.zygotes._idle))
    assert set(zy.cgroup.procs()) == zy.keep, "a run's processes outlived it"
    r, _ = await zygote.run_fresh(None, {}, Action(kind="run_command", command=["ps", "-eo", "pid,args"]))
    assert "sleep" not in r.stdout and r.stdout.count("\n") == 3, r.stdout  # header, init, ps


async def test_a_run_has_no_capability_and_cannot_mount_or_unshare(zygote: SandboxManager) -> None:
    r, _ = await zygote.run_fresh(None, {}, sh("grep -E '^(Cap|NoNewPrivs)' /proc/self/status"))
    fields = dict(line.split(":\t") for line in r.stdout.splitlines())
    assert {fields[k] for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")} == {"0000000000000000"}
    assert fields["NoNewPrivs"] == "1"
    for cmd in ("mount -t tmpfs none /tmp", "unshare -m true", "unshare -U true", "unshare -pf true"):
        r, _ = await zygote.run_fresh(None, {}, sh(cmd))
        assert r.exit_code not in (0, None) and r.stderr, (cmd, r)
    r, _ = await zygote.run_fresh(None, {}, sh("touch /usr/x /x 2>&1; echo done"))
    assert r.stdout.count("Read-only file system") == 2, r.stdout


async def test_sysv_ipc_does_not_survive_a_run(zygote: SandboxManager) -> None:
    r, _ = await zygote.run_fresh(None, {}, sh("ipcmk -M 4096 && ipcmk -Q && ipcs -m | grep -c 0x"))
    assert r.ok and r.stdout.splitlines()[-1] == "1", r
    r, _ = await zygote.run_fresh(None, {}, sh("cat /proc/sysvipc/shm /proc/sysvipc/msg | grep -vc key"))
    assert r.stdout.strip() == "0", r


@pytest.mark.parametrize(("code", "limits", "reason"), KILLS)
async def test_kill_reasons(zygote: SandboxManager, code: str, limits: dict, reason: KillReason) -> None:
    r, _ = await zygote.run_fresh(SMALL.model_copy(update=limits), {}, py(code))
    assert r.kill_reason is reason, r
    assert not r.ok
    # The next run on the same zygote gets the default limits back, and works.
    again, _ = await zygote.run_fresh(None, {}, py("x = bytearray(80 << 20); print('still here')"))
    assert again.ok and again.stdout == "still here\n", again


async def test_a_full_workspace_is_a_disk_kill(zygote: SandboxManager) -> None:
    code = "for i in range(8): open(f'f{i}', 'wb').write(b'z' * (1 << 20))"
    r, _ = await zygote.run_fresh(SMALL.model_copy(update={"workspace_mb": 2}), {}, py(code))
    assert r.kill_reason is KillReason.disk and not r.ok, r
    r, _ = await zygote.run_fresh(None, {}, py("open('f', 'wb').write(b'z' * (3 << 20))"))
    assert r.ok, r  # the next run's workspace is empty and of the default size


async def test_fetched_files_stay_inside_the_workspace(zygote: SandboxManager) -> None:
    r, fetched = await zygote.run_fresh(
        None,
        {},
        sh("echo out > out.txt; ln -s /etc/passwd link; mkdir d; printf 'é' > d/u"),
        ["out.txt", "d/u", "missing", "link", "../etc/passwd", "/etc/passwd"],
    )
    assert r.ok, r
    assert fetched == {
        "out.txt": b"out\n",
        "d/u": "é".encode(),
        "missing": None,
        "link": None,
        "../etc/passwd": None,
        "/etc/passwd": None,
    }


async def test_files_outside_the_workspace_or_too_large_are_refused(zygote: SandboxManager) -> None:
    for path in ("../x", "/etc/x", "", "a/../../x"):
        r, _ = await zygote.run_fresh(None, {path: b"x"}, sh("true"))
        assert r.error and "inside the workspace" in r.error, (path, r)
    r, _ = await zygote.run_fresh(None, {"big": b"z" * ((SMALL.file_size_mb << 20) + 1)}, sh("true"))
    assert r.error and r.kill_reason is KillReason.disk
    r, _ = await zygote.run_fresh(None, {"ok": b"fine"}, sh("cat ok"))
    assert r.ok and r.stdout == "fine"


async def test_limits_a_zygote_cannot_give_run_in_a_sandbox_of_their_own(zygote: SandboxManager) -> None:
    before = fresh_runs("sandbox")
    lim = SMALL.model_copy(update={"network": NetworkPolicy.loopback, "services": []})
    assert lim.fixed_at_start != SMALL.fixed_at_start
    r, fetched = await zygote.run_fresh(
        lim,
        {"in": b"x"},
        sh("cat in > out; ln -s out link; grep Seccomp: /proc/self/status"),
        ["out", "link"],
    )
    # Under the same filter, and fetched the same way (no link followed), as on a zygote.
    assert r.ok and r.stdout.split() == ["Seccomp:", "2"] and fetched == {"out": b"x", "link": None}, r
    assert fresh_runs("sandbox") - before == 1


async def test_concurrent_runs_each_get_a_zygote_of_their_own(sandbox_root) -> None:
    import asyncio

    m = SandboxManager(make_settings(sandbox_root, pool_size=0, zygotes=3))
    await m.start()
    try:
        code = "import os, time; open('mine', 'w').write(str(os.getpid())); time.sleep(0.3); print(os.listdir('.'))"
        results = await asyncio.gather(*(m.run_fresh(None, {}, py(code)) for _ in range(6)))
        assert all(r.ok and r.stdout == "['mine']\n" for r, _ in results), results
        assert m.zygotes.started == 3
    finally:
        await assert_clean_close(m)


async def test_a_host_that_refuses_zygotes_runs_each_in_a_sandbox_and_says_so(
    sandbox_root, monkeypatch
) -> None:
    from temper.sandbox.backends import BwrapBackend

    plain = BwrapBackend.namespace_args
    # Without the capabilities a zygote keeps, its agent cannot make namespaces: as on a
    # host whose bwrap or kernel refuses them.
    monkeypatch.setattr(
        BwrapBackend, "namespace_args", lambda self, limits, zygote=False: plain(self, limits)
    )
    m = SandboxManager(make_settings(sandbox_root, pool_size=0, zygotes=2))
    await m.start()
    try:
        before = fresh_runs("sandbox")
        for _ in range(2):
            r, fetched = await m.run_fresh(None, {"in": b"x"}, sh("cat in > out"), ["out"])
            assert r.ok and fetched == {"out": b"x"}, r
        assert fresh_runs("sandbox") - before == 2
        assert m.zygotes.started == 0
        assert m.health()["zygotes"].startswith("unavailable: a zygote cannot make namespaces here")
    finally:
        await assert_clean_close(m)


# --- the findings of issue 27, each a test that failed before its fix ---------------------


async def test_a_run_cannot_redirect_the_next_runs_stdin_or_stdout(zygote: SandboxManager) -> None:
    """Finding 1: /dev was one writable tmpfs per zygote, so a run could point /dev/stdout
    and /dev/stdin at files of its own and read or write the next run's answers."""
    attack = (
        "echo planted > /dev/planted; mkdir -p /dev/shm && echo planted > /dev/shm/planted; "
        "echo attacker-input > /dev/shm/in; ln -sf /dev/shm/out /dev/stdout; ln -sf /dev/shm/in /dev/stdin; "
        "ls -A /dev"
    )
    await zygote.run_fresh(None, {}, sh(attack))
    victim = "cat /dev/stdin; echo my-answer > /dev/stdout; python3 -c \"print(open('/dev/stdin').read())\" < in; ls -A /dev /dev/shm"
    r, _ = await zygote.run_fresh(None, {"in": b"file-input"}, sh(victim, stdin="my-input\n"))
    lines = r.stdout.splitlines()
    assert lines[:3] == ["my-input", "my-answer", "file-input"], r
    assert "planted" not in r.stdout and "in" not in r.stdout.split("/dev/shm:")[1].split(), r.stdout


async def test_shared_memory_left_by_a_run_does_not_lift_the_next_runs_memory_limit(
    zygote: SandboxManager,
) -> None:
    """Finding 2: 64 MB left in /dev/shm outlived its run and was charged to the zygote; a
    later run's lower memory limit then failed to apply (EBUSY, ignored) and it ran with the
    earlier, larger one."""
    big = SMALL.model_copy(update={"memory_mb": 256, "file_size_mb": 128})
    r, _ = await zygote.run_fresh(
        big, {}, sh("head -c 67108864 /dev/zero > /dev/shm/pinned && ls -l /dev/shm/pinned")
    )
    assert r.ok and "67108864" in r.stdout, r
    small = SMALL.model_copy(update={"memory_mb": 48})
    r, _ = await zygote.run_fresh(small, {}, py("x = b'y' * (160 << 20); print('allocated')"))
    assert r.kill_reason is KillReason.memory and "allocated" not in r.stdout, r
    r, _ = await zygote.run_fresh(None, {}, sh("ls -A /dev/shm"))
    assert r.ok and r.stdout == "", r


SYSCALLS = """
import ctypes, errno, mmap, os
libc = ctypes.CDLL(None, use_errno=True)
def sys(nr, *args):
    rc = libc.syscall(nr, *args)
    return 'ok' if rc >= 0 else errno.errorcode[ctypes.get_errno()]
def machine(code):
    m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    m.write(code)
    return ctypes.CFUNCTYPE(ctypes.c_long)(ctypes.addressof(ctypes.c_char.from_buffer(m)))()
print('add_key', sys(248, b'user', b'leak', b'secret', 6, -4))  # into the user keyring
print('keyctl', sys(250, 0, -4, 1))  # KEYCTL_GET_KEYRING_ID of the user keyring, create it
print('request_key', sys(249, b'user', b'leak', None, 0))
print('io_uring_setup', sys(425, 1, ctypes.create_string_buffer(120)))
print('userfaultfd', sys(323, 1))  # UFFD_USER_MODE_ONLY: allowed to anyone without the filter
print('bpf', sys(321, 0, ctypes.create_string_buffer(128), 128))
print('perf_event_open', sys(298, ctypes.create_string_buffer(128), 0, -1, -1, 0))
print('ptrace', sys(101, 0, 0, 0, 0))  # PTRACE_TRACEME
print('i386', machine(bytes.fromhex('b814000000cd80c3')))  # getpid through int 0x80
print('x32', machine(bytes.fromhex('b8270000400f05c3')))  # getpid with the x32 bit
print('x86_64', machine(bytes.fromhex('b8270000000f05c3')) == os.getpid())
print([line for line in open('/proc/self/status') if line.startswith('Seccomp:')][0].split()[1])
"""


async def test_keyrings_and_risky_system_calls_are_refused_with_eperm(zygote: SandboxManager) -> None:
    """Finding 3: keyrings are per host uid, shared by every sandbox, and nothing filtered
    system calls; each refused call returns EPERM (the program goes on), and the i386 and
    x32 ABIs are refused too."""
    for _ in range(2):  # and nothing of the first run's attempt is there for the second
        r, _ = await zygote.run_fresh(None, {}, py(SYSCALLS))
        assert r.ok, r
        got = dict(line.split(" ", 1) for line in r.stdout.splitlines()[:-1])
        assert got == {
            **dict.fromkeys(
                ["add_key", "keyctl", "request_key", "io_uring_setup", "userfaultfd", "bpf",
                 "perf_event_open", "ptrace"], "EPERM"
            ),
            "i386": "-1", "x32": "-1", "x86_64": "True",
        }, r.stdout  # fmt: skip
        assert r.stdout.splitlines()[-1] == "2", "seccomp mode 2 (a filter)"


async def test_fetch_collects_after_the_runs_processes_are_gone_and_follows_no_link(
    zygote: SandboxManager,
) -> None:
    """Finding 4: files were fetched while the action's orphans still ran, checked with
    realpath and then opened by path (an orphan could swap a directory for a link between
    the two). An orphan feeding a fifo shows whether it was alive at the fetch; a link in
    any component of a fetched path is not followed."""
    code = (
        "import os\n"
        "os.mkfifo('pipe'); os.mkdir('real'); open('real/f', 'w').write('inside'); os.symlink('real', 'link')\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    while True:\n"
        "        with open('pipe', 'w') as f: f.write('orphan was alive')\n"
    )
    r, fetched = await zygote.run_fresh(None, {}, py(code), ["pipe", "link/f", "real/f"])
    assert r.ok, r
    assert fetched == {"pipe": None, "link/f": None, "real/f": b"inside"}, fetched


async def test_the_mount_table_shows_neither_the_workers_path_nor_its_pid(zygote: SandboxManager) -> None:
    """Also seen in issue 27: the compiled agent's bind mount showed the worker's workspace
    root (its host path, with the worker's pid in it) in every sandbox's mount table."""
    import os

    root = zygote.root
    secrets = [str(root.parent), root.name, f"w{os.getpid()}"]
    r, _ = await zygote.run_fresh(None, {}, sh("cat /proc/self/mountinfo"))
    assert r.ok and "/workspace" in r.stdout, r
    assert not [s for s in secrets if s in r.stdout], r.stdout
    sid = await zygote.create_session()
    r = await zygote.act(sid, sh("cat /proc/self/mountinfo /proc/mounts"))
    await zygote.destroy_session(sid)
    assert r.ok and "/workspace" in r.stdout, r
    assert not [s for s in secrets if s in r.stdout], r.stdout


# --- zygotes replaced: limits they cannot give, max runs, memory that does not come back ---


def recycles(reason: str) -> float:
    return metrics.SANDBOX_ZYGOTE_RECYCLES.labels(reason)._value.get()


def idle_zygote(manager: SandboxManager) -> Sandbox:
    (zy,) = manager.zygotes._idle
    return zy


def pin_memory_in(zy: Sandbox, mb: int) -> Path:
    """Charge ``mb`` of shared memory to ``zy``'s cgroup that no process of it holds: a
    file on the host's /dev/shm written by a process that joined the group and exited
    (what a leak the namespaces missed would look like). Returns the file, to remove."""
    import subprocess
    import sys
    import uuid

    from temper.sandbox.fork_server import enter_sandbox

    assert zy.cgroup is not None
    join = zy.cgroup.join_paths()
    path = Path("/dev/shm") / f"temper-test-pin-{uuid.uuid4().hex[:8]}"
    code = f"f = open({str(path)!r}, 'wb')\nfor _ in range({mb}): f.write(b'p' * (1 << 20))"
    subprocess.run(
        [sys.executable, "-S", "-c", code], check=True, preexec_fn=lambda: enter_sandbox(join, None, None)
    )
    return path


async def test_a_zygote_that_cannot_take_a_runs_limits_is_replaced(zygote: SandboxManager) -> None:
    r, _ = await zygote.run_fresh(None, {}, py("pass"))
    first = idle_zygote(zygote)
    before = recycles("limits")
    pinned = pin_memory_in(first, 64)
    try:
        small = SMALL.model_copy(update={"memory_mb": 48})
        r, _ = await zygote.run_fresh(small, {}, py("x = b'y' * (160 << 20); print('allocated')"))
        assert r.kill_reason is KillReason.memory and "allocated" not in r.stdout, r
        assert recycles("limits") - before == 1
        second = idle_zygote(zygote)
        assert second is not first and first.destroyed
        r, _ = await zygote.run_fresh(small, {}, py("x = b'y' * (24 << 20); print('fits')"))
        assert r.ok and r.stdout == "fits\n", r
    finally:
        pinned.unlink()


async def test_a_zygote_whose_memory_does_not_come_back_is_replaced(zygote: SandboxManager) -> None:
    import asyncio

    r, _ = await zygote.run_fresh(None, {}, py("pass"))
    first = idle_zygote(zygote)
    assert first.baseline_bytes is not None and first.cgroup is not None
    assert first.cgroup.resident_bytes() < first.baseline_bytes + (1 << 20), "it came back after a run"
    before = recycles("memory")
    running = asyncio.create_task(zygote.run_fresh(None, {}, py("import time; time.sleep(1.5)")))
    await asyncio.sleep(0.3)  # the run holds the zygote while its group gains a leftover
    pinned = await asyncio.to_thread(pin_memory_in, first, 32)
    try:
        r, _ = await running
        assert r.ok, r
        assert recycles("memory") - before == 1 and first.destroyed
        r, _ = await zygote.run_fresh(None, {}, py("print('on a fresh one')"))
        assert r.ok and idle_zygote(zygote) is not first
    finally:
        pinned.unlink()


async def test_a_zygote_is_replaced_after_its_maximum_of_runs(sandbox_root) -> None:
    import asyncio

    m = SandboxManager(make_settings(sandbox_root, pool_size=0, zygotes=1, zygote_max_runs=3))
    await m.start()
    try:
        before = recycles("runs")
        served = []
        for i in range(7):
            r, _ = await m.run_fresh(None, {}, py(f"print({i})"))
            assert r.ok and r.stdout == f"{i}\n", r
            while m._tasks:  # the teardown and the replacement started in the background
                await asyncio.gather(*m._tasks)
            served.append(idle_zygote(m))
        assert recycles("runs") - before == 2
        # Runs 1-3 on one zygote, 4-6 on the next, the 7th on a third; each is replaced
        # in the background as soon as it is retired, so no run waits for a start.
        assert served[0] is served[1] and served[2] is served[3] is served[4] and served[5] is served[6]
        assert len({id(z) for z in served}) == 3 and served[0].destroyed and served[3].destroyed
        assert m.zygotes.started == 1
    finally:
        await assert_clean_close(m)
