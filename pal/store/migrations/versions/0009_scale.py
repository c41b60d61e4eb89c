"""The control plane at scale (docs/scale.md): indexes that let each of the leader's loops
and the paged list read what they act on, never the fleet's idle or terminated VMs; the
``listed`` flag of the VM list and the metadata filter's ``vm_tags``; the nodes a VM's
snapshots were taken on (a delete asks those, not every node); the events' time
index for retention; each tenant's running counts of what its quotas limit (books.py).

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from alembic import op

from pal.store import books
from pal.store.tables import (
    IDLE_DUE,
    IDLE_DUE_WHERE,
    IDLE_LIVE_DUE,
    IDLE_LIVE_DUE_WHERE,
    LIFETIME_DUE,
    UtcDateTime,
)

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def _where(predicate: str) -> dict[str, Any]:
    return {"postgresql_where": sa.text(predicate), "sqlite_where": sa.text(predicate)}


def upgrade() -> None:
    with op.batch_alter_table("vms") as batch:
        batch.add_column(sa.Column("listed", sa.Boolean, nullable=False, server_default=sa.true()))
        batch.add_column(sa.Column("snapshot_nodes", sa.JSON))
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("slots_used", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("paused_vms", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("snapshot_bytes_used", sa.BigInteger, nullable=False, server_default="0"))
    books.recount(op.get_bind())
    # Terminated more than an hour ago: out of the list already (pal/scheduler/reads.py's rule).
    op.execute(
        sa.text("UPDATE vms SET listed = :no WHERE state = 'terminated' AND updated_at < :cutoff").bindparams(
            no=False, cutoff=_an_hour_ago()
        )
    )
    op.drop_index("ix_vms_state", "vms")
    op.drop_index("ix_vms_lifetime", "vms")
    op.drop_index("ix_vms_tenant_created", "vms")
    op.create_index("ix_vms_state_marker", "vms", ["state", "marker", "vm_id"])
    op.create_index("ix_vms_slots", "vms", ["node_id", "vm_id"], **_where("holds_slot"))
    op.create_index(
        "ix_vms_mem_snapshot", "vms", ["mem_snapshot_id"], **_where("mem_snapshot_id IS NOT NULL")
    )
    op.create_index("ix_vms_listed", "vms", ["tenant_id", "created_at", "vm_id"], **_where("listed"))
    op.create_index("ix_vms_unlist", "vms", ["updated_at"], **_where("listed AND state = 'terminated'"))
    op.create_index("ix_vms_lifetime_due", "vms", ["lifetime_ends_at"], **_where(LIFETIME_DUE))
    op.create_index("ix_vms_idle_due", "vms", [sa.text(IDLE_DUE)], **_where(IDLE_DUE_WHERE))
    op.create_index("ix_vms_idle_live_due", "vms", [sa.text(IDLE_LIVE_DUE)], **_where(IDLE_LIVE_DUE_WHERE))
    op.create_index("ix_events_at", "events", ["at"])
    tags = op.create_table(
        "vm_tags",
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("tag", sa.String(330), nullable=False),
        sa.Column("created_at", UtcDateTime, nullable=False),
        sa.Column("vm_id", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "tag", "created_at", "vm_id", name="pk_vm_tags"),
    )
    op.create_index("ix_vm_tags_vm", "vm_tags", ["vm_id"])
    # The listed VMs' metadata as tags (0008 added metadata: usually few VMs have any yet).
    conn = op.get_bind()
    rows = conn.execute(sa.text("SELECT vm_id, tenant_id, created_at, metadata FROM vms WHERE listed")).all()
    batch_rows = []
    for vm_id, tenant_id, created_at, meta in rows:
        pairs = json.loads(meta) if isinstance(meta, str) else (meta or {})
        for k, v in pairs.items():
            batch_rows.append(
                {"tenant_id": tenant_id, "tag": f"{k}={v}", "created_at": created_at, "vm_id": vm_id}
            )
    if batch_rows:
        op.bulk_insert(tags, batch_rows)


def _an_hour_ago() -> object:
    from datetime import UTC, datetime, timedelta

    return (datetime.now(UTC) - timedelta(hours=1)).replace(tzinfo=None)


def downgrade() -> None:
    op.drop_index("ix_vm_tags_vm", "vm_tags")
    op.drop_table("vm_tags")
    op.drop_index("ix_events_at", "events")
    for name in (
        "ix_vms_idle_live_due",
        "ix_vms_idle_due",
        "ix_vms_lifetime_due",
        "ix_vms_unlist",
        "ix_vms_listed",
        "ix_vms_mem_snapshot",
        "ix_vms_slots",
        "ix_vms_state_marker",
    ):
        op.drop_index(name, "vms")
    op.create_index("ix_vms_tenant_created", "vms", ["tenant_id", "created_at", "vm_id"])
    op.create_index("ix_vms_lifetime", "vms", ["lifetime_ends_at"])
    op.create_index("ix_vms_state", "vms", ["state"])
    with op.batch_alter_table("tenants") as batch:
        for col in ("snapshot_bytes_used", "paused_vms", "slots_used"):
            batch.drop_column(col)
    with op.batch_alter_table("vms") as batch:
        batch.drop_column("snapshot_nodes")
        batch.drop_column("listed")
