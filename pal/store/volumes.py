"""Volumes in the store (docs/volumes.md): their rows, each tenant's volume limits and
running counts (``volumes_used``, ``volume_bytes_used`` on the tenant's row, changed in the
same transaction as the volume rows they count, as books.py keeps the VMs'), the paged list
and its metadata filter (``volume_tags``, as ``vm_tags`` for VMs), and the mounts that make
a delete wait for ``force``.

What counts against ``max_volume_bytes`` is a volume's size (``size_mib``), whether or not
it is filled: the node may have to hold all of it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Select, delete, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from pal.errors import Conflict, NotFound, QuotaExceeded
from pal.store.paging import tagged_page_query
from pal.store.records import Tenant, VolumeRecord
from pal.store.store import Store
from pal.store.tables import tenants, volume_mounts, volume_tags, volumes
from pal.store.write_tx import WriteTx, record_of, tag_of, utcnow

MIB = 1 << 20
GIB = 1 << 30


def volume_from_row(row: Any) -> VolumeRecord:
    return record_of(VolumeRecord, row)


def _adjust(conn: Connection, tenant_id: str, *, count: int = 0, size_mib: int = 0) -> None:
    t = tenants.c
    conn.execute(
        update(tenants)
        .where(t.id == tenant_id)
        .values(volumes_used=t.volumes_used + count, volume_bytes_used=t.volume_bytes_used + size_mib * MIB)
    )


def _check_room(tenant: Tenant, *, count: int, size_mib: int) -> None:
    """QuotaExceeded (402) if ``count`` more volumes and ``size_mib`` more MiB would take the
    tenant past its volume limits."""
    if count and tenant.max_volumes is not None and tenant.volumes_used + count > tenant.max_volumes:
        raise QuotaExceeded(
            f"tenant {tenant.name!r} is limited to max_volumes={tenant.max_volumes} volumes: "
            f"{tenant.volumes_used} exist; delete one first"
        )
    more = size_mib * MIB
    if more > 0 and tenant.max_volume_bytes is not None:
        used = tenant.volume_bytes_used
        if used + more > tenant.max_volume_bytes:
            raise QuotaExceeded(
                f"tenant {tenant.name!r} is limited to {tenant.max_volume_bytes / GIB:.2f} GiB of volumes: "
                f"{used / GIB:.2f} GiB in volumes, this needs {more / GIB:.2f} GiB more; "
                "delete a volume first"
            )


def _locked_tenant(tx: WriteTx, tenant_id: str) -> Tenant:
    tenant = tx.tenant(tenant_id)
    if tenant is None or tenant.deleting_at is not None:
        raise NotFound(f"tenant {tenant_id} not found")
    return tenant


def create(store: Store, vol: VolumeRecord) -> VolumeRecord:
    """Insert a new volume (state ``creating``) and count it, or raise: 402 past the
    tenant's limits, 409 when the tenant has a volume of that name."""
    try:
        with store.write() as tx:
            _check_room(_locked_tenant(tx, vol.tenant_id), count=1, size_mib=vol.size_mib)
            conn = tx._conn
            conn.execute(insert(volumes).values(**vol.__dict__))
            if vol.metadata:
                conn.execute(
                    insert(volume_tags),
                    [
                        {"tenant_id": vol.tenant_id, "tag": tag_of(k, v), "created_at": vol.created_at,
                         "volume_id": vol.volume_id}
                        for k, v in sorted(vol.metadata.items())
                    ],
                )  # fmt: skip
            _adjust(conn, vol.tenant_id, count=1, size_mib=vol.size_mib)
    except IntegrityError as exc:
        raise Conflict(f"a volume named {vol.name!r} exists already") from exc
    return vol


def get(store: Store, volume_id: str) -> VolumeRecord | None:
    with store._read() as conn:
        row = conn.execute(select(volumes).where(volumes.c.volume_id == volume_id)).first()
    return volume_from_row(row) if row else None


def by_name(store: Store, tenant_id: str, name: str) -> VolumeRecord | None:
    with store._read() as conn:
        q = select(volumes).where(volumes.c.tenant_id == tenant_id, volumes.c.name == name)
        row = conn.execute(q).first()
    return volume_from_row(row) if row else None


def set_state(store: Store, volume_id: str, state: str, *, expect: str | None = None) -> VolumeRecord:
    """Set a volume's state (only from ``expect``, when given: else 409)."""
    with store.write() as tx:
        row = tx._conn.execute(
            select(volumes).where(volumes.c.volume_id == volume_id).with_for_update()
        ).first()
        if row is None:
            raise NotFound(f"volume {volume_id} not found")
        if expect is not None and row.state != expect:
            raise Conflict(f"volume {row.name!r} is {row.state}, not {expect}")
        now = utcnow()
        tx._conn.execute(
            update(volumes).where(volumes.c.volume_id == volume_id).values(state=state, updated_at=now)
        )
    return VolumeRecord(**{**volume_from_row(row).__dict__, "state": state, "updated_at": now})


def resize(store: Store, volume_id: str, size_mib: int) -> VolumeRecord:
    """Grow a ready volume's size to ``size_mib`` and count the difference (402 past the
    tenant's bytes; 409 unless it is ready). Growing only: the caller refuses a shrink."""
    with store.write() as tx:
        row = tx._conn.execute(
            select(volumes).where(volumes.c.volume_id == volume_id).with_for_update()
        ).first()
        if row is None:
            raise NotFound(f"volume {volume_id} not found")
        if row.state != "ready":
            raise Conflict(f"volume {row.name!r} is {row.state}; only a ready volume is resized")
        grown = size_mib - int(row.size_mib)
        _check_room(_locked_tenant(tx, row.tenant_id), count=0, size_mib=grown)
        now = utcnow()
        tx._conn.execute(
            update(volumes).where(volumes.c.volume_id == volume_id).values(size_mib=size_mib, updated_at=now)
        )
        _adjust(tx._conn, row.tenant_id, size_mib=grown)
    return VolumeRecord(**{**volume_from_row(row).__dict__, "size_mib": size_mib, "updated_at": now})


def remove(store: Store, volume_id: str) -> bool:
    """Delete the volume's rows (its mounts' and tags' too) and uncount it; False if gone."""
    with store.write() as tx:
        row = tx._conn.execute(
            select(volumes).where(volumes.c.volume_id == volume_id).with_for_update()
        ).first()
        if row is None:
            return False
        tx._conn.execute(delete(volume_mounts).where(volume_mounts.c.volume_id == volume_id))
        tx._conn.execute(delete(volume_tags).where(volume_tags.c.volume_id == volume_id))
        tx._conn.execute(delete(volumes).where(volumes.c.volume_id == volume_id))
        _adjust(tx._conn, row.tenant_id, count=-1, size_mib=-int(row.size_mib))
    return True


def add_mount(store: Store, volume_id: str, vm_id: str, path: str, *, read_only: bool) -> None:
    """Record that ``vm_id`` mounts the volume at ``path`` (the volume's row must exist)."""
    with store.write() as tx:
        row = tx._conn.execute(select(volumes.c.tenant_id).where(volumes.c.volume_id == volume_id)).first()
        if row is None:
            raise NotFound(f"volume {volume_id} not found")
        tx._conn.execute(
            insert(volume_mounts).values(
                volume_id=volume_id, vm_id=vm_id, tenant_id=row.tenant_id, path=path, read_only=read_only
            )
        )


def mounted_by(store: Store, volume_id: str) -> list[str]:
    """The VMs that mount the volume, by id."""
    with store._read() as conn:
        q = select(volume_mounts.c.vm_id).where(volume_mounts.c.volume_id == volume_id)
        return sorted(str(r[0]) for r in conn.execute(q))


def page_query(
    tenant_id: str, *, after: tuple[datetime, str] | None, limit: int, metadata: dict[str, str] | None = None
) -> Select[tuple[object, ...]]:
    """The tenant's volumes in (created_at, volume_id) order after ``after``, holding every
    ``metadata`` pair: one index range, as pal/store/paging.py reads VMs."""
    return tagged_page_query(
        volumes, volume_tags, "volume_id", tenant_id, after=after, limit=limit, metadata=metadata
    )


def page(
    store: Store,
    tenant_id: str,
    *,
    after: tuple[datetime, str] | None,
    limit: int,
    metadata: dict[str, str] | None = None,
) -> list[VolumeRecord]:
    with store._read() as conn:
        rows = conn.execute(page_query(tenant_id, after=after, limit=limit, metadata=metadata)).all()
    return [volume_from_row(r) for r in rows]


def of_tenant(store: Store, tenant_id: str) -> list[VolumeRecord]:
    """Every volume of the tenant (its removal deletes them)."""
    with store._read() as conn:
        q = select(volumes).where(volumes.c.tenant_id == tenant_id).order_by(volumes.c.created_at)
        return [volume_from_row(r) for r in conn.execute(q)]


def recount(conn: Connection) -> None:
    """Set every tenant's volume counts from the volume rows."""
    v = volumes.c
    n = select(func.count()).where(v.tenant_id == tenants.c.id).scalar_subquery()
    mib = select(func.coalesce(func.sum(v.size_mib), 0)).where(v.tenant_id == tenants.c.id).scalar_subquery()
    conn.execute(update(tenants).values(volumes_used=n, volume_bytes_used=mib * MIB))


def mounts_of(store: Store, vm_id: str) -> list[tuple[str, str, bool, str]]:
    """The VM's mounts: (volume id, path, read only, the volume's node), in path order."""
    with store._read() as conn:
        q = (
            select(
                volume_mounts.c.volume_id, volume_mounts.c.path, volume_mounts.c.read_only, volumes.c.node_id
            )
            .join(volumes, volumes.c.volume_id == volume_mounts.c.volume_id)
            .where(volume_mounts.c.vm_id == vm_id)
            .order_by(volume_mounts.c.path)
        )
        return [(str(r[0]), str(r[1]), bool(r[2]), str(r[3] or "")) for r in conn.execute(q)]


def copy_mounts(store: Store, src_vm_id: str, vm_ids: list[str]) -> None:
    """Fork children mount what their source mounts."""
    for volume_id, path, read_only, _ in mounts_of(store, src_vm_id):
        for vm_id in vm_ids:
            add_mount(store, volume_id, vm_id, path, read_only=read_only)


def remove_mounts(store: Store, vm_id: str) -> None:
    """The VM is gone: it mounts nothing."""
    with store.write() as tx:
        tx._conn.execute(delete(volume_mounts).where(volume_mounts.c.vm_id == vm_id))


def named_mounts(store: Store, vm_ids: list[str]) -> dict[str, list[tuple[str, str, bool]]]:
    """The mounts of each of ``vm_ids`` in one read: (the volume's name, path, read only),
    in path order; a VM that mounts nothing is not in the answer."""
    out: dict[str, list[tuple[str, str, bool]]] = {}
    if not vm_ids:
        return out
    with store._read() as conn:
        q = (
            select(volume_mounts.c.vm_id, volumes.c.name, volume_mounts.c.path, volume_mounts.c.read_only)
            .join(volumes, volumes.c.volume_id == volume_mounts.c.volume_id)
            .where(volume_mounts.c.vm_id.in_(vm_ids))
            .order_by(volume_mounts.c.vm_id, volume_mounts.c.path)
        )
        for r in conn.execute(q):
            out.setdefault(str(r[0]), []).append((str(r[1]), str(r[2]), bool(r[3])))
    return out
