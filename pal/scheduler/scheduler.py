"""The runtime scheduler: a thin façade over one module per operation, for the API, the
dashboard and `pal up`/`pal serve` (pal/server.py). It builds the parts and forwards each
public call; the work, the checks and the docs of each operation are in its module:

| operation                                     | module            |
| --------------------------------------------- | ----------------- |
| schedule                                      | schedule.py       |
| pause, resume, the idle sweeper's tiers       | pause_resume.py   |
| live pause and resume, wait management, wakes | live.py           |
| fork                                          | fork.py           |
| delete, removed tenants                       | delete.py         |
| exec, files, ports, processes                 | exec_files.py     |
| a request's wake and in-flight count          | wake.py           |
| egress policy and brokered secrets            | egress_secrets.py |
| node drain, server shutdown                   | drain.py          |
| reads (VMs, events, metrics, images, nodes)   | reads.py          |
| clients' audit events (MCP tool calls)        | audit.py          |
| paged reads (VMs by metadata, events)         | listing.py        |
| lifetimes (their end, PUT lifetime)           | lifetime.py       |
| reconciliation, node loss, node heartbeats    | reconcile.py      |
| the idle sweeper                              | idle.py           |
| leadership and the leader's periodic chores   | background.py     |

Shared by all of them (deps.py): the store, the per-VM locks and in-flight counts, the
node clients, the transition function (transition.py, checking states.py's table), the
telemetry, the settings and the clock. Placement and spawn requests: spawning.py; a VM's
snapshots: snapshot_books.py. No module imports this one (an import-linter contract,
pyproject.toml): each takes only the parts it needs.
"""

from __future__ import annotations

import asyncio
import builtins
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from datetime import datetime
from typing import Any

from pal.config import Settings
from pal.errors import Unavailable
from pal.manager.api import RuntimeManager
from pal.manager.code_models import CodeContext, CodeEvent, CodeRequest, ContextCreate
from pal.manager.models import (
    ExecEvent,
    FileDeleted,
    FileList,
    FileWritten,
    HeartbeatAck,
    ImageInfo,
    NodeHeartbeat,
    SnapshotInfo,
    VmMetrics,
)
from pal.manager.process_models import ProcessDeleted, ProcessEvent, ProcessInfo, ProcessOutput, StdinWritten
from pal.manager.tunnel import TunnelStream
from pal.scheduler.audit import ToolAudit
from pal.scheduler.background import Background, LeaderChores, LeaderState
from pal.scheduler.brokering import SecretBroker
from pal.scheduler.delete import Deleting
from pal.scheduler.deps import Chores, Deps, VmLocks
from pal.scheduler.drain import Draining
from pal.scheduler.egress_events import EgressEvents
from pal.scheduler.egress_secrets import EgressAndSecrets
from pal.scheduler.exec_files import ExecAndFiles
from pal.scheduler.fork import Forking
from pal.scheduler.idle import IdleSweeper
from pal.scheduler.leader import Leadership, SingleProcessLeader
from pal.scheduler.lifetime import Lifetimes
from pal.scheduler.listing import Listing
from pal.scheduler.live import LiveOps
from pal.scheduler.liveview import LiveView
from pal.scheduler.nodes import NodePool
from pal.scheduler.pause_resume import PauseResume
from pal.scheduler.reads import Reads
from pal.scheduler.reconcile import Reconciler
from pal.scheduler.retention import Retention
from pal.scheduler.schedule import Scheduling
from pal.scheduler.snapshot_audit import SnapshotChecks
from pal.scheduler.snapshot_books import SnapshotBooks
from pal.scheduler.spawning import Spawner
from pal.scheduler.streams import StreamBudget
from pal.scheduler.telemetry import Telemetry
from pal.scheduler.transition import Transitioner
from pal.scheduler.views import ForkChild, ForkResult, OperatorStats
from pal.scheduler.wake import Waker
from pal.spec import (
    AgentSpec,
    EgressUpdate,
    ExecRequest,
    LifetimeUpdate,
    PauseRequest,
    ProcessStartRequest,
    SecretUpdate,
    SignalRequest,
    Terminal,
)
from pal.store import EventRecord, Store, VmRecord

__all__ = ["ForkChild", "ForkResult", "Scheduler"]


class Scheduler:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        manager: RuntimeManager | None = None,
        *,
        nodes: NodePool | None = None,
        clock: Callable[[], float] = time.time,
        leader: Leadership | None = None,
    ) -> None:
        """``manager``: an embedded node (`pal up`, tests); ``nodes``: the node pool of a
        control plane (remote nodes register through heartbeats)."""
        self.settings = settings
        self.store = store
        self.nodes = nodes or NodePool(settings, store)
        if manager is not None:
            self.nodes.add_local(manager)
        self.clock = clock
        self.leader: Leadership = leader or SingleProcessLeader()
        self.live_view = LiveView(store)
        self.transitions = Transitioner(store, on_change=self.live_view.apply)
        self.telemetry = Telemetry()
        self.locks = VmLocks()
        self.chores = Chores()
        self.brokering = SecretBroker(settings, store)
        self.lead = LeaderState()
        self.nodes.leading = lambda: self.lead.leading
        d = Deps(
            settings, store, self.nodes, self.transitions, self.locks, self.telemetry, clock, self.live_view
        )
        self.deps = d
        self.live = LiveOps(d, self.leader.is_leader)
        spawner = Spawner(d, self.brokering)
        books = SnapshotBooks(d)
        self.scheduling = Scheduling(d, spawner, self.brokering)
        self.pauses = PauseResume(d, spawner, books, self.live, self.chores.spawn)
        self.forking = Forking(d, spawner, books)
        self.deleting = Deleting(d, books)
        streams = StreamBudget(settings.tenant_max_streams, settings.vm_max_streams)
        self.guest = ExecAndFiles(d, Waker(d, self.live.resume, self.pauses.resume_locked, streams))
        self.egress_secrets = EgressAndSecrets(d, self.brokering)
        self.draining = Draining(d, self.pauses, books, self.deleting)
        self.reads = Reads(d, spawner)
        self.audit = ToolAudit.of(d)
        self.listing = Listing(d)
        self.lifetimes = Lifetimes(d, self.pauses, self.deleting)
        self.egress_events = EgressEvents(store, self.nodes)
        self.reconciler = Reconciler(
            d,
            record_offload=self.live.record_offload,
            leader_since=lambda: self.lead.since,
            spawn_chore=self.chores.spawn,
            books=books,
        )
        self.sweeper = IdleSweeper(d, self.pauses)
        self.retention = Retention(d)
        self.snapshot_checks = SnapshotChecks(d)
        chores = LeaderChores(
            reseal_secrets=self.egress_secrets.reseal_secrets,
            reseal_again=self.egress_secrets.reseal_again,
            record_egress_events=self.egress_events.record,
            purge_deleted_tenants=self.deleting.purge_deleted_tenants,
            end_lifetimes=self.lifetimes.sweep,
            retention=self.retention.sweep,
            audit_snapshots=self.snapshot_checks.audit,
            sweep_snapshots=self.snapshot_checks.sweep,
            sweep_again=self.snapshot_checks.again,
        )
        self.background = Background(
            settings,
            self.leader,
            self.nodes,
            clock,
            self.reconciler,
            self.sweeper,
            chores,
            self.lead,
            self.telemetry.loops,
        )

    # -- the scheduler itself ------------------------------------------------------------------

    async def start(self) -> None:
        """Take the lead if nobody holds it (then reconcile every VM), and start the loops:
        leadership renewal, and the leader's periodic chores. Unavailable if an embedded
        node does not answer its first heartbeat."""
        try:
            await self.nodes.register_local()
        except Exception as exc:
            raise Unavailable(f"the runtime manager did not answer its heartbeat: {exc}") from exc
        self.leader.keep()  # renews from the first token on: a long first takeover keeps the lease
        await self.background.lead_once()
        self.background.start()
        self.live.start()

    async def close(self) -> None:
        """Stop background tasks; VMs keep running."""
        await self.background.stop()
        await self.live.close()
        self.chores.cancel_all()
        await self.background.release()
        await self.nodes.aclose()

    async def is_leader(self) -> bool:
        return await self.leader.is_leader()

    @property
    def leader_since(self) -> float:
        """clock() when this replica last became leader."""
        return self.lead.since

    @leader_since.setter
    def leader_since(self, value: float) -> None:
        self.lead.since = value

    @property
    def reconciled(self) -> bool:
        """This replica leads and has settled every VM of every node that answered."""
        return self.background.reconciled

    def loop_report(self) -> dict[str, dict[str, float | int]]:
        """Each leader loop's ticks (pal/scheduler/loops.py)."""
        return self.telemetry.loops.report()

    @property
    def unreconciled_nodes(self) -> set[str | None]:
        return self.reconciler.unreconciled_nodes

    @property
    def inflight(self) -> dict[str, int]:
        return self.locks.inflight

    def now_ms(self) -> int:
        return self.deps.now_ms()

    def op_lock(self, vm_id: str) -> asyncio.Lock:
        return self.deps.op_lock(vm_id)

    def occupying(self, node_id: str | None = None) -> builtins.list[VmRecord]:
        return self.deps.occupying(node_id)

    async def shutdown_vms(self) -> None:
        await self.draining.shutdown_vms()

    async def purge_deleted_tenants(self) -> builtins.list[str]:
        return await self.deleting.purge_deleted_tenants()

    def reseal_secrets(self) -> int:
        return self.egress_secrets.reseal_secrets()

    async def record_egress_events(self) -> int:
        return await self.egress_events.record()

    # -- VMs -----------------------------------------------------------------------------------

    async def schedule(self, tenant_id: str, spec: AgentSpec) -> tuple[VmRecord, str]:
        return await self.scheduling.schedule(tenant_id, spec)

    async def pause(self, tenant_id: str, vm_id: str, req: PauseRequest | None = None) -> VmRecord:
        return await self.pauses.pause(tenant_id, vm_id, req)

    async def resume(self, tenant_id: str, vm_id: str) -> VmRecord:
        return await self.pauses.resume(tenant_id, vm_id)

    async def idle_pause(self, vm_id: str, *, still_idle: Callable[[VmRecord], bool]) -> VmRecord | None:
        return await self.pauses.idle_pause(vm_id, still_idle=still_idle)

    async def idle_live_pause(self, vm_id: str, *, still_idle: Callable[[VmRecord], bool]) -> VmRecord | None:
        return await self.pauses.idle_live_pause(vm_id, still_idle=still_idle)

    async def fork(self, tenant_id: str, vm_id: str, count: int) -> ForkResult:
        return await self.forking.fork(tenant_id, vm_id, count)

    async def delete(self, tenant_id: str, vm_id: str) -> VmRecord:
        return await self.deleting.delete(tenant_id, vm_id)

    async def set_egress(self, tenant_id: str, vm_id: str, update: EgressUpdate) -> VmRecord:
        return await self.egress_secrets.set_egress(tenant_id, vm_id, update)

    async def rotate_secret(self, tenant_id: str, vm_id: str, name: str, update: SecretUpdate) -> bool:
        return await self.egress_secrets.rotate_secret(tenant_id, vm_id, name, update)

    async def set_lifetime(self, tenant_id: str, vm_id: str, update: LifetimeUpdate) -> VmRecord:
        return await self.lifetimes.set_lifetime(tenant_id, vm_id, update)

    # -- reads ---------------------------------------------------------------------------------

    async def get(self, tenant_id: str, vm_id: str) -> VmRecord:
        return await self.reads.get(tenant_id, vm_id)

    async def list(self, tenant_id: str) -> builtins.list[VmRecord]:
        return await self.reads.list_vms(tenant_id)

    async def events(
        self, tenant_id: str, vm_id: str, *, before: int | None = None, limit: int = 50
    ) -> builtins.list[EventRecord]:
        """The VM's events newest first, a page at a time (older than ``before``)."""
        return await self.listing.latest_events(tenant_id, vm_id, before=before, limit=limit)

    async def record_tool_call(self, tenant_id: str, vm_id: str, details: dict[str, object]) -> None:
        await self.audit.record_tool_call(tenant_id, vm_id, details)

    async def list_page(
        self, tenant_id: str, *, after: tuple[datetime, str] | None, limit: int, metadata: dict[str, str]
    ) -> builtins.list[VmRecord]:
        return await self.listing.vms(tenant_id, after=after, limit=limit, metadata=metadata)

    async def events_page(
        self, tenant_id: str, vm_id: str, *, after: int | None, limit: int
    ) -> builtins.list[EventRecord]:
        return await self.listing.events(tenant_id, vm_id, after=after, limit=limit)

    async def network(self, vm: VmRecord) -> dict[str, int]:
        return await self.reads.network(vm)

    async def metrics(self, tenant_id: str, vm_id: str) -> VmMetrics:
        return await self.reads.metrics(tenant_id, vm_id)

    async def snapshots(self, tenant_id: str, vm_id: str) -> builtins.list[SnapshotInfo]:
        return await self.reads.snapshots(tenant_id, vm_id)

    async def list_images(self, tenant_id: str) -> builtins.list[ImageInfo]:
        return await self.reads.list_images(tenant_id)

    async def operator_stats(self) -> OperatorStats:
        return await self.reads.operator_stats()

    # -- exec, files and ports (exec_files.py) --------------------------------------------------

    def exec_stream(self, tenant_id: str, vm_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        """Errors (404/409/402) are raised on the first ``__anext__``, before any event."""
        return self.guest.exec_stream(tenant_id, vm_id, req)

    def port_stream(self, tenant_id: str, vm_id: str, port: int) -> AbstractAsyncContextManager[TunnelStream]:
        return self.guest.port_stream(tenant_id, vm_id, port)

    async def open_port(self, tenant_id: str, vm_id: str, port: int) -> TunnelStream:
        return await self.guest.open_port(tenant_id, vm_id, port)

    async def list_files(self, tenant_id: str, vm_id: str, path: str) -> FileList:
        return await self.guest.list_files(tenant_id, vm_id, path)

    async def read_file(self, tenant_id: str, vm_id: str, path: str) -> tuple[bytes, bool]:
        return await self.guest.read_file(tenant_id, vm_id, path)

    async def write_file(self, tenant_id: str, vm_id: str, path: str, data: bytes) -> FileWritten:
        return await self.guest.write_file(tenant_id, vm_id, path, data)

    async def delete_file(self, tenant_id: str, vm_id: str, path: str) -> FileDeleted:
        return await self.guest.delete_file(tenant_id, vm_id, path)

    # -- code contexts (exec_files.py; docs/agents.md) -------------------------------------------
    def run_code(self, tenant_id: str, vm_id: str, req: CodeRequest) -> AsyncIterator[CodeEvent]:
        return self.guest.run_code(tenant_id, vm_id, req)

    async def create_context(self, tenant_id: str, vm_id: str, req: ContextCreate) -> CodeContext:
        return await self.guest.create_context(tenant_id, vm_id, req)

    async def list_contexts(self, tenant_id: str, vm_id: str) -> builtins.list[CodeContext]:
        return await self.guest.list_contexts(tenant_id, vm_id)

    async def delete_context(self, tenant_id: str, vm_id: str, ctx: str) -> None:
        await self.guest.delete_context(tenant_id, vm_id, ctx)

    async def interrupt_context(self, tenant_id: str, vm_id: str, ctx: str) -> bool:
        return await self.guest.interrupt_context(tenant_id, vm_id, ctx)

    # -- processes (exec_files.py; docs/processes.md) -------------------------------------------
    async def start_process(self, tenant_id: str, vm_id: str, req: ProcessStartRequest) -> ProcessInfo:
        return await self.guest.start_process(tenant_id, vm_id, req)

    async def list_processes(self, tenant_id: str, vm_id: str) -> builtins.list[ProcessInfo]:
        return await self.guest.list_processes(tenant_id, vm_id)

    async def get_process(self, tenant_id: str, vm_id: str, pid: int) -> ProcessInfo:
        return await self.guest.get_process(tenant_id, vm_id, pid)

    async def delete_process(self, tenant_id: str, vm_id: str, pid: int) -> ProcessDeleted:
        return await self.guest.delete_process(tenant_id, vm_id, pid)

    async def read_output(
        self, tenant_id: str, vm_id: str, pid: int, start: int, max_bytes: int, wait_ms: int
    ) -> ProcessOutput:
        return await self.guest.read_output(tenant_id, vm_id, pid, start, max_bytes, wait_ms)

    def attach_process(self, tenant_id: str, vm_id: str, pid: int, start: int) -> AsyncIterator[ProcessEvent]:
        return self.guest.attach_process(tenant_id, vm_id, pid, start)

    async def write_stdin(self, tenant_id: str, vm_id: str, pid: int, data: bytes, eof: bool) -> StdinWritten:
        return await self.guest.write_stdin(tenant_id, vm_id, pid, data, eof)

    async def signal_process(self, tenant_id: str, vm_id: str, pid: int, req: SignalRequest) -> None:
        await self.guest.signal_process(tenant_id, vm_id, pid, req)

    async def resize_process(self, tenant_id: str, vm_id: str, pid: int, size: Terminal) -> None:
        await self.guest.resize_process(tenant_id, vm_id, pid, size)

    async def wait_process(self, tenant_id: str, vm_id: str, pid: int, timeout_ms: int) -> ProcessInfo:
        return await self.guest.wait_process(tenant_id, vm_id, pid, timeout_ms)

    # -- nodes (operator and node-facing) --------------------------------------------------------

    async def node_heartbeat(self, hb: NodeHeartbeat) -> HeartbeatAck:
        return await self.reconciler.node_heartbeat(hb)

    def node_count(self) -> int:
        return len(self.nodes.nodes())

    def node_views(self) -> builtins.list[dict[str, Any]]:
        return self.reads.node_views()

    async def set_node_active(self, node_id: str) -> dict[str, Any]:
        return await self.draining.set_node_active(node_id)

    async def drain_node(self, node_id: str, *, migrate: bool = False) -> dict[str, Any]:
        return await self.draining.drain_node(node_id, migrate=migrate)
