"""The proxy's minimal HTTP/1.1 client (http1.py) and the error kinds the backend maps it to,
against scripted raw-socket servers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from services.inference_gateway.backends import BackendError, CpuServerBackend, ErrorKind
from services.inference_gateway.http1 import HTTP1Pool, HTTPTransportError
from temper.settings.inference import BackendSpec

pytestmark = pytest.mark.timeout(20)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


def response(status: int, body: bytes, *extra: str) -> bytes:
    head = [f"HTTP/1.1 {status} X", f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return await reader.readexactly(length)


class Server:
    """Serves each connection with ``handler(reader, writer, connection_number)``."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self.connections)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()


def keep_alive(*answers: bytes) -> Handler:
    """Answers requests on one connection in turn, then keeps it open."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        for answer in answers:
            await read_request(reader)
            writer.write(answer)
        await reader.read()

    return handler


@pytest.fixture
async def ok_server() -> AsyncIterator[tuple[Server, str]]:
    srv = Server(keep_alive(*[response(200, b'{"n":%d}' % i) for i in range(3)]))
    async with srv as url:
        yield srv, url


async def test_reuses_one_connection(ok_server) -> None:  # noqa: ANN001
    srv, url = ok_server
    pool = HTTP1Pool(url, connect_timeout_s=1)
    try:
        assert await pool.post("/a", b"{}", timeout_s=5) == (200, b'{"n":0}')
        assert await pool.post("/a", b"{}", timeout_s=5) == (200, b'{"n":1}')
        assert srv.connections == 1
    finally:
        await pool.aclose()


async def test_request_line_headers_and_url_prefix() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        seen.append(head + await reader.readexactly(7))
        writer.write(response(200, b"{}"))
        await reader.read()

    async with Server(handler) as url:
        pool = HTTP1Pool(url + "/prefix/", connect_timeout_s=1)
        await pool.post("/v1/completions", b'{"a":1}', timeout_s=5)
        await pool.aclose()
    lines = seen[0].split(b"\r\n")
    assert lines[0] == b"POST /prefix/v1/completions HTTP/1.1"
    assert b"Content-Type: application/json" in lines and b"Content-Length: 7" in lines
    assert lines[1] == b"Host: " + url.removeprefix("http://").encode() and seen[0].endswith(b'{"a":1}')


async def test_chunked_and_connection_close_and_body_to_eof() -> None:
    chunked = (
        b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{"a"\r\n3;x=y\r\n:1}\r\n0\r\nT: 1\r\n\r\n'
    )

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        if n == 1:
            writer.write(chunked)
            await read_request(reader)
            writer.write(response(200, b'{"b":2}', "Connection: close"))
        else:
            writer.write(b'HTTP/1.1 200 OK\r\n\r\n{"c":3}')  # no length: the body ends with the connection

    srv = Server(handler)
    async with srv as url:
        pool = HTTP1Pool(url, connect_timeout_s=1)
        assert await pool.post("/", b"{}", timeout_s=5) == (200, b'{"a":1}')
        assert await pool.post("/", b"{}", timeout_s=5) == (200, b'{"b":2}')  # same connection, then closed
        assert await pool.post("/", b"{}", timeout_s=5) == (200, b'{"c":3}')  # a new one, closed after
        assert await pool.post("/", b"{}", timeout_s=5) == (200, b'{"c":3}')
        assert not pool._idle  # noqa: SLF001
        await pool.aclose()
    assert srv.connections == 3


async def test_a_reused_connection_closed_without_an_answer_is_replaced_once() -> None:
    # What a server that drops an idle keep-alive connection looks like from here: the
    # request goes out on the reused connection and the answer is EOF.
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(response(200, b'{"conn":%d}' % n))
        if n == 1:
            await read_request(reader)  # the second request: closed without an answer

    srv = Server(handler)
    async with srv as url:
        pool = HTTP1Pool(url, connect_timeout_s=1)
        assert await pool.post("/", b"{}", timeout_s=5) == (200, b'{"conn":1}')
        assert await pool.post("/", b"{}", timeout_s=5) == (200, b'{"conn":2}')
        await pool.aclose()
    assert srv.connections == 2


async def backend_error(handler: Handler, *, timeout_s: float = 5.0) -> BackendError:
    async with Server(handler) as url:
        b = CpuServerBackend(
            BackendSpec(name="e0", url=url), model_name="m", timeout_s=timeout_s, connect_timeout_s=1
        )
        try:
            with pytest.raises(BackendError) as info:
                await b.post("/v1/completions", {"prompt": [1]})
        finally:
            await b.aclose()
    return info.value


@pytest.mark.parametrize(
    ("answer", "kind", "status"),
    [
        (response(503, b"busy"), ErrorKind.server, 503),
        (response(429, b"slow down"), ErrorKind.server, 429),
        (response(400, b"maximum context length"), ErrorKind.client, 400),
        (response(200, b"<html>"), ErrorKind.protocol, None),
        (b"SSH-2.0-OpenSSH\r\n\r\n", ErrorKind.connect, None),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}", ErrorKind.connect, None),  # cut short
        (b"", ErrorKind.connect, None),  # closed without an answer
    ],
)
async def test_backend_error_kinds(answer: bytes, kind: ErrorKind, status: int | None) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(answer)

    err = await backend_error(handler)
    assert err.kind is kind and err.status == status
    if status is not None:
        assert answer.split(b"\r\n\r\n")[1].decode() in str(err)


async def test_backend_timeout_and_refused_connection() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await reader.read()

    err = await backend_error(silent, timeout_s=0.2)
    assert err.kind is ErrorKind.timeout and err.retryable

    async with Server(silent) as url:
        pass  # closed: nothing listens there now
    b = CpuServerBackend(BackendSpec(name="e0", url=url), model_name="m", connect_timeout_s=1)
    with pytest.raises(BackendError) as info:
        await b.post("/v1/completions", {})
    assert info.value.kind is ErrorKind.connect and info.value.retryable
    await b.aclose()


async def test_backend_posts_json_and_parses_the_answer() -> None:
    got: list[dict] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        got.append(json.loads(await read_request(reader)))
        writer.write(response(200, '{"ok":true,"s":"é"}'.encode()))
        await reader.read()

    async with Server(handler) as url:
        b = CpuServerBackend(BackendSpec(name="e0", url=url), model_name="m")
        assert await b.post("/v1/x", {"prompt": [1, 2], "stop": ["é"], "t": 0.5}) == {"ok": True, "s": "é"}
        await b.aclose()
    assert got == [{"prompt": [1, 2], "stop": ["é"], "t": 0.5}]


def test_only_plain_http_urls() -> None:
    assert HTTP1Pool.supports("http://h:1") and not HTTP1Pool.supports("https://h")
    with pytest.raises(ValueError):
        HTTP1Pool("https://h", connect_timeout_s=1)
    b = CpuServerBackend(BackendSpec(name="e0", url="https://h"), model_name="m")
    assert b._http1 is None  # noqa: SLF001 - TLS backends keep the httpcore pool


async def test_transport_error_is_raised_by_the_pool() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)

    async with Server(handler) as url:
        pool = HTTP1Pool(url, connect_timeout_s=1)
        with pytest.raises(HTTPTransportError):
            await pool.post("/", b"{}", timeout_s=5)
        await pool.aclose()
