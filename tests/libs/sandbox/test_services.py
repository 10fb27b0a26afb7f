"""Services in a sandbox: started before the first action, alive across actions, on the
sandbox's own loopback, in its cgroup, and gone with it; everything else an action starts
still dies with the action."""

from __future__ import annotations

import pytest

from temper.sandbox import Action, NetworkPolicy, SandboxError, SandboxLimits, SandboxManager, ServiceSpec
from tests.libs.sandbox.conftest import SMALL

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(60)]

HTTP = ServiceSpec(
    name="web",
    command="mkdir -p /tmp/site && echo served > /tmp/site/index.html && "
    "exec python3 -m http.server 8080 --bind 127.0.0.1 --directory /tmp/site",
    ready_port=8080,
)
# A TCP counter: each connection gets the number of connections before it, so a reply of
# 2 on the third call proves the same process served all three.
COUNTER = ServiceSpec(
    name="counter",
    command=(
        "exec python3 -c '\n"
        "import socket\n"
        's = socket.create_server(("127.0.0.1", 9000))\n'
        "n = 0\n"
        "while True:\n"
        "    c, _ = s.accept(); c.sendall(str(n).encode()); c.close(); n += 1\n"
        "'"
    ),
    ready_command="python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 9000)).close()'",
)


def with_services(*services: ServiceSpec) -> SandboxLimits:
    return SandboxLimits.model_validate(
        {**SMALL.model_dump(), "network": "loopback", "services": [s.model_dump() for s in services]}
    )


def get(url: str) -> Action:
    return Action(
        kind="run_python",
        code=f"import urllib.request\nprint(urllib.request.urlopen({url!r}).read().decode())",
    )


def count() -> Action:
    return Action(
        kind="run_python",
        code="import socket\nprint(socket.create_connection(('127.0.0.1', 9000)).recv(16).decode())",
    )


async def test_services_outlive_actions_and_die_with_the_sandbox(manager: SandboxManager) -> None:
    sid = await manager.create_session(with_services(HTTP, COUNTER))
    sb = manager.get(sid)
    for _ in range(2):
        r = await manager.act(sid, get("http://127.0.0.1:8080/index.html"))
        assert r.ok and r.stdout.strip() == "served", r.stderr
    r = await manager.act(sid, count())
    # the readiness check connected once (0); this is the same process, one later
    assert r.ok and r.stdout.strip() == "1", r.stdout + r.stderr
    # An action's own background processes, setsid and double forks included, still die.
    sleeps = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done | grep -c '^sleep 100' || true"
    start = "(setsid sleep 100 &); (sleep 100 &); nohup sleep 100 >/dev/null 2>&1 & sleep 0.3; "
    r = await manager.act(sid, Action(kind="run_command", command=start + sleeps))
    assert r.stdout.strip() == "3", r.stdout + r.stderr  # all three running during the action
    r = await manager.act(sid, Action(kind="run_command", command=sleeps))
    assert r.stdout.strip() == "0", r.stdout
    r = await manager.act(sid, count())
    assert r.stdout.strip() == "2"
    # The services are in the sandbox's cgroup (besides bwrap and the agent).
    assert sb.cgroup is not None
    assert len(sb.cgroup.procs()) >= len(sb.keep) + 2
    await manager.destroy_session(sid)
    assert sb.cgroup.procs() == []  # checked again by the fixture: nothing left anywhere


async def test_a_service_that_never_gets_ready_fails_the_start(manager: SandboxManager) -> None:
    never = ServiceSpec(
        name="mute", command="echo starting; echo oops >&2; sleep 60", ready_port=7000, ready_timeout_s=1
    )
    with pytest.raises(
        SandboxError, match=r"service mute was not ready within 1 s \(port 7000\).*starting\\noops"
    ):
        await manager.acquire(with_services(never))


async def test_services_need_a_loopback_policy() -> None:
    with pytest.raises(ValueError, match="services need network: loopback"):
        SandboxLimits(services=[HTTP])
    assert SandboxLimits(network=NetworkPolicy.loopback, services=[HTTP]).services[0].name == "web"
    with pytest.raises(ValueError, match="exactly one of ready_port and ready_command"):
        ServiceSpec(name="x", command="true")


async def test_a_fork_bomb_beside_a_service_is_cleaned_up(manager: SandboxManager) -> None:
    sid = await manager.create_session(with_services(COUNTER))
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    r = await manager.act(sid, Action(kind="run_python", code=bomb, timeout_s=2))
    assert r.kill_reason is not None
    r = await manager.act(sid, count())
    assert r.ok and r.stdout.strip() == "1", r.stdout + r.stderr
    procs = "import os\nprint(sum(e.isdigit() for e in os.listdir('/proc')))"
    r = await manager.act(sid, Action(kind="run_python", code=procs))
    assert r.ok and int(r.stdout) <= 3, r.stdout  # the agent, the counter, this action
    await manager.destroy_session(sid)


async def test_every_process_of_a_sandbox_runs_under_the_system_call_filter(manager: SandboxManager) -> None:
    """The agent, the task's services and the actions all inherit bwrap's seccomp filter:
    keyctl is refused (EPERM) in every one of them."""
    sid = await manager.create_session(with_services(COUNTER))
    code = (
        "import os\n"
        "for pid in sorted(int(p) for p in os.listdir('/proc') if p.isdigit()):\n"
        "    status = dict(l.split(':', 1) for l in open(f'/proc/{pid}/status').read().splitlines())\n"
        "    print(status['Name'].strip(), status['Seccomp'].strip())\n"
    )
    r = await manager.act(sid, Action(kind="run_python", code=code))
    await manager.destroy_session(sid)
    assert r.ok, r
    seen = [line.split() for line in r.stdout.splitlines()]
    assert {mode for _name, mode in seen} == {"2"}, seen
    assert [name for name, _ in seen].count("python3") >= 3, seen  # the agent, the counter, this action
