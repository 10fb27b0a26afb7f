"""temper.eventloop: the loop service processes and the CLI run on."""

from __future__ import annotations

import asyncio
import sys

import pytest
import uvloop

from temper import eventloop


async def _loop_and_child_output() -> tuple[type, bytes]:
    """The running loop's type, and what a child process printed (the sandbox and the
    embedded runner start children on this loop)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "print('from the child')", stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    return type(asyncio.get_running_loop()), out


def test_services_run_on_uvloop_by_default(monkeypatch):
    monkeypatch.delenv("TEMPER_EVENT_LOOP", raising=False)
    loop_type, out = eventloop.run(_loop_and_child_output())
    assert issubclass(loop_type, uvloop.Loop)
    assert out == b"from the child\n"


def test_the_standard_loop_when_asked(monkeypatch):
    monkeypatch.setenv("TEMPER_EVENT_LOOP", "asyncio")
    loop_type, out = eventloop.run(_loop_and_child_output())
    assert not issubclass(loop_type, uvloop.Loop)
    assert issubclass(loop_type, asyncio.BaseEventLoop)
    assert out == b"from the child\n"


def test_an_unknown_loop_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("TEMPER_EVENT_LOOP", "trio")
    coro = _loop_and_child_output()
    with pytest.raises(ValueError, match=r"TEMPER_EVENT_LOOP='trio': expected one of uvloop, asyncio"):
        eventloop.run(coro)
    coro.close()
