"""Each tenant's running counts of what its quotas limit: slots held, VMs paused (or being
paused), bytes of snapshots. Kept on the tenant's row, in the same transaction as every
change of the VM rows they count, so a quota check reads one row instead of counting the
tenant's VMs (which at 10^5 VMs a tenant cost tens of ms under the tenant's lock: the
control-plane benchmark's finding, docs/scale.md).

The one writer of each counted column adds its change here (write_tx.py: a VM inserted,
its slot flag flipped, its state, marker or snapshot bytes written); :func:`recount`
rebuilds the counts from the rows (the migration, a bulk load, a repair).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from sqlalchemy import Connection, func, select, update

from pal.store.tables import PAUSING_MARKERS, tenants, vms


def counts_as_paused(state: str, marker: str) -> bool:
    """Paused, or being paused (draining for a pause): what ``max_paused`` counts."""
    return state == "paused" or (state == "draining" and marker in PAUSING_MARKERS)


def adjust(
    conn: Connection, tenant_id: str, *, slots: int = 0, paused: int = 0, snapshot_bytes: int = 0
) -> None:
    if not (slots or paused or snapshot_bytes):
        return
    t = tenants.c
    conn.execute(
        update(tenants)
        .where(t.id == tenant_id)
        .values(
            slots_used=t.slots_used + slots,
            paused_vms=t.paused_vms + paused,
            snapshot_bytes_used=t.snapshot_bytes_used + snapshot_bytes,
        )
    )


def change(conn: Connection, before: Any, after: dict[str, Any]) -> None:
    """Count a VM row's change: ``before`` its row as it was, ``after`` the columns written."""
    state, marker = after.get("state", before.state), after.get("marker", before.marker)
    paused = int(counts_as_paused(state, marker)) - int(counts_as_paused(before.state, before.marker))
    grown = int(after.get("snapshot_bytes", before.snapshot_bytes) or 0) - int(before.snapshot_bytes or 0)
    adjust(conn, before.tenant_id, paused=paused, snapshot_bytes=grown)


def recount(conn: Connection, tenant_ids: Collection[str] | None = None) -> None:
    """Set each tenant's counts from its VM rows (every tenant's, or those given)."""
    v = vms.c
    slots = select(func.count()).where(v.tenant_id == tenants.c.id, v.holds_slot).scalar_subquery()
    paused_when = (v.state == "paused") | ((v.state == "draining") & v.marker.in_(PAUSING_MARKERS))
    paused = select(func.count()).where(v.tenant_id == tenants.c.id, paused_when).scalar_subquery()
    used = select(func.coalesce(func.sum(v.snapshot_bytes), 0)).where(v.tenant_id == tenants.c.id)
    q = update(tenants).values(
        slots_used=slots, paused_vms=paused, snapshot_bytes_used=used.scalar_subquery()
    )
    if tenant_ids is not None:
        q = q.where(tenants.c.id.in_(sorted(tenant_ids)))
    conn.execute(q)
