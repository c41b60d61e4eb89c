"""Volumes (docs/volumes.md): their rows, their metadata's rows for the list's filter, the
VMs that mount them, and each tenant's volume limits and running counts.

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from pal.store.tables import UtcDateTime

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("max_volumes", sa.Integer))
        batch.add_column(sa.Column("max_volume_bytes", sa.BigInteger))
        batch.add_column(sa.Column("volumes_used", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("volume_bytes_used", sa.BigInteger, nullable=False, server_default="0"))
    op.create_table(
        "volumes",
        sa.Column("volume_id", sa.String(64), primary_key=True),
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("size_mib", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("node_id", sa.String(128)),
        sa.Column("metadata", sa.JSON, nullable=False),
        sa.Column("created_at", UtcDateTime, nullable=False),
        sa.Column("updated_at", UtcDateTime, nullable=False),
        sa.UniqueConstraint("tenant_id", "name", name="uq_volumes_tenant_name"),
    )
    op.create_index("ix_volumes_tenant", "volumes", ["tenant_id", "created_at", "volume_id"])
    op.create_table(
        "volume_tags",
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("tag", sa.String(330), nullable=False),
        sa.Column("created_at", UtcDateTime, nullable=False),
        sa.Column("volume_id", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "tag", "created_at", "volume_id", name="pk_volume_tags"),
    )
    op.create_index("ix_volume_tags_volume", "volume_tags", ["volume_id"])
    op.create_table(
        "volume_mounts",
        sa.Column("volume_id", sa.String(64), sa.ForeignKey("volumes.volume_id"), primary_key=True),
        sa.Column("vm_id", sa.String(64), primary_key=True),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("path", sa.String(512), nullable=False),
        sa.Column("read_only", sa.Boolean, nullable=False),
    )
    op.create_index("ix_volume_mounts_vm", "volume_mounts", ["vm_id"])


def downgrade() -> None:
    op.drop_table("volume_mounts")
    op.drop_table("volume_tags")
    op.drop_table("volumes")
    with op.batch_alter_table("tenants") as batch:
        for col in ("volume_bytes_used", "volumes_used", "max_volume_bytes", "max_volumes"):
            batch.drop_column(col)
