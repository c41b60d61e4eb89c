"""Hardening: tenant limits on paused VMs and snapshot bytes, API key expiry and rotation,
tenant deletion; each VM's snapshot bytes.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from pal.store.tables import UtcDateTime

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("max_paused", sa.Integer))
    op.add_column("tenants", sa.Column("max_snapshot_bytes", sa.BigInteger))
    op.add_column("tenants", sa.Column("api_key_expires_at", UtcDateTime))
    op.add_column("tenants", sa.Column("prev_api_key_sha256", sa.String(64)))
    op.add_column("tenants", sa.Column("prev_api_key_expires_at", UtcDateTime))
    op.add_column("tenants", sa.Column("deleting_at", UtcDateTime))
    op.create_index("ix_tenants_prev_key", "tenants", ["prev_api_key_sha256"])
    op.add_column("vms", sa.Column("snapshot_bytes", sa.BigInteger, nullable=False, server_default="0"))


def downgrade() -> None:
    op.drop_column("vms", "snapshot_bytes")
    op.drop_index("ix_tenants_prev_key", "tenants")
    for col in (
        "deleting_at",
        "prev_api_key_expires_at",
        "prev_api_key_sha256",
        "api_key_expires_at",
        "max_snapshot_bytes",
        "max_paused",
    ):
        op.drop_column("tenants", col)
