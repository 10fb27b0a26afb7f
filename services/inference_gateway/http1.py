"""A minimal keep-alive HTTP/1.1 client for the proxy's hot path: JSON POSTs to one backend.

The gateway proxies every completion to a backend on the same host or network, where a
request takes a few milliseconds; a general client (httpx, httpcore with h11 and anyio)
spends a large part of that in its own layers. This one writes a request in one call and
reads the response straight from an asyncio stream. It speaks just enough HTTP/1.1 for
that: ``Content-Length`` and ``chunked`` bodies (or a body up to EOF), ``Connection: close``,
idle connections kept for reuse. Plain ``http://`` only; callers use another client for TLS.

Errors: :class:`TimeoutError` when ``timeout_s`` runs out (connect: ``connect_timeout_s``),
:class:`HTTPTransportError` for anything else between the sockets (refused, reset, closed
early, a response that is not HTTP/1.x).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from urllib.parse import urlsplit

_MAX_HEAD = 64 * 1024  # the response's status line and headers
_NO_BODY = frozenset({204, 304})


class HTTPTransportError(Exception):
    """The connection failed or the backend's answer is not HTTP/1.x."""


class _Stale(Exception):
    """The connection was closed (EOF or reset) before any byte of the response. On a reused
    connection that means the server dropped it while idle, before reading the request, so
    the request goes once more on a fresh connection; on a fresh one it is an error."""


class _Conn:
    __slots__ = ("reader", "writer", "idle_since")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def usable(self, now: float, expiry_s: float) -> bool:
        return not (self.reader.at_eof() or self.writer.is_closing()) and now - self.idle_since < expiry_s

    def close(self) -> None:
        self.writer.close()


class HTTP1Pool:
    """Keep-alive connections to one ``http://host:port[/prefix]`` origin."""

    def __init__(
        self, url: str, *, connect_timeout_s: float, max_idle: int = 64, keepalive_expiry_s: float = 30.0
    ) -> None:
        u = urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"not a plain http:// url: {url!r}")
        self.host = u.hostname
        self.port = u.port or 80
        self.prefix = u.path.rstrip("/")
        self._host_header = u.netloc.rsplit("@", 1)[-1].encode("ascii")
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self.keepalive_expiry_s = keepalive_expiry_s
        self._idle: deque[_Conn] = deque()

    @staticmethod
    def supports(url: str) -> bool:
        return url.startswith("http://")

    async def post(
        self, path: str, body: bytes, *, timeout_s: float, content_type: bytes = b"application/json"
    ) -> tuple[int, bytes]:
        """POST ``body`` to ``path``; returns the status and the whole response body."""
        head = b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n" % (
            (self.prefix + path).encode("ascii"),
            self._host_header,
            content_type,
            len(body),
        )
        request = head + body
        conn = self._take_idle()
        if conn is not None:
            try:
                return await self._exchange(conn, request, timeout_s)
            except _Stale:
                pass  # dropped while idle: once more on a fresh connection
        try:
            return await self._exchange(await self._connect(), request, timeout_s)
        except _Stale as exc:
            raise HTTPTransportError("server closed the connection without a response") from exc

    async def aclose(self) -> None:
        while self._idle:
            self._idle.popleft().close()

    # --- connections -----------------------------------------------------------------------------
    def _take_idle(self) -> _Conn | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()  # the most recently used: least likely to have been dropped
            if conn.usable(now, self.keepalive_expiry_s):
                return conn
            conn.close()
        return None

    def _put_idle(self, conn: _Conn) -> None:
        if len(self._idle) >= self.max_idle:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    async def _connect(self) -> _Conn:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(self.host, self.port, limit=_MAX_HEAD)
        except TimeoutError:
            raise
        except OSError as exc:
            raise HTTPTransportError(f"connect to {self.host}:{self.port}: {exc}") from exc
        return _Conn(reader, writer)

    # --- one request/response ------------------------------------------------------------------
    async def _exchange(self, conn: _Conn, request: bytes, timeout_s: float) -> tuple[int, bytes]:
        keep = False
        try:
            async with asyncio.timeout(timeout_s):
                status, headers = await _send(conn, request)
                body, keep = await _read_body(conn.reader, status, headers)
        except TimeoutError:
            raise
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            raise HTTPTransportError(f"{type(exc).__name__}: {exc}") from exc
        finally:  # a connection is reused only after a complete exchange
            if keep:
                self._put_idle(conn)
            else:
                conn.close()
        return status, body


async def _send(conn: _Conn, request: bytes) -> tuple[int, dict[bytes, bytes]]:
    """Write the request and read the response head; :class:`_Stale` when the connection
    turns out closed (EOF or reset) before the first byte of an answer."""
    try:
        conn.writer.write(request)
        await conn.writer.drain()
        return await _read_head(conn.reader)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise
        raise _Stale from exc
    except ConnectionError as exc:
        raise _Stale from exc


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes]]:
    """The status and the headers (names lower-cased; the HTTP version under ``b":version"``)."""
    lines = (await reader.readuntil(b"\r\n\r\n"))[:-4].split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    if not version.startswith(b"HTTP/1."):
        raise ValueError(f"not an HTTP/1.x response: {lines[0][:80]!r}")
    status = int(rest[:3])
    if status < 200:
        raise ValueError(f"unexpected informational response {status}")
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise ValueError(f"malformed header line {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    headers[b":version"] = version  # no header name has a colon
    return status, headers


async def _read_body(
    reader: asyncio.StreamReader, status: int, headers: dict[bytes, bytes]
) -> tuple[bytes, bool]:
    """The body, and whether the connection may carry another request."""
    connection = headers.get(b"connection", b"").lower()
    keep = b"close" not in connection and (headers[b":version"] != b"HTTP/1.0" or b"keep-alive" in connection)
    if status in _NO_BODY:
        return b"", keep
    if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
        return await _read_chunked(reader), keep
    length = headers.get(b"content-length")
    if length is None:
        return await reader.read(), False  # delimited by the end of the connection
    return await reader.readexactly(int(length)), keep


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip(), 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass  # trailers
            return b"".join(parts)
        parts.append((await reader.readexactly(size + 2))[:-2])
