"""Alembic environment: always handed a live connection by pal.store.migrate (no alembic.ini)."""

from __future__ import annotations

from alembic import context

connection = context.config.attributes["connection"]
# render_as_batch: SQLite can only ALTER tables by copying them; batch mode does that.
context.configure(connection=connection, target_metadata=None, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
