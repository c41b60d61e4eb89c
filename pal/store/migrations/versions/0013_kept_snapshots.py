"""A tenant's kept snapshots (pal/store/kept.py, docs/lifecycle.md "Kept snapshots"): named
or not, out of their VM's retention and past its delete, that new VMs start from.

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from pal.store.tables import UtcDateTime

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "kept_snapshots",
        sa.Column("snapshot_id", sa.String(64), primary_key=True),
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("name", sa.String(200)),
        sa.Column("source_vm_id", sa.String(64), nullable=False),
        sa.Column("agent_version_id", sa.String(128), nullable=False),
        sa.Column("node_id", sa.String(64)),
        sa.Column("created_at", UtcDateTime, nullable=False),
        sa.UniqueConstraint("tenant_id", "name", name="uq_kept_snapshots_name"),
    )
    op.create_index("ix_kept_snapshots_tenant", "kept_snapshots", ["tenant_id", "created_at", "snapshot_id"])
    op.create_index("ix_kept_snapshots_source", "kept_snapshots", ["source_vm_id"])


def downgrade() -> None:
    op.drop_index("ix_kept_snapshots_source", "kept_snapshots")
    op.drop_index("ix_kept_snapshots_tenant", "kept_snapshots")
    op.drop_table("kept_snapshots")
