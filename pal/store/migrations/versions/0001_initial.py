"""Initial schema: tenants, vms, events.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from pal.store.tables import UtcDateTime

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False, unique=True),
        sa.Column("api_key_sha256", sa.String(64), nullable=False, unique=True),
        sa.Column("max_vms", sa.Integer, nullable=False),
        sa.Column("created_at", UtcDateTime, nullable=False),
    )
    op.create_table(
        "vms",
        sa.Column("vm_id", sa.String(64), primary_key=True),
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("marker", sa.String(64), nullable=False),
        sa.Column("reason", sa.Text),
        sa.Column("image", sa.String(64), nullable=False),
        sa.Column("agent_version_id", sa.String(128)),
        sa.Column("limits", sa.JSON, nullable=False),
        sa.Column("idle_timeout_secs", sa.Integer, nullable=False),
        sa.Column("secrets", sa.JSON, nullable=False),
        sa.Column("boot", sa.String(16), nullable=False),
        sa.Column("created_at", UtcDateTime, nullable=False),
        sa.Column("updated_at", UtcDateTime, nullable=False),
        sa.Column("snapshot_id", sa.String(64)),
        sa.Column("parent_vm_id", sa.String(64)),
        sa.Column("mem_snapshot_id", sa.String(64)),
        sa.Column("incarnation", sa.Integer, nullable=False),
        sa.Column("token", sa.String(128), nullable=False),
        sa.Column("holds_slot", sa.Boolean, nullable=False),
        sa.Column("paused_by", sa.String(16)),
        sa.Column("node_id", sa.String(128)),
        sa.Column("last_activity_unix_ms", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_vms_tenant_slot", "vms", ["tenant_id", "holds_slot"])
    op.create_index("ix_vms_state", "vms", ["state"])
    op.create_index("ix_vms_parent", "vms", ["parent_vm_id"])
    op.create_table(
        "events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("vm_id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("at", UtcDateTime, nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("from_state", sa.String(16)),
        sa.Column("to_state", sa.String(16)),
        sa.Column("marker", sa.String(64), nullable=False),
        sa.Column("reason", sa.Text),
    )
    op.create_index("ix_events_vm", "events", ["vm_id", "id"])


def downgrade() -> None:
    op.drop_table("events")
    op.drop_table("vms")
    op.drop_table("tenants")
