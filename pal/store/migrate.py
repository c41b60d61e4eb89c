"""Run the packaged alembic migrations on a live engine (no alembic.ini at runtime).

On PostgreSQL several replicas may start at once against one database: each upgrade runs
under a session-level advisory lock (``pg_advisory_lock``) on its migration connection, so
one migrates and the others, once it is done, find the schema at head and do nothing. The
lock goes with the connection if the process dies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, text

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
# The advisory lock's key (any 64-bit number no other user of the database takes): "palmigr".
MIGRATION_LOCK_KEY = 0x70616C6D696772


def _config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


def head() -> str:
    """The newest migration of this code."""
    return str(ScriptDirectory.from_config(_config()).get_current_head())


def current(engine: Engine) -> str | None:
    """The migration the database is at (None: never migrated)."""
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    cfg = _config()
    with engine.connect() as conn, _migration_lock(conn):
        with conn.begin():
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)


@contextlib.contextmanager
def _migration_lock(conn: Connection) -> Iterator[None]:
    """One migrator at a time per PostgreSQL database (SQLite: one process, nothing to do).
    Session-level, so it spans the migration's own transaction and outlives its commit."""
    if conn.dialect.name != "postgresql":
        yield
        return
    conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
    conn.commit()
    try:
        yield
    finally:
        conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK_KEY})
        conn.commit()
