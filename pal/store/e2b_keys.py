"""A tenant's keys of E2B's form (table ``tenant_e2b_keys``; the form and its making are
pal/e2b/keys.py's). Each is kept as a sha256 only, shown once when it is made, and
authenticates its tenant on the E2B surface alone (never `/v1`). A tenant holds several at
once (one per app); revoking one deletes its row, removing the tenant deletes them all
(``Store.delete_tenant``)."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, insert, select

from pal.store.store import Store
from pal.store.tables import tenant_e2b_keys, tenants
from pal.store.write_tx import utcnow

MAX_KEYS_PER_TENANT = 100


@dataclass(frozen=True)
class E2bKey:
    key_id: str
    tenant_id: str
    name: str
    mask: str  # the key's first and last characters, to tell keys apart
    created_at: datetime
    last_used_at: datetime | None = None


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def mask_of(key: str) -> str:
    return f"{key[:8]}...{key[-4:]}"


def _record(row: object) -> E2bKey:
    r = row._mapping  # type: ignore[attr-defined]
    return E2bKey(r["key_id"], r["tenant_id"], r["name"], r["mask"], r["created_at"], r["last_used_at"])


def add_key(store: Store, tenant_id: str, key: str, name: str = "") -> E2bKey:
    """Keep ``key`` (made by the caller: pal.e2b.keys.new_key) as one of the tenant's;
    NotFound-free: the tenant must exist (its foreign key), at most MAX_KEYS_PER_TENANT."""
    from pal.errors import Conflict, NotFound

    made = E2bKey("k" + secrets.token_hex(8), tenant_id, name[:200], mask_of(key), utcnow())
    with store.write() as tx:
        conn = tx._conn
        if conn.execute(select(tenants.c.id).where(tenants.c.id == tenant_id)).first() is None:
            raise NotFound(f"tenant {tenant_id} not found")
        held = conn.execute(select(tenant_e2b_keys.c.key_id).where(tenant_e2b_keys.c.tenant_id == tenant_id))
        if len(held.all()) >= MAX_KEYS_PER_TENANT:
            raise Conflict(f"the tenant holds {MAX_KEYS_PER_TENANT} E2B keys already: revoke one first")
        conn.execute(
            insert(tenant_e2b_keys).values(
                key_id=made.key_id,
                tenant_id=tenant_id,
                key_sha256=_hash(key),
                name=made.name,
                mask=made.mask,
                created_at=made.created_at,
            )
        )
    return made


def tenant_of_key(store: Store, key: str) -> str | None:
    """The id of the tenant ``key`` is one of the E2B keys of (None: no such key, or its
    tenant is being removed)."""
    q = (
        select(tenants.c.id, tenants.c.deleting_at)
        .select_from(tenant_e2b_keys.join(tenants, tenants.c.id == tenant_e2b_keys.c.tenant_id))
        .where(tenant_e2b_keys.c.key_sha256 == _hash(key))
    )
    with store._read() as conn:
        row = conn.execute(q).first()
    if row is None or row.deleting_at is not None:
        return None
    return str(row.id)


def list_keys(store: Store, tenant_id: str) -> list[E2bKey]:
    q = (
        select(tenant_e2b_keys)
        .where(tenant_e2b_keys.c.tenant_id == tenant_id)
        .order_by(tenant_e2b_keys.c.created_at, tenant_e2b_keys.c.key_id)
    )
    with store._read() as conn:
        return [_record(r) for r in conn.execute(q)]


def revoke_key(store: Store, tenant_id: str, key_id: str) -> bool:
    """Delete the tenant's key ``key_id``; False when it has none of that id."""
    with store.write() as tx:
        done = tx._conn.execute(
            delete(tenant_e2b_keys).where(
                tenant_e2b_keys.c.tenant_id == tenant_id, tenant_e2b_keys.c.key_id == key_id
            )
        )
    return bool(done.rowcount)
