"""A tenant's kept snapshots (table ``kept_snapshots``; the rules are
pal/scheduler/kept.py's, docs/lifecycle.md "Kept snapshots"). A row names a snapshot of one
of the tenant's VMs (its files stay where that VM's snapshots are) that the VM's retention
and delete leave alone and that new VMs start from; a name, when it has one, is unique
among the tenant's kept snapshots: keeping another snapshot under a name moves the name to
it (E2B's "a new build of the same template"). Removing the tenant removes its rows
(``Store.delete_tenant``)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_, delete, insert, or_, select, update

from pal.store.store import Store
from pal.store.tables import kept_snapshots as ks


@dataclass(frozen=True)
class KeptSnapshot:
    snapshot_id: str
    tenant_id: str
    name: str | None
    source_vm_id: str
    agent_version_id: str
    node_id: str | None
    created_at: datetime


def _record(row: object) -> KeptSnapshot:
    r = row._mapping  # type: ignore[attr-defined]
    return KeptSnapshot(
        r["snapshot_id"],
        r["tenant_id"],
        r["name"],
        r["source_vm_id"],
        r["agent_version_id"],
        r["node_id"],
        r["created_at"],
    )


def add(store: Store, rec: KeptSnapshot) -> str | None:
    """Keep ``rec``; its name (if any) moves to it from the tenant's snapshot that held it,
    whose id is returned (it stays kept, unnamed)."""
    with store.write() as tx:
        conn = tx._conn
        before = None
        if rec.name is not None:
            q = select(ks.c.snapshot_id).where(ks.c.tenant_id == rec.tenant_id, ks.c.name == rec.name)
            before = conn.execute(q.with_for_update()).scalar_one_or_none()
            if before is not None:
                conn.execute(update(ks).where(ks.c.snapshot_id == before).values(name=None))
        conn.execute(
            insert(ks).values(
                snapshot_id=rec.snapshot_id,
                tenant_id=rec.tenant_id,
                name=rec.name,
                source_vm_id=rec.source_vm_id,
                agent_version_id=rec.agent_version_id,
                node_id=rec.node_id,
                created_at=rec.created_at,
            )
        )
    return before


def get(store: Store, tenant_id: str, id_or_name: str) -> KeptSnapshot | None:
    """The tenant's kept snapshot of that id, else of that name (None: neither)."""
    with store._read() as conn:
        q = select(ks).where(
            ks.c.tenant_id == tenant_id, or_(ks.c.snapshot_id == id_or_name, ks.c.name == id_or_name)
        )
        rows = [_record(r) for r in conn.execute(q)]
    by_id = [r for r in rows if r.snapshot_id == id_or_name]
    found = by_id or rows
    return found[0] if found else None


def page(
    store: Store,
    tenant_id: str,
    *,
    source_vm_id: str | None = None,
    after: tuple[datetime, str] | None = None,
    limit: int = 100,
) -> list[KeptSnapshot]:
    """The tenant's kept snapshots, oldest first, after the key ``after`` (created_at, id)."""
    q = select(ks).where(ks.c.tenant_id == tenant_id)
    if source_vm_id is not None:
        q = q.where(ks.c.source_vm_id == source_vm_id)
    if after is not None:
        at, sid = after
        q = q.where(or_(ks.c.created_at > at, and_(ks.c.created_at == at, ks.c.snapshot_id > sid)))
    q = q.order_by(ks.c.created_at, ks.c.snapshot_id).limit(limit)
    with store._read() as conn:
        return [_record(r) for r in conn.execute(q)]


def of_vms(store: Store, vm_ids: Collection[str]) -> list[KeptSnapshot]:
    """The kept snapshots taken of these VMs (whatever their tenant)."""
    if not vm_ids:
        return []
    with store._read() as conn:
        return [_record(r) for r in conn.execute(select(ks).where(ks.c.source_vm_id.in_(sorted(vm_ids))))]


def remove(store: Store, tenant_id: str, snapshot_id: str) -> KeptSnapshot | None:
    """Forget the tenant's kept snapshot (its files are the caller's); None: not the tenant's."""
    with store.write() as tx:
        conn = tx._conn
        q = select(ks).where(ks.c.tenant_id == tenant_id, ks.c.snapshot_id == snapshot_id)
        row = conn.execute(q.with_for_update()).first()
        if row is None:
            return None
        conn.execute(delete(ks).where(ks.c.snapshot_id == snapshot_id))
        return _record(row)


def remove_of_tenant(store: Store, tenant_id: str) -> int:
    """Forget every kept snapshot of a tenant being removed (its VMs' releases then delete
    the files); how many there were."""
    with store.write() as tx:
        return int(tx._conn.execute(delete(ks).where(ks.c.tenant_id == tenant_id)).rowcount or 0)
