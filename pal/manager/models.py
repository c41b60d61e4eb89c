"""Request/response models of the runtime manager RPC (HTTP+JSON over a unix socket).

Shared by the manager's server (rpc.py) and its one client class (client.py), so the two
sides cannot drift. camelCase on the wire.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


MemMode = Literal["private", "shared"]


class RestoreFrom(_Model):
    snapshot_id: str
    agent_version_id: str
    source_vm_id: str  # the VM that took the snapshot (== vm_id on resume)
    tenant_id: str
    # private: map the snapshot's mem copy-on-write (fork children; pages shared through
    # the page cache). shared: reflink mem into the VM dir and map it shared (resume).
    mem_mode: MemMode = "shared"


class SpawnRequest(_Model):
    vm_id: str
    tenant_id: str
    image: str = "default"
    vcpus: int = 1
    memory_mib: int = 256
    disk_mib: int = 2048
    incarnation: int = 1
    token: str
    env: dict[str, str] = Field(default_factory=dict)
    boot: Literal["auto", "cold"] = "auto"
    restore: RestoreFrom | None = None


class SpawnResult(_Model):
    vm_id: str
    pid: int
    incarnation: int
    boot_ms: float
    method: Literal["cold", "template", "restore"]
    agent_version_id: str
    mem_snapshot_id: str | None = None  # snapshot whose mem this VM maps privately


class SnapshotRequest(_Model):
    snapshot_id: str
    agent_version_id: str
    tenant_id: str
    keep_running: bool
    parent_snapshot_id: str | None = None
    # snapshot ids retention must keep for this VM (what paused VMs resume from, what
    # live forks map); the manager adds the ones its own live VMs map.
    protected: list[str] = Field(default_factory=list)


class SnapshotResult(_Model):
    snapshot_id: str
    path: str
    sizes: dict[str, int]
    durations_ms: dict[str, float]
    memory_kind: Literal["file", "stream"]


class SnapshotStatus(_Model):
    complete: bool
    meta: dict[str, object] | None = None


class RetentionRequest(_Model):
    agent_version_id: str
    vm_id: str
    protected: list[str] = Field(default_factory=list)


class VmActivity(_Model):
    vm_id: str
    alive: bool
    pid: int | None = None
    incarnation: int | None = None
    has_active_exec: bool = False
    last_activity_unix_ms: int = 0
    last_heartbeat_unix_ms: int = 0


class NodeHeartbeat(_Model):
    node_id: str
    accel: str
    vms: list[VmActivity]


class ExecEvent(_Model):
    """One line of the exec NDJSON stream; mirrors the API's SSE events."""

    type: Literal["stdout", "stderr", "exit", "error"]
    data: str | None = None
    exit_code: int | None = None
    code: str | None = None
    message: str | None = None


class FileList(_Model):
    path: str
    entries: list[dict[str, object]]
    truncated: bool


class FileWritten(_Model):
    path: str
    bytes_written: int
