"""The host limits a VM's node applied when it last came up ({applied, skipped}: which of
CPU, memory, pids, IO weight and disk throttle hold on its host, and why a missing one is).

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("vms", sa.Column("limits_applied", sa.JSON))


def downgrade() -> None:
    op.drop_column("vms", "limits_applied")
