"""Table definitions (SQLAlchemy Core). Portable SQL only: SQLite today, PostgreSQL later.

The migrations in ``migrations/versions`` create these; keep both in step.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
)
from sqlalchemy.engine import Dialect


class UtcDateTime(TypeDecorator[datetime]):
    """Stores naive UTC, returns aware UTC: SQLite has no time zones, PostgreSQL would shift."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the store; use UTC-aware datetimes")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return value.replace(tzinfo=UTC) if value is not None else None


metadata = MetaData()

tenants = Table(
    "tenants",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("name", String(200), nullable=False, unique=True),
    Column("api_key_sha256", String(64), nullable=False, unique=True),
    Column("max_vms", Integer, nullable=False),
    Column("created_at", UtcDateTime, nullable=False),
)

vms = Table(
    "vms",
    metadata,
    Column("vm_id", String(64), primary_key=True),
    Column("tenant_id", String(64), ForeignKey("tenants.id"), nullable=False),
    Column("state", String(16), nullable=False),
    Column("marker", String(64), nullable=False, default=""),
    Column("reason", Text),
    Column("image", String(64), nullable=False),
    Column("agent_version_id", String(128)),
    Column("limits", JSON, nullable=False),
    Column("idle_timeout_secs", Integer, nullable=False, default=0),
    Column("secrets", JSON, nullable=False),
    Column("boot", String(16), nullable=False, default="auto"),
    Column("created_at", UtcDateTime, nullable=False),
    Column("updated_at", UtcDateTime, nullable=False),
    Column("snapshot_id", String(64)),
    Column("parent_vm_id", String(64)),
    Column("mem_snapshot_id", String(64)),
    Column("incarnation", Integer, nullable=False, default=1),
    Column("token", String(128), nullable=False),
    Column("holds_slot", Boolean, nullable=False, default=False),
    Column("paused_by", String(16)),
    Column("node_id", String(128)),
    Column("last_activity_unix_ms", BigInteger, nullable=False, default=0),
    Index("ix_vms_tenant_slot", "tenant_id", "holds_slot"),
    Index("ix_vms_state", "state"),
    Index("ix_vms_parent", "parent_vm_id"),
)

events = Table(
    "events",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("vm_id", String(64), nullable=False),
    Column("tenant_id", String(64), nullable=False),
    Column("at", UtcDateTime, nullable=False),
    Column("kind", String(32), nullable=False),
    Column("from_state", String(16)),
    Column("to_state", String(16)),
    Column("marker", String(64), nullable=False, default=""),
    Column("reason", Text),
    Index("ix_events_vm", "vm_id", "id"),
)
