"""Egress: each VM's policy and its accumulated network counters; event details.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # VMs made before this had no network at all: "none" is what they had.
    op.add_column("vms", sa.Column("egress", sa.JSON, nullable=False, server_default=sa.text("'\"none\"'")))
    op.add_column("vms", sa.Column("egress_stats", sa.JSON, nullable=False, server_default=sa.text("'{}'")))
    op.add_column("events", sa.Column("details", sa.JSON))


def downgrade() -> None:
    op.drop_column("events", "details")
    op.drop_column("vms", "egress_stats")
    op.drop_column("vms", "egress")
