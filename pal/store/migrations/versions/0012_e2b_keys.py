"""A tenant's keys of E2B's form (pal/e2b/keys.py, docs/e2b.md): sha256 only, several per
tenant, each revocable.

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from pal.store.tables import UtcDateTime

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tenant_e2b_keys",
        sa.Column("key_id", sa.String(32), primary_key=True),
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("key_sha256", sa.String(64), nullable=False, unique=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("mask", sa.String(32), nullable=False),
        sa.Column("created_at", UtcDateTime, nullable=False),
        sa.Column("last_used_at", UtcDateTime),
    )
    op.create_index("ix_tenant_e2b_keys_tenant", "tenant_e2b_keys", ["tenant_id"])


def downgrade() -> None:
    op.drop_index("ix_tenant_e2b_keys_tenant", "tenant_e2b_keys")
    op.drop_table("tenant_e2b_keys")
