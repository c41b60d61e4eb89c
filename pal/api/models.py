"""Response bodies of the REST API (camelCase on the wire).

Declared as pydantic models so `/openapi.json` documents every shape; request bodies are
the scheduler's own models (`AgentSpec`, `ExecRequest`, `ForkRequest`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from pal.scheduler.spec import Limits


class _Out(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)


class VmOut(_Out):
    vm_id: str
    state: str
    image: str
    limits: Limits
    created_at: datetime
    snapshot_id: str | None = None
    parent_vm_id: str | None = None
    reason: str | None = None
    idle_timeout_secs: int = 0
    paused_by: str | None = Field(
        default=None, description="`operator`, `idle` or null; only idle-paused VMs wake"
    )
    boot_method: str | None = Field(
        default=None,
        description="on schedule answers: how the VM started (`template`, `cold`); null elsewhere",
    )

    @classmethod
    def from_view(cls, view: Any) -> VmOut:
        return cls(
            vm_id=view.vm_id,
            state=str(view.state),
            image=view.image,
            limits=view.limits,
            created_at=view.created_at,
            snapshot_id=view.snapshot_id,
            parent_vm_id=view.parent_vm_id,
            reason=view.reason,
            idle_timeout_secs=view.idle_timeout_secs,
            paused_by=getattr(view, "paused_by", None),
            boot_method=getattr(view, "boot_method", None),
        )


class VmListOut(_Out):
    vms: list[VmOut]


class SnapshotStateOut(_Out):
    """Answer of pause and resume."""

    vm_id: str
    snapshot_id: str | None
    state: str


class ForkChildOut(_Out):
    vm_id: str
    state: str
    error: str | None = Field(default=None, description="why this child failed; absent when it runs")


class ForkOut(_Out):
    source_vm_id: str
    snapshot_id: str
    forks: list[ForkChildOut]


class ExecOut(_Out):
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool | None = Field(
        default=None, description="true when the guest killed the command at timeoutSecs; absent otherwise"
    )
    truncated: bool | None = Field(
        default=None,
        description="true when stdout or stderr passed 8 MiB and was cut (use SSE for all); absent otherwise",
    )


class FileEntryOut(_Out):
    name: str
    type: str
    size: int | None = None


class FileListOut(_Out):
    path: str
    entries: list[FileEntryOut]
    truncated: bool


class FileWrittenOut(_Out):
    path: str
    bytes_written: int


class EventOut(_Out):
    at: datetime
    kind: str
    from_state: str | None = None
    to_state: str | None = None
    reason: str | None = None


class EventListOut(_Out):
    events: list[EventOut]


class ErrorBody(_Out):
    code: str
    message: str


class ErrorOut(_Out):
    error: ErrorBody
