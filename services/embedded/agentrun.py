"""What ``temper run`` adds for a job whose episodes run an agent program
(``environment.kind: agent``): the gateway's agent base URLs served over HTTP on a port
of this machine's loopback, 127.0.0.2 (the agents' sandboxes reach it through their
allowlist proxy, which the sandbox worker lets through to that one address), the agent's files from
``local.agent_dir``, and the sandbox image from ``local.image`` published into the run's
own object store."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

from services.inference_gateway.component import Gateway
from services.inference_gateway.routes import add_agent_routes
from temper.jobspec import JobSpec, SpecError
from temper.runtime import Component
from temper.sandbox.images import publish

# A loopback address of this machine that a sandbox's NO_PROXY (localhost, 127.0.0.1: its
# own loopback) does not name, so the agent's calls go through its allowlist proxy.
AGENT_HOST = "127.0.0.2"


def agent_url() -> str:
    """Where this run serves the agent base URLs: a free port on :data:`AGENT_HOST`."""
    with socket.socket() as s:
        s.bind((AGENT_HOST, 0))
        return f"http://{AGENT_HOST}:{s.getsockname()[1]}"


class _Server(uvicorn.Server):
    """A server inside ``temper run``: Ctrl-C is the run's, not this server's."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def serving_agents(components: Sequence[Component], url: str) -> AsyncIterator[None]:
    """The gateway component's agent routes served at ``url`` (:func:`agent_url`)
    while the block runs."""
    gateway = next(c for c in components if isinstance(c, Gateway))
    app = FastAPI(title="Temper agent proxy (temper run)")
    app.state.gateway = gateway
    add_agent_routes(app)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    server = _Server(uvicorn.Config(app, host=host, port=int(port), log_config=None, lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # the port was taken: say why
        await asyncio.sleep(0.02)
    try:
        yield
    finally:
        server.should_exit = True
        await task


def agent_files(directory: Path) -> dict[str, str]:
    """The text files under ``directory`` (``local.agent_dir``), by path relative to it."""
    files = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            try:
                files[path.relative_to(directory).as_posix()] = path.read_text()
            except UnicodeDecodeError:
                raise SpecError([("local.agent_dir", f"{path} is not UTF-8 text")]) from None
    if not files:
        raise SpecError([("local.agent_dir", f"{directory} holds no files")])
    return files


def with_agent(spec: JobSpec, *, files: dict[str, str] | None, image: str | None) -> JobSpec:
    """``spec`` with the agent's files added to ``environment.agent.files`` and the image as
    ``environment.limits.image``."""
    env = spec.environment
    update: dict[str, Any] = {}
    if files and env.agent is not None:
        update["agent"] = env.agent.model_copy(update={"files": {**files, **env.agent.files}})
    if image:
        update["limits"] = {**env.limits, "image": image}
    return spec.model_copy(update={"environment": env.model_copy(update=update)}) if update else spec


async def publish_image(store: Any, path: Path) -> str:
    """Publish the image blob at ``path`` (``temper images build-debian --output``) into the
    run's store; its digest."""
    if not await asyncio.to_thread(path.is_file):
        raise SpecError([("local.image", f"{path} does not exist: build it with scripts/agent_image.sh")])
    return await publish(store, await asyncio.to_thread(path.read_bytes), source={"file": path.name})
