"""Table definitions (SQLAlchemy Core). Portable SQL only: SQLite (`pal up`) and PostgreSQL.

The migrations in ``migrations/versions`` create these; keep both in step.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

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
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
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

# The markers of a VM being snapshot-paused (states.py PAUSE_MARKERS; a test keeps the two
# in step): such a VM counts as paused against its tenant's max_paused (books.py).
PAUSING_MARKERS = ("scheduler:pausing", "scheduler:idle-pausing")
# The automatic live pauses (pal/scheduler/states.py AUTO_LIVE_MARKERS; a test keeps the
# two in step): the idle sweeper takes them to a snapshot after idleTimeoutSecs.
AUTO_LIVE_MARKERS = ("live:idle", "live:wait")
_AUTO = ", ".join(f"'{m}'" for m in AUTO_LIVE_MARKERS)
# When the idle sweeper may next find a VM idle, as its row says (its host-observed last
# activity plus its timeout; a heartbeat can only make it later: pal/scheduler/idle.py),
# for the VMs it may take to each tier. The queries repeat these exact texts, so both
# databases use the partial expression indexes below.
IDLE_DUE = "(last_activity_unix_ms + idle_timeout_secs * 1000)"
IDLE_DUE_WHERE = (
    f"idle_timeout_secs > 0 AND (state = 'running' OR (state = 'paused' AND marker IN ({_AUTO})))"
)
IDLE_LIVE_DUE = "(last_activity_unix_ms + idle_live_pause_secs * 1000)"
IDLE_LIVE_DUE_WHERE = "idle_live_pause_secs > 0 AND state = 'running'"
LIFETIME_DUE = "lifetime_ends_at IS NOT NULL AND state <> 'terminated'"


def _where(predicate: str) -> dict[str, Any]:
    """A partial index's predicate, for both databases."""
    return {"postgresql_where": text(predicate), "sqlite_where": text(predicate)}


tenants = Table(
    "tenants",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("name", String(200), nullable=False, unique=True),
    Column("api_key_sha256", String(64), nullable=False, unique=True),
    Column("max_vms", Integer, nullable=False),
    Column("created_at", UtcDateTime, nullable=False),
    Column("max_paused", Integer),  # None: no limit
    Column("max_snapshot_bytes", BigInteger),  # None: no limit
    Column("api_key_expires_at", UtcDateTime),  # None: never
    Column("prev_api_key_sha256", String(64)),  # the key before a rotation, during its grace
    Column("prev_api_key_expires_at", UtcDateTime),
    Column("deleting_at", UtcDateTime),  # `pal tenants rm` in progress: keys refused
    # Running counts of what its quotas limit, kept with the VM rows (books.py).
    Column("slots_used", Integer, nullable=False, default=0),
    Column("paused_vms", Integer, nullable=False, default=0),
    Column("snapshot_bytes_used", BigInteger, nullable=False, default=0),
    # Volumes (pal/store/volumes.py): limits (None: none) and running counts, kept with the
    # volume rows as the counts above are with the VM rows.
    Column("max_volumes", Integer),
    Column("max_volume_bytes", BigInteger),
    Column("volumes_used", Integer, nullable=False, default=0),
    Column("volume_bytes_used", BigInteger, nullable=False, default=0),
    Index("ix_tenants_prev_key", "prev_api_key_sha256"),
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
    Column("egress", JSON, nullable=False, default="none"),  # pal.spec.Egress as JSON
    Column("egress_stats", JSON, nullable=False, default=dict),  # counters of past incarnations
    Column("placement", JSON),  # AgentSpec.placement: {region, labels} (null: anywhere)
    Column("wait_pause", JSON),  # pal.spec.WaitPause as JSON, resolved at schedule; null: off
    Column("idle_live_pause_secs", Integer, nullable=False, default=0),
    Column("paused_at", UtcDateTime),  # when the current pause (either kind) began
    Column("live_stats", JSON, nullable=False, default=dict),  # live-pause counters over its life
    # Bytes its snapshots take on its node (allocated), for the tenant's snapshot limit.
    Column("snapshot_bytes", BigInteger, nullable=False, default=0),
    Column("metadata", JSON, nullable=False, default=dict),  # AgentSpec.metadata (the tenant's tags)
    # lifetimeSecs as a deadline (the leader ends the VM then: pal/scheduler/lifetime.py)
    Column("lifetime_ends_at", UtcDateTime),
    Column("on_lifetime_end", String(8), nullable=False, default="delete"),  # pause | delete
    Column("limits_applied", JSON),  # {applied, skipped}: the host limits of its last start
    # In the tenant's list: every VM until an hour after it terminated (the leader's
    # retention sweep then clears it: pal/scheduler/retention.py), so a page never walks
    # past the terminated VMs of the past.
    Column("listed", Boolean, nullable=False, default=True),
    # The nodes its snapshots were taken on (a delete asks those; null: from before this
    # was kept, so every node is asked).
    Column("snapshot_nodes", JSON),
    Index("ix_vms_tenant_slot", "tenant_id", "holds_slot"),
    Index("ix_vms_state_marker", "state", "marker", "vm_id"),
    Index("ix_vms_parent", "parent_vm_id"),
    Index("ix_vms_mem_snapshot", "mem_snapshot_id", **_where("mem_snapshot_id IS NOT NULL")),  # fork children
    Index("ix_vms_node", "node_id", "state"),
    # Each index below serves one of the leader's loops or the paged list, so each reads
    # what it acts on and never the fleet's idle or terminated VMs (docs/scale.md).
    Index("ix_vms_slots", "node_id", "vm_id", **_where("holds_slot")),  # the VMs that use a node
    Index("ix_vms_listed", "tenant_id", "created_at", "vm_id", **_where("listed")),  # the paged list
    Index("ix_vms_unlist", "updated_at", **_where("listed AND state = 'terminated'")),
    Index("ix_vms_lifetime_due", "lifetime_ends_at", **_where(LIFETIME_DUE)),
    Index("ix_vms_idle_due", text(IDLE_DUE), **_where(IDLE_DUE_WHERE)),
    Index("ix_vms_idle_live_due", text(IDLE_LIVE_DUE), **_where(IDLE_LIVE_DUE_WHERE)),
)

# A VM's metadata, one row per pair (``key=value``), for the list's metadata filter: the
# first pair's rows, in list order, are an index range (pal/store/paging.py). Written with
# the VM's row; the retention sweep drops them when the VM leaves the list.
vm_tags = Table(
    "vm_tags",
    metadata,
    Column("tenant_id", String(64), nullable=False),
    Column("tag", String(330), nullable=False),  # key (<= 63) "=" value (<= 256)
    Column("created_at", UtcDateTime, nullable=False),
    Column("vm_id", String(64), nullable=False),
    PrimaryKeyConstraint("tenant_id", "tag", "created_at", "vm_id", name="pk_vm_tags"),
    Index("ix_vm_tags_vm", "vm_id"),
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
    Column("details", JSON),  # structured data of audit events (egress_denied: name, port, rule)
    Index("ix_events_vm", "vm_id", "id"),
    Index("ix_events_at", "at"),  # retention (Store.prune_events)
)

# The nodes of the cluster, as their heartbeats describe them (pal/scheduler/nodes.py).
nodes = Table(
    "nodes",
    metadata,
    Column("node_id", String(128), primary_key=True),
    Column("url", String(512), nullable=False),  # its runtime manager RPC ("local" = embedded)
    Column("region", String(64), nullable=False, default=""),
    Column("labels", JSON, nullable=False),
    Column("capacity", JSON, nullable=False),  # memoryMib, vcpus, diskFreeMib
    Column("templates", JSON, nullable=False),  # warm template keys
    Column("images", JSON, nullable=False),  # [{name, agentVersionId}]
    Column("healthy", Boolean, nullable=False, default=True),
    Column("health", Text),  # why not healthy
    Column("vm_count", Integer, nullable=False, default=0),
    Column("state", String(16), nullable=False),  # active | draining | lost
    Column("epoch", String(64), nullable=False),  # changes each time the node process starts
    Column("registered_at", UtcDateTime, nullable=False),
    Column("last_seen_at", UtcDateTime, nullable=False),
)

# Leadership of the control-plane replicas: one row, a lease with a fencing token
# (pal/scheduler/leader.py). Times are the database's clock, in ms since the epoch.
leader_lease = Table(
    "leader_lease",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("holder", String(128), nullable=False),
    Column("url", String(512), nullable=False),
    Column("token", BigInteger, nullable=False),
    Column("expires_at_ms", BigInteger, nullable=False),
)

# Each tenant's CA for brokered secrets (pal/scheduler/brokering.py), in the store so that
# every control-plane replica signs with the same one. The key is sealed with the secrets
# key (pal/secretbox.py); the certificate is public.
tenant_cas = Table(
    "tenant_cas",
    metadata,
    Column("tenant_id", String(64), ForeignKey("tenants.id"), primary_key=True),
    Column("cert_pem", Text, nullable=False),
    Column("key_sealed", Text, nullable=False),
    Column("created_at", UtcDateTime, nullable=False),
)

# Port links revoked before they expire (pal/api/port_links.py). A link carries its id; a
# row here refuses it. Rows go once ``expires_at`` (the latest the link could live) passed.
port_link_revocations = Table(
    "port_link_revocations",
    metadata,
    Column("tenant_id", String(64), ForeignKey("tenants.id"), primary_key=True),
    Column("link_id", String(64), primary_key=True),
    Column("revoked_at", UtcDateTime, nullable=False),
    Column("expires_at", UtcDateTime, nullable=False),
)

# Volumes: storage that outlives VMs (docs/volumes.md; pal/store/volumes.py). A name is
# unique within its tenant; ``size_mib`` is what counts against the tenant's byte limit.
volumes = Table(
    "volumes",
    metadata,
    Column("volume_id", String(64), primary_key=True),
    Column("tenant_id", String(64), ForeignKey("tenants.id"), nullable=False),
    Column("name", String(64), nullable=False),
    Column("size_mib", Integer, nullable=False),
    Column("state", String(16), nullable=False),  # creating | ready | deleting
    Column("node_id", String(128)),  # the node that holds its files
    Column("metadata", JSON, nullable=False, default=dict),
    Column("created_at", UtcDateTime, nullable=False),
    Column("updated_at", UtcDateTime, nullable=False),
    UniqueConstraint("tenant_id", "name", name="uq_volumes_tenant_name"),
    Index("ix_volumes_tenant", "tenant_id", "created_at", "volume_id"),  # the paged list
)

# A volume's metadata, one row per pair, for the list's filter (as vm_tags for VMs).
volume_tags = Table(
    "volume_tags",
    metadata,
    Column("tenant_id", String(64), nullable=False),
    Column("tag", String(330), nullable=False),
    Column("created_at", UtcDateTime, nullable=False),
    Column("volume_id", String(64), nullable=False),
    PrimaryKeyConstraint("tenant_id", "tag", "created_at", "volume_id", name="pk_volume_tags"),
    Index("ix_volume_tags_volume", "volume_id"),
)

# Which VMs mount which volume: a volume with a row here is mounted (a delete is refused
# unless forced). Written with the VM's row by the mount's phase (docs/volumes.md, "Design").
volume_mounts = Table(
    "volume_mounts",
    metadata,
    Column("volume_id", String(64), ForeignKey("volumes.volume_id"), primary_key=True),
    Column("vm_id", String(64), primary_key=True),
    Column("tenant_id", String(64), nullable=False),
    Column("path", String(512), nullable=False),
    Column("read_only", Boolean, nullable=False, default=False),
    Index("ix_volume_mounts_vm", "vm_id"),
)

# A tenant's keys of E2B's form (`e2b_` + hex; pal/e2b/keys.py), beside its Pal key: each
# authenticates the E2B surface only (/e2b, docs/e2b.md), several at once (one per app),
# each revocable on its own. Kept as a sha256 only, like the Pal key.
tenant_e2b_keys = Table(
    "tenant_e2b_keys",
    metadata,
    Column("key_id", String(32), primary_key=True),
    Column("tenant_id", String(64), ForeignKey("tenants.id"), nullable=False),
    Column("key_sha256", String(64), nullable=False, unique=True),
    Column("name", String(200), nullable=False, default=""),
    Column("mask", String(32), nullable=False, default=""),
    Column("created_at", UtcDateTime, nullable=False),
    Column("last_used_at", UtcDateTime),
    Index("ix_tenant_e2b_keys_tenant", "tenant_id"),
)

# A tenant's kept snapshots (pal/store/kept.py, docs/lifecycle.md "Kept snapshots"): a
# snapshot of a VM that the tenant keeps, optionally by a name (unique among the tenant's),
# out of the VM's retention and past its delete, that new VMs start from. The snapshot's
# files stay where the VM's snapshots are (its node, and S3 where S3 is configured).
kept_snapshots = Table(
    "kept_snapshots",
    metadata,
    Column("snapshot_id", String(64), primary_key=True),
    Column("tenant_id", String(64), ForeignKey("tenants.id"), nullable=False),
    Column("name", String(200)),
    Column("source_vm_id", String(64), nullable=False),
    Column("agent_version_id", String(128), nullable=False),
    Column("node_id", String(64)),
    Column("created_at", UtcDateTime, nullable=False),
    Index("ix_kept_snapshots_tenant", "tenant_id", "created_at", "snapshot_id"),
    Index("ix_kept_snapshots_source", "source_vm_id"),
    UniqueConstraint("tenant_id", "name", name="uq_kept_snapshots_name"),
)
