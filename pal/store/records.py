"""Plain dataclasses the store returns, so no ORM/SQL object ever leaks to callers."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class Tenant:
    id: str
    name: str
    max_vms: int
    created_at: datetime
    max_paused: int | None = None  # paused VMs at once; None: no limit
    max_snapshot_bytes: int | None = None  # bytes of snapshots kept; None: no limit
    api_key_expires_at: datetime | None = None  # None: the key never expires
    prev_api_key_expires_at: datetime | None = None  # the rotated-out key works until then
    deleting_at: datetime | None = None  # `pal tenants rm` is under way
    # What its quotas count, kept with the VM rows (pal/store/books.py)
    slots_used: int = 0
    paused_vms: int = 0
    snapshot_bytes_used: int = 0
    max_volumes: int | None = None  # volumes at once; None: no limit
    max_volume_bytes: int | None = None  # bytes of volumes (their sizes); None: no limit
    volumes_used: int = 0
    volume_bytes_used: int = 0


@dataclass
class VmRecord:
    vm_id: str
    tenant_id: str
    image: str
    limits: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    state: str = ""  # set by the transition function that inserts the row
    marker: str = ""
    reason: str | None = None
    agent_version_id: str | None = None
    idle_timeout_secs: int = 0
    # name -> value, or a brokered secret's {placeholder, sealed, hosts, header, format}
    secrets: dict[str, Any] = field(default_factory=dict)
    boot: str = "auto"
    snapshot_id: str | None = None
    parent_vm_id: str | None = None
    mem_snapshot_id: str | None = None  # snapshot whose mem a fork child maps privately
    incarnation: int = 1
    token: str = ""
    holds_slot: bool = False
    paused_by: str | None = None  # "operator" | "idle" | None
    node_id: str | None = None
    last_activity_unix_ms: int = 0  # host-side: last exec/file request or (re)start
    egress: Any = "none"  # pal.spec.Egress as JSON ("none" | "open" | {"allow"|"deny": [...]})
    egress_stats: dict[str, int] = field(default_factory=dict)  # past incarnations' counters
    placement: dict[str, Any] | None = None  # AgentSpec.placement (region, labels)
    wait_pause: dict[str, Any] | None = None  # pal.spec.WaitPause as JSON; None: off
    idle_live_pause_secs: int = 0
    paused_at: datetime | None = None  # when the current pause began (live or snapshot)
    # live pauses over the VM's life: livePauses, waitPauses, livePausedMs, offloads,
    # freedMib, bytesWhilePaused (pal/scheduler/views.py add_live_stats)
    live_stats: dict[str, int] = field(default_factory=dict)
    snapshot_bytes: int = 0  # allocated bytes of its snapshots on its node
    metadata: dict[str, str] = field(default_factory=dict)  # AgentSpec.metadata
    lifetime_ends_at: datetime | None = None  # lifetimeSecs after the schedule; None: no lifetime
    on_lifetime_end: str = "delete"  # pause | delete
    # The host limits its node applied when it last came up: {applied, skipped} (pal/manager/
    # models.py LimitsApplied); None before it first runs (or from before Pal recorded them).
    limits_applied: dict[str, Any] | None = None
    listed: bool = True  # in the tenant's list (until an hour after it terminated)
    # the nodes its snapshots were taken on (None: not known, from before they were kept)
    snapshot_nodes: list[str] | None = field(default_factory=list)


@dataclass(frozen=True)
class PortLinkCheck:
    """What decides whether a port link of a tenant still opens (pal/api/port_links.py)."""

    key_hashes: tuple[str, ...]  # hashes of the tenant's API keys that authenticate now
    revoked: bool  # the link's id is on the revocation list


@dataclass(frozen=True)
class EventRecord:
    id: int
    vm_id: str
    tenant_id: str
    at: datetime
    kind: str  # "status" for transitions, else an audit kind such as "auto_resume"
    from_state: str | None
    to_state: str | None
    marker: str
    reason: str | None
    details: dict[str, Any] | None = None


@dataclass
class NodeRecord:
    """A node as its last heartbeat described it (``state``: active | draining | lost)."""

    node_id: str
    url: str
    region: str
    labels: dict[str, str]
    capacity: dict[str, Any]  # memoryMib, vcpus, diskFreeMib
    templates: list[dict[str, Any]]  # WarmTemplate dicts
    images: list[dict[str, str]]
    healthy: bool
    health: str | None
    vm_count: int
    state: str
    epoch: str
    registered_at: datetime
    last_seen_at: datetime


@dataclass(frozen=True)
class LeaseInfo:
    holder: str
    url: str
    token: int
    expires_in_ms: int  # by the database's clock; <= 0: expired


@dataclass
class VolumeRecord:
    """A volume (pal/store/volumes.py): ``size_mib`` counts against its tenant's bytes."""

    volume_id: str
    tenant_id: str
    name: str
    size_mib: int
    state: str  # creating | ready | deleting
    created_at: datetime
    updated_at: datetime
    node_id: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
