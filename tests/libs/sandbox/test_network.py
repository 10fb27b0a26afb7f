"""Network policies on the real bwrap backend: none (the default), allowlist through the
worker's proxy, host refused unless the operator allows it. Every server here listens on
the host's 127.0.0.1 only."""

from __future__ import annotations

import socket
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from temper import metrics
from temper.sandbox import Action, NetworkPolicy, SandboxError, SandboxLimits, SandboxManager
from tests.libs.sandbox.conftest import SMALL, assert_clean_close, make_settings

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(60)]


class Hello(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        body = f"hello from {self.server.server_address[1]} {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def servers() -> Iterator[tuple[int, int]]:
    """Two HTTP servers on the host's 127.0.0.1: the first is allowlisted, the second not."""
    started = [ThreadingHTTPServer(("127.0.0.1", 0), Hello) for _ in range(2)]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in started]
    for t in threads:
        t.start()
    yield started[0].server_address[1], started[1].server_address[1]
    for s in started:
        s.shutdown()
        s.server_close()


@pytest.fixture
async def net_manager(sandbox_root: Path) -> AsyncIterator[SandboxManager]:
    # The test servers are on loopback, which the proxy refuses unless allowed.
    m = SandboxManager(make_settings(sandbox_root, egress_allow_private=True))
    await m.start()
    yield m
    await assert_clean_close(m)


def fetch(url: str) -> Action:
    """urllib in the sandbox, through the proxy that HTTP_PROXY names. (NO_PROXY, which
    sends the sandbox's own 127.0.0.1 direct, is emptied: the test's servers are on the
    host's 127.0.0.1.)"""
    return Action(
        kind="run_python",
        env={"NO_PROXY": "", "no_proxy": ""},
        code=(
            "import urllib.request, urllib.error\n"
            f"try:\n    print(urllib.request.urlopen({url!r}, timeout=5).read().decode())\n"
            "except urllib.error.HTTPError as e:\n    print('HTTP', e.code, e.read().decode())\n"
        ),
    )


def connect(port: int, payload: bytes) -> Action:
    """A raw TCP client in the sandbox: prints what the server answered, or the error."""
    return Action(
        kind="run_python",
        code=(
            "import socket\n"
            f"try:\n    s = socket.create_connection(('127.0.0.1', {port}), 3)\n"
            f"    s.sendall({payload!r}); print(s.recv(4096).decode(errors='replace'))\n"
            "except OSError as e:\n    print('ERR', type(e).__name__, e)\n"
        ),
    )


async def test_default_is_none_and_reaches_nothing(manager: SandboxManager, servers: tuple[int, int]) -> None:
    assert SandboxLimits().network is NetworkPolicy.none
    allowed, _ = servers
    async with manager.sandbox() as sb:
        r = await sb.act(connect(allowed, b"GET / HTTP/1.0\r\n\r\n"))
        assert r.stdout.startswith("ERR ConnectionRefusedError"), r.stdout + r.stderr
        r = await sb.act(Action(kind="run_command", command="env | grep -i proxy; ls /run/temper"))
        assert r.stdout == "" and r.exit_code != 0  # no proxy, no socket


async def test_allowlist_allows_the_listed_port_and_refuses_the_rest(
    net_manager: SandboxManager, servers: tuple[int, int]
) -> None:
    allowed, other = servers
    limits = SMALL.model_copy(update={"network": NetworkPolicy.allowlist, "allow": [f"127.0.0.1:{allowed}"]})
    refused_before = metrics.SANDBOX_EGRESS_REFUSED._value.get()
    sid = await net_manager.create_session(SandboxLimits.model_validate(limits.model_dump()))
    # Allowed: plain HTTP through the proxy (urllib reads HTTP_PROXY), in two actions:
    # the forwarder outlives the first one.
    for _ in range(2):
        r = await net_manager.act(sid, fetch(f"http://127.0.0.1:{allowed}/x"))
        assert r.stdout.strip() == f"hello from {allowed} /x", r.stdout + r.stderr
    # Allowed: a CONNECT tunnel, then HTTP inside it.
    r = await net_manager.act(
        sid,
        connect(3128, f"CONNECT 127.0.0.1:{allowed} HTTP/1.1\r\n\r\nGET /t HTTP/1.0\r\n\r\n".encode()),
    )
    assert r.stdout.startswith("HTTP/1.1 200 Connection established"), r.stdout + r.stderr
    # Refused: the other port, by CONNECT and by plain HTTP; a name not on the list.
    r = await net_manager.act(sid, connect(3128, f"CONNECT 127.0.0.1:{other} HTTP/1.1\r\n\r\n".encode()))
    assert r.stdout.startswith("HTTP/1.1 403 Forbidden") and "not on the sandbox's allowlist" in r.stdout
    r = await net_manager.act(sid, fetch(f"http://127.0.0.1:{other}/"))
    assert r.stdout.startswith("HTTP 403"), r.stdout + r.stderr
    r = await net_manager.act(sid, connect(3128, b"CONNECT example.com:443 HTTP/1.1\r\n\r\n"))
    assert r.stdout.startswith("HTTP/1.1 403 Forbidden")
    assert metrics.SANDBOX_EGRESS_REFUSED._value.get() - refused_before == 3
    # Direct connections never leave the sandbox's own network namespace.
    for port in (allowed, other):
        r = await net_manager.act(sid, connect(port, b"GET / HTTP/1.0\r\n\r\n"))
        assert r.stdout.startswith("ERR ConnectionRefusedError"), r.stdout
    r = await net_manager.act(
        sid, Action(kind="run_command", command="cat /proc/net/dev | tail -n +3 | cut -d: -f1")
    )
    assert r.stdout.split() == ["lo"]
    await net_manager.destroy_session(sid)


async def test_the_proxy_refuses_private_addresses_unless_allowed(
    manager: SandboxManager, servers: tuple[int, int]
) -> None:
    allowed, _ = servers
    limits = SMALL.model_copy(update={"network": NetworkPolicy.allowlist, "allow": [f"localhost:{allowed}"]})
    async with manager.sandbox(SandboxLimits.model_validate(limits.model_dump())) as sb:
        r = await sb.act(connect(3128, f"CONNECT localhost:{allowed} HTTP/1.1\r\n\r\n".encode()))
        assert r.stdout.startswith("HTTP/1.1 403 Forbidden") and "loopback/private" in r.stdout, r.stdout


async def test_host_network_is_refused_unless_the_operator_allows_it(sandbox_root: Path) -> None:
    assert SandboxLimits.model_validate({"network": True}).network is NetworkPolicy.host  # the old boolean
    assert SandboxLimits.model_validate({"network": False}).network is NetworkPolicy.none
    m = SandboxManager(make_settings(sandbox_root, pool_size=0))
    await m.start()
    try:
        with pytest.raises(SandboxError, match="ALLOW_HOST_NETWORK"):
            await m.acquire(SandboxLimits(network=NetworkPolicy.host))
    finally:
        await assert_clean_close(m)
    m = SandboxManager(make_settings(sandbox_root, pool_size=0, allow_host_network=True))
    await m.start()
    try:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        async with m.sandbox(SMALL.model_copy(update={"network": NetworkPolicy.host})) as sb:
            r = await sb.act(connect(listener.getsockname()[1], b"x"))
            assert not r.stdout.startswith("ERR"), r.stdout  # reached the host's listener
        listener.close()
    finally:
        await assert_clean_close(m)


def test_limits_validate_the_policy() -> None:
    with pytest.raises(ValueError, match="needs at least one host:port"):
        SandboxLimits(network=NetworkPolicy.allowlist)
    with pytest.raises(ValueError, match="only for network: allowlist"):
        SandboxLimits(allow=["example.com:443"])
    with pytest.raises(ValueError, match="is not host:port"):
        SandboxLimits(network=NetworkPolicy.allowlist, allow=["example.com"])
    assert SandboxLimits(network="allowlist", allow=["Example.COM:443"]).allow == ["example.com:443"]


async def test_allowlist_and_a_service_on_the_image(
    sandbox_root: Path, image_store, debian_image: str, servers: tuple[int, int]
) -> None:
    """The same on the Debian image: its python3 runs the forwarder and the service."""
    from temper.sandbox import ServiceSpec
    from tests.libs.sandbox.conftest import IMAGE_CACHE

    store, _ = image_store
    settings = make_settings(
        sandbox_root,
        pool_size=0,
        image_cache=IMAGE_CACHE,
        default_image=debian_image,
        egress_allow_private=True,
    )
    m = SandboxManager(settings, store=store)
    await m.start()
    try:
        allowed, other = servers
        web = ServiceSpec(
            name="web", command="exec python3 -m http.server 8080 --bind 127.0.0.1", ready_port=8080
        )
        limits = SandboxLimits.model_validate(
            {
                **SMALL.model_dump(),
                "network": "allowlist",
                "allow": [f"127.0.0.1:{allowed}"],
                "services": [web.model_dump()],
            }
        )
        async with m.sandbox(limits) as sb:
            assert sb.image is not None
            r = await sb.act(fetch(f"http://127.0.0.1:{allowed}/img"))
            assert r.stdout.strip() == f"hello from {allowed} /img", r.stdout + r.stderr
            r = await sb.act(fetch(f"http://127.0.0.1:{other}/"))
            assert r.stdout.startswith("HTTP 403"), r.stdout + r.stderr
            local = Action(
                kind="run_command",
                command="git --version && python3 -c \"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8080/').status)\"",
            )
            r = await sb.act(local)  # NO_PROXY: the sandbox's own service is reached directly
            assert r.ok and r.stdout.split()[-1] == "200", r.stdout + r.stderr
    finally:
        await assert_clean_close(m)
