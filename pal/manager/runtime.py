"""The runtime manager: owns the VMs of one host.

Spawn (cold boot, warm template, or restore), stop, snapshot, exec and file proxying, and
the node heartbeat. It knows VM ids, images and snapshots, never tenants' quotas or
lifecycle states: those are the scheduler's. Every method follows the contract documented
in ``pal/manager/api.py``.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import logging
import os
import secrets
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pal import failpoints
from pal.config import Settings
from pal.errors import (
    BackendError,
    Conflict,
    InsufficientStorage,
    InvalidRequest,
    NotFound,
    PalError,
    Unavailable,
)
from pal.guest import protocol as p
from pal.ids import is_safe_id, validate_id
from pal.images.builder import is_current
from pal.images.paths import ImagePaths, image_for_restore, list_images, load_image
from pal.manager import admission, guest_clock
from pal.manager import guest_input as gi
from pal.manager.channel import GuestError, HarnessChannel
from pal.manager.guest_errors import to_pal_error
from pal.manager.live import LiveControl, LivePause
from pal.manager.metrics import MetricsBook, RawReading
from pal.manager.models import (
    BrokeredSet,
    EgressEvents,
    EgressSet,
    EgressSetResult,
    ExecEvent,
    FileDeleted,
    FileList,
    FileWritten,
    ImageInfo,
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
from pal.manager.notices import NoticeBoard
from pal.manager.parked import ParkedVm, Parking
from pal.manager.ports import GuestConnection, PortRoutes
from pal.manager.templates import TemplateCache
from pal.manager.vmnet import Brokered, VmNetworking, limits_json, read_names, wait_rule
from pal.manager.waits import WaitWatcher
from pal.network.netns import VmNetns
from pal.sizes import size_name
from pal.snapshots.layout import SnapshotRef
from pal.snapshots.store import SnapshotStore
from pal.spec import Egress, ExecRequest, WaitPause, egress_from_json, egress_to_json
from pal.vmm import cgroups, disks, offload, usage
from pal.vmm.accel import AccelInfo
from pal.vmm.handoff import qemu_opt
from pal.vmm.jail import Jail, real_uid
from pal.vmm.qemu import QemuVm, VmSpec

log = logging.getLogger(__name__)

COLD_BOOT_TIMEOUT_S = 120.0  # TCG boots take seconds; a loaded CI machine more
PARKED_PREFETCH_WAIT_S = 2.0  # a parked resume waits this long at most for the working set
# What the host keeps for itself when PAL_NODE_MEMORY_MIB is not set.
HOST_RESERVE_MIB = 1024
# Below this much free space in the data dir the node reports itself unhealthy.
MIN_DISK_FREE_MIB = admission.MIN_FREE_MIB
# Snapshot byte counts walk the snapshot dir (and list S3): done at most this often.
STATS_MAX_AGE_S = 30.0


def _set_event() -> asyncio.Event:
    ev = asyncio.Event()
    ev.set()
    return ev


@dataclass
class LiveVm:
    vm_id: str
    tenant_id: str
    qemu: QemuVm
    channel: HarnessChannel
    image: ImagePaths
    incarnation: int
    token: str
    env: dict[str, str]
    memory_mib: int
    vcpus: int
    disk_mib: int
    mem_snapshot_id: str | None = None  # snapshot whose mem is mapped privately (forks)
    mem_ref: SnapshotRef | None = None
    egress: Egress = "none"
    net_limits: dict[str, Any] = field(default_factory=dict)
    mac: str = ""
    brokered: Brokered = field(default_factory=Brokered)
    # Host-side activity: known at once, unlike the guest's 5 s heartbeat.
    active_execs: int = 0
    last_activity_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    last_output_mono: float = 0.0  # host monotonic time of the latest exec output
    net_bytes: tuple[int, int] | None = None  # the gateway's (in, out) counters at the last sample
    files_in_flight: int = 0  # file requests sent to the guest, not answered yet
    files_idle: asyncio.Event = field(default_factory=_set_event)
    op_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Live pause (live.py): the current one, if any, and the VM's wait management rule.
    live: LivePause | None = None
    wait: WaitPause | None = None
    live_paused_ms_total: int = 0  # finished live pauses of this incarnation
    sampled_paused_ms: int = 0  # what the metrics sampler counted so far
    resumed_at: float = 0.0  # host monotonic time of the latest live resume
    parked_snapshot: str | None = None  # parked (parked.py) after this snapshot

    def paused_ms(self) -> int:
        """Live-paused time of this incarnation, the current pause included."""
        now = int((time.time() - self.live.since) * 1000) if self.live is not None else 0
        return self.live_paused_ms_total + max(0, now)


class NodeRuntime:
    def __init__(self, settings: Settings, store: SnapshotStore, accel: AccelInfo) -> None:
        self.settings = settings
        self.store = store
        self.accel = accel
        self.node_id = settings.node_name or os.uname().nodename
        self.epoch = uuid.uuid4().hex  # this process's incarnation of the node
        self.url = ""  # where the control plane reaches this node (set by `pal node`)
        self.vms: dict[str, LiveVm] = {}
        self._spawning: set[str] = set()
        self.jail = Jail()  # each QEMU's uid, and groups for RAM files forks share
        # snapshot id -> fork children mapping (or about to map) its fork memory file
        self._fork_mem_users: dict[str, int] = {}
        self.templates: TemplateCache | None = None  # set by the server (PAL_TEMPLATES=0: none)
        self.metrics = MetricsBook(interval_s=settings.metrics_interval_s)
        self.net = VmNetworking(settings)
        self.ports = PortRoutes()
        self.net.gateway.on_restart = self._gateway_restarted
        # Per-VM network byte counters (rx, tx) for the metrics samples: the gateway's,
        # refreshed before each sampling round.
        self.net_counters: Callable[[str], tuple[int, int] | None] | None = self.net.cached_bytes
        self._stats_cache: tuple[float, int, int | None] | None = None  # (monotonic, local, s3)
        self._stats_lock = asyncio.Lock()
        self.notices_board = NoticeBoard()
        self.live = LiveControl(self)
        self.parking = Parking(self, settings.parked_max, settings.parked_secs)
        self.waits = WaitWatcher(self)

    # ------------------------------------------------------------------ helpers
    def _vm_dir(self, vm_id: str) -> Path:
        # Every path the manager makes from a caller's vm id goes through here.
        return self.settings.vms_dir / validate_id(vm_id, "vm_id")

    def _live(self, vm_id: str) -> LiveVm:
        lv = self.vms.get(vm_id)
        if lv is None or lv.qemu.exited.is_set():
            raise Conflict(f"VM {vm_id} is not running on this node")
        return lv

    def _running(self, vm_id: str) -> LiveVm:
        """A live VM whose vCPUs run: exec and file requests need its guest to answer."""
        lv = self._live(vm_id)
        self.live.require_running(lv)
        return lv

    def _identity(
        self, vm_id: str, incarnation: int, token: str, env: dict[str, str], mac: str = "", ca: str = ""
    ) -> p.Message:
        return {
            "ca_pem": ca,
            "mac": mac,
            "k": p.K_IDENTIFY,
            "vm_id": vm_id,
            "incarnation": incarnation,
            "token": token,
            "now_ns": time.time_ns(),
            "seed": secrets.token_hex(64),
            "env": env,
            "hb_interval": self.settings.heartbeat_interval_s,
        }

    def _write_config_drive(self, vm_dir: Path, req: SpawnRequest) -> Path:
        cfg = {
            "vm_id": req.vm_id,
            "incarnation": req.incarnation,
            "token": req.token,
            "env": req.env,
            "hb_interval": self.settings.heartbeat_interval_s,
        }
        path = vm_dir / "config.img"
        path.write_bytes(p.encode_config(cfg))
        return path

    def _vm_spec(
        self,
        req: SpawnRequest,
        image: ImagePaths,
        vm_dir: Path,
        disk: Path,
        fmt: str,
        net_fd: int,
        groups: tuple[int, ...] = (),
    ) -> VmSpec:
        return VmSpec(
            run_as=self.jail.identity(req.vm_id),
            groups=groups,
            cgroup_limits=self.settings.cgroups,
            seccomp=self.settings.seccomp,
            vm_id=req.vm_id,
            vm_dir=vm_dir,
            image=image,
            vcpus=req.vcpus,
            memory_mib=req.memory_mib,
            disk_path=disk,
            disk_format=fmt,
            config_drive=vm_dir / "config.img",
            accel=self.accel.name,
            net_fd=net_fd,
        )

    # ------------------------------------------------------------------ spawn
    async def spawn(self, req: SpawnRequest) -> SpawnResult:
        if req.vm_id in self.vms or req.vm_id in self._spawning:
            raise Conflict(f"VM {req.vm_id} is already live on this node")
        # Before any work: its RAM file and disk must fit (a full disk SIGBUSes a guest).
        what = f"VM {req.vm_id} ({req.memory_mib} MiB RAM)"
        await self._admit_memory(req.memory_mib, what)
        if req.restore is not None and req.restore.mem_mode == "shared":
            parked = self.parking.take(req.vm_id, req.restore.snapshot_id)
            if parked is not None:
                try:
                    return await self._unpark(parked, req)
                except Exception as exc:
                    # Its snapshot is intact: restore it into a new QEMU as if never parked.
                    log.warning("VM %s: parked QEMU could not continue (%s); restoring", req.vm_id, exc)
                    await self.parking.park_failed(parked)
        # A parked process of another snapshot of this VM (or too old) is in the way.
        await self.parking.discard(req.vm_id)
        await asyncio.to_thread(admission.check_disk, self.settings.data_dir, req.memory_mib, what)
        self._spawning.add(req.vm_id)
        t0 = time.perf_counter()
        vm_dir = self._vm_dir(req.vm_id)
        qemu: QemuVm | None = None
        channel: HarnessChannel | None = None
        vnet: VmNetns | None = None
        registered = False
        mem_ref: SnapshotRef | None = None
        limits = limits_json(req.egress_mbps, req.max_connections)
        brokered = _brokered_of(req)
        # The template restored from stays (not pruned) until this spawn is done with it.
        pinned = contextlib.ExitStack()
        try:
            snap_dir: Path | None = None
            if req.restore is not None:
                r = req.restore
                ref = SnapshotRef(r.agent_version_id, r.source_vm_id, r.snapshot_id, r.tenant_id)
                snap_dir = await asyncio.to_thread(self.store.open_for_restore, ref)
                # The snapshot's own kernel/initrd and root fs: not the image's current ones.
                boot_id = (await asyncio.to_thread(self.store.read_meta, ref)).get("boot")
                image = image_for_restore(self.settings, req.image, boot_id)
            else:
                image = load_image(self.settings, req.image)
            if vm_dir.exists():
                shutil.rmtree(vm_dir)
            vm_dir.mkdir(parents=True)
            self._write_config_drive(vm_dir, req)
            method: str
            template = None
            if req.restore is None and req.boot != "cold" and self.templates is not None:
                template = pinned.enter_context(
                    self.templates.use(image, req.memory_mib, req.vcpus, req.disk_mib)
                )
                if template is None:
                    # This one boots cold; the next VM of this size restores warm (when
                    # its size is one of PAL_TEMPLATE_SIZES).
                    self.templates.ensure_in_background(self, image, req.memory_mib, req.vcpus, req.disk_mib)
            if req.restore is not None and snap_dir is not None:
                r = req.restore
                ref = SnapshotRef(r.agent_version_id, r.source_vm_id, r.snapshot_id, r.tenant_id)
                disk_src = snap_dir / "rootfs"
                method = "restore"
            elif template is not None:
                disk_src = template / "rootfs"
                method = "template"
            else:
                disk_src = image.rootfs
                method = "cold"
            # The VM's network namespace is made while its disk is cloned.
            got_disk, got_net = await asyncio.gather(
                self._disk_from(disk_src, image, vm_dir, req.disk_mib),
                self.net.create(req.vm_id),
                return_exceptions=True,
            )
            if not isinstance(got_net, BaseException):
                vnet = got_net
            for got in (got_disk, got_net):
                if isinstance(got, BaseException):
                    raise got
            assert not isinstance(got_disk, BaseException) and vnet is not None
            disk, fmt = got_disk
            await self.net.register(
                req.vm_id,
                (vnet.listener.fileno(), vnet.dns.fileno()),
                req.egress,
                limits,
                read_names(snap_dir),
                brokered,
                wait=wait_rule(req.wait_pause),
            )
            registered = True
            groups: tuple[int, ...] = ()
            fork_mem: Path | None = None
            if req.restore is not None and req.restore.mem_mode == "private":
                assert snap_dir is not None
                if (snap_dir / "mem").exists():
                    mem_ref = ref
                    self._fork_mem_users[ref.snapshot_id] = self._fork_mem_users.get(ref.snapshot_id, 0) + 1
                    fork_mem = await asyncio.to_thread(self.store.fork_mem, ref)
                    # Mapped copy-on-write by this VM and its siblings: their group's alone.
                    groups = self.jail.share(fork_mem, req.vm_id)
            spec = self._vm_spec(req, image, vm_dir, disk, fmt, vnet.tap_fd, groups)
            t_prep = time.perf_counter()
            if req.restore is not None:
                assert snap_dir is not None
                qemu = await QemuVm.restore(spec, snap_dir, req.restore.mem_mode, fork_mem)
            elif template is not None:
                qemu = await QemuVm.restore(spec, template, "shared")
            else:
                qemu = await QemuVm.boot(spec)
            failpoints.hit("manager:booted")  # QEMU runs; no state.json to adopt it by yet
            vnet.close_fds()  # QEMU holds the tap, the gateway its sockets
            t_vmm = time.perf_counter()
            channel = HarnessChannel(qemu.agent_socket, req.vm_id)
            await channel.connect()
            timeout = (
                COLD_BOOT_TIMEOUT_S if method == "cold" else self.settings.harness_ready_timeout_ms / 1000
            )
            mac = self.net.new_mac()
            ca = req.tenant_ca.cert if req.tenant_ca and req.brokered else ""
            guest_steps = await self._identify(
                channel,
                req.vm_id,
                req.incarnation,
                req.token,
                req.env,
                timeout,
                qemu,
                mac,
                ca,
            )
            lv = LiveVm(
                vm_id=req.vm_id,
                tenant_id=req.tenant_id,
                qemu=qemu,
                channel=channel,
                image=image,
                incarnation=req.incarnation,
                token=req.token,
                env=dict(req.env),
                memory_mib=req.memory_mib,
                vcpus=req.vcpus,
                disk_mib=req.disk_mib,
                mem_snapshot_id=mem_ref.snapshot_id if mem_ref else None,
                mem_ref=mem_ref,
                egress=req.egress,
                net_limits=limits,
                mac=mac,
                brokered=brokered,
                wait=req.wait_pause,
            )
            self.vms[req.vm_id] = lv
            self._write_state(lv)
            t_end = time.perf_counter()
            boot_ms = (t_end - t0) * 1000
            # Where the time went, step by step (docs/lifecycle.md, "The restore path").
            timings = {
                "prepare_ms": round((t_prep - t0) * 1000, 1),
                **{f"qemu_{k}_ms": round(v, 1) for k, v in qemu.timings_ms.items()},
                "identify_ms": round((t_end - t_vmm) * 1000, 1),
                **{f"identify_{k}": v for k, v in guest_steps.items()},
            }
            log.info("VM %s up by %s in %.0f ms (pid %s): %s", req.vm_id, method, boot_ms, qemu.pid, timings)
            return SpawnResult(
                vm_id=req.vm_id,
                pid=qemu.pid or 0,
                incarnation=req.incarnation,
                boot_ms=boot_ms,
                method=method,  # type: ignore[arg-type]
                # A restored VM is what its snapshot was, whatever the image is now.
                agent_version_id=req.restore.agent_version_id if req.restore else image.agent_version_id,
                mem_snapshot_id=lv.mem_snapshot_id,
                timings=timings,
            )
        except BaseException as exc:
            if channel is not None:
                await channel.close()
            if qemu is not None:
                tail = qemu.log_tail()
                await qemu.kill()
                if isinstance(exc, PalError) and tail and not isinstance(exc, NotFound):
                    log.warning("VM %s failed to start: %s\n%s", req.vm_id, exc, tail)
            if vnet is not None:
                vnet.close_fds()
                if registered:
                    await self.net.release(req.vm_id)
                else:
                    await asyncio.to_thread(_quiet_delete_netns, vnet.name)
            with contextlib.suppress(OSError):
                shutil.rmtree(vm_dir)
            self.jail.release(req.vm_id)
            if mem_ref is not None:
                await self._unmap_fork_mem(mem_ref.snapshot_id)
            raise
        finally:
            pinned.close()
            self._spawning.discard(req.vm_id)

    async def _identify(
        self,
        channel: HarnessChannel,
        vm_id: str,
        incarnation: int,
        token: str,
        env: dict[str, str],
        timeout: float,
        qemu: QemuVm,
        mac: str = "",
        ca: str = "",
    ) -> dict[str, Any]:
        """Give the guest its identity (clock, RNG seed, token, MAC, the tenant CA to trust
        when it has brokered secrets) and wait for it to say so. Returns the timing of the
        steps: the guest's own (µs) and, from the host, ``first_line_ms`` (the guest's first
        word since the request) and ``reply_ms`` (its answer).

        The answer names the VM and incarnation it took, so no heartbeat is awaited on top
        (it follows the answer; waiting for it cost a cold heartbeat path per restore)."""
        ident = self._identity(vm_id, incarnation, token, env, mac, ca)
        t0 = time.monotonic()
        channel.first_line_at = 0.0  # a parked guest's channel heard it long ago
        waiter = asyncio.create_task(channel.request(ident, timeout=timeout))
        died = asyncio.create_task(qemu.exited.wait())
        try:
            done, _ = await asyncio.wait({waiter, died}, return_when=asyncio.FIRST_COMPLETED)
            if died in done and waiter not in done:
                raise BackendError(f"VM {vm_id}: QEMU exited while booting")
            reply, _ = waiter.result()
            t_reply, received_ns = time.monotonic(), time.time_ns()
            result = reply.get("result") or {}
            if result.get("vm_id") != vm_id or result.get("incarnation") != incarnation:
                raise BackendError(
                    f"VM {vm_id}: the guest answered identify as {gi.text(str(result.get('vm_id')))} "
                    f"incarnation {gi.text(str(result.get('incarnation')))}"
                )
            channel.heard()
            lag = await guest_clock.correct(channel, result, received_ns)
            steps = result.get("steps_us")
            out: dict[str, Any] = {
                f"guest_{k}_us": v
                for k, v in (steps.items() if isinstance(steps, dict) else ())
                if isinstance(v, int) and not isinstance(v, bool)
            }
            if channel.first_line_at:
                out["first_line_ms"] = round((channel.first_line_at - t0) * 1000, 1)
            out["reply_ms"] = round((t_reply - t0) * 1000, 1)
            out["clock_lag_ms"] = round(lag / 1e6, 1)
            return out
        finally:
            for t in (waiter, died):
                t.cancel()
            await asyncio.gather(waiter, died, return_exceptions=True)

    async def _disk_from(self, src: Path, image: ImagePaths, vm_dir: Path, disk_mib: int) -> tuple[Path, str]:
        """A per-VM writable disk: reflink where possible, qcow2 overlay otherwise."""
        if not src.exists():
            # A legacy snapshot without a captured disk (the spec's behaviour): restore onto
            # the base image, which does not match the snapshot's memory.
            log.warning("snapshot at %s has no rootfs; restoring onto the base image", src.parent)
            src = image.rootfs
        dst = vm_dir / "disk"
        method = await asyncio.to_thread(disks.clone, src, dst, disk_mib * 1024 * 1024)
        return dst, disks.disk_format_for(method)

    def _write_state(self, lv: LiveVm) -> None:
        """Everything needed to re-adopt this VM if the manager process dies (root-only:
        it holds the exec token and the VM's secrets)."""
        state = {
            "vmId": lv.vm_id,
            "tenantId": lv.tenant_id,
            "pid": lv.qemu.pid,
            "incarnation": lv.incarnation,
            "token": lv.token,
            "env": lv.env,
            "image": lv.image.name,
            "boot": lv.image.boot_id,
            "memoryMib": lv.memory_mib,
            "vcpus": lv.vcpus,
            "diskMib": lv.disk_mib,
            "diskFormat": lv.qemu.spec.disk_format,
            "memPath": str(lv.qemu.mem_path),
            "memShare": lv.qemu.mem_share,
            "runAs": list(lv.qemu.spec.run_as) if lv.qemu.spec.run_as else None,
            "memRef": None
            if lv.mem_ref is None
            else [lv.mem_ref.agent_version_id, lv.mem_ref.vm_id, lv.mem_ref.snapshot_id],
            "egress": egress_to_json(lv.egress),
            "netLimits": lv.net_limits,
            "mac": lv.mac,
            # The real values of brokered secrets, sealed: a restarted node gives a restarted
            # gateway the VM's secrets again.
            "brokered": self.net.seal_brokered(lv.vm_id, lv.brokered),
            "wait": None if lv.wait is None else lv.wait.model_dump(by_alias=True),
            "livePause": None if lv.live is None else lv.live.to_json(),
            "livePausedMs": lv.live_paused_ms_total,
            "parked": lv.parked_snapshot,
        }
        path = self._vm_dir(lv.vm_id) / "state.json"
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(state, f)
        os.replace(tmp, path)

    async def adopt_all(self) -> tuple[list[str], list[str]]:
        """At start: take over the QEMUs a previous manager of this data dir left running
        (a crash or restart of the control plane must not kill the sandboxes). A VM that
        cannot be adopted is killed; the scheduler's reconciliation then settles its state.
        """
        adopted: list[str] = []
        killed: list[str] = []
        root = self.settings.vms_dir
        for vm_dir in sorted(root.iterdir()) if root.is_dir() else []:
            try:
                lv = await self._adopt(vm_dir)
            except Exception as exc:
                log.warning("cannot adopt %s: %s", vm_dir.name, exc)
                self.jail.release(vm_dir.name)
                lv = None
            if lv is not None:
                self.vms[lv.vm_id] = lv
                adopted.append(lv.vm_id)
                continue
            if self._kill_leftover(vm_dir):
                killed.append(vm_dir.name)
            if self.settings.cgroups and is_safe_id(vm_dir.name):  # its QEMU is gone: so are its limits
                await asyncio.to_thread(cgroups.remove_leftover, vm_dir.name)
            shutil.rmtree(vm_dir, ignore_errors=True)
        for lv in self.vms.values():
            if lv.mem_snapshot_id:
                self._fork_mem_users[lv.mem_snapshot_id] = self._fork_mem_users.get(lv.mem_snapshot_id, 0) + 1
        pruned = await asyncio.to_thread(self.store.prune_fork_mem, set(self._fork_mem_users))
        if pruned:
            log.info("removed fork memory files no live VM maps: %s", pruned)
        return adopted, killed

    async def start_network(self) -> None:
        """Start (or adopt) the egress gateway and watch its events; call before
        :meth:`adopt_all`."""
        await self.net.gateway.start()
        self.net.gateway.watch(self.waits.on_gateway_event)

    async def settle_network(self) -> None:
        """After adoption: the gateway and the namespaces hold exactly the live VMs; the
        adopted live pauses and waits are watched again (what came meanwhile is posted)."""
        await self.net.sync(set(self.vms) | set(self.parking.vms))
        await self.live.rearm_all()
        await self.waits.start()

    async def _gateway_restarted(self) -> None:
        """The gateway died and was restarted empty: give it every live VM again. The
        connections it held are gone, so a wait-paused guest is woken to see that."""
        for lv in list(self.vms.values()):
            try:
                await self.net.reregister(lv.vm_id, lv.egress, lv.net_limits, lv.brokered, wait_rule(lv.wait))
            except Exception as exc:
                log.error("VM %s lost its network with the gateway: %s", lv.vm_id, exc)
            if lv.live is not None:
                with contextlib.suppress(Exception):
                    await self.net.hold(lv.vm_id)
                if lv.live.by == "wait":
                    self.notices_board.post(lv.vm_id, "wake", reason="gateway restarted")

    async def _adopt(self, vm_dir: Path) -> LiveVm | None:
        st = json.loads((vm_dir / "state.json").read_text())
        if st.get("parked"):
            return None  # a parked process is a cache: its snapshot is on disk
        pid = int(st["pid"])
        run_as = tuple(st["runAs"]) if st.get("runAs") else None
        if st["vmId"] != vm_dir.name or not _is_qemu_of(pid, vm_dir, run_as[0] if run_as else None):
            return None
        image = image_for_restore(self.settings, st["image"], st.get("boot"))
        mem_path, mem_share = Path(st["memPath"]), bool(st["memShare"])
        groups: tuple[int, ...] = ()
        if run_as is not None:
            groups = self.jail.adopt(vm_dir.name, run_as[0], None if mem_share else mem_path)
        spec = VmSpec(
            vm_id=st["vmId"],
            vm_dir=vm_dir,
            image=image,
            vcpus=int(st["vcpus"]),
            memory_mib=int(st["memoryMib"]),
            disk_path=vm_dir / "disk",
            disk_format=st["diskFormat"],
            config_drive=vm_dir / "config.img",
            accel=self.accel.name,
            run_as=run_as,  # type: ignore[arg-type]
            groups=groups,
            cgroup_limits=self.settings.cgroups,
        )
        egress = egress_from_json(st.get("egress", "none"))
        net_limits = dict(st.get("netLimits") or {})
        brokered = self.net.open_brokered(st["vmId"], st.get("brokered"), st.get("tenantCa"))
        ns = self.net.ns_name(spec.vm_id)
        from pal.network import netns

        if not netns.exists(ns):
            raise BackendError(f"VM {spec.vm_id} lost its network namespace {ns}")
        wait = WaitPause.model_validate(st["wait"]) if st.get("wait") else None
        live = LivePause.from_json(st["livePause"]) if st.get("livePause") else None
        if spec.vm_id not in await self.net.registered():
            await self.net.reregister(spec.vm_id, egress, net_limits, brokered, wait_rule(wait))
        if live is not None:  # it holds already, unless the crash came mid-resume
            await self.net.hold(spec.vm_id)
        qemu = await QemuVm.adopt(
            spec,
            pid,
            mem_path=mem_path,
            mem_share=mem_share,
            keep_paused=live is not None,
        )
        channel = HarnessChannel(qemu.agent_socket, spec.vm_id)
        try:
            await channel.connect(timeout=2)
            if live is None:
                # The harness heartbeats as soon as it sees the new connection (a
                # live-paused one when it runs again).
                await channel.wait_heartbeat(int(st["incarnation"]), timeout=5)
        except BaseException:
            await channel.close()
            await qemu.kill()
            raise
        mem_ref = None
        if st.get("memRef"):
            av, src, snap = st["memRef"]
            mem_ref = SnapshotRef(av, src, snap, None)
        log.info("adopted VM %s (QEMU pid %d) left by a previous manager", spec.vm_id, pid)
        return LiveVm(
            vm_id=spec.vm_id,
            tenant_id=st["tenantId"],
            qemu=qemu,
            channel=channel,
            image=image,
            incarnation=int(st["incarnation"]),
            token=st["token"],
            env=dict(st.get("env") or {}),
            memory_mib=spec.memory_mib,
            vcpus=spec.vcpus,
            disk_mib=int(st["diskMib"]),
            mem_snapshot_id=mem_ref.snapshot_id if mem_ref else None,
            mem_ref=mem_ref,
            egress=egress,
            net_limits=net_limits,
            mac=str(st.get("mac") or ""),
            brokered=brokered,
            live=live,
            wait=wait,
            live_paused_ms_total=int(st.get("livePausedMs") or 0),
        )

    @staticmethod
    def _kill_leftover(vm_dir: Path) -> bool:
        with contextlib.suppress(OSError, ValueError):
            pid = int((vm_dir / "qemu.pid").read_text().strip())
            if _is_qemu_of(pid, vm_dir, None):
                os.killpg(pid, 9)
                return True
        return False

    # ------------------------------------------------------------------ stop
    def runs_other_incarnation(self, vm_id: str, incarnation: int) -> bool:
        """A stop order for ``incarnation`` must not stop a newer one (stray cleanup)."""
        lv = self.vms.get(vm_id)
        return lv is not None and lv.incarnation != incarnation

    async def _unmap_fork_mem(self, snapshot_id: str) -> None:
        """One fork child less maps the snapshot's fork memory file; drop it at zero."""
        n = self._fork_mem_users.get(snapshot_id, 0) - 1
        if n > 0:
            self._fork_mem_users[snapshot_id] = n
            return
        self._fork_mem_users.pop(snapshot_id, None)
        try:
            await asyncio.to_thread(self.store.drop_fork_mem, snapshot_id)
        except OSError as exc:
            log.warning("could not remove the fork memory file of %s: %s", snapshot_id, exc)

    async def stop(self, vm_id: str) -> dict[str, Any] | None:
        """Kill the VM and free its files and network; returns its final egress counters."""
        lv = self._forget_live(vm_id)
        if lv is not None:
            await lv.channel.close()
            await lv.qemu.kill()
            if lv.mem_snapshot_id:
                await self._unmap_fork_mem(lv.mem_snapshot_id)
        elif await self.parking.discard(vm_id):
            return None
        return await self.free_vm_files(vm_id)

    def _may_park(self, lv: LiveVm) -> bool:
        """Park the QEMU of a VM just snapshot-paused (parked.py) instead of killing it?
        Only a plain running VM whose RAM is its own shared file (a fork child maps its
        parent's snapshot privately: its dirty pages could not be handed back)."""
        return (
            self.parking.enabled
            and lv.live is None
            and lv.qemu.mem_share
            and lv.mem_snapshot_id is None
            and not lv.qemu.exited.is_set()
        )

    async def _admit_memory(self, need_mib: int, what: str) -> None:
        """507 unless the host has the memory; parked processes go first to make room."""
        try:
            admission.check_memory(need_mib, what)
        except InsufficientStorage:
            if not self.parking.vms:
                raise
            await self.parking.evict(keep=0)
            admission.check_memory(need_mib, what)

    async def _unpark(self, pv: ParkedVm, req: SpawnRequest) -> SpawnResult:
        """Continue a parked QEMU as the resumed VM (parked.py): its RAM and disk are its
        snapshot's. It takes the new incarnation's identity like any restored guest, and
        gets new gateway state (the snapshot's DNS names, no connection)."""
        assert req.restore is not None
        lv = pv.lv
        t0 = time.perf_counter()
        r = req.restore
        ref = SnapshotRef(r.agent_version_id, r.source_vm_id, r.snapshot_id, r.tenant_id)
        if not await asyncio.to_thread(self.store.exists, ref):
            raise NotFound(f"snapshot {r.snapshot_id} not found")
        names = read_names(self.store.path(ref))
        limits = limits_json(req.egress_mbps, req.max_connections)
        brokered = _brokered_of(req)
        await pv.settled()  # an offload still running finishes first
        prefetch = None
        if pv.offloaded:
            prefetch = asyncio.create_task(
                asyncio.to_thread(offload.prefetch, lv.qemu.mem_path, pv.working_set)
            )
        await self.net.reregister(
            req.vm_id, req.egress, limits, brokered, wait_rule(req.wait_pause), names=names, new_guest=True
        )
        t_net = time.perf_counter()
        if prefetch is not None:
            # The working set back first: the guest then takes minor faults only.
            with contextlib.suppress(TimeoutError, Exception):
                await asyncio.wait_for(asyncio.shield(prefetch), PARKED_PREFETCH_WAIT_S)
        t_prefetch = time.perf_counter()
        await lv.qemu.cont()
        t_vmm = time.perf_counter()
        mac = self.net.new_mac()
        ca = req.tenant_ca.cert if req.tenant_ca and req.brokered else ""
        timeout = self.settings.harness_ready_timeout_ms / 1000
        guest_steps = await self._identify(
            lv.channel, req.vm_id, req.incarnation, req.token, req.env, timeout, lv.qemu, mac, ca
        )
        lv.tenant_id, lv.incarnation, lv.token, lv.env = (
            req.tenant_id,
            req.incarnation,
            req.token,
            dict(req.env),
        )
        lv.egress, lv.net_limits, lv.mac, lv.brokered, lv.wait = (
            req.egress,
            limits,
            mac,
            brokered,
            req.wait_pause,
        )
        lv.parked_snapshot = None
        lv.last_activity_ms = int(time.time() * 1000)
        self.vms[req.vm_id] = lv
        self._write_state(lv)
        t_end = time.perf_counter()
        timings = {
            "parked_s": round(time.monotonic() - pv.parked_at, 1),
            "offloaded": 1.0 if pv.offloaded else 0.0,
            "prepare_ms": round((t_net - t0) * 1000, 1),
            "prefetch_ms": round((t_prefetch - t_net) * 1000, 1),
            "qemu_cont_ms": round((t_vmm - t_prefetch) * 1000, 1),
            "identify_ms": round((t_end - t_vmm) * 1000, 1),
            **{f"identify_{k}": v for k, v in guest_steps.items()},
        }
        boot_ms = (t_end - t0) * 1000
        log.info(
            "VM %s up by its parked QEMU in %.0f ms (pid %s): %s", req.vm_id, boot_ms, lv.qemu.pid, timings
        )
        return SpawnResult(
            vm_id=req.vm_id,
            pid=lv.qemu.pid or 0,
            incarnation=req.incarnation,
            boot_ms=boot_ms,
            method="restore",
            agent_version_id=r.agent_version_id,
            mem_snapshot_id=None,
            warm=True,
            timings=timings,
        )

    def _forget_live(self, vm_id: str) -> LiveVm | None:
        """Take the VM out of the live ones (and everything that watches them)."""
        lv = self.vms.pop(vm_id, None)
        self.metrics.stopped(vm_id)
        self.ports.forget(vm_id)
        self.waits.forget(vm_id)
        if lv is not None:
            self.live.forget(lv)
        return lv

    async def free_vm_files(self, vm_id: str) -> dict[str, Any] | None:
        """What a VM held besides its QEMU: gateway state, namespace, uid, files; returns
        its final egress counters."""
        counters = await self.net.release(vm_id)
        self.jail.release(vm_id)
        with contextlib.suppress(OSError):
            shutil.rmtree(self._vm_dir(vm_id))
        return counters

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.stop(v) for v in list(self.vms)), return_exceptions=True)
        await self.parking.discard_all()

    # ------------------------------------------------------------------ snapshot
    async def snapshot(self, vm_id: str, req: SnapshotRequest) -> SnapshotResult:
        lv = self._live(vm_id)
        async with lv.op_lock:
            # Before the guest stops: a snapshot that cannot fit is refused, the VM runs on.
            await asyncio.to_thread(
                admission.check_disk, self.store.root, lv.memory_mib, f"a snapshot of VM {vm_id}"
            )
            ref = SnapshotRef(req.agent_version_id, vm_id, req.snapshot_id, req.tenant_id)
            staging = self.store.staging_dir(req.snapshot_id)
            t0 = time.perf_counter()
            try:
                art = await lv.qemu.capture(staging)  # on failure the guest runs again (or is gone)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                await self._capture_failed(lv, req.keep_running, running=True)
                raise
            try:
                await self.net.save_names(vm_id, staging)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                await self._capture_failed(lv, req.keep_running, running=False)
                raise
            t_capture = time.perf_counter()
            failpoints.hit("manager:captured")
            if req.keep_running and lv.live is None:
                # The capture is independent reflinked files: the guest may run on while
                # they are checksummed and committed. (A live-paused source stays paused.)
                await lv.qemu.cont()
            meta: dict[str, Any] = {
                "tenantId": req.tenant_id,
                "vmId": vm_id,
                "agentVersionId": req.agent_version_id,
                "parentSnapshotId": req.parent_snapshot_id or lv.mem_snapshot_id,
                "image": lv.image.name,
                "boot": lv.image.boot_id,
                "memoryMib": lv.memory_mib,
                "vcpus": lv.vcpus,
                "diskMib": lv.disk_mib,
                "memoryKind": art.memory_kind,
                "qemuVersion": art.meta.get("qemuVersion"),
                "kernelVersion": lv.image.meta.get("kernelVersion"),
                "accel": self.accel.name,
            }
            try:
                path = await asyncio.to_thread(self.store.commit, staging, ref, meta)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                if not req.keep_running:
                    await self._capture_failed(lv, False, running=False)
                raise
            t_commit = time.perf_counter()
            failpoints.hit("manager:committed")
            counters = None
            if not req.keep_running:
                if self._may_park(lv):
                    self._forget_live(vm_id)
                    lv.parked_snapshot = req.snapshot_id
                    self._write_state(lv)  # a restarted manager discards it, never adopts it
                    counters = await self.parking.park(lv, req.snapshot_id)
                else:
                    counters = await self.stop(vm_id)
            t_end = time.perf_counter()
            # Retention after every write; the snapshot just made is always kept.
            keep = set(req.protected) | self._mapped_snapshots() | {req.snapshot_id}
            try:
                await asyncio.to_thread(self.store.apply_retention, req.agent_version_id, vm_id, keep)
            except Exception:
                log.exception("retention after snapshot %s failed; it runs again next time", req.snapshot_id)
            durations = dict(art.durations_ms)
            durations.update(
                capture=(t_capture - t0) * 1000,
                commit=(t_commit - t_capture) * 1000,
                stop=(t_end - t_commit) * 1000,
                total=(t_end - t0) * 1000,
            )
            log.info(
                "snapshot %s of %s: %s",
                req.snapshot_id,
                vm_id,
                {k: round(v, 1) for k, v in durations.items()},
            )
            return SnapshotResult(
                snapshot_id=req.snapshot_id,
                path=str(path),
                sizes=art.sizes,
                durations_ms=durations,
                memory_kind="stream" if art.memory_kind == "stream" else "file",
                egress_counters=counters,
            )

    async def _capture_failed(self, lv: LiveVm, keep_running: bool, *, running: bool) -> None:
        """A snapshot failed (``running``: QEMU already continued the guest). The VM is
        left as it was before: running, or live-paused for a fork of a live-paused source;
        a pause's live-paused VM runs again (the scheduler rolls it back to running)."""
        if lv.qemu.exited.is_set():
            return
        with contextlib.suppress(Exception):
            if lv.live is None:
                if not running:
                    await lv.qemu.cont()
            elif keep_running:
                if running:
                    await lv.qemu.pause()
            else:
                await self.live.end_after_capture(lv, running=running)

    def _mapped_snapshots(self) -> set[str]:
        return {lv.mem_snapshot_id for lv in self.vms.values() if lv.mem_snapshot_id}

    async def snapshot_status(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> SnapshotStatus:
        ref = SnapshotRef(agent_version_id, vm_id, snapshot_id, "")
        ok = await asyncio.to_thread(self.store.verify, ref)
        meta = await asyncio.to_thread(self.store.read_meta, ref) if ok else None
        return SnapshotStatus(complete=ok, meta=meta)

    async def ensure_uploaded(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> None:
        await asyncio.to_thread(self.store.ensure_uploaded, SnapshotRef(agent_version_id, vm_id, snapshot_id))

    async def delete_snapshot(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> None:
        # A VM whose snapshot goes (deleted, or resumed elsewhere and cleaned up) will
        # never continue its parked process here.
        await self.parking.discard(vm_id)
        if snapshot_id in self._mapped_snapshots():
            raise Conflict(f"snapshot {snapshot_id} is mapped by a live fork")
        await asyncio.to_thread(self.store.delete, SnapshotRef(agent_version_id, vm_id, snapshot_id, ""))

    # ------------------------------------------------------------------ exec and files
    async def exec_stream(self, vm_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        lv = self._running(vm_id)
        msg: p.Message = {
            "k": p.K_EXEC,
            "tok": lv.token,
            "argv": [req.command, *req.argv],
            "env": req.env,
            "cwd": req.cwd,
            "timeout": req.timeout_secs,
            "user": req.user,
        }
        # Sent under the VM's operation lock: a live pause comes either before (and this
        # answers 409 LIVE_PAUSED, which the scheduler turns into a wake) or after the
        # request is in the guest's channel (and its probe, behind it, sees the exec).
        async with lv.op_lock:
            self.live.require_running(lv)
            lv.active_execs += 1
            lv.last_activity_ms = int(time.time() * 1000)
            try:
                replies = await lv.channel.start_stream(msg)
            except BaseException:
                lv.active_execs -= 1
                raise
        try:
            async for ev in self._exec_events(lv, replies):
                yield ev
        finally:
            await replies.aclose()
            lv.active_execs -= 1
            lv.last_activity_ms = int(time.time() * 1000)

    async def _exec_events(self, lv: LiveVm, replies: AsyncIterator[p.Message]) -> AsyncIterator[ExecEvent]:
        decoders = {
            1: codecs.getincrementaldecoder("utf-8")("replace"),
            2: codecs.getincrementaldecoder("utf-8")("replace"),
        }
        async for reply in replies:
            kind = reply["k"]
            if kind == p.K_OUT:
                lv.last_output_mono = time.monotonic()  # an exec producing output: not waiting
                fd = gi.out_fd(reply)
                data = gi.payload(reply)
                if data is None:
                    continue  # not base64: noise from a misbehaving guest
                text = decoders[fd].decode(data)
                if text:
                    yield ExecEvent(type="stdout" if fd == 1 else "stderr", data=text)
            elif kind == p.K_EXIT:
                for fd, dec in decoders.items():
                    rest = dec.decode(b"", final=True)
                    if rest:
                        yield ExecEvent(type="stdout" if fd == 1 else "stderr", data=rest)
                yield ExecEvent(type="exit", exit_code=gi.exit_code(reply))
            elif kind == p.K_ERR:
                code, message = gi.error(reply)
                yield ExecEvent(type="error", code=code, message=message)

    async def _file_request(
        self, vm_id: str, msg: p.Message, data: bytes | None = None
    ) -> tuple[p.Message, bytes]:
        lv = self._running(vm_id)
        async with lv.op_lock:  # ordered with live pauses, like exec
            self.live.require_running(lv)
            lv.files_in_flight += 1
            lv.files_idle.clear()
        lv.last_activity_ms = int(time.time() * 1000)
        try:
            return await lv.channel.request({**msg, "tok": lv.token}, data)
        except GuestError as exc:
            raise to_pal_error(exc.guest_code, exc.message, "file") from None
        finally:
            lv.files_in_flight -= 1
            if lv.files_in_flight == 0:
                lv.files_idle.set()

    @staticmethod
    def _bad_reply(vm_id: str, kind: str, exc: gi.BadReply) -> PalError:
        log.warning("VM %s: invalid %s reply from the guest: %s", vm_id, kind, exc)
        return Unavailable(f"VM {vm_id}: the guest sent an invalid reply to {kind}", code="GUEST_ERROR")

    async def list_files(self, vm_id: str, path: str) -> FileList:
        reply, _ = await self._file_request(vm_id, {"k": p.K_LS, "path": path})
        try:
            return FileList.model_validate(gi.file_list(reply))
        except gi.BadReply as exc:
            raise self._bad_reply(vm_id, "ls", exc) from None

    async def read_file(self, vm_id: str, path: str) -> tuple[bytes, bool]:
        reply, data = await self._file_request(
            vm_id, {"k": p.K_READ, "path": path, "limit": p.MAX_FILE_BYTES}
        )
        try:
            return gi.file_read(reply, data)
        except gi.BadReply as exc:
            raise self._bad_reply(vm_id, "read", exc) from None

    async def write_file(self, vm_id: str, path: str, data: bytes) -> FileWritten:
        reply, _ = await self._file_request(vm_id, {"k": p.K_WRITE, "path": path}, data)
        try:
            return FileWritten.model_validate(gi.file_written(reply, len(data)))
        except gi.BadReply as exc:
            raise self._bad_reply(vm_id, "write", exc) from None

    async def delete_file(self, vm_id: str, path: str) -> FileDeleted:
        reply, _ = await self._file_request(vm_id, {"k": p.K_RM, "path": path})
        return FileDeleted.model_validate(reply["result"])

    # ------------------------------------------------------------------ ports
    async def open_port(self, vm_id: str, port: int) -> GuestConnection:
        """A byte stream to the server listening on ``port`` in the guest (0.0.0.0 or
        127.0.0.1). Prerequisites: the VM is live here (else 409). Failure: 400 for a port
        outside 1-65535, 502 when nothing listens there or the guest does not answer, 409
        LIVE_PAUSED while its vCPUs are stopped (the scheduler wakes it and asks again)."""
        self._running(vm_id)
        conn = await self.ports.open(vm_id, self.net.ns_name(vm_id), port)
        self.port_traffic(vm_id)
        return conn

    def port_traffic(self, vm_id: str) -> None:
        """Bytes moved on one of the VM's ports: host-observed activity (idle suspend). Bytes
        for a wait-paused guest (a stream opened before the pause) wake it: a port request
        is a wake event (docs/live-pause.md)."""
        lv = self.vms.get(vm_id)
        if lv is not None:
            lv.last_activity_ms = int(time.time() * 1000)
            if lv.live is not None and lv.live.by == "wait" and not lv.live.port_woken:
                lv.live.port_woken = True
                self.notices_board.post(vm_id, "wake", reason="port traffic")

    # ------------------------------------------------------------------ metrics
    async def run_sampler(self) -> None:
        """Sample every live VM each ``metrics_interval_s`` until cancelled."""
        interval = self.metrics.interval_s
        next_at = time.monotonic()
        while True:
            try:
                await self.sample_once()
            except Exception:
                log.exception("metrics sampling failed")
            next_at += interval
            # On a loaded host a late tick is not made up twice: sample at the next slot.
            next_at = max(next_at, time.monotonic())
            await asyncio.sleep(next_at - time.monotonic())

    async def sample_once(self) -> None:
        live = [lv for lv in list(self.vms.values()) if not lv.qemu.exited.is_set()]
        await self.net.refresh_counters()
        self.stamp_network_activity(live)
        for vm_id, lv in list(self.vms.items()):
            if lv.qemu.exited.is_set():
                self.metrics.stopped(vm_id)
        hb_max_age = 3 * max(self.settings.heartbeat_interval_s, self.metrics.interval_s)

        def net(vm_id: str) -> tuple[int, int] | None:
            if self.net_counters is None:
                return None
            try:
                return self.net_counters(vm_id)
            except Exception:
                return None

        readings = await asyncio.to_thread(
            lambda: [_Sampling.read(lv, hb_max_age, net(lv.vm_id)) for lv in live]
        )
        for lv, reading in zip(live, readings, strict=True):
            if self.vms.get(lv.vm_id) is lv:  # not stopped while we read
                source = "cgroup" if lv.qemu.cgroup is not None else "proc"
                self.metrics.record(
                    lv.vm_id, reading, process_key=(lv.qemu.pid, id(lv.qemu)), cpu_source=source
                )
        self.metrics.expire()

    def stamp_network_activity(self, live: list[LiveVm]) -> None:
        """Bytes the egress gateway moved for a running guest since the last sample are
        activity the host saw (scheduler/idle.py), like an exec: a guest busy on the
        network is not idle, whatever its heartbeat says. A live-paused guest moves none
        itself (the gateway may hold bytes for it: waits.py decides about those)."""
        now_ms = int(time.time() * 1000)
        for lv in live:
            try:
                moved = self.net_counters(lv.vm_id) if self.net_counters is not None else None
            except Exception:
                moved = None
            if moved is None:
                continue
            if lv.net_bytes is not None and moved != lv.net_bytes and lv.live is None:
                lv.last_activity_ms = max(lv.last_activity_ms, now_ms)
            lv.net_bytes = moved

    def vm_metrics(self, vm_id: str) -> VmMetrics:
        """The VM's last samples (an empty series when this node never ran it)."""
        lv = self.vms.get(vm_id)
        return self.metrics.series(vm_id, live=lv is not None and not lv.qemu.exited.is_set())

    async def stats(self) -> NodeStats:
        """Operator figures; snapshot byte counts are at most STATS_MAX_AGE_S old."""
        async with self._stats_lock:
            now = time.monotonic()
            if self._stats_cache is None or now - self._stats_cache[0] > STATS_MAX_AGE_S:
                local = await asyncio.to_thread(self.store.local_bytes)
                s3: int | None = None
                try:
                    s3 = await asyncio.to_thread(self.store.s3_bytes)
                except PalError as exc:
                    log.warning("S3 snapshot bytes unknown: %s", exc)
                    s3 = self._stats_cache[2] if self._stats_cache else None
                self._stats_cache = (time.monotonic(), local, s3)
            at, local, s3 = self._stats_cache
        return NodeStats(
            node_id=self.node_id,
            accel=self.accel.name,
            vms_live=sum(1 for lv in self.vms.values() if not lv.qemu.exited.is_set()),
            snapshot_bytes_local=local,
            snapshot_bytes_s3=s3,
            s3_queue_depth=self.store.s3_queue_depth(),
            seal_queue_depth=self.store.pending_seals(),
            stats_age_secs=round(time.monotonic() - at, 3),
        )

    async def list_snapshots(self, agent_version_id: str, vm_id: str) -> list[SnapshotInfo]:
        """The VM's complete local snapshots, oldest first, with their artifact sizes."""

        def read() -> list[tuple[dict[str, Any], int]]:
            metas = self.store.list_vm(agent_version_id, vm_id)
            return [
                (m, self.store.stored_bytes(SnapshotRef(agent_version_id, vm_id, str(m.get("snapshotId")))))
                for m in metas
            ]

        out = []
        for m, stored in await asyncio.to_thread(read):
            raw = m.get("sizes")
            sizes: dict[str, Any] = raw if isinstance(raw, dict) else {}
            out.append(
                SnapshotInfo(
                    snapshot_id=str(m.get("snapshotId")),
                    created_at=m.get("createdAt"),
                    sizes={str(k): int(v) for k, v in sizes.items() if isinstance(v, int)},
                    sealed=bool(m.get("sealed")),
                    memory_kind=m.get("memoryKind"),
                    parent_snapshot_id=m.get("parentSnapshotId"),
                    stored_bytes=stored,
                )
            )
        return out

    async def delete_vm_snapshots(self, agent_version_id: str, vm_id: str, keep: list[str]) -> list[str]:
        """Delete every snapshot of the VM on both tiers except ``keep`` and those a live
        fork on this node maps. Returns the local ids deleted."""
        keep_all = set(keep) | self._mapped_snapshots()
        return await asyncio.to_thread(self.store.delete_vm, agent_version_id, vm_id, keep_all)

    async def snapshot_owners(self) -> SnapshotOwners:
        return SnapshotOwners(vms=sorted(await asyncio.to_thread(self.store.vms)))

    # ------------------------------------------------------------------ egress
    async def set_egress(self, vm_id: str, req: EgressSet) -> EgressSetResult:
        """Apply a new policy to a live VM: new connections at once, refused open ones reset."""
        lv = self._live(vm_id)
        limits = limits_json(req.egress_mbps, req.max_connections)
        closed = await self.net.set_policy(vm_id, req.egress, limits)
        lv.egress, lv.net_limits = req.egress, limits
        self._write_state(lv)
        return EgressSetResult(closed=closed)

    async def set_brokered(self, vm_id: str, req: BrokeredSet) -> None:
        """New values for a live VM's brokered secrets: the gateway uses them from the next
        request (open connections included); the guest is not touched."""
        lv = self._live(vm_id)
        rules = [r.model_dump(mode="json") for r in req.brokered]
        await self.net.set_brokered(vm_id, rules)
        lv.brokered = Brokered(rules, lv.brokered.ca)
        self._write_state(lv)

    async def egress_counters(self, vm_id: str) -> dict[str, int] | None:
        self._live(vm_id)
        return await self.net.counters(vm_id)

    async def egress_events(self, after: int, epoch: str) -> EgressEvents:
        return EgressEvents.model_validate(await self.net.events(after, epoch))

    # ------------------------------------------------------------------ images
    def _image_info(self, image: ImagePaths) -> ImageInfo:
        m = image.meta
        return ImageInfo(
            name=image.name,
            agent_version_id=image.agent_version_id,
            kind=str(m.get("kind") or "debian"),
            source=m.get("source"),
            source_digest=m.get("sourceDigest"),
            created_at=m.get("builtAt"),
            size_bytes=int(m.get("treeBytes") or 0),
            rootfs_bytes=int(m.get("rootfsAllocatedBytes") or 0),
            tenants=m.get("tenants"),
            config=dict(m.get("config") or {}),
            templates=self.templates.sizes(image.agent_version_id) if self.templates is not None else [],
            current=is_current(m),
        )

    async def images(self) -> list[ImageInfo]:
        """Every complete image of this node (visibility is the scheduler's business)."""
        images = await asyncio.to_thread(list_images, self.settings)
        return [self._image_info(i) for i in images]

    async def warm(self, req: WarmRequest) -> WarmResult:
        """Build the template of ``req.image`` at that size now (``--warm``); returns when
        it is ready (or could not be built). Prerequisite: templates enabled."""
        if self.templates is None:
            raise Unavailable("warm templates are disabled on this node (PAL_TEMPLATES=0)")
        image = await asyncio.to_thread(load_image, self.settings, req.image)
        key = self.templates.key(image, req.memory_mib, req.vcpus, req.disk_mib)
        task = self.templates.ensure_in_background(self, image, req.memory_mib, req.vcpus, req.disk_mib)
        if task is None:
            raise InvalidRequest(
                f"size {size_name(req.memory_mib, req.vcpus, req.disk_mib)} gets no template: "
                "it is not one of PAL_TEMPLATE_SIZES"
            )
        # Shielded: a caller that gives up does not cancel a build other schedules wait for.
        path = await asyncio.shield(task)
        return WarmResult(key=key, ready=path is not None)

    # ------------------------------------------------------------------ heartbeat
    async def heartbeat(self) -> NodeHeartbeat:
        """Each live VM's activity: what the host saw (exec and file requests through this
        manager) apart from what the guest claims (already cleaned by the channel); the
        scheduler decides how much a claim may count (idle.py). The incarnation is the one
        this manager spawned, never the guest's word."""
        out: list[VmActivity] = []
        now_wall, now_mono = time.time(), time.monotonic()
        for lv in list(self.vms.values()):
            hb = lv.channel.heartbeat or {}
            # A live pause silences the guest; its resume counts as hearing from it.
            heard = max(lv.channel.last_heard(), lv.resumed_at)
            out.append(
                VmActivity(
                    vm_id=lv.vm_id,
                    alive=not lv.qemu.exited.is_set(),
                    pid=lv.qemu.pid,
                    incarnation=lv.incarnation,
                    has_active_exec=lv.active_execs > 0,
                    last_activity_unix_ms=lv.last_activity_ms,
                    guest_active=bool(hb.get("active")),
                    guest_last_activity_unix_ms=int(hb.get("last_activity_ms") or 0),
                    last_heartbeat_unix_ms=int((now_wall - (now_mono - heard)) * 1000) if heard else 0,
                    live=LiveControl.state(lv),
                )
            )
        report = await asyncio.to_thread(self._node_report)
        return NodeHeartbeat(node_id=self.node_id, accel=self.accel.name, vms=out, **report)

    def _node_report(self) -> dict[str, Any]:
        """Capacity, warm templates, images and health (file system reads: off the loop)."""
        st = os.statvfs(self.settings.data_dir)
        disk_free_mib = st.f_bavail * st.f_frsize // (1024 * 1024)
        memory = self.settings.node_memory_mib or max(0, _host_memory_mib() - HOST_RESERVE_MIB)
        images = [self._image_info(i) for i in list_images(self.settings)]
        templates = []
        for t in self.templates.warm() if self.templates is not None else []:
            with contextlib.suppress(KeyError, TypeError, ValueError):
                templates.append(
                    WarmTemplate(
                        agent_version_id=str(t["agentVersionId"]),
                        memory_mib=int(t["memoryMib"]),
                        vcpus=int(t["vcpus"]),
                        disk_mib=int(t["diskMib"]),
                    )
                )
        problems = []
        if not images:
            problems.append("no guest image built (pal image build)")
        if disk_free_mib < MIN_DISK_FREE_MIB:
            problems.append(f"data dir has {disk_free_mib} MiB free (< {MIN_DISK_FREE_MIB})")
        return {
            "epoch": self.epoch,
            "url": self.url,
            "region": self.settings.node_region,
            "labels": dict(self.settings.node_labels),
            "capacity": NodeCapacity(
                memory_mib=memory, vcpus=os.cpu_count() or 1, disk_free_mib=disk_free_mib
            ),
            "templates": templates,
            "images": images,
            "healthy": not problems,
            "health": "; ".join(problems) or None,
        }

    # ------------------------------------------------------------------ live pause
    async def live_pause(self, vm_id: str, req: LivePauseRequest) -> LivePauseResult:
        return await self.live.pause(vm_id, req)

    async def live_resume(self, vm_id: str) -> LiveResumeResult:
        return await self.live.resume(vm_id)

    async def live_status(self, vm_id: str) -> LiveState | None:
        return await self.live.status(vm_id)

    async def notices(self, after: int, epoch: str, wait_s: float) -> Notices:
        return await self.notices_board.wait(after, epoch, wait_s)


def _host_memory_mib() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 0


def _brokered_of(req: SpawnRequest) -> Brokered:
    if not req.brokered or req.tenant_ca is None:
        return Brokered()
    return Brokered([r.model_dump(mode="json") for r in req.brokered], req.tenant_ca.model_dump())


def _quiet_delete_netns(name: str) -> None:
    from pal.network import netns

    with contextlib.suppress(OSError):
        netns.delete(name)


def _is_qemu_of(pid: int, vm_dir: Path, uid: int | None) -> bool:
    """Whether ``pid`` is a live QEMU of the VM of ``vm_dir`` (not a reused pid): its
    command line is named after the VM and labels its files with ``vm_dir``, and it runs
    as the VM's uid (when that is known)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    if not args or b"qemu-system" not in args[0]:
        return False
    named = f"pal-{vm_dir.name},".encode()
    labelled = qemu_opt(str(vm_dir) + "/").encode() in b"\0".join(args)
    if not labelled or not any(a.startswith(named) for a in args):
        return False
    return uid is None or real_uid(pid) == uid


# --------------------------------------------------------------------------- metrics


class _Sampling:
    """Readings of the live VMs, taken off the event loop (smaps_rollup walks page tables)."""

    @staticmethod
    def read(lv: LiveVm, hb_max_age_s: float, net: tuple[int, int] | None) -> RawReading:
        pid = lv.qemu.pid
        cpu, _ = usage.cpu_ns(pid, lv.qemu.cgroup) if pid else (None, "")
        mem = usage.process_memory(pid) if pid else None
        hb = lv.channel.heartbeat  # cleaned by the channel (guest_input.heartbeat)
        fresh = hb is not None and time.monotonic() - lv.channel.heartbeat_at <= hb_max_age_s
        paused = lv.paused_ms()
        paused_delta, lv.sampled_paused_ms = max(0, paused - lv.sampled_paused_ms), paused
        return RawReading(
            at=time.time(),
            mono=time.monotonic(),
            cpu_ns=cpu,
            rss_bytes=mem.rss_bytes if mem else None,
            pss_bytes=mem.pss_bytes if mem else None,
            heartbeat=dict(hb) if fresh and hb is not None else None,
            net_rx_bytes=net[0] if net else None,
            net_tx_bytes=net[1] if net else None,
            live_paused_ms=paused_delta,
        )
