"""``temper serve``: the whole platform in one process on one machine.

The dispatcher's app (REST API, console, episode state machine) with the other four services
started on its runtime (sandbox worker, gateway with the in-process CPU engine, reward
scorer, trainer), task-set validation run in-process instead of on Celery, SQLite and a
local object store under the data directory, the in-process bus. Redis is never used.

Order of work: settings (the environment's, with the data directory's database and
object store unless ``TEMPER_DB__URL`` / ``TEMPER_STORAGE__ROOT`` say otherwise);
migrations to head; the admin key of tenant ``local`` (the tenant ``temper run`` writes
its job under, so ``temper serve --data-dir runs/<id>`` shows that run); then the app,
and the console's URL once it listens. The key is printed on the first start only and
kept in ``<data-dir>/admin-key`` (mode 0600); a later start says where it is. Logs go
to ``<data-dir>/temper.log`` unless ``TEMPER_LOG__FILE`` names another file; they never
carry the key.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from services.dispatcher.app import create_app
from services.embedded.components import executors, in_one_process
from temper.db import Database, Tenant
from temper.db.migrate import upgrade
from temper.runtime import GracefulServer, StartupError, load_settings
from temper.settings import Mode, Settings
from temper.tenants import issue_key

TENANT = "local"  # temper run's tenant (services.embedded.runner.TENANT)
KEY_FILE = "admin-key"


def serve_settings(data_dir: Path) -> Settings:
    """The environment's settings in embedded mode, rooted at ``data_dir``."""
    settings = load_settings(service="temper-serve")
    if settings.mode is not Mode.embedded:
        raise StartupError(
            "temper serve runs everything in one process (TEMPER_MODE=embedded); "
            "a distributed deployment starts each service on its own (docs/operations.md)"
        )
    data_dir = data_dir.resolve()
    env = os.environ
    db = settings.db
    if "TEMPER_DB__URL" not in env:
        db = db.model_copy(update={"url": f"sqlite+aiosqlite:///{data_dir / 'temper.db'}"})
    storage = settings.storage
    if "TEMPER_STORAGE__ROOT" not in env:
        storage = storage.model_copy(update={"root": data_dir / "objects"})
    log = settings.log
    if log.file is None:
        log = log.model_copy(update={"file": data_dir / "temper.log"})
    settings = in_one_process(settings, scheduler_interval_s=0.2)
    return settings.model_copy(
        update={
            "data_dir": data_dir,
            "db": db,
            "storage": storage,
            "log": log,
        }
    )


@dataclass
class AdminKey:
    path: Path
    key: str | None  # the value, on the start that issued it only


async def admin_key(settings: Settings) -> AdminKey:
    """Issue tenant ``local``'s admin key unless ``<data-dir>/admin-key`` holds one already."""
    path = settings.data_dir / KEY_FILE
    if path.exists():
        return AdminKey(path, None)
    db = Database(settings.db)
    try:
        async with db.session() as session:
            if await session.get(Tenant, TENANT) is None:
                session.add(Tenant(id=TENANT, name="local", max_concurrent_episodes=1024))
                await session.flush()
            issued = await issue_key(session, tenant_id=TENANT, name="temper serve", admin=True)
    finally:
        await db.dispose()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(issued.key + "\n")
    return AdminKey(path, issued.key)


def banner(url: str, key: AdminKey, settings: Settings) -> list[str]:
    lines = [
        f"temper serve: {settings.data_dir}",
        f"console: {url}/console/",
        f"API: {url}/v1 (docs {url}/docs)",
    ]
    if key.key is not None:
        lines.append(f"admin key (tenant {TENANT}): {key.key}")
        lines.append(f"  kept in {key.path}; it is shown on this first start only")
    else:
        lines.append(f"admin key (tenant {TENANT}): cat {key.path}")
    lines.append(f"logs: {settings.log.file}")
    return lines


async def serve(data_dir: Path, *, host: str, port: int, out: TextIO) -> None:
    import uvicorn

    settings = serve_settings(data_dir)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    await asyncio.to_thread(upgrade, settings.db.url)
    key = await admin_key(settings)
    app = create_app(settings, executors=executors)

    async with app.router.lifespan_context(app):
        config = uvicorn.Config(app, host=host, port=port, log_config=None, lifespan="off")
        server = GracefulServer(config)
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():  # noqa: ASYNC110 - uvicorn sets a flag, no event
            await asyncio.sleep(0.05)
        if server.started:
            bound = server.servers[0].sockets[0].getsockname()[1] if port == 0 else port
            out.write("\n".join(banner(f"http://{host}:{bound}", key, settings)) + "\n")
            out.flush()
        await task
