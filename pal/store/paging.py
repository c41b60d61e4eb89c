"""Paged reads of VMs and events (keyset pagination: each page starts after the last row of
the one before, so rows added or removed meanwhile never shift it), and the VM list's
metadata filter. The cursors the API hands out encode these keys (pal/api/pagination.py);
the store only sees the decoded keys.

Each page is one index range read from its start key, whatever the size of the fleet
(docs/scale.md): the list reads ``ix_vms_listed`` (the tenant's listed VMs in list order:
terminated ones leave it an hour after they end), the metadata filter the ``vm_tags`` rows
of its first pair (each other pair a tag row of the same VM), the events ``ix_events_vm``.
The ``*_query`` functions build the statements (tests/unit/test_query_plans.py explains
them); the others run them.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Select, Table, and_, exists, or_, select, text

from pal.store.records import EventRecord, VmRecord
from pal.store.store import Store
from pal.store.tables import LIFETIME_DUE, events, vm_tags, vms
from pal.store.write_tx import event_from_row, tag_of, vm_from_row


def tagged_page_query(
    table: Table,
    tags: Table,
    key: str,
    tenant_id: str,
    *,
    after: tuple[datetime, str] | None,
    limit: int,
    metadata: dict[str, str] | None = None,
    listed: bool = False,
) -> Select[tuple[object, ...]]:
    """The tenant's rows of ``table`` in (created_at, ``key``) order after ``after``, holding
    every ``metadata`` pair (``tags``: one row per pair, as ``vm_tags``); ``listed``: only
    those in the list (the VMs' partial index). The keyset rule of every list (VMs,
    volumes) in one place."""
    pairs = sorted((metadata or {}).items())
    if pairs:
        first = tags.alias("t0")
        at_col, id_col = first.c.created_at, first.c[key]
        where = [first.c.tenant_id == tenant_id, first.c.tag == tag_of(*pairs[0])]
        q = (
            select(table)
            .select_from(first.join(table, table.c[key] == first.c[key]))
            .where(*where, *([text(f"{table.name}.listed")] if listed else []))
        )
        # Each other pair is its own tag row of the same row (a primary-key probe): the
        # planner knows tags' frequencies, never those of a JSON expression.
        for i, (k, v) in enumerate(pairs[1:], 1):
            other = tags.alias(f"t{i}")
            q = q.where(
                exists().where(
                    other.c.tenant_id == first.c.tenant_id,
                    other.c.tag == tag_of(k, v),
                    other.c.created_at == first.c.created_at,
                    other.c[key] == first.c[key],
                )
            )
    else:
        at_col, id_col = table.c.created_at, table.c[key]
        q = select(table).where(table.c.tenant_id == tenant_id, *([text("listed")] if listed else []))
    if after is not None:
        at, row_id = after
        # The first half bounds the index range; the second breaks ties on the time.
        q = q.where(at_col >= at, or_(at_col > at, and_(at_col == at, id_col > row_id)))
    return q.order_by(at_col, id_col).limit(limit)


def vm_page_query(
    tenant_id: str, *, after: tuple[datetime, str] | None, limit: int, metadata: dict[str, str] | None = None
) -> Select[tuple[object, ...]]:
    return tagged_page_query(
        vms, vm_tags, "vm_id", tenant_id, after=after, limit=limit, metadata=metadata, listed=True
    )


def vm_page(
    store: Store,
    tenant_id: str,
    *,
    after: tuple[datetime, str] | None,
    limit: int,
    metadata: dict[str, str] | None = None,
) -> list[VmRecord]:
    """Up to ``limit`` of the tenant's listed VMs in (created_at, vm_id) order, after
    ``after``; only those whose metadata holds every ``metadata`` pair (AND)."""
    with store._read() as conn:
        rows = conn.execute(vm_page_query(tenant_id, after=after, limit=limit, metadata=metadata)).all()
    return [vm_from_row(r) for r in rows]


def event_page_query(vm_id: str, *, after: int | None, limit: int) -> Select[tuple[object, ...]]:
    q = select(events).where(events.c.vm_id == vm_id)
    if after is not None:
        q = q.where(events.c.id > after)
    return q.order_by(events.c.id).limit(limit)


def event_page(store: Store, vm_id: str, *, after: int | None, limit: int) -> list[EventRecord]:
    """Up to ``limit`` of the VM's events in order, after the event ``after``."""
    with store._read() as conn:
        rows = conn.execute(event_page_query(vm_id, after=after, limit=limit)).all()
    return [event_from_row(r) for r in rows]


def latest_events(store: Store, vm_id: str, *, before: int | None, limit: int) -> list[EventRecord]:
    """Up to ``limit`` of the VM's events, newest first, older than the event ``before``."""
    q = select(events).where(events.c.vm_id == vm_id)
    if before is not None:
        q = q.where(events.c.id < before)
    with store._read() as conn:
        rows = conn.execute(q.order_by(events.c.id.desc()).limit(limit)).all()
    return [event_from_row(r) for r in rows]


def lifetime_over_query(now: datetime, limit: int) -> Select[tuple[object, ...]]:
    # LIFETIME_DUE is the predicate of ix_vms_lifetime_due, word for word.
    q = select(vms).where(text(LIFETIME_DUE), vms.c.lifetime_ends_at <= now)
    return q.order_by(vms.c.lifetime_ends_at).limit(limit)


def lifetime_over(store: Store, now: datetime, limit: int = 1000) -> list[VmRecord]:
    """VMs not terminated whose lifetime ended by ``now``, the most overdue first (at most
    ``limit``: the rest are the next sweep's)."""
    with store._read() as conn:
        rows = conn.execute(lifetime_over_query(now, limit)).all()
    return [vm_from_row(r) for r in rows]
