"""One-shot runs on zygotes (``SandboxManager.run_fresh``): each run in pid, mount and IPC
namespaces of its own, on a fresh workspace and /tmp, without a capability; one zygote
(``zygotes=1``) serves every run here, so anything a run could leave for the next would
be found."""

from __future__ import annotations

import pytest

from temper import metrics
from temper.sandbox import Action, KillReason, NetworkPolicy, SandboxManager
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
    r, fetched = await zygote.run_fresh(lim, {"in": b"x"}, sh("cat in > out"), ["out"])
    assert r.ok and fetched == {"out": b"x"}
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
