"""What the scheduler may ask of a runtime manager: the one interface both the real RPC
client (client.py) and test doubles implement.

Every call documents prerequisites / effect on success / effect on failure. Failures are
:class:`pal.errors.PalError` subclasses carrying the status the API should answer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from pal.manager import models
from pal.manager.code_models import CodeContext, CodeEvent, CodeRequest, ContextCreate
from pal.manager.process_models import ProcessDeleted, ProcessEvent, ProcessInfo, ProcessOutput, StdinWritten
from pal.manager.tunnel import TunnelStream
from pal.spec import ExecRequest, ProcessStartRequest, SignalRequest, Terminal


class RuntimeManager(Protocol):
    async def spawn(self, req: models.SpawnRequest) -> models.SpawnResult:
        """Boot (cold or from a warm template) or restore a VM.

        Prerequisites: no live VM with ``req.vm_id`` on this node.
        Success: the VM's harness has heartbeated with ``req.incarnation``; exec works.
        Failure: no QEMU is left running and the VM's live files are removed; the
        snapshot restored from (if any) is untouched.
        """
        ...

    async def stop(self, vm_id: str, incarnation: int | None = None) -> None:
        """Kill the VM's QEMU and remove its live files. Idempotent (unknown id: no-op).
        With ``incarnation``: only if the VM here runs that incarnation (stray cleanup must
        never stop a newer one)."""
        ...

    async def snapshot(self, vm_id: str, req: models.SnapshotRequest) -> models.SnapshotResult:
        """Capture device state, memory and disk at one instant.

        Prerequisites: the VM is live on this node.
        Success: a complete, checksummed snapshot is in place (renamed from staging);
        with ``keep_running`` the guest continues, otherwise its QEMU is gone.
        Failure: no snapshot directory with that id exists; the guest is running again
        (``cont``) if its QEMU is alive.
        """
        ...

    async def live_pause(self, vm_id: str, req: models.LivePauseRequest) -> models.LivePauseResult:
        """Stop the VM's vCPUs in place (docs/live-pause.md: Pause, and Offload).

        Prerequisites: the VM is live on this node.
        Success: its vCPUs are stopped, the gateway holds its connections (buffering their
        upstreams), the pause is recorded on the node (a restarted manager adopts it as
        live-paused); with ``offload`` its RAM has been handed back, with
        ``offload_after_ms`` that happens later unless it is resumed first. Already
        live-paused: ``by`` operator takes it over, ``offload`` offloads it. ``paused``
        False: an ``if_waiting`` pause found no waiting connection or a busy guest, and
        nothing changed.
        Failure: the VM runs as before.
        """
        ...

    async def live_resume(self, vm_id: str) -> models.LiveResumeResult:
        """Continue a live-paused VM: the same QEMU and incarnation, connections kept.

        Prerequisites: the VM is live on this node.
        Success: its vCPUs run, its wall clock is the host's, the gateway delivered what it
        held; ``resumed`` False if it was not live-paused (nothing changed).
        Failure: its QEMU is gone (the scheduler then loses the VM).
        """
        ...

    async def live_status(self, vm_id: str) -> models.LiveState | None:
        """The VM's live pause (None while it runs), resident guest RAM measured now."""
        ...

    async def notices(self, after: int, epoch: str, wait_s: float) -> models.Notices:
        """What the node saw for the scheduler to act on (wait-ready, wake, offloaded),
        newer than ``after`` (all kept ones if ``epoch`` is not the node's numbering);
        waits up to ``wait_s`` for one when there is none (long poll)."""
        ...

    def exec_stream(self, vm_id: str, req: ExecRequest) -> AsyncIterator[models.ExecEvent]:
        """Run a command; yields stdout/stderr chunks as they come, then exit or error."""
        ...

    # Processes (docs/processes.md; node side pal/manager/processes.py). Prerequisites of
    # each: the VM runs here (409, or 409 LIVE_PAUSED, which the scheduler turns into a
    # wake); the process exists (404 PROCESS_NOT_FOUND). Failure: the guest's error mapped
    # by guest_errors.py (400 bad input, 409 PROCESS_STATE, 429 TOO_MANY_PROCESSES).
    async def start_process(self, vm_id: str, req: ProcessStartRequest) -> ProcessInfo:
        """Success: the process runs (a missing executable is 400, as for exec)."""
        ...

    async def list_processes(self, vm_id: str) -> list[ProcessInfo]: ...

    async def get_process(self, vm_id: str, pid: int) -> ProcessInfo: ...

    async def delete_process(self, vm_id: str, pid: int) -> ProcessDeleted:
        """Success: killed (its group) if it ran, and forgotten."""
        ...

    async def read_output(
        self, vm_id: str, pid: int, start: int, max_bytes: int, wait_ms: int
    ) -> ProcessOutput:
        """Its journal from ``start`` (waiting up to ``wait_ms`` for output past it);
        400 when ``start`` is past the output's end."""
        ...

    def attach_process(self, vm_id: str, pid: int, start: int) -> AsyncIterator[ProcessEvent]:
        """Its output as it comes; ends with ``exit`` or ``detached`` (never a made-up exit)."""
        ...

    async def write_stdin(self, vm_id: str, pid: int, data: bytes, eof: bool) -> StdinWritten: ...

    async def signal_process(self, vm_id: str, pid: int, req: SignalRequest) -> None: ...

    async def resize_process(self, vm_id: str, pid: int, size: Terminal) -> None: ...

    async def wait_process(self, vm_id: str, pid: int, timeout_ms: int) -> ProcessInfo: ...

    # Code contexts (docs/agents.md; node side pal/manager/code.py): as processes, with
    # 404 CONTEXT_NOT_FOUND, 409 CONTEXT_BUSY / KERNEL_UNAVAILABLE, 429 TOO_MANY_CONTEXTS.
    def run_code(self, vm_id: str, req: CodeRequest) -> AsyncIterator[CodeEvent]:
        """A cell's stdout/stderr/result/error events, then ``end``."""
        ...

    async def create_context(self, vm_id: str, req: ContextCreate) -> CodeContext: ...

    async def list_contexts(self, vm_id: str) -> list[CodeContext]: ...

    async def delete_context(self, vm_id: str, ctx: str) -> None: ...

    async def interrupt_context(self, vm_id: str, ctx: str) -> bool: ...

    async def open_port(self, vm_id: str, port: int) -> TunnelStream:
        """A byte stream to the server listening on ``port`` inside the guest (on 0.0.0.0
        or 127.0.0.1); traffic on it counts as the VM's activity.

        Prerequisites: the VM is live on this node (else 409).
        Success: the stream is connected to the guest's server.
        Failure: 400 for a port outside 1-65535; 502 (``PORT_NOT_LISTENING``) when nothing
        listens there; nothing is left open.
        """
        ...

    async def list_files(self, vm_id: str, path: str) -> models.FileList: ...

    async def read_file(self, vm_id: str, path: str) -> tuple[bytes, bool]:
        """Return (content cut at 1 MiB, truncated)."""
        ...

    async def write_file(self, vm_id: str, path: str, data: bytes) -> models.FileWritten: ...

    async def set_egress(self, vm_id: str, req: models.EgressSet) -> models.EgressSetResult:
        """Change a live VM's egress policy and limits.

        Prerequisites: the VM is live on this node.
        Success: new connections follow the policy at once; open connections it refuses
        are reset (their number is returned); a restarted manager keeps the new policy.
        Failure: the previous policy stays in force.
        """
        ...

    async def set_brokered(self, vm_id: str, req: models.BrokeredSet) -> None:
        """New values for a live VM's brokered secrets (rotation).

        Prerequisites: the VM is live on this node (else 409).
        Success: the gateway puts the new values into the VM's next requests (on open
        connections too); nothing in the guest changes.
        Failure: the previous values stay in force.
        """
        ...

    async def egress_counters(self, vm_id: str) -> dict[str, int] | None:
        """The current incarnation's gateway counters (bytesIn, bytesOut, connections,
        refused, dnsQueries, active); None when the gateway cannot tell."""
        ...

    async def egress_events(self, after: int, epoch: str) -> models.EgressEvents:
        """egress_denied events newer than ``after`` (all kept ones if ``epoch`` is not the
        gateway's current numbering). Bounded: the gateway keeps the newest 2000."""
        ...

    async def warm(self, req: models.WarmRequest) -> models.WarmResult:
        """Build the warm template of an image at a size now.

        Prerequisites: the image exists; templates are enabled (else 503).
        Success: ``ready`` is True and schedules of that image and size restore from it.
        Failure: ``ready`` is False (the build failed; the next schedule retries it).
        """
        ...

    async def delete_file(self, vm_id: str, path: str) -> models.FileDeleted:
        """Remove a file or symlink under /workspace (404 FILE_NOT_FOUND, 400 for a dir)."""
        ...

    async def heartbeat(self) -> models.NodeHeartbeat:
        """This node's live VMs and each one's latest harness activity, plus what placement
        needs: capacity, warm templates, images, health, region and labels."""
        ...

    async def images(self) -> list[models.ImageInfo]:
        """The complete images of this node, by name: content digest, exec defaults, which
        tenants may use each (None: all) and its warm template sizes."""
        ...

    async def vm_metrics(self, vm_id: str) -> models.VmMetrics:
        """The VM's resource samples of the last 15 minutes (pal/manager/metrics.py).

        Prerequisites: none; a VM this node never ran answers an empty series.
        Success: its samples, oldest first; ``live`` says whether it runs here now.
        """
        ...

    async def stats(self) -> models.NodeStats:
        """Operator figures of the node: live VMs, snapshot bytes per tier, queue depths."""
        ...

    async def list_snapshots(self, agent_version_id: str, vm_id: str) -> list[models.SnapshotInfo]:
        """The VM's complete local snapshots, oldest first, with artifact sizes."""
        ...

    async def snapshot_status(
        self, agent_version_id: str, vm_id: str, snapshot_id: str
    ) -> models.SnapshotStatus:
        """Whether a snapshot is complete and verified (local or S3)."""
        ...

    async def ensure_uploaded(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> None:
        """Make the snapshot restorable on any node: S3 holds a sealed, complete copy.

        Prerequisites: the snapshot is complete on this node (or already in S3); S3 is set.
        Success: S3 has the complete copy (meta.json last). Failure: Unavailable (no S3 or
        S3 down), NotFound (no such snapshot here or in S3); nothing changes locally.
        """
        ...

    async def delete_snapshot(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> None: ...

    async def delete_vm_snapshots(self, agent_version_id: str, vm_id: str, keep: list[str]) -> list[str]:
        """Delete every snapshot of a VM, local and S3, except ``keep`` (and what a live
        fork on the node maps). Idempotent. Returns the local snapshot ids deleted."""
        ...

    async def snapshot_owners(self) -> models.SnapshotOwners:
        """Which VMs have snapshots on the node's tiers (the control plane's sweep)."""
        ...
