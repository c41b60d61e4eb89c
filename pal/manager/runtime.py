"""The runtime manager: owns the VMs of one host. The node's composition root: it builds
each operation's module once, hands each the few collaborators its constructor names, and
binds the verbs of the node RPC to them (handlers.py). It forwards nothing: the RPC calls
the operations themselves, and so do `pal up` and `pal node` for the node's own life
(start, shutdown). The modules (docs/internals.md, "The node's request paths"):

| module | what |
|---|---|
| vm.py | the VM registry: live VMs, their state files, the live/running preconditions |
| vm_states.py | the node's states of a VM and the moves allowed between them |
| spawn.py, restore.py, identify.py, fork.py | spawn, its sources, the guest's identity, fork memory |
| stop.py | stop, and freeing what a VM held |
| snapshot.py | snapshot capture and the stored snapshots |
| exec_files.py, guest_ports.py | exec and files through the guest channel; ports |
| live.py, waits.py | live pause, offload and resume; wait management |
| parked.py, templates.py | parked QEMUs; warm templates |
| pool.py, slots.py | the claimable warm pool; host slots (what host resources are named by) |
| prestart.py | QEMUs waiting in `-incoming defer` for a restore to take |
| adopt.py | adoption after a crash or restart |
| egress.py, heartbeat.py, sampling.py | the VM's network; the node's reports; metrics |

It knows VM ids, images and snapshots, never tenants' quotas or lifecycle states: those
are the scheduler's. What each verb promises is declared in pal/wire/verbs.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid

from pal.config import Settings
from pal.manager.adopt import AdoptDeps, Adopter
from pal.manager.code import GuestCode
from pal.manager.egress import Egress
from pal.manager.exec_files import GuestCalls
from pal.manager.fork import ForkMemory
from pal.manager.guest_ports import GuestPorts
from pal.manager.guest_relay import relay
from pal.manager.heartbeat import NodeIdentity, NodeReports, ReportDeps
from pal.manager.live import LiveControl, PauseDeps
from pal.manager.metrics import MetricsBook
from pal.manager.notices import NoticeBoard
from pal.manager.parked import Parking
from pal.manager.pool import PoolDeps, WarmPool
from pal.manager.ports import PortRoutes
from pal.manager.prestart import PrestartDeps, PrestartSet
from pal.manager.processes import GuestProcesses
from pal.manager.restore import RestoreDeps, Restores
from pal.manager.restore_gate import RestoreGate
from pal.manager.sampling import Sampler
from pal.manager.snapshot import SnapshotDeps, Snapshots
from pal.manager.spawn import PoolHooks, SpawnDeps, Spawner
from pal.manager.stop import Stopper, VmFiles
from pal.manager.templates import TemplateCache, TemplateHost
from pal.manager.vm import VmRegistry
from pal.manager.vmnet import VmNetworking
from pal.manager.volume_content import VolumeContent
from pal.manager.volumes import VolumeFiles
from pal.manager.waits import WaitWatcher
from pal.snapshots.store import SnapshotStore
from pal.vmm.accel import AccelInfo
from pal.vmm.jail import Jail
from pal.wire import code as c
from pal.wire import models as m
from pal.wire import processes as pr
from pal.wire import verbs as v
from pal.wire.handlers import Handlers
from pal.wire.tunnel import Opened
from pal.wire.volumes import VolumeDeleted, VolumeRef


class NodeRuntime:
    def __init__(
        self,
        settings: Settings,
        store: SnapshotStore,
        accel: AccelInfo,
        templates: TemplateCache | None = None,
    ) -> None:
        """``templates``: the warm templates (None: PAL_TEMPLATES=0, every VM boots cold)."""
        self.settings = settings
        self.store = store
        self.accel = accel
        self.me = NodeIdentity(settings.node_name or os.uname().nodename, uuid.uuid4().hex, accel.name)
        self.templates = templates
        self.net = VmNetworking(settings)
        self.registry = VmRegistry(settings.vms_dir, self.net.seal_brokered)
        self.jail = Jail()  # each QEMU's uid, and groups for RAM files forks share
        self.metrics = MetricsBook(interval_s=settings.metrics_interval_s)
        self.ports = PortRoutes()
        self.notices_board = NoticeBoard()
        reg, board = self.registry, self.notices_board
        self.forks = ForkMemory(store, self.jail)
        self.files = VmFiles(reg, self.net, self.jail)
        self.parking = Parking(self.files, settings.parked_max, settings.parked_secs)
        pausing = PauseDeps(reg, self.net, board)
        self.live = LiveControl(pausing, lambda lv: self.waits.watch(lv))
        self.waits = WaitWatcher(pausing, self.live.start_prefetch)
        watchers = (self.live.forget, self.metrics.stopped, self.ports.forget, self.waits.forget)
        self.stopper = Stopper(reg, self.files, self.parking, self.forks, watchers)
        gate = self.restore_gate = RestoreGate(settings.fork_concurrency)
        self._spawning(settings, store, accel, templates)
        self.snapshots = Snapshots(
            SnapshotDeps(reg, store, self.net, self.parking, self.live, self.stopper, accel.name)
        )
        self.guest = GuestCalls(reg)
        self.volumes: VolumeFiles = self.net.volume_files  # docs/volumes.md
        self.volume_content = VolumeContent(self.volumes)  # a volume's files API
        self.processes = GuestProcesses(reg)
        self.code = GuestCode(reg)  # code contexts
        self.guest_ports = GuestPorts(reg, self.ports, self.net, board)
        self.egress = Egress(reg, self.net, board)
        self.adopter = Adopter(
            AdoptDeps(settings, accel.name, reg, self.jail, self.net, self.forks, gate.sampler)
        )
        self.reports = NodeReports(
            ReportDeps(self.me, settings, store, reg, templates, self.template_host, gate.sampler)
        )
        self.sampler = Sampler(
            reg, self.metrics, settings.heartbeat_interval_s, self.net.cached_bytes, self.net.refresh_counters
        )

    def _spawning(
        self, settings: Settings, store: SnapshotStore, accel: AccelInfo, templates: TemplateCache | None
    ) -> None:
        """What makes VMs: the restores' sources, the pre-started QEMUs, the spawner and the
        warm pool (which spawns through the spawner, and which a spawn claims from)."""
        reg, net, jail, gate = self.registry, self.net, self.jail, self.restore_gate
        # A template build spawns, execs and stops like any VM (the spawner is made below).
        host = self.template_host = TemplateHost(
            spawn=lambda req: self.spawner.spawn(req),
            exec_stream=lambda vm_id, req: self.guest.exec_stream(vm_id, req),
            stop=lambda vm_id: self.stopper.stop(vm_id),
            live=reg.live,
        )
        restores = Restores(RestoreDeps(settings, store, net, reg, templates, host, gate.sampler))
        self.prestart = PrestartSet(
            PrestartDeps(settings, accel.name, reg, net, jail, gate, self.files.free_vm_files)
        )
        pool = PoolHooks(claim=lambda req: self.pool.claim(req), evict=lambda mib: self.pool.evict(mib))
        forks, parking, prestart = self.forks, self.parking, self.prestart
        self.spawner = Spawner(
            SpawnDeps(settings, accel.name, reg, net, jail, forks, parking, restores, gate, pool, prestart)
        )
        self.pool = WarmPool(
            PoolDeps(settings, reg, net, self.spawner.spawn_pooled, self.files.free_vm_files, templates, host)
        )

    # ------------------------------------------------------------------ the node's life

    async def start(self) -> tuple[list[str], list[str]]:
        """Start (or adopt) the egress gateway and watch its events, adopt the QEMUs a
        previous manager left (returns those adopted and those killed), then settle the
        gateway on what runs."""
        await self.egress.start(self.waits)
        await asyncio.to_thread(self.volumes.sweep)  # deletes a crash interrupted
        self.net.volumes.sweep()  # a volume server a dead node process left: its exports died with it
        adopted, killed = await self.adopter.adopt_all()
        await self.egress.settle(self.parking.vms, self.live, self.waits)
        return adopted, killed

    def start_pool(self) -> None:
        """Fill the warm pool and start the pre-started QEMUs in the background (after
        adoption: PAL_POOL, PAL_PRESTART)."""
        self.pool.start()
        self.prestart.start()

    async def stop_all(self) -> None:
        """Stop every VM, pooled and pre-started QEMUs too (`pal up` shutting down)."""
        await self.pool.close()
        await self.prestart.close()
        await self.stopper.stop_all()

    async def shutdown(self) -> None:
        """`pal up` ends: every VM stopped, the egress gateway stopped, long polls ended."""
        await self.stop_all()
        await self.net.gateway.stop()
        await self.net.volumes.stop()
        self.notices_board.close()

    async def detach(self) -> None:
        """`pal node` ends: its VMs (and the gateway carrying their connections) keep
        running for the next start to adopt; its long polls and the VMs' channels close."""
        self.notices_board.close()
        for lv in list(self.registry.vms.values()):
            with contextlib.suppress(Exception):
                await lv.channel.close()

    async def stats(self) -> m.NodeStats:
        """The node's figures (heartbeat.py) with the warm pool's and the pre-started
        QEMUs' (pool.py, prestart.py)."""
        pool, pre = self.pool.status(), self.prestart.status()
        return (await self.reports.stats()).model_copy(
            update={
                "pool_ready": sum(r["ready"] for r in pool["sizes"].values()),
                "pool_target": sum(r["target"] for r in pool["sizes"].values()),
                "pool_rss_bytes": pool["rssBytes"],
                "pool_claims": pool["claims"],
                "pool_misses": pool["misses"],
                "prestart_ready": sum(r["ready"] for r in pre["sizes"].values()),
                "prestart_target": sum(r["target"] for r in pre["sizes"].values()),
                "prestart_rss_bytes": pre["rssBytes"],
                "prestart_takes": pre["takes"],
                "prestart_misses": pre["misses"],
            }
        )

    # ------------------------------------------------------------------ what it serves

    async def _delete_volume(self, r: VolumeRef) -> VolumeDeleted:
        """A volume's export goes before its files (a forced delete: VMs still mount it)."""
        await self.net.volumes.drop(r.volume_id)
        gone = await self.volumes.delete(r)
        self.volume_content.forget(r.volume_id)  # its lock and measured usage
        return gone

    def handlers(self) -> Handlers:
        """Every verb of the node RPC (pal/wire/verbs.py) bound to the operation that serves
        it here; a guest verb declared without a handler of its own is relayed to the guest
        (guest_relay.py). The one place a verb meets the node's code."""
        h = Handlers()
        self._bind_life(h)
        self._bind_snapshots(h)
        self._bind_guest(h)
        for verb in v.VERBS:
            if isinstance(verb, v.Call) and verb.guest is not None and not h.bound(verb):
                h.on(verb, relay(self.registry, verb))
        return h

    def _bind_life(self, h: Handlers) -> None:
        async def stop(r: m.StopVm) -> m.Stopped:
            if r.incarnation is not None and self.stopper.runs_other_incarnation(r.vm_id, r.incarnation):
                return m.Stopped(vm_id=r.vm_id, stopped=False)  # a newer one runs: keep it
            await self.stopper.stop(r.vm_id)
            return m.Stopped(vm_id=r.vm_id, stopped=True)

        async def live_status(r: m.VmRef) -> m.LiveStatus:
            return m.LiveStatus(live=await self.live.status(r.vm_id))

        async def images(_: m.Empty) -> m.ImageList:
            return m.ImageList(images=await self.reports.images())

        async def vm_metrics(r: m.VmRef) -> m.VmMetrics:
            return self.sampler.vm_metrics(r.vm_id)

        async def set_brokered(r: m.BrokeredSet) -> m.BrokeredSetResult:
            await self.egress.set_brokered(r.vm_id, r)
            return m.BrokeredSetResult(vm_id=r.vm_id, rules=len(r.brokered))

        async def egress_counters(r: m.VmRef) -> m.EgressCounters:
            return m.EgressCounters(counters=await self.egress.counters(r.vm_id))

        h.on(v.SPAWN, self.spawner.spawn)
        h.on(v.STOP, stop)
        h.on(v.LIVE_PAUSE, lambda r: self.live.pause(r.vm_id, r))
        h.on(v.LIVE_RESUME, lambda r: self.live.resume(r.vm_id))
        h.on(v.LIVE_STATUS, live_status)
        h.on(v.NOTICES, lambda r: self.notices_board.wait(r.after, r.epoch, r.wait_s))
        h.on(v.WARM, self.reports.warm)
        h.on(v.HEARTBEAT, lambda _: self.reports.heartbeat())
        h.on(v.IMAGES, images)
        h.on(v.VM_METRICS, vm_metrics)
        h.on(v.STATS, lambda _: self.stats())
        h.on(v.SET_EGRESS, lambda r: self.egress.set_egress(r.vm_id, r))
        h.on(v.SET_BROKERED, set_brokered)
        h.on(v.EGRESS_COUNTERS, egress_counters)
        h.on(v.EGRESS_EVENTS, lambda r: self.egress.events(r.after, r.epoch))
        h.on(v.CREATE_VOLUME, self.volumes.create)
        h.on(v.RESIZE_VOLUME, self.volumes.resize)
        h.on(v.DELETE_VOLUME, self._delete_volume)
        h.on(v.VOLUME_LIST, self.volume_content.list_dir)
        h.on(v.VOLUME_STAT, self.volume_content.stat)
        h.on(v.VOLUME_READ, self.volume_content.read)
        h.on(v.VOLUME_WRITE, self.volume_content.write)
        h.on(v.VOLUME_MKDIR, self.volume_content.mkdir)
        h.on(v.VOLUME_REMOVE, self.volume_content.remove)
        h.on(v.VOLUME_SET_ATTRS, self.volume_content.set_attrs)

    def _bind_snapshots(self, h: Handlers) -> None:
        snaps = self.snapshots

        async def listed(r: m.VmSnapshots) -> m.SnapshotList:
            return m.SnapshotList(snapshots=await snaps.list_vm(r.agent_version_id, r.vm_id))

        async def deleted_all(r: m.VmSnapshotsDelete) -> m.SnapshotsDeleted:
            return m.SnapshotsDeleted(
                deleted=await snaps.delete_vm(r.agent_version_id, r.vm_id, list(r.keep))
            )

        async def uploaded(r: m.SnapshotAt) -> m.Uploaded:
            await snaps.ensure_uploaded(r.agent_version_id, r.vm_id, r.snapshot_id)
            return m.Uploaded(uploaded=True)

        async def deleted(r: m.SnapshotAt) -> m.SnapshotDeleted:
            await snaps.delete(r.agent_version_id, r.vm_id, r.snapshot_id)
            return m.SnapshotDeleted(deleted=True)

        h.on(v.SNAPSHOT, lambda r: snaps.snapshot(r.vm_id, r))
        h.on(v.SNAPSHOT_OWNERS, lambda _: snaps.owners())
        h.on(v.LIST_SNAPSHOTS, listed)
        h.on(v.DELETE_VM_SNAPSHOTS, deleted_all)
        h.on(v.SNAPSHOT_STATUS, lambda r: snaps.status(r.agent_version_id, r.vm_id, r.snapshot_id))
        h.on(v.ENSURE_UPLOADED, uploaded)
        h.on(v.DELETE_SNAPSHOT, deleted)

    def _bind_guest(self, h: Handlers) -> None:
        guest, procs, code, ports = self.guest, self.processes, self.code, self.guest_ports

        async def port(r: m.PortOpen) -> Opened:
            conn = await ports.open_port(r.vm_id, r.port)
            return Opened(conn.reader, conn.writer, conn.route, lambda: ports.port_traffic(r.vm_id))

        async def read_file(r: m.FileRef) -> m.FileContent:
            data, truncated = await guest.read_file(r.vm_id, r.path)
            return m.FileContent(data=data, truncated=truncated)

        async def list_processes(r: m.VmRef) -> pr.ProcessList:
            return pr.ProcessList(processes=await procs.list(r.vm_id))

        async def signal(r: pr.ProcessSignal) -> pr.SignalSent:
            await procs.signal(r.vm_id, r.pid, r)
            return pr.SignalSent(process_id=r.pid, signal=r.signal)

        async def resize(r: pr.ProcessResize) -> pr.Resized:
            await procs.resize(r.vm_id, r.pid, r)
            return pr.Resized(process_id=r.pid, cols=r.cols, rows=r.rows)

        async def list_contexts(r: m.VmRef) -> c.ContextList:
            return c.ContextList(contexts=await code.list_contexts(r.vm_id))

        async def delete_context(r: c.ContextRef) -> c.ContextDeleted:
            await code.delete_context(r.vm_id, r.context_id)
            return c.ContextDeleted(context_id=r.context_id)

        async def restart_context(r: c.ContextRef) -> c.ContextRestarted:
            await code.restart_context(r.vm_id, r.context_id)
            return c.ContextRestarted(context_id=r.context_id)

        async def interrupt_context(r: c.ContextRef) -> c.ContextInterrupted:
            interrupted = await code.interrupt_context(r.vm_id, r.context_id)
            return c.ContextInterrupted(context_id=r.context_id, interrupted=interrupted)

        h.on_stream(v.EXEC, lambda r: guest.exec_stream(r.vm_id, r))
        h.on_tunnel(v.PORT, port)
        h.on(v.LIST_FILES, lambda r: guest.list_files(r.vm_id, r.path))
        h.on(v.READ_FILE, read_file)
        h.on(v.WRITE_FILE, lambda r: guest.write_file(r.vm_id, r.path, r.data, r.metadata))
        h.on(v.DELETE_FILE, lambda r: guest.delete_file(r.vm_id, r.path))
        h.on(v.START_PROCESS, lambda r: procs.start(r.vm_id, r))
        h.on_stream(v.START_ATTACHED, lambda r: procs.start_attached(r.vm_id, r))
        h.on(v.LIST_PROCESSES, list_processes)
        h.on(v.GET_PROCESS, lambda r: procs.get(r.vm_id, r.pid))
        h.on(v.DELETE_PROCESS, lambda r: procs.delete(r.vm_id, r.pid))
        h.on(v.READ_OUTPUT, lambda r: procs.read(r.vm_id, r.pid, r.start, r.max_bytes, r.wait_ms))
        h.on_stream(v.ATTACH_PROCESS, lambda r: procs.attach(r.vm_id, r.pid, r.start))
        h.on(v.WRITE_STDIN, lambda r: procs.write_stdin(r.vm_id, r.pid, r.data, r.eof))
        h.on(v.SIGNAL_PROCESS, signal)
        h.on(v.RESIZE_PROCESS, resize)
        h.on(v.WAIT_PROCESS, lambda r: procs.wait(r.vm_id, r.pid, r.timeout_ms))
        h.on_stream(v.RUN_CODE, lambda r: code.run(r.vm_id, r))
        h.on(v.CREATE_CONTEXT, lambda r: code.create_context(r.vm_id, r))
        h.on(v.LIST_CONTEXTS, list_contexts)
        h.on(v.DELETE_CONTEXT, delete_context)
        h.on(v.INTERRUPT_CONTEXT, interrupt_context)
        h.on(v.RESTART_CONTEXT, restart_context)
