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


@dataclass
class VmRecord:
    vm_id: str
    tenant_id: str
    state: str
    image: str
    limits: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    marker: str = ""
    reason: str | None = None
    agent_version_id: str | None = None
    idle_timeout_secs: int = 0
    secrets: dict[str, str] = field(default_factory=dict)
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
