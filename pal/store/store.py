"""The repository: every read and write of Pal's durable state, behind explicit methods.

Callers get dataclasses (records.py), never rows. Transactions are short and synchronous;
a write that must be atomic with a check (quota reservation, a state change guarded by the
current state) goes through :meth:`Store.write` which yields a :class:`WriteTx`. On SQLite
that transaction starts with ``BEGIN IMMEDIATE`` so two writers serialise at BEGIN instead of
failing at COMMIT; a PostgreSQL implementation would lock the tenant row instead.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from pal.config import Settings
from pal.errors import Conflict, InvalidRequest
from pal.store import migrate
from pal.store.records import EventRecord, Tenant, VmRecord
from pal.store.tables import events, tenants, vms

SQLITE_BUSY_TIMEOUT_MS = 10_000
_WRITE = "pal_write_tx"
_VM_COLUMNS = [c.name for c in vms.columns]


def utcnow() -> datetime:
    return datetime.now(UTC)


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _sqlite_setup(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        # Take transaction control away from the sqlite3 module so BEGIN is ours.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        immediate = conn.get_execution_options().get(_WRITE, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def _vm_from_row(row: Any) -> VmRecord:
    m = row._mapping
    return VmRecord(
        vm_id=m["vm_id"],
        tenant_id=m["tenant_id"],
        state=m["state"],
        image=m["image"],
        limits=dict(m["limits"] or {}),
        created_at=m["created_at"],
        updated_at=m["updated_at"],
        marker=m["marker"] or "",
        reason=m["reason"],
        agent_version_id=m["agent_version_id"],
        idle_timeout_secs=m["idle_timeout_secs"],
        secrets=dict(m["secrets"] or {}),
        boot=m["boot"],
        snapshot_id=m["snapshot_id"],
        parent_vm_id=m["parent_vm_id"],
        mem_snapshot_id=m["mem_snapshot_id"],
        incarnation=m["incarnation"],
        token=m["token"],
        holds_slot=bool(m["holds_slot"]),
        paused_by=m["paused_by"],
        node_id=m["node_id"],
        last_activity_unix_ms=m["last_activity_unix_ms"],
    )


def _tenant_from_row(row: Any) -> Tenant:
    m = row._mapping
    return Tenant(id=m["id"], name=m["name"], max_vms=m["max_vms"], created_at=m["created_at"])


def _event_from_row(row: Any) -> EventRecord:
    m = row._mapping
    return EventRecord(
        id=m["id"],
        vm_id=m["vm_id"],
        tenant_id=m["tenant_id"],
        at=m["at"],
        kind=m["kind"],
        from_state=m["from_state"],
        to_state=m["to_state"],
        marker=m["marker"] or "",
        reason=m["reason"],
    )


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
        return _tenant_from_row(row) if row else None

    def count_slots(self, tenant_id: str) -> int:
        q = select(func.count()).where(vms.c.tenant_id == tenant_id, vms.c.holds_slot.is_(True))
        return int(self._conn.execute(q).scalar_one())

    def get_vm(self, vm_id: str) -> VmRecord | None:
        row = self._conn.execute(select(vms).where(vms.c.vm_id == vm_id)).first()
        return _vm_from_row(row) if row else None

    def insert_vm(self, vm: VmRecord) -> None:
        self._conn.execute(insert(vms).values(**asdict(vm)))

    def update_vm(self, vm_id: str, *, expect_state: str | None = None, **fields: Any) -> bool:
        """Update columns; with ``expect_state`` only if the row is still in that state."""
        unknown = set(fields) - set(_VM_COLUMNS)
        if unknown:
            raise ValueError(f"unknown vm columns: {sorted(unknown)}")
        q = update(vms).where(vms.c.vm_id == vm_id)
        if expect_state is not None:
            q = q.where(vms.c.state == expect_state)
        res = self._conn.execute(q.values(updated_at=utcnow(), **fields))
        return res.rowcount == 1

    def set_holds_slot(self, vm_id: str, value: bool) -> bool:
        """Flip the flag only if it differs: True when this call changed it."""
        q = (
            update(vms)
            .where(vms.c.vm_id == vm_id, vms.c.holds_slot.is_(not value))
            .values(holds_slot=value, updated_at=utcnow())
        )
        return self._conn.execute(q).rowcount == 1

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
    ) -> None:
        self._conn.execute(
            insert(events).values(
                vm_id=vm_id,
                tenant_id=tenant_id,
                at=utcnow(),
                kind=kind,
                from_state=from_state,
                to_state=to_state,
                marker=marker,
                reason=reason,
            )
        )


class Store:
    def __init__(self, url: str, *, run_migrations: bool = True) -> None:
        self.url = url
        self.engine = create_engine(url)
        if self.engine.dialect.name == "sqlite":
            _sqlite_setup(self.engine)
        if run_migrations:
            migrate.upgrade(self.engine)

    @classmethod
    def open(cls, settings: Settings) -> Store:
        settings.db_path.parent.mkdir(parents=True, exist_ok=True)
        return cls(f"sqlite:///{settings.db_path}")

    def close(self) -> None:
        self.engine.dispose()

    # -- transactions -------------------------------------------------------------------

    @contextmanager
    def write(self) -> Iterator[WriteTx]:
        with self.engine.connect().execution_options(**{_WRITE: True}) as conn, conn.begin():
            yield WriteTx(conn)

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with self.engine.connect() as conn, conn.begin():
            yield conn

    # -- tenants --------------------------------------------------------------------------

    def create_tenant(self, name: str, max_vms: int) -> tuple[Tenant, str]:
        """Create a tenant; returns it and its API key (shown once: only a sha256 is kept)."""
        if not name.strip():
            raise InvalidRequest("tenant name must not be empty")
        if max_vms < 0:
            raise InvalidRequest("max_vms must be 0 or more")
        key = "pal_" + secrets.token_urlsafe(32)
        tenant = Tenant(id="t-" + uuid.uuid4().hex[:16], name=name, max_vms=max_vms, created_at=utcnow())
        try:
            with self.write() as tx:
                tx._conn.execute(
                    insert(tenants).values(
                        id=tenant.id,
                        name=name,
                        api_key_sha256=hash_api_key(key),
                        max_vms=max_vms,
                        created_at=tenant.created_at,
                    )
                )
        except IntegrityError as exc:
            raise Conflict(f"a tenant named {name!r} already exists") from exc
        return tenant, key

    def tenant_by_api_key(self, key: str) -> Tenant | None:
        with self._read() as conn:
            row = conn.execute(select(tenants).where(tenants.c.api_key_sha256 == hash_api_key(key))).first()
        return _tenant_from_row(row) if row else None

    def get_tenant(self, tenant_id: str) -> Tenant | None:
        with self._read() as conn:
            row = conn.execute(select(tenants).where(tenants.c.id == tenant_id)).first()
        return _tenant_from_row(row) if row else None

    def list_tenants(self) -> list[Tenant]:
        with self._read() as conn:
            rows = conn.execute(select(tenants).order_by(tenants.c.created_at, tenants.c.name)).all()
        return [_tenant_from_row(r) for r in rows]

    def set_tenant_max_vms(self, tenant_id: str, max_vms: int) -> None:
        with self.write() as tx:
            tx._conn.execute(update(tenants).where(tenants.c.id == tenant_id).values(max_vms=max_vms))

    # -- vms --------------------------------------------------------------------------------

    def get_vm(self, vm_id: str) -> VmRecord | None:
        with self._read() as conn:
            row = conn.execute(select(vms).where(vms.c.vm_id == vm_id)).first()
        return _vm_from_row(row) if row else None

    def list_vms(
        self,
        *,
        tenant_id: str | None = None,
        states: Iterable[str] | None = None,
        parent_vm_id: str | None = None,
        mem_snapshot_id: str | None = None,
    ) -> list[VmRecord]:
        q = select(vms)
        if tenant_id is not None:
            q = q.where(vms.c.tenant_id == tenant_id)
        if states is not None:
            q = q.where(vms.c.state.in_(list(states)))
        if parent_vm_id is not None:
            q = q.where(vms.c.parent_vm_id == parent_vm_id)
        if mem_snapshot_id is not None:
            q = q.where(vms.c.mem_snapshot_id == mem_snapshot_id)
        with self._read() as conn:
            rows = conn.execute(q.order_by(vms.c.created_at, vms.c.vm_id)).all()
        return [_vm_from_row(r) for r in rows]

    def update_vm(self, vm_id: str, **fields: Any) -> bool:
        """Columns that are not lifecycle state (activity stamps, node id...)."""
        with self.write() as tx:
            return tx.update_vm(vm_id, **fields)

    def count_slots(self, tenant_id: str) -> int:
        with self._read() as conn:
            return WriteTx(conn).count_slots(tenant_id)

    # -- events -----------------------------------------------------------------------------

    def add_event(self, vm_id: str, tenant_id: str, kind: str, **kw: Any) -> None:
        with self.write() as tx:
            tx.add_event(vm_id, tenant_id, kind, **kw)

    def list_events(self, vm_id: str) -> list[EventRecord]:
        with self._read() as conn:
            rows = conn.execute(select(events).where(events.c.vm_id == vm_id).order_by(events.c.id)).all()
        return [_event_from_row(r) for r in rows]
