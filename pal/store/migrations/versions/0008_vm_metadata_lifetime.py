"""A VM's metadata (the tenant's tags) and lifetime (its deadline and what ends it), and
the index of the paged VM list.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from pal.store.tables import UtcDateTime

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("vms", sa.Column("metadata", sa.JSON, nullable=False, server_default="{}"))
    op.add_column("vms", sa.Column("lifetime_ends_at", UtcDateTime))
    op.add_column("vms", sa.Column("on_lifetime_end", sa.String(8), nullable=False, server_default="delete"))
    op.create_index("ix_vms_lifetime", "vms", ["lifetime_ends_at"])
    op.create_index("ix_vms_tenant_created", "vms", ["tenant_id", "created_at", "vm_id"])


def downgrade() -> None:
    op.drop_index("ix_vms_tenant_created", "vms")
    op.drop_index("ix_vms_lifetime", "vms")
    for col in ("on_lifetime_end", "lifetime_ends_at", "metadata"):
        op.drop_column("vms", col)
