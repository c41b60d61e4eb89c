"""Revoked port links (pal/api/port_links.py): a link's id here refuses it until it expires.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from pal.store.tables import UtcDateTime

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "port_link_revocations",
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id"), primary_key=True),
        sa.Column("link_id", sa.String(64), primary_key=True),
        sa.Column("revoked_at", UtcDateTime, nullable=False),
        sa.Column("expires_at", UtcDateTime, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("port_link_revocations")
