"""Live pause: each VM's wait management and idle live tier, when its pause began, and its
live-pause counters.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from pal.store.tables import UtcDateTime

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("vms", sa.Column("wait_pause", sa.JSON))
    op.add_column(
        "vms", sa.Column("idle_live_pause_secs", sa.Integer, nullable=False, server_default=sa.text("0"))
    )
    op.add_column("vms", sa.Column("paused_at", UtcDateTime))
    op.add_column("vms", sa.Column("live_stats", sa.JSON, nullable=False, server_default=sa.text("'{}'")))


def downgrade() -> None:
    op.drop_column("vms", "live_stats")
    op.drop_column("vms", "paused_at")
    op.drop_column("vms", "idle_live_pause_secs")
    op.drop_column("vms", "wait_pause")
