"""Paged reads of VMs and events (keyset pagination: each page starts after the last row of
the one before, so rows added or removed meanwhile never shift it), the VM list's metadata
filter, and the VMs whose lifetime is over. The cursors the API hands out encode these keys
(pal/api/pagination.py); the store only sees the decoded keys.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import and_, or_, select

from pal.store.records import EventRecord, VmRecord
from pal.store.store import Store
from pal.store.tables import events, vms
from pal.store.write_tx import event_from_row, vm_from_row


def vm_page(
    store: Store,
    tenant_id: str,
    *,
    after: tuple[datetime, str] | None,
    limit: int,
    metadata: dict[str, str] | None = None,
    terminated_since: datetime | None = None,
) -> list[VmRecord]:
    """Up to ``limit`` of the tenant's VMs in (created_at, vm_id) order, after ``after``;
    only those whose metadata holds every ``metadata`` pair (AND); terminated ones only if
    they changed since ``terminated_since`` (when given)."""
    q = select(vms).where(vms.c.tenant_id == tenant_id)
    if terminated_since is not None:
        q = q.where(or_(vms.c.state != "terminated", vms.c.updated_at >= terminated_since))
    for key, value in sorted((metadata or {}).items()):
        q = q.where(vms.c.metadata[key].as_string() == value)
    if after is not None:
        at, vm_id = after
        q = q.where(or_(vms.c.created_at > at, and_(vms.c.created_at == at, vms.c.vm_id > vm_id)))
    with store._read() as conn:
        rows = conn.execute(q.order_by(vms.c.created_at, vms.c.vm_id).limit(limit)).all()
    return [vm_from_row(r) for r in rows]


def event_page(store: Store, vm_id: str, *, after: int | None, limit: int) -> list[EventRecord]:
    """Up to ``limit`` of the VM's events in order, after the event ``after``."""
    q = select(events).where(events.c.vm_id == vm_id)
    if after is not None:
        q = q.where(events.c.id > after)
    with store._read() as conn:
        rows = conn.execute(q.order_by(events.c.id).limit(limit)).all()
    return [event_from_row(r) for r in rows]


def latest_events(store: Store, vm_id: str, *, before: int | None, limit: int) -> list[EventRecord]:
    """Up to ``limit`` of the VM's events, newest first, older than the event ``before``."""
    q = select(events).where(events.c.vm_id == vm_id)
    if before is not None:
        q = q.where(events.c.id < before)
    with store._read() as conn:
        rows = conn.execute(q.order_by(events.c.id.desc()).limit(limit)).all()
    return [event_from_row(r) for r in rows]


def lifetime_over(store: Store, now: datetime) -> list[VmRecord]:
    """VMs not terminated whose lifetime ended by ``now``, the most overdue first."""
    q = select(vms).where(vms.c.lifetime_ends_at.is_not(None), vms.c.lifetime_ends_at <= now)
    q = q.where(vms.c.state != "terminated").order_by(vms.c.lifetime_ends_at)
    with store._read() as conn:
        rows = conn.execute(q).all()
    return [vm_from_row(r) for r in rows]
