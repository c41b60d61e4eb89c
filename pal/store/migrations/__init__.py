"""Alembic migrations, run programmatically by :func:`pal.store.migrate.upgrade`."""
