"""Request bodies read with a limit: ``413`` as soon as the declared length, or the bytes
received so far, pass it, never after the whole body was buffered. The limits are the
API's documented ones (docs/api.md, "Errors")."""

from __future__ import annotations

from fastapi import HTTPException, Request, status

MAX_SPEC_BYTES = 1 << 20  # a job spec
MAX_TASKSET_BYTES = 64 << 20  # a task set upload (JSONL or YAML)


def too_large(what: str, limit: int) -> HTTPException:
    return HTTPException(
        status.HTTP_413_CONTENT_TOO_LARGE,
        f"{what} is larger than its limit of {limit} bytes ({limit >> 20} MiB)",
    )


async def read_limited(request: Request, limit: int, what: str) -> bytes:
    """The body of ``request``, refused with 413 once it passes ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(what, limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(what, limit)
        chunks.append(chunk)
    return b"".join(chunks)
