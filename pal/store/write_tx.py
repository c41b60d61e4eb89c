"""The write transaction (:class:`WriteTx`): the checks and writes that must be atomic
with each other (quota reservation, a state change guarded by the current state), and the
row-to-record decoding every read shares. store.py opens it (``Store.write``)."""

from __future__ import annotations

from dataclasses import asdict, fields
from datetime import UTC, datetime
from typing import Any, TypeVar

from sqlalchemy import Connection, delete, func, insert, select, update

from pal.store import books
from pal.store.records import EventRecord, Tenant, VmRecord
from pal.store.tables import events, tenants, vm_tags, vms

R = TypeVar("R")
_VM_COLUMNS = [c.name for c in vms.columns]


def utcnow() -> datetime:
    return datetime.now(UTC)


# A VM's lifecycle: written only by the scheduler's transition function
# (pal/scheduler/transition.py, through write_lifecycle/insert_vm/set_holds_slot);
# update_vm refuses them.
LIFECYCLE_COLUMNS = frozenset(
    {
        "state",
        "marker",
        "reason",
        "holds_slot",
        "paused_by",
        "incarnation",
        "token",
        "snapshot_id",
        "mem_snapshot_id",
        "paused_at",
    }
)


def tag_of(key: str, value: str) -> str:
    """A metadata pair as one tag (a key never holds ``=``: pal/spec.py METADATA_KEY)."""
    return f"{key}={value}"


def record_of(cls: type[R], row: Any) -> R:
    """A row as a record: the record's fields are columns of its table, read by name
    (tests/unit/test_store.py checks that records and tables agree)."""
    m = row._mapping
    return cls(**{f.name: m[f.name] for f in fields(cls)})  # type: ignore[arg-type]


def vm_from_row(row: Any) -> VmRecord:
    return record_of(VmRecord, row)


def tenant_from_row(row: Any) -> Tenant:
    return record_of(Tenant, row)


def event_from_row(row: Any) -> EventRecord:
    return record_of(EventRecord, row)


class WriteTx:
    """One write transaction. Only the store and quotas.py/transition.py use it."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def tenant(self, tenant_id: str) -> Tenant | None:
        """Read the tenant, locking its row where the database can (PostgreSQL: FOR UPDATE;
        SQLite omits it, BEGIN IMMEDIATE already serialises writers), so quota checks of
        one tenant never interleave."""
        q = select(tenants).where(tenants.c.id == tenant_id).with_for_update()
        row = self._conn.execute(q).first()
        return tenant_from_row(row) if row else None

    def count_slots(self, tenant_id: str) -> int:
        q = select(func.count()).where(vms.c.tenant_id == tenant_id, vms.c.holds_slot.is_(True))
        return int(self._conn.execute(q).scalar_one())

    def slot_holders(self, tenant_id: str, limit: int) -> list[tuple[str, str]]:
        """(vm id, state) of the tenant's VMs holding a slot, oldest first, at most ``limit``."""
        q = (
            select(vms.c.vm_id, vms.c.state)
            .where(vms.c.tenant_id == tenant_id, vms.c.holds_slot.is_(True))
            .order_by(vms.c.created_at, vms.c.vm_id)
            .limit(limit)
        )
        return [(str(r.vm_id), str(r.state)) for r in self._conn.execute(q)]

    def get_vm(self, vm_id: str) -> VmRecord | None:
        """Read the VM row, locking it where the database can (PostgreSQL: FOR UPDATE), so
        a decision taken on its state holds until this transaction ends."""
        row = self._conn.execute(select(vms).where(vms.c.vm_id == vm_id).with_for_update()).first()
        return vm_from_row(row) if row else None

    def insert_vm(self, vm: VmRecord) -> None:
        """A new VM row (the transition function's create, through quotas.reserve_in), and
        its metadata's rows of the list's filter (tables.vm_tags)."""
        self._conn.execute(insert(vms).values(**asdict(vm)))
        books.adjust(
            self._conn,
            vm.tenant_id,
            slots=int(vm.holds_slot),
            paused=int(books.counts_as_paused(vm.state, vm.marker)),
            snapshot_bytes=vm.snapshot_bytes,
        )
        if vm.metadata:
            self._conn.execute(
                insert(vm_tags),
                [
                    {
                        "tenant_id": vm.tenant_id,
                        "tag": tag_of(k, v),
                        "created_at": vm.created_at,
                        "vm_id": vm.vm_id,
                    }
                    for k, v in sorted(vm.metadata.items())
                ],
            )

    def update_vm(self, vm_id: str, **fields: Any) -> bool:
        """Update columns that are not lifecycle state (activity stamps...)."""
        lifecycle = set(fields) & LIFECYCLE_COLUMNS
        if lifecycle:
            raise ValueError(
                f"{sorted(lifecycle)} are lifecycle columns: only the transition function "
                "(pal/scheduler/transition.py) writes them"
            )
        return self._update(vm_id, None, fields) is not None

    def write_lifecycle(
        self, vm_id: str, *, expect_state: str, before: VmRecord | None = None, **fields: Any
    ) -> VmRecord | None:
        """The transition function's write: any columns, only if the row is still in
        ``expect_state``; the row as written (None: it was not in that state). ``before``:
        the row as the caller read it under its lock (saves reading it again)."""
        return self._update(vm_id, expect_state, fields, before)

    def _update(
        self, vm_id: str, expect_state: str | None, fields: dict[str, Any], before: Any = None
    ) -> VmRecord | None:
        unknown = set(fields) - set(_VM_COLUMNS)
        if unknown:
            raise ValueError(f"unknown vm columns: {sorted(unknown)}")
        counted = {"state", "marker", "snapshot_bytes"} & set(fields)
        if counted and before is None:  # the row is locked already (get_vm): as it was
            cols = (vms.c.tenant_id, vms.c.state, vms.c.marker, vms.c.snapshot_bytes)
            before = self._conn.execute(select(*cols).where(vms.c.vm_id == vm_id).with_for_update()).first()
        q = update(vms).where(vms.c.vm_id == vm_id)
        if expect_state is not None:
            q = q.where(vms.c.state == expect_state)
        row = self._conn.execute(q.values(updated_at=utcnow(), **fields).returning(*vms.c)).first()
        if row is not None and counted:
            books.change(self._conn, before, fields)
        return vm_from_row(row) if row is not None else None

    def set_holds_slot(self, vm_id: str, value: bool) -> bool:
        """Flip the flag only if it differs: True when this call changed it."""
        q = (
            update(vms)
            .where(vms.c.vm_id == vm_id, vms.c.holds_slot.is_(not value))
            .values(holds_slot=value, updated_at=utcnow())
            .returning(vms.c.tenant_id)
        )
        tenant_id = self._conn.execute(q).scalar_one_or_none()
        if tenant_id is None:
            return False
        books.adjust(self._conn, str(tenant_id), slots=1 if value else -1)
        return True

    def add_event(
        self,
        vm_id: str,
        tenant_id: str,
        kind: str,
        *,
        from_state: str | None = None,
        to_state: str | None = None,
        marker: str = "",
        reason: str | None = None,
        details: dict[str, Any] | None = None,
        at: datetime | None = None,
    ) -> None:
        self._conn.execute(
            insert(events).values(
                vm_id=vm_id,
                tenant_id=tenant_id,
                at=at or utcnow(),
                kind=kind,
                from_state=from_state,
                to_state=to_state,
                marker=marker,
                reason=reason,
                details=details,
            )
        )

    def trim_events(self, vm_id: str, kind: str, keep: int) -> int:
        """Keep only the newest ``keep`` events of ``kind`` of the VM (a ring); how many went."""
        cutoff = (
            select(events.c.id)
            .where(events.c.vm_id == vm_id, events.c.kind == kind)
            .order_by(events.c.id.desc())
            .offset(keep)
            .limit(1)
            .scalar_subquery()
        )
        q = delete(events).where(events.c.vm_id == vm_id, events.c.kind == kind, events.c.id <= cutoff)
        return int(self._conn.execute(q).rowcount or 0)
