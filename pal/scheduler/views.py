"""What the scheduler hands the API: plain dataclasses built from store records."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from pal.scheduler.spec import Limits
from pal.scheduler.states import VmState
from pal.store import EventRecord, VmRecord


@dataclass
class VmView:
    vm_id: str
    tenant_id: str
    state: VmState
    image: str
    limits: Limits
    created_at: datetime
    snapshot_id: str | None
    parent_vm_id: str | None
    reason: str | None
    idle_timeout_secs: int
    marker: str
    paused_by: str | None  # "operator" | "idle" | None
    # How the manager started it ("cold" | "template" | "restore"); only on the view that
    # schedule()/resume() return, it is not stored.
    boot_method: str | None = None

    @classmethod
    def of(cls, vm: VmRecord, boot_method: str | None = None) -> VmView:
        return cls(
            vm_id=vm.vm_id,
            tenant_id=vm.tenant_id,
            state=VmState(vm.state),
            image=vm.image,
            limits=Limits.model_validate(vm.limits),
            created_at=vm.created_at,
            snapshot_id=vm.snapshot_id,
            parent_vm_id=vm.parent_vm_id,
            reason=vm.reason,
            idle_timeout_secs=vm.idle_timeout_secs,
            marker=vm.marker,
            paused_by=vm.paused_by,
            boot_method=boot_method,
        )


@dataclass
class ForkChild:
    vm_id: str
    state: VmState
    error: str | None = None


@dataclass
class ForkResult:
    source_vm_id: str
    snapshot_id: str
    forks: list[ForkChild]


@dataclass
class EventView:
    at: datetime
    kind: str
    from_state: str | None
    to_state: str | None
    reason: str | None

    @classmethod
    def of(cls, ev: EventRecord) -> EventView:
        return cls(at=ev.at, kind=ev.kind, from_state=ev.from_state, to_state=ev.to_state, reason=ev.reason)
