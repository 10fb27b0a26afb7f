"""The egress proxy of a ``network: allowlist`` sandbox, run by the worker.

The sandbox keeps its private network namespace (no route out). The worker listens on a
Unix socket bound into the sandbox at ``/run/temper/proxy.sock``; a forwarder the agent
starts inside relays ``127.0.0.1:3128`` to it, and ``HTTP(S)_PROXY`` point there. This
proxy takes one request per connection: ``CONNECT host:port`` (HTTPS, git, anything
tunnelled) or a plain-HTTP request in absolute form (``GET http://host:port/path``).
The target must be on the sandbox's list; the name is resolved here and the connection
goes to the address resolved (no second lookup for a rebinding name to change), and an
address in a loopback, private, link-local or reserved range is refused unless the
operator allows it (all of them, or the platform's own targets such as the gateway that
agents call: ``TEMPER_SANDBOX__EGRESS_PRIVATE_TARGETS``). Every refusal is logged and counted; the client gets a 403.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
from collections.abc import Sequence
from pathlib import Path

from temper import metrics
from temper.limits import split_host_port

log = logging.getLogger(__name__)

SANDBOX_SOCKET = "/run/temper/proxy.sock"  # where the sandbox sees it
FORWARD_PORT = 3128  # the forwarder's port on the sandbox's loopback
MAX_HEAD = 16384
HEAD_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0


class Refused(Exception):
    pass


def _blocked(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return bool(
        ip.is_loopback or ip.is_private or ip.is_link_local or ip.is_multicast
        or ip.is_reserved or ip.is_unspecified
    )  # fmt: skip


class EgressProxy:
    def __init__(
        self,
        path: Path,
        allow: list[str],
        *,
        sandbox_id: str,
        allow_private: bool = False,
        private_targets: Sequence[str] = (),
    ) -> None:
        self.path = path
        self.allow = {split_host_port(entry) for entry in allow}
        self.sandbox_id = sandbox_id
        self.allow_private = allow_private
        # listed targets the operator's own platform serves (the gateway agents call): reached
        # even where they resolve to private addresses
        self.private_targets = {split_host_port(entry) for entry in private_targets}
        self.refused = 0
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        if len(os.fsencode(self.path)) >= 108:
            raise OSError(f"proxy socket path too long for AF_UNIX: {self.path}")
        self._server = await asyncio.start_unix_server(self._handle, path=str(self.path), limit=MAX_HEAD)
        os.chmod(self.path, 0o666)  # the sandbox uid connects to it

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._conns):
            task.cancel()
        with contextlib.suppress(OSError):
            self.path.unlink()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            await self._serve(reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            pass
        finally:
            self._conns.discard(task)
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            return await self._answer(writer, 400, "not an HTTP request line")
        method, target, version = parts
        try:
            if method.upper() == "CONNECT":
                host, port = split_host_port(target)
                forward = b""
            else:
                host, port, forward = _origin_form(method, target, version, lines[1:])
        except ValueError as e:
            return await self._answer(writer, 400, str(e))
        try:
            address = await self._check(host, port)
        except Refused as e:
            self.refused += 1
            metrics.SANDBOX_EGRESS_REFUSED.inc()
            log.warning("sandbox %s: egress to %s:%d refused: %s", self.sandbox_id, host, port, e)
            return await self._answer(writer, 403, f"egress to {host}:{port} refused: {e}")
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(address, port), CONNECT_TIMEOUT_S
            )
        except (OSError, TimeoutError) as e:
            return await self._answer(writer, 502, f"cannot connect to {host}:{port}: {e}")
        log.info("sandbox %s: egress to %s:%d (%s)", self.sandbox_id, host, port, address)
        if forward:
            up_writer.write(forward)
        else:
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            up_writer.close()

    async def _check(self, host: str, port: int) -> str:
        if (host, port) not in self.allow:
            raise Refused("not on the sandbox's allowlist")
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as e:
            raise Refused(f"cannot resolve {host}: {e}") from None
        addresses = [str(info[4][0]) for info in infos]
        if not addresses:
            raise Refused(f"{host} has no address")
        private_ok = self.allow_private or (host, port) in self.private_targets
        if not private_ok and any(_blocked(a) for a in addresses):
            raise Refused(
                f"{host} resolves to a loopback/private/link-local address "
                "(TEMPER_SANDBOX__EGRESS_ALLOW_PRIVATE)"
            )
        return addresses[0]

    @staticmethod
    async def _answer(writer: asyncio.StreamWriter, status: int, text: str) -> None:
        reason = {400: "Bad Request", 403: "Forbidden", 502: "Bad Gateway"}[status]
        body = f"temper proxy: {text}\n".encode()
        writer.write(
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + body
        )
        with contextlib.suppress(OSError):
            await writer.drain()


def _origin_form(method: str, target: str, version: str, headers: list[str]) -> tuple[str, int, bytes]:
    """A plain-HTTP proxy request rewritten for the origin server: the path only, no
    ``Proxy-*`` headers, and ``Connection: close`` (one request per tunnel)."""
    if not target.lower().startswith("http://"):
        raise ValueError("only CONNECT and absolute http:// requests go through this proxy")
    rest = target[7:]
    authority, slash, path = rest.partition("/")
    if ":" not in authority.rsplit("]", 1)[-1]:
        authority += ":80"
    host, port = split_host_port(authority)
    kept = [h for h in headers if h and not h.lower().startswith(("proxy-", "connection:", "keep-alive:"))]
    lines = [f"{method} {slash or '/'}{path} {version}", *kept, "Connection: close", "", ""]
    return host, port, "\r\n".join(lines).encode("latin-1")


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.close()
