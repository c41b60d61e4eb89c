"""A simulated node for `pal bench control-plane` (bench-only: nothing in the product imports
it). It is the node *runtime* of a real `pal node` without QEMU: the control plane reaches
it through the real node RPC (``pal.manager.rpc.create_rpc_app`` over its handler table,
:meth:`SimNode.handlers`: the same verbs, routes, token check and error bodies), and it
pushes its heartbeat with the real ``pal.node.Heartbeats``. So every byte of control-plane
code a real node exercises (the RPC client, heartbeats and their acks, placement inputs,
stray stops, reconciliation, snapshots, resumes, forks) runs unchanged; only what happens
*on* the node is a stand-in: a VM is a record, and each call answers after a configurable
time (:class:`SimTimes`).

What it keeps, per node: its live VMs (incarnation, activity, a live pause), the snapshots
it holds (what a pause wrote, and what the benchmark's fill says it holds), the notices
long poll (it never has a notice to give: no guest waits on I/O here). What it does not
simulate: guests (exec answers ``ok``), files beyond a small dict, processes, code
contexts, ports, egress (no gateway: no events).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pal.errors import Conflict, InvalidRequest, LivePaused, NotFound, Unavailable
from pal.sizes import DEFAULT_DISK_MIB, DEFAULT_MEMORY_MIB, DEFAULT_VCPUS
from pal.spec import ExecRequest
from pal.wire import models as m
from pal.wire import verbs as v
from pal.wire.handlers import Handlers
from pal.wire.models import (
    BrokeredSet,
    EgressEvents,
    EgressSet,
    EgressSetResult,
    ExecEvent,
    FileDeleted,
    FileList,
    FileWritten,
    ImageInfo,
    LiveBy,
    LivePauseRequest,
    LivePauseResult,
    LiveResumeResult,
    LiveState,
    NodeCapacity,
    NodeHeartbeat,
    NodeStats,
    Notices,
    SnapshotInfo,
    SnapshotOwners,
    SnapshotRequest,
    SnapshotResult,
    SnapshotStatus,
    SpawnRequest,
    SpawnResult,
    VmActivity,
    VmMetrics,
    WarmRequest,
    WarmResult,
    WarmTemplate,
)
from pal.wire.volumes import VolumeCreate, VolumeDeleted, VolumeInfo, VolumeRef, VolumeResize

# The one image every simulated node has (its digest is made up: nothing is booted).
SIM_IMAGE = "default"
SIM_AGENT_VERSION = "sha256-" + "5" * 64
SIM_SNAPSHOT_BYTES = 64 << 20  # what a simulated snapshot takes on the node


@dataclass(frozen=True)
class SimTimes:
    """How long each node call takes on a simulated node (the node's time, which the
    benchmark subtracts to get the control plane's own)."""

    spawn_ms: float = 50.0
    restore_ms: float = 50.0
    snapshot_ms: float = 50.0
    stop_ms: float = 5.0
    exec_ms: float = 5.0


@dataclass
class SimVm:
    vm_id: str
    tenant_id: str
    incarnation: int
    pid: int
    last_activity_ms: int
    live: LiveState | None = None
    mem_snapshot_id: str | None = None


@dataclass
class SimNodeConfig:
    node_id: str
    url: str
    region: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    memory_mib: int = 64 * 1024
    vcpus: int = 32
    disk_free_mib: int = 1 << 20
    times: SimTimes = field(default_factory=SimTimes)


def _now_ms() -> int:
    return int(time.time() * 1000)


class SimNode:
    """A node runtime kept in memory, serving the node RPC's verbs (pal/wire/verbs.py) from
    its handler table (:meth:`handlers`). tests/unit/test_simnode.py checks which verbs it
    leaves unserved (guest processes and code, ports: it has no guests), so a verb added to
    the node shows up here first."""

    def __init__(self, cfg: SimNodeConfig) -> None:
        self.cfg = cfg
        self.node_id = cfg.node_id
        self.url = cfg.url
        self.epoch = uuid.uuid4().hex[:12]
        self.vms: dict[str, SimVm] = {}
        # (agent version, vm id) -> snapshot id -> its info
        self.snapshots: dict[tuple[str, str], dict[str, SnapshotInfo]] = {}
        self.files: dict[tuple[str, str], bytes] = {}
        self.volumes: dict[str, tuple[str, int]] = {}  # volume id -> (tenant, size MiB)
        self._pids = 1000
        self._notice = asyncio.Event()  # never set: a simulated guest never waits on I/O
        self.calls: dict[str, int] = {}

    # -- seeding (the benchmark's fill) ----------------------------------------------------

    def seed_running(
        self,
        vm_id: str,
        tenant_id: str,
        incarnation: int,
        last_activity_ms: int,
        live_by: LiveBy | None = None,
    ) -> None:
        """A VM this node runs (``live_by``: live-paused, and by whom)."""
        live = LiveState(by=live_by, since=last_activity_ms / 1000, offloaded=True) if live_by else None
        self.vms[vm_id] = SimVm(vm_id, tenant_id, incarnation, self._pid(), last_activity_ms, live=live)

    def seed_snapshot(self, vm_id: str, snapshot_id: str, agent_version_id: str = SIM_AGENT_VERSION) -> None:
        self.snapshots.setdefault((agent_version_id, vm_id), {})[snapshot_id] = SnapshotInfo(
            snapshot_id=snapshot_id, sealed=True, memory_kind="file", stored_bytes=SIM_SNAPSHOT_BYTES
        )

    # -- helpers ------------------------------------------------------------------------------

    def _pid(self) -> int:
        self._pids += 1
        return self._pids

    def _count(self, call: str) -> None:
        self.calls[call] = self.calls.get(call, 0) + 1

    @staticmethod
    async def _take(ms: float) -> None:
        if ms > 0:
            await asyncio.sleep(ms / 1000)

    def _live(self, vm_id: str) -> SimVm:
        vm = self.vms.get(vm_id)
        if vm is None:
            raise Conflict(f"VM {vm_id} is not running on this node")
        return vm

    def require_running(self, vm_id: str) -> None:
        vm = self._live(vm_id)
        if vm.live is not None:
            raise LivePaused(f"VM {vm_id} is live-paused")

    def runs_other_incarnation(self, vm_id: str, incarnation: int) -> bool:
        vm = self.vms.get(vm_id)
        return vm is not None and vm.incarnation != incarnation

    # -- a VM's life --------------------------------------------------------------------------

    async def spawn(self, req: SpawnRequest) -> SpawnResult:
        self._count("spawn")
        if req.vm_id in self.vms:
            raise Conflict(f"VM {req.vm_id} is already running on this node")
        if req.restore is not None:
            key = (req.restore.agent_version_id, req.restore.source_vm_id)
            # A snapshot this node never held comes "from S3": every simulated node shares
            # one imaginary bucket, so a resume elsewhere works as it does in a cluster.
            await self._take(self.cfg.times.restore_ms)
            method, ms = "restore", self.cfg.times.restore_ms
            mem = req.restore.snapshot_id if req.restore.mem_mode == "private" else None
            if key not in self.snapshots and req.restore.source_vm_id == req.vm_id:
                self.snapshots.setdefault(key, {})
        else:
            if req.image != SIM_IMAGE:
                raise NotFound(f"image {req.image!r} not found")
            await self._take(self.cfg.times.spawn_ms)
            method, ms, mem = "template", self.cfg.times.spawn_ms, None
        if req.vm_id in self.vms:  # a second spawn of it raced this one
            raise Conflict(f"VM {req.vm_id} is already running on this node")
        vm = SimVm(req.vm_id, req.tenant_id, req.incarnation, self._pid(), _now_ms(), mem_snapshot_id=mem)
        self.vms[req.vm_id] = vm
        return SpawnResult.model_validate(
            {
                "vm_id": req.vm_id,
                "pid": vm.pid,
                "incarnation": req.incarnation,
                "boot_ms": ms,
                "method": method,
                "agent_version_id": SIM_AGENT_VERSION,
                "mem_snapshot_id": mem,
            }
        )

    async def stop(self, vm_id: str) -> None:
        self._count("stop")
        if self.vms.pop(vm_id, None) is not None:
            await self._take(self.cfg.times.stop_ms)

    async def snapshot(self, vm_id: str, req: SnapshotRequest) -> SnapshotResult:
        self._count("snapshot")
        self._live(vm_id)
        await self._take(self.cfg.times.snapshot_ms)
        vm = self._live(vm_id)  # it may have been stopped meanwhile
        info = SnapshotInfo(
            snapshot_id=req.snapshot_id,
            sealed=True,
            memory_kind="file",
            parent_snapshot_id=req.parent_snapshot_id,
            stored_bytes=SIM_SNAPSHOT_BYTES,
        )
        kept = self.snapshots.setdefault((req.agent_version_id, vm_id), {})
        kept[req.snapshot_id] = info
        # Retention as the real node: the newest 3 and the protected ones.
        for old in list(kept)[:-3]:
            if old not in req.protected:
                del kept[old]
        if not req.keep_running:
            self.vms.pop(vm.vm_id, None)
        return SnapshotResult(
            snapshot_id=req.snapshot_id,
            path=f"sim://{self.node_id}/{vm_id}/{req.snapshot_id}",
            sizes={"mem": SIM_SNAPSHOT_BYTES},
            durations_ms={"total": self.cfg.times.snapshot_ms},
            memory_kind="file",
            egress_counters=None if req.keep_running else {},
            stored_bytes=SIM_SNAPSHOT_BYTES * len(kept),
        )

    async def live_pause(self, vm_id: str, req: LivePauseRequest) -> LivePauseResult:
        self._count("live_pause")
        vm = self._live(vm_id)
        if req.if_waiting:
            return LivePauseResult(paused=False)
        if vm.live is None or req.by == "operator":
            vm.live = LiveState(by=req.by, since=time.time(), offloaded=req.offload)
        return LivePauseResult(paused=True, pause_ms=1.0, state=vm.live)

    async def live_resume(self, vm_id: str) -> LiveResumeResult:
        self._count("live_resume")
        vm = self._live(vm_id)
        if vm.live is None:
            return LiveResumeResult(resumed=False)
        paused_ms = int((time.time() - vm.live.since) * 1000)
        vm.live, vm.last_activity_ms = None, _now_ms()
        return LiveResumeResult(resumed=True, resume_ms=1.0, paused_ms=paused_ms)

    async def live_status(self, vm_id: str) -> LiveState | None:
        return self._live(vm_id).live

    async def notices(self, after: int, epoch: str, wait_s: float) -> Notices:
        self._count("notices")
        if wait_s > 0:
            try:
                await asyncio.wait_for(self._notice.wait(), min(wait_s, 60.0))
            except TimeoutError:
                pass
        return Notices(notices=[], seq=0, epoch=self.epoch)

    # -- in the guest ---------------------------------------------------------------------------

    async def exec_stream(self, vm_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        self._count("exec")
        vm = self._live(vm_id)
        vm.last_activity_ms = _now_ms()
        yield ExecEvent(type="process", process_id=1)
        await self._take(self.cfg.times.exec_ms)
        yield ExecEvent(type="stdout", data="ok\n")
        yield ExecEvent(type="exit", exit_code=0)

    async def open_port(self, vm_id: str, port: int) -> None:
        raise Unavailable("a simulated node has no guest ports")

    def port_traffic(self, vm_id: str) -> None:
        return None

    async def list_files(self, vm_id: str, path: str) -> FileList:
        self.require_running(vm_id)
        names = [p for (v, p) in self.files if v == vm_id]
        return FileList(
            path=path, entries=[{"name": n, "type": "file"} for n in sorted(names)], truncated=False
        )

    async def read_file(self, vm_id: str, path: str) -> tuple[bytes, bool]:
        self.require_running(vm_id)
        data = self.files.get((vm_id, path))
        if data is None:
            raise NotFound(f"{path} not found")
        return data, False

    async def write_file(self, vm_id: str, path: str, data: bytes) -> FileWritten:
        self.require_running(vm_id)
        if len(data) > 1 << 20:
            raise InvalidRequest("a simulated guest keeps files of at most 1 MiB")
        self.files[(vm_id, path)] = data
        return FileWritten(path=path, bytes_written=len(data))

    async def delete_file(self, vm_id: str, path: str) -> FileDeleted:
        self.require_running(vm_id)
        if self.files.pop((vm_id, path), None) is None:
            raise NotFound(f"{path} not found")
        return FileDeleted(path=path, deleted=True)

    # -- egress (no gateway: nothing to count, nothing refused) --------------------------------

    async def set_egress(self, vm_id: str, req: EgressSet) -> EgressSetResult:
        self._live(vm_id)
        return EgressSetResult(closed=0)

    async def set_brokered(self, vm_id: str, req: BrokeredSet) -> None:
        self._live(vm_id)

    async def egress_counters(self, vm_id: str) -> dict[str, int]:
        return {}

    async def egress_events(self, after: int, epoch: str) -> EgressEvents:
        self._count("egress_events")
        return EgressEvents(events=[], seq=0, epoch=self.epoch)

    # -- the node ---------------------------------------------------------------------------

    def _template(self) -> WarmTemplate:
        return WarmTemplate(
            agent_version_id=SIM_AGENT_VERSION,
            memory_mib=DEFAULT_MEMORY_MIB,
            vcpus=DEFAULT_VCPUS,
            disk_mib=DEFAULT_DISK_MIB,
        )

    async def warm(self, req: WarmRequest) -> WarmResult:
        return WarmResult(key=f"{SIM_AGENT_VERSION}-{req.memory_mib}m", ready=True)

    async def images(self) -> list[ImageInfo]:
        self._count("images")
        return [ImageInfo(name=SIM_IMAGE, agent_version_id=SIM_AGENT_VERSION, templates=["256m-1c-2048d"])]

    async def heartbeat(self) -> NodeHeartbeat:
        self._count("heartbeat")
        now = _now_ms()
        return NodeHeartbeat(
            node_id=self.node_id,
            accel="sim",
            epoch=self.epoch,
            url=self.url,
            region=self.cfg.region,
            labels=dict(self.cfg.labels),
            capacity=NodeCapacity(
                memory_mib=self.cfg.memory_mib, vcpus=self.cfg.vcpus, disk_free_mib=self.cfg.disk_free_mib
            ),
            templates=[self._template()],
            images=await self.images(),
            vms=[
                VmActivity(
                    vm_id=vm.vm_id,
                    alive=True,
                    pid=vm.pid,
                    incarnation=vm.incarnation,
                    last_activity_unix_ms=vm.last_activity_ms,
                    last_heartbeat_unix_ms=now,
                    silent_cpu_ms=0,
                    live=vm.live,
                )
                for vm in self.vms.values()
            ],
        )

    def vm_metrics(self, vm_id: str) -> VmMetrics:
        return VmMetrics(
            vm_id=vm_id, interval_secs=5.0, window_secs=900.0, live=vm_id in self.vms, samples=[]
        )

    async def stats(self) -> NodeStats:
        kept = sum(len(v) for v in self.snapshots.values())
        return NodeStats(
            node_id=self.node_id,
            accel="sim",
            vms_live=len(self.vms),
            snapshot_bytes_local=kept * SIM_SNAPSHOT_BYTES,
            snapshot_bytes_s3=None,
            s3_queue_depth=0,
            seal_queue_depth=0,
            stats_age_secs=0.0,
        )

    # -- snapshots kept ---------------------------------------------------------------------------

    async def snapshot_owners(self) -> SnapshotOwners:
        self._count("snapshot_owners")
        return SnapshotOwners(vms=[key for key, kept in self.snapshots.items() if kept])

    async def delete_vm_snapshots(self, agent_version_id: str, vm_id: str, keep: list[str]) -> list[str]:
        self._count("delete_vm_snapshots")
        kept = self.snapshots.get((agent_version_id, vm_id), {})
        mapped = {vm.mem_snapshot_id for vm in self.vms.values() if vm.mem_snapshot_id}
        gone = [s for s in kept if s not in keep and s not in mapped]
        for s in gone:
            del kept[s]
        if not kept:
            self.snapshots.pop((agent_version_id, vm_id), None)
        return gone

    async def list_snapshots(self, agent_version_id: str, vm_id: str) -> list[SnapshotInfo]:
        return list(self.snapshots.get((agent_version_id, vm_id), {}).values())

    async def snapshot_status(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> SnapshotStatus:
        self._count("snapshot_status")
        info = self.snapshots.get((agent_version_id, vm_id), {}).get(snapshot_id)
        return SnapshotStatus(complete=info is not None, meta=None)

    async def ensure_uploaded(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> None:
        return None

    async def delete_snapshot(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> None:
        self.snapshots.get((agent_version_id, vm_id), {}).pop(snapshot_id, None)

    # -- the verbs it serves ----------------------------------------------------------------------

    def handlers(self) -> Handlers:
        """Each verb bound to the method above that answers it (what a NodeRuntime binds)."""
        h = Handlers()

        async def stop(r: m.StopVm) -> m.Stopped:
            if r.incarnation is not None and self.runs_other_incarnation(r.vm_id, r.incarnation):
                return m.Stopped(vm_id=r.vm_id, stopped=False)
            await self.stop(r.vm_id)
            return m.Stopped(vm_id=r.vm_id, stopped=True)

        async def live_status(r: m.VmRef) -> m.LiveStatus:
            return m.LiveStatus(live=await self.live_status(r.vm_id))

        async def exec_(r: m.ExecCall) -> AsyncIterator[m.ExecEvent]:
            self.require_running(r.vm_id)
            async for ev in self.exec_stream(r.vm_id, r):
                yield ev

        async def read_file(r: m.FileRef) -> m.FileContent:
            data, truncated = await self.read_file(r.vm_id, r.path)
            return m.FileContent(data=data, truncated=truncated)

        async def set_brokered(r: m.BrokeredSet) -> m.BrokeredSetResult:
            await self.set_brokered(r.vm_id, r)
            return m.BrokeredSetResult(vm_id=r.vm_id, rules=len(r.brokered))

        async def counters(r: m.VmRef) -> m.EgressCounters:
            return m.EgressCounters(counters=await self.egress_counters(r.vm_id))

        async def images(_: m.Empty) -> m.ImageList:
            return m.ImageList(images=await self.images())

        async def metrics(r: m.VmRef) -> m.VmMetrics:
            return self.vm_metrics(r.vm_id)

        async def listed(r: m.VmSnapshots) -> m.SnapshotList:
            return m.SnapshotList(snapshots=await self.list_snapshots(r.agent_version_id, r.vm_id))

        async def deleted_all(r: m.VmSnapshotsDelete) -> m.SnapshotsDeleted:
            return m.SnapshotsDeleted(
                deleted=await self.delete_vm_snapshots(r.agent_version_id, r.vm_id, r.keep)
            )

        async def uploaded(r: m.SnapshotAt) -> m.Uploaded:
            await self.ensure_uploaded(r.agent_version_id, r.vm_id, r.snapshot_id)
            return m.Uploaded(uploaded=True)

        async def deleted(r: m.SnapshotAt) -> m.SnapshotDeleted:
            await self.delete_snapshot(r.agent_version_id, r.vm_id, r.snapshot_id)
            return m.SnapshotDeleted(deleted=True)

        h.on(v.SPAWN, self.spawn)
        h.on(v.STOP, stop)
        h.on(v.SNAPSHOT, lambda r: self.snapshot(r.vm_id, r))
        h.on(v.LIVE_PAUSE, lambda r: self.live_pause(r.vm_id, r))
        h.on(v.LIVE_RESUME, lambda r: self.live_resume(r.vm_id))
        h.on(v.LIVE_STATUS, live_status)
        h.on(v.NOTICES, lambda r: self.notices(r.after, r.epoch, r.wait_s))
        h.on(v.WARM, self.warm)
        h.on(v.HEARTBEAT, lambda _: self.heartbeat())
        h.on(v.IMAGES, images)
        h.on(v.VM_METRICS, metrics)
        h.on(v.STATS, lambda _: self.stats())
        h.on(v.SET_EGRESS, lambda r: self.set_egress(r.vm_id, r))
        h.on(v.SET_BROKERED, set_brokered)
        h.on(v.EGRESS_COUNTERS, counters)
        h.on(v.EGRESS_EVENTS, lambda r: self.egress_events(r.after, r.epoch))
        h.on(v.SNAPSHOT_OWNERS, lambda _: self.snapshot_owners())
        h.on(v.LIST_SNAPSHOTS, listed)
        h.on(v.DELETE_VM_SNAPSHOTS, deleted_all)
        h.on(v.SNAPSHOT_STATUS, lambda r: self.snapshot_status(r.agent_version_id, r.vm_id, r.snapshot_id))
        h.on(v.ENSURE_UPLOADED, uploaded)
        h.on(v.DELETE_SNAPSHOT, deleted)
        h.on_stream(v.EXEC, exec_)
        h.on(v.LIST_FILES, lambda r: self.list_files(r.vm_id, r.path))
        h.on(v.READ_FILE, read_file)
        h.on(v.WRITE_FILE, lambda r: self.write_file(r.vm_id, r.path, r.data))
        h.on(v.DELETE_FILE, lambda r: self.delete_file(r.vm_id, r.path))
        self._bind_volumes(h)
        return h

    def _bind_volumes(self, h: Handlers) -> None:
        """Volumes as the node keeps them (pal/manager/volumes.py), in memory."""

        async def create(r: VolumeCreate) -> VolumeInfo:
            tenant, size = self.volumes.setdefault(r.volume_id, (r.tenant_id, r.size_mib))
            if tenant != r.tenant_id:
                raise Conflict(f"volume {r.volume_id} exists on this node for another tenant")
            return VolumeInfo(volume_id=r.volume_id, size_mib=size)

        async def resize(r: VolumeResize) -> VolumeInfo:
            if r.volume_id not in self.volumes:
                raise NotFound(f"volume {r.volume_id} not found on this node")
            tenant, size = self.volumes[r.volume_id]
            if r.size_mib < size:
                raise InvalidRequest(f"volume {r.volume_id} is {size} MiB: a volume only grows")
            self.volumes[r.volume_id] = (tenant, r.size_mib)
            return VolumeInfo(volume_id=r.volume_id, size_mib=r.size_mib)

        async def delete(r: VolumeRef) -> VolumeDeleted:
            return VolumeDeleted(
                volume_id=r.volume_id, deleted=self.volumes.pop(r.volume_id, None) is not None
            )

        h.on(v.CREATE_VOLUME, create)
        h.on(v.RESIZE_VOLUME, resize)
        h.on(v.DELETE_VOLUME, delete)
