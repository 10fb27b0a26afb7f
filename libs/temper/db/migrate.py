"""Schema migrations (Alembic, ``migrations/``) for Postgres and SQLite.

``python -m temper.db.migrate`` is the prestart step: wait for the database, then
upgrade to head. ``python -m temper.db.migrate downgrade base`` goes the other way.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from alembic import command
from alembic.config import Config

from temper.db.engine import Database, DatabaseUnavailable
from temper.settings import DatabaseSettings, get_settings

REPO_ROOT = Path(__file__).resolve().parents[3]


def alembic_config(url: str) -> Config:
    root = Path(os.environ.get("TEMPER_MIGRATIONS_DIR", REPO_ROOT / "migrations"))
    cfg = Config()
    cfg.set_main_option("script_location", str(root))
    cfg.set_main_option("file_template", "%%(year)d_%%(month).2d_%%(day).2d-%%(rev)s_%%(slug)s")
    cfg.attributes["url"] = url
    return cfg


async def wait_for_database(settings: DatabaseSettings, timeout_s: float = 30.0) -> None:
    db = Database(settings)
    deadline = asyncio.get_running_loop().time() + timeout_s
    try:
        while True:
            try:
                await db.check()
                return
            except DatabaseUnavailable:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.5)
    finally:
        await db.dispose()


class NotMigrated(RuntimeError):
    """The database's schema is missing or behind the code's; the message says what to run."""


async def check_migrated(db: Database) -> None:
    """Raise :class:`NotMigrated` unless the database is at the newest revision (a revision
    this checkout does not know, from newer code, is let through)."""
    from alembic.script import ScriptDirectory
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    try:
        async with db.session() as session:
            current = (await session.execute(text("SELECT version_num FROM alembic_version"))).scalar()
    except DBAPIError:  # no alembic_version table
        current = None
    script = ScriptDirectory.from_config(alembic_config(db.url))
    heads = set(script.get_heads())
    fix = "run `python -m temper.db.migrate` (same TEMPER_DB__URL) first, or `temper serve`, which migrates"
    if current is None:
        raise NotMigrated(f"the database is not migrated: {fix}")
    if current not in heads and script.get_revision(current) is not None:
        raise NotMigrated(
            f"the database is at revision {current}, the code needs {', '.join(sorted(heads))}: {fix}"
        )


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)


def main(argv: list[str]) -> int:
    settings = get_settings()
    action = argv[0] if argv else "upgrade"
    revision = argv[1] if len(argv) > 1 else ("head" if action == "upgrade" else "base")
    try:
        asyncio.run(wait_for_database(settings.db))
    except DatabaseUnavailable as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    if action == "upgrade":
        upgrade(settings.db.url, revision)
    elif action == "downgrade":
        downgrade(settings.db.url, revision)
    else:
        sys.stderr.write("usage: python -m temper.db.migrate [upgrade [REV] | downgrade [REV]]\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
