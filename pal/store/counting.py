"""How much of the store a piece of work touched: the statements it ran and the rows they
returned or changed, counted for whoever asks (:func:`counting`), per asyncio task tree.

The leader's loops run each tick under it (pal/scheduler/loops.py), so an operator and
`pal bench control-plane` see what each tick reads, and a test can assert that a tick's
reads do not grow with the records it leaves alone. Rows are the driver's count
(``cursor.rowcount``: PostgreSQL's rows returned or changed; SQLite's sqlite3 knows only
those changed).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, event


@dataclass
class QueryCount:
    statements: int = 0
    rows: int = 0


_current: ContextVar[QueryCount | None] = ContextVar("pal_store_counting", default=None)


@contextmanager
def counting() -> Iterator[QueryCount]:
    """Count the statements run (and their rows) until the block ends, in this task and the
    tasks it starts meanwhile. Nested counts each see their own part and the outer one all."""
    outer = _current.get()
    mine = QueryCount()
    token = _current.set(mine)
    try:
        yield mine
    finally:
        _current.reset(token)
        if outer is not None:
            outer.statements += mine.statements
            outer.rows += mine.rows


def _after_execute(_conn: Any, cursor: Any, *_args: Any) -> None:
    got = _current.get()
    if got is not None:
        got.statements += 1
        got.rows += max(int(getattr(cursor, "rowcount", 0) or 0), 0)


def install(engine: Engine) -> None:
    event.listen(engine, "after_cursor_execute", _after_execute)
