"""Cluster: the nodes table, the leadership lease row, each VM's placement constraints.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from pal.store.tables import UtcDateTime

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "nodes",
        sa.Column("node_id", sa.String(128), primary_key=True),
        sa.Column("url", sa.String(512), nullable=False),
        sa.Column("region", sa.String(64), nullable=False),
        sa.Column("labels", sa.JSON, nullable=False),
        sa.Column("capacity", sa.JSON, nullable=False),
        sa.Column("templates", sa.JSON, nullable=False),
        sa.Column("images", sa.JSON, nullable=False),
        sa.Column("healthy", sa.Boolean, nullable=False),
        sa.Column("health", sa.Text),
        sa.Column("vm_count", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("epoch", sa.String(64), nullable=False),
        sa.Column("registered_at", UtcDateTime, nullable=False),
        sa.Column("last_seen_at", UtcDateTime, nullable=False),
    )
    lease = op.create_table(
        "leader_lease",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("holder", sa.String(128), nullable=False),
        sa.Column("url", sa.String(512), nullable=False),
        sa.Column("token", sa.BigInteger, nullable=False),
        sa.Column("expires_at_ms", sa.BigInteger, nullable=False),
    )
    op.bulk_insert(lease, [{"id": 1, "holder": "", "url": "", "token": 0, "expires_at_ms": 0}])
    op.create_index("ix_vms_node", "vms", ["node_id", "state"])
    with op.batch_alter_table("vms") as batch:
        batch.add_column(sa.Column("placement", sa.JSON))


def downgrade() -> None:
    with op.batch_alter_table("vms") as batch:
        batch.drop_column("placement")
    op.drop_index("ix_vms_node", "vms")
    op.drop_table("leader_lease")
    op.drop_table("nodes")
