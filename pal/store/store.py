"""The repository: every read and write of Pal's durable state, behind explicit methods.

Callers get dataclasses (records.py), never rows. Transactions are short and synchronous;
a write that must be atomic with a check (quota reservation, a state change guarded by the
current state) goes through :meth:`Store.write` which yields a :class:`WriteTx`.

Two databases behind the same code:
- SQLite (`pal up`'s embedded default): the write transaction starts with ``BEGIN
  IMMEDIATE``, so two writers serialise at BEGIN instead of failing at COMMIT.
- PostgreSQL (``PAL_DATABASE_URL``, several control-plane replicas): READ COMMITTED with row
  locks: quota checks lock the tenant row (``FOR UPDATE``), so reservations of one tenant
  serialise and each sees the others' committed slots; a transition locks its VM row, so two
  writers of one VM serialise and the second sees the first's state.

Fencing: a replica that leads installs a fence (:meth:`Store.set_fence`); every write
transaction then first reads the lease row ``FOR SHARE`` and refuses to go on
(:class:`NotLeader`) unless the lease still carries this replica's fencing token. A deposed
leader's late write therefore fails, and a takeover (which updates that row) waits for the
in-flight writes of the old token to commit or roll back.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    create_engine,
    event,
    func,
    insert,
    literal_column,
    select,
    update,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError

from pal.config import Settings
from pal.errors import Conflict, InvalidRequest, NotFound, NotLeader
from pal.store import counting, migrate
from pal.store.records import EventRecord, LeaseInfo, NodeRecord, PortLinkCheck, Tenant, VmRecord
from pal.store.tables import (
    events,
    kept_snapshots,
    leader_lease,
    nodes,
    port_link_revocations,
    tenant_cas,
    tenant_e2b_keys,
    tenants,
    vm_tags,
    vms,
    volumes,
)
from pal.store.write_tx import (
    WriteTx,
    event_from_row,
    record_of,
    tenant_from_row,
    utcnow,
    vm_from_row,
)

SQLITE_BUSY_TIMEOUT_MS = 10_000
_WRITE = "pal_write_tx"
_KEEP: Any = object()  # "leave this limit as it is" in set_tenant_limits


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_api_key() -> str:
    return "pal_" + secrets.token_urlsafe(32)


def _check_limits(
    max_vms: int, max_paused: int | None, max_snapshot_bytes: int | None, **others: int | None
) -> None:
    for name, value in others.items():
        if value is not None and value < 0:
            raise InvalidRequest(f"{name} must be 0 or more (or no limit)")
    if max_vms < 0:
        raise InvalidRequest("max_vms must be 0 or more")
    if max_paused is not None and max_paused < 0:
        raise InvalidRequest("max_paused must be 0 or more (or no limit)")
    if max_snapshot_bytes is not None and max_snapshot_bytes < 0:
        raise InvalidRequest("max_snapshot_bytes must be 0 or more (or no limit)")


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


def database_url(url: str) -> str:
    """A SQLAlchemy URL: ``postgresql://`` and ``postgres://`` mean psycopg 3."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def redacted(url: str) -> str:
    """The URL without its password, for logs and `pal doctor`."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<unparsable database URL>"


def _db_now_ms(dialect: str) -> ColumnElement[Any]:
    """The database's clock in ms since the epoch (lease expiry is judged by one clock)."""
    if dialect == "postgresql":
        return literal_column("(extract(epoch from clock_timestamp()) * 1000)::bigint")
    return literal_column("CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)")


class Store:
    def __init__(self, url: str, *, run_migrations: bool = True) -> None:
        self.url = database_url(url)
        if self.url.startswith("postgresql"):
            # pre_ping: a replica outlives database restarts and failovers.
            self.engine = create_engine(self.url, pool_pre_ping=True, pool_size=10, max_overflow=20)
        else:
            self.engine = create_engine(self.url)
        self.dialect = self.engine.dialect.name
        counting.install(self.engine)
        if self.dialect == "sqlite":
            _sqlite_setup(self.engine)
        self._fence: Callable[[], int | None] | None = None
        if run_migrations:
            migrate.upgrade(self.engine)

    @classmethod
    def open(cls, settings: Settings) -> Store:
        """PostgreSQL when ``PAL_DATABASE_URL`` / ``--database`` is set, else the embedded
        SQLite file in the data dir."""
        if settings.database_url:
            return cls(settings.database_url)
        settings.db_path.parent.mkdir(parents=True, exist_ok=True)
        return cls(f"sqlite:///{settings.db_path}")

    def close(self) -> None:
        self.engine.dispose()

    def set_fence(self, token: Callable[[], int | None] | None) -> None:
        """From now on every write transaction checks that the lease row carries
        ``token()`` (None: this replica does not lead, so it may not write)."""
        self._fence = token

    # -- transactions -------------------------------------------------------------------

    @contextmanager
    def write(self) -> Iterator[WriteTx]:
        with self.engine.connect().execution_options(**{_WRITE: True}) as conn, conn.begin():
            if self._fence is not None:
                self._check_fence(conn, self._fence())
            yield WriteTx(conn)

    @staticmethod
    def _check_fence(conn: Connection, token: int | None) -> None:
        q = select(leader_lease.c.token).where(leader_lease.c.id == 1).with_for_update(read=True)
        current = conn.execute(q).scalar_one_or_none()
        if token is None or current != token:
            raise NotLeader(
                "this control-plane replica is not the leader"
                + (
                    f" (fencing token {token} is stale; the lease is at {current})"
                    if token is not None
                    else ""
                )
            )

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with self.engine.connect() as conn, conn.begin():
            yield conn

    # -- tenants --------------------------------------------------------------------------

    def create_tenant(
        self,
        name: str,
        max_vms: int,
        *,
        max_paused: int | None = None,
        max_snapshot_bytes: int | None = None,
        max_volumes: int | None = None,
        max_volume_bytes: int | None = None,
        key_ttl: timedelta | None = None,
    ) -> tuple[Tenant, str]:
        """Create a tenant; returns it and its API key (shown once: only a sha256 is kept).
        ``key_ttl``: the key expires that long from now (None: never)."""
        if not name.strip():
            raise InvalidRequest("tenant name must not be empty")
        _check_limits(
            max_vms,
            max_paused,
            max_snapshot_bytes,
            max_volumes=max_volumes,
            max_volume_bytes=max_volume_bytes,
        )
        key = new_api_key()
        now = utcnow()
        values = {
            "id": "t-" + uuid.uuid4().hex[:16],
            "name": name,
            "api_key_sha256": hash_api_key(key),
            "max_vms": max_vms,
            "created_at": now,
            "max_paused": max_paused,
            "max_snapshot_bytes": max_snapshot_bytes,
            "max_volumes": max_volumes,
            "max_volume_bytes": max_volume_bytes,
            "api_key_expires_at": now + key_ttl if key_ttl is not None else None,
        }
        try:
            with self.write() as tx:
                tx._conn.execute(insert(tenants).values(**values))
                row = tx._conn.execute(select(tenants).where(tenants.c.id == values["id"])).one()
        except IntegrityError as exc:
            raise Conflict(f"a tenant named {name!r} already exists") from exc
        return tenant_from_row(row), key

    def tenant_by_api_key(self, key: str) -> Tenant | None:
        """The tenant this key authenticates now: its current key (unless expired) or its
        previous one within the grace after a rotation; never a tenant being deleted."""
        return self.tenant_by_api_key_hash(hash_api_key(key))

    def tenant_by_api_key_hash(self, h: str) -> Tenant | None:
        """:meth:`tenant_by_api_key` of the key whose hash is ``h`` (dashboard sessions keep
        the hash, never the key)."""
        now = utcnow()
        with self._read() as conn:
            row = conn.execute(
                select(tenants).where((tenants.c.api_key_sha256 == h) | (tenants.c.prev_api_key_sha256 == h))
            ).first()
        if row is None or row.deleting_at is not None:
            return None
        if row.api_key_sha256 == h:
            ok = row.api_key_expires_at is None or now < row.api_key_expires_at
        else:
            ok = row.prev_api_key_expires_at is not None and now < row.prev_api_key_expires_at
        return tenant_from_row(row) if ok else None

    def why_key_refused(self, key: str) -> str:
        """Why ``tenant_by_api_key`` refused ``key`` (for the 401's message)."""
        h = hash_api_key(key)
        with self._read() as conn:
            row = conn.execute(
                select(tenants).where((tenants.c.api_key_sha256 == h) | (tenants.c.prev_api_key_sha256 == h))
            ).first()
        if row is None:
            return "invalid API key"
        if row.deleting_at is not None:
            return "this tenant is being deleted"
        if row.api_key_sha256 == h:
            return f"API key expired at {row.api_key_expires_at:%Y-%m-%d %H:%M} UTC"
        return "API key was rotated and its grace period is over"

    def get_tenant(self, tenant_id: str) -> Tenant | None:
        with self._read() as conn:
            row = conn.execute(select(tenants).where(tenants.c.id == tenant_id)).first()
        return tenant_from_row(row) if row else None

    def tenant_by_name(self, name: str) -> Tenant | None:
        with self._read() as conn:
            row = conn.execute(select(tenants).where(tenants.c.name == name)).first()
        return tenant_from_row(row) if row else None

    def list_tenants(self) -> list[Tenant]:
        with self._read() as conn:
            rows = conn.execute(select(tenants).order_by(tenants.c.created_at, tenants.c.name)).all()
        return [tenant_from_row(r) for r in rows]

    def deleting_tenants(self) -> list[Tenant]:
        """The tenants `pal tenants rm` marked and the leader has still to remove."""
        with self._read() as conn:
            rows = conn.execute(select(tenants).where(tenants.c.deleting_at.is_not(None))).all()
        return [tenant_from_row(r) for r in rows]

    def set_tenant_limits(
        self,
        tenant_id: str,
        *,
        max_vms: int = _KEEP,
        max_paused: int | None = _KEEP,
        max_snapshot_bytes: int | None = _KEEP,
        max_volumes: int | None = _KEEP,
        max_volume_bytes: int | None = _KEEP,
    ) -> Tenant:
        """Change some limits (None: no limit; an argument not given keeps its value).
        A lower limit applies to what comes next: nothing running is stopped."""
        changes = {
            k: v
            for k, v in (
                ("max_vms", max_vms),
                ("max_paused", max_paused),
                ("max_snapshot_bytes", max_snapshot_bytes),
                ("max_volumes", max_volumes),
                ("max_volume_bytes", max_volume_bytes),
            )
            if v is not _KEEP
        }
        _check_limits(
            int(changes.get("max_vms") or 0),
            changes.get("max_paused"),
            changes.get("max_snapshot_bytes"),
            max_volumes=changes.get("max_volumes"),
            max_volume_bytes=changes.get("max_volume_bytes"),
        )
        with self.write() as tx:
            if changes:
                tx._conn.execute(update(tenants).where(tenants.c.id == tenant_id).values(**changes))
            row = tx._conn.execute(select(tenants).where(tenants.c.id == tenant_id)).first()
        if row is None:
            raise NotFound(f"tenant {tenant_id} not found")
        return tenant_from_row(row)

    def rotate_api_key(
        self, tenant_id: str, *, grace: timedelta = timedelta(0), key_ttl: timedelta | None = None
    ) -> str:
        """A new API key for the tenant (shown once). The old one keeps working for
        ``grace`` (0: refused at once); the new one expires after ``key_ttl`` (None: never)."""
        key, now = new_api_key(), utcnow()
        with self.write() as tx:
            row = tx._conn.execute(select(tenants).where(tenants.c.id == tenant_id).with_for_update()).first()
            if row is None or row.deleting_at is not None:
                raise NotFound(f"tenant {tenant_id} not found")
            tx._conn.execute(
                update(tenants)
                .where(tenants.c.id == tenant_id)
                .values(
                    api_key_sha256=hash_api_key(key),
                    api_key_expires_at=now + key_ttl if key_ttl is not None else None,
                    prev_api_key_sha256=row.api_key_sha256 if grace > timedelta(0) else None,
                    prev_api_key_expires_at=now + grace if grace > timedelta(0) else None,
                )
            )
        return key

    def mark_tenant_deleting(self, tenant_id: str) -> Tenant:
        """`pal tenants rm`: the tenant's keys stop working now; the leader then deletes its
        VMs and snapshots and finally the tenant (scheduler: purge_deleted_tenants)."""
        with self.write() as tx:
            tx._conn.execute(
                update(tenants)
                .where(tenants.c.id == tenant_id, tenants.c.deleting_at.is_(None))
                .values(deleting_at=utcnow())
            )
            row = tx._conn.execute(select(tenants).where(tenants.c.id == tenant_id)).first()
        if row is None:
            raise NotFound(f"tenant {tenant_id} not found")
        return tenant_from_row(row)

    def delete_tenant(self, tenant_id: str) -> bool:
        """Remove a tenant marked for deletion and its VM rows and events; refuses (False)
        while any of its VMs is not terminated or any of its volumes is left (the leader
        deletes those first, files and all)."""
        with self.write() as tx:
            row = tx._conn.execute(select(tenants).where(tenants.c.id == tenant_id).with_for_update()).first()
            if row is None:
                return True
            if row.deleting_at is None:
                raise Conflict(f"tenant {tenant_id} is not being deleted")
            live = tx._conn.execute(
                select(func.count()).where(vms.c.tenant_id == tenant_id, vms.c.state != "terminated")
            ).scalar_one()
            if live:
                return False
            if tx._conn.execute(select(volumes.c.volume_id).where(volumes.c.tenant_id == tenant_id)).first():
                return False
            tx._conn.execute(events.delete().where(events.c.tenant_id == tenant_id))
            tx._conn.execute(vm_tags.delete().where(vm_tags.c.tenant_id == tenant_id))
            tx._conn.execute(vms.delete().where(vms.c.tenant_id == tenant_id))
            tx._conn.execute(tenant_cas.delete().where(tenant_cas.c.tenant_id == tenant_id))
            tx._conn.execute(tenant_e2b_keys.delete().where(tenant_e2b_keys.c.tenant_id == tenant_id))
            tx._conn.execute(kept_snapshots.delete().where(kept_snapshots.c.tenant_id == tenant_id))
            tx._conn.execute(
                port_link_revocations.delete().where(port_link_revocations.c.tenant_id == tenant_id)
            )
            tx._conn.execute(tenants.delete().where(tenants.c.id == tenant_id))
        return True

    # -- port links (pal/api/port_links.py) ---------------------------------------------------

    def revoke_port_link(self, tenant_id: str, link_id: str, expires_at: datetime) -> None:
        """Put a link of the tenant on the revocation list until ``expires_at`` (when it
        would have expired anyway); revoking twice is a no-op. Entries past their expiry go."""
        now = utcnow()
        with self.write() as tx:
            tx._conn.execute(port_link_revocations.delete().where(port_link_revocations.c.expires_at < now))
            known = tx._conn.execute(
                select(port_link_revocations.c.link_id).where(
                    port_link_revocations.c.tenant_id == tenant_id, port_link_revocations.c.link_id == link_id
                )
            ).first()
            if known is not None:
                return
            tx._conn.execute(
                insert(port_link_revocations).values(
                    link_id=link_id, tenant_id=tenant_id, revoked_at=now, expires_at=expires_at
                )
            )

    def port_link_check(self, tenant_id: str, link_id: str) -> PortLinkCheck | None:
        """The tenant's API keys that authenticate now and whether the link is revoked
        (one read); None when the tenant is gone or being deleted."""
        now = utcnow()
        with self._read() as conn:
            row = conn.execute(select(tenants).where(tenants.c.id == tenant_id)).first()
            revoked = conn.execute(
                select(port_link_revocations.c.link_id).where(
                    port_link_revocations.c.tenant_id == tenant_id, port_link_revocations.c.link_id == link_id
                )
            ).first()
        if row is None or row.deleting_at is not None:
            return None
        hashes = []
        if row.api_key_expires_at is None or now < row.api_key_expires_at:
            hashes.append(row.api_key_sha256)
        if row.prev_api_key_sha256 and row.prev_api_key_expires_at and now < row.prev_api_key_expires_at:
            hashes.append(row.prev_api_key_sha256)
        return PortLinkCheck(key_hashes=tuple(hashes), revoked=revoked is not None)

    # -- tenant CAs (pal/scheduler/brokering.py) ----------------------------------------------

    def tenant_ca(self, tenant_id: str) -> tuple[str, str] | None:
        """The tenant's CA as stored: (certificate PEM, sealed key), or None."""
        with self._read() as conn:
            row = conn.execute(select(tenant_cas).where(tenant_cas.c.tenant_id == tenant_id)).first()
        return (row.cert_pem, row.key_sealed) if row else None

    def add_tenant_ca(self, tenant_id: str, cert_pem: str, key_sealed: str) -> tuple[str, str]:
        """Store the tenant's CA unless it has one already; returns the one stored (the
        first one made wins: a CA that signed a guest's trust store must never change)."""
        with self.write() as tx:
            if tx.tenant(tenant_id) is None:  # locks the tenant row: one maker at a time
                raise NotFound(f"tenant {tenant_id} not found")
            row = tx._conn.execute(select(tenant_cas).where(tenant_cas.c.tenant_id == tenant_id)).first()
            if row is not None:
                return (row.cert_pem, row.key_sealed)
            tx._conn.execute(
                insert(tenant_cas).values(
                    tenant_id=tenant_id, cert_pem=cert_pem, key_sealed=key_sealed, created_at=utcnow()
                )
            )
        return (cert_pem, key_sealed)

    # -- vms --------------------------------------------------------------------------------

    def get_vm(self, vm_id: str) -> VmRecord | None:
        with self._read() as conn:
            row = conn.execute(select(vms).where(vms.c.vm_id == vm_id)).first()
        return vm_from_row(row) if row else None

    def list_vms(
        self,
        *,
        tenant_id: str | None = None,
        states: Iterable[str] | None = None,
        parent_vm_id: str | None = None,
        mem_snapshot_id: str | None = None,
        node_id: str | None = None,
    ) -> list[VmRecord]:
        q = select(vms)
        if node_id is not None:
            q = q.where(vms.c.node_id == node_id)
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
        return [vm_from_row(r) for r in rows]

    def update_vm(self, vm_id: str, **fields: Any) -> bool:
        """Columns that are not lifecycle state (activity stamps...); see WriteTx.update_vm."""
        with self.write() as tx:
            return tx.update_vm(vm_id, **fields)

    def count_slots(self, tenant_id: str) -> int:
        with self._read() as conn:
            return WriteTx(conn).count_slots(tenant_id)

    def count_vms_by_state(self) -> dict[str, int]:
        """Every VM row counted by state (operator metrics)."""
        with self._read() as conn:
            rows = conn.execute(select(vms.c.state, func.count()).group_by(vms.c.state)).all()
        return {str(state): int(n) for state, n in rows}

    def slots_by_tenant(self) -> dict[str, int]:
        """Quota slots held, per tenant id (tenants holding none are absent)."""
        q = select(vms.c.tenant_id, func.count()).where(vms.c.holds_slot.is_(True)).group_by(vms.c.tenant_id)
        with self._read() as conn:
            rows = conn.execute(q).all()
        return {str(t): int(n) for t, n in rows}

    # -- events -----------------------------------------------------------------------------

    def add_event(self, vm_id: str, tenant_id: str, kind: str, **kw: Any) -> None:
        with self.write() as tx:
            tx.add_event(vm_id, tenant_id, kind, **kw)

    def add_ring_event(self, vm_id: str, tenant_id: str, kind: str, keep: int, **kw: Any) -> None:
        """An event of a kind kept as a ring per VM (clients' audit events): the newest
        ``keep`` stay, in the same transaction."""
        with self.write() as tx:
            tx.add_event(vm_id, tenant_id, kind, **kw)
            tx.trim_events(vm_id, kind, keep)

    def prune_events(self, before: datetime, limit: int, *, kinds: Collection[str] | None = None) -> int:
        """Retention of the event log, whoever writes it: delete up to ``limit`` of the
        events older than ``before`` (only those of ``kinds``, when given), oldest first
        (``ix_events_at``); the number deleted. Leader only (fenced)."""
        q = select(events.c.id).where(events.c.at < before)
        if kinds is not None:
            q = q.where(events.c.kind.in_(sorted(kinds)))
        with self.write() as tx:
            ids = [r[0] for r in tx._conn.execute(q.order_by(events.c.at).limit(limit)).all()]
            if ids:
                tx._conn.execute(events.delete().where(events.c.id.in_(ids)))
        return len(ids)

    def list_events(self, vm_id: str) -> list[EventRecord]:
        with self._read() as conn:
            rows = conn.execute(select(events).where(events.c.vm_id == vm_id).order_by(events.c.id)).all()
        return [event_from_row(r) for r in rows]

    # -- nodes ------------------------------------------------------------------------------

    def record_node(self, rec: NodeRecord) -> NodeRecord:
        """:meth:`record_nodes` of one."""
        return self.record_nodes([rec])[0]

    def record_nodes(self, recs: Sequence[NodeRecord]) -> list[NodeRecord]:
        """Upsert nodes from their heartbeats, in one transaction. Keeps ``registered_at``
        and an operator's ``draining``; a node marked lost that heartbeats again is active
        again (the caller has stopped what it must not run). The records as stored."""
        if not recs:
            return []
        ids = sorted({r.node_id for r in recs})
        with self.write() as tx:
            q = select(nodes).where(nodes.c.node_id.in_(ids)).with_for_update()
            old = {r.node_id: record_of(NodeRecord, r) for r in tx._conn.execute(q).all()}
            out = []
            new, changed = [], []
            for rec in recs:
                values = asdict(rec)
                prev = old.get(rec.node_id)
                if prev is None:
                    new.append(values)
                else:
                    values["registered_at"] = prev.registered_at
                    if prev.state == "draining":
                        values["state"] = "draining"
                    changed.append(values)
                out.append(NodeRecord(**values))
            if new:
                tx._conn.execute(insert(nodes), new)
            for values in changed:
                tx._conn.execute(update(nodes).where(nodes.c.node_id == values["node_id"]).values(**values))
        return out

    def list_nodes(self) -> list[NodeRecord]:
        with self._read() as conn:
            rows = conn.execute(select(nodes).order_by(nodes.c.node_id)).all()
        return [record_of(NodeRecord, r) for r in rows]

    def get_node(self, node_id: str) -> NodeRecord | None:
        with self._read() as conn:
            row = conn.execute(select(nodes).where(nodes.c.node_id == node_id)).first()
        return record_of(NodeRecord, row) if row else None

    def set_node_state(self, node_id: str, state: str, *, expect: str | None = None) -> bool:
        """Set a node's state (only if it is ``expect``, when given); True if it changed."""
        with self.write() as tx:
            q = update(nodes).where(nodes.c.node_id == node_id, nodes.c.state != state)
            if expect is not None:
                q = q.where(nodes.c.state == expect)
            return tx._conn.execute(q.values(state=state)).rowcount == 1

    # -- leadership lease (pal/scheduler/leader.py) -------------------------------------------
    # Not fenced: these statements are what decides who may write.

    def lease_acquire(self, holder: str, url: str, ttl_ms: int) -> int | None:
        """Take the lease if it has expired: the new fencing token, else None."""
        now = _db_now_ms(self.dialect)
        q = (
            update(leader_lease)
            .where(leader_lease.c.id == 1, leader_lease.c.expires_at_ms < now)
            .values(holder=holder, url=url, token=leader_lease.c.token + 1, expires_at_ms=now + ttl_ms)
            .returning(leader_lease.c.token)
        )
        with self.engine.begin() as conn:
            token = conn.execute(q).scalar_one_or_none()
        return int(token) if token is not None else None

    def lease_renew(self, holder: str, token: int, ttl_ms: int) -> bool:
        """Extend the lease if ``holder`` still holds it with ``token``."""
        now = _db_now_ms(self.dialect)
        q = (
            update(leader_lease)
            .where(leader_lease.c.id == 1, leader_lease.c.holder == holder, leader_lease.c.token == token)
            .values(expires_at_ms=now + ttl_ms)
        )
        with self.engine.begin() as conn:
            return conn.execute(q).rowcount == 1

    def lease_release(self, holder: str, token: int) -> None:
        """Give the lease up at once (a clean shutdown: the next replica need not wait)."""
        q = (
            update(leader_lease)
            .where(leader_lease.c.id == 1, leader_lease.c.holder == holder, leader_lease.c.token == token)
            .values(expires_at_ms=0)
        )
        with self.engine.begin() as conn:
            conn.execute(q)

    def lease_info(self) -> LeaseInfo:
        now = _db_now_ms(self.dialect)
        q = select(
            leader_lease.c.holder,
            leader_lease.c.url,
            leader_lease.c.token,
            (leader_lease.c.expires_at_ms - now).label("left"),
        ).where(leader_lease.c.id == 1)
        with self._read() as conn:
            row = conn.execute(q).one()
        return LeaseInfo(holder=row.holder, url=row.url, token=int(row.token), expires_in_ms=int(row.left))
