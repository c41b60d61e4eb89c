"""What the scheduler may ask of a runtime manager: the one interface both the real RPC
client (client.py) and test doubles implement.

Every call documents prerequisites / effect on success / effect on failure. Failures are
:class:`pal.errors.PalError` subclasses carrying the status the API should answer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from pal.manager.models import (
    ExecEvent,
    FileList,
    FileWritten,
    NodeHeartbeat,
    SnapshotRequest,
    SnapshotResult,
    SnapshotStatus,
    SpawnRequest,
    SpawnResult,
)
from pal.scheduler.spec import ExecRequest


class RuntimeManager(Protocol):
    async def spawn(self, req: SpawnRequest) -> SpawnResult:
        """Boot (cold or from a warm template) or restore a VM.

        Prerequisites: no live VM with ``req.vm_id`` on this node.
        Success: the VM's harness has heartbeated with ``req.incarnation``; exec works.
        Failure: no QEMU is left running and the VM's live files are removed; the
        snapshot restored from (if any) is untouched.
        """
        ...

    async def stop(self, vm_id: str) -> None:
        """Kill the VM's QEMU and remove its live files. Idempotent (unknown id: no-op)."""
        ...

    async def snapshot(self, vm_id: str, req: SnapshotRequest) -> SnapshotResult:
        """Capture device state, memory and disk at one instant.

        Prerequisites: the VM is live on this node.
        Success: a complete, checksummed snapshot is in place (renamed from staging);
        with ``keep_running`` the guest continues, otherwise its QEMU is gone.
        Failure: no snapshot directory with that id exists; the guest is running again
        (``cont``) if its QEMU is alive.
        """
        ...

    def exec_stream(self, vm_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        """Run a command; yields stdout/stderr chunks as they come, then exit or error."""
        ...

    async def list_files(self, vm_id: str, path: str) -> FileList: ...

    async def read_file(self, vm_id: str, path: str) -> tuple[bytes, bool]:
        """Return (content cut at 1 MiB, truncated)."""
        ...

    async def write_file(self, vm_id: str, path: str, data: bytes) -> FileWritten: ...

    async def heartbeat(self) -> NodeHeartbeat:
        """This node's live VMs and each one's latest harness activity."""
        ...

    async def snapshot_status(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> SnapshotStatus:
        """Whether a snapshot is complete and verified (local or S3)."""
        ...

    async def delete_snapshot(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> None: ...

    async def apply_retention(self, agent_version_id: str, vm_id: str, protected: list[str]) -> list[str]: ...
