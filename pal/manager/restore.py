"""Where a spawned VM comes from: a snapshot (a resume, or a fork: its memory mapped
privately), a warm template, or a cold boot of its image; and the fastest resume of all,
a parked QEMU of the same snapshot continued (parked.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pal.config import Settings
from pal.errors import NotFound
from pal.images.paths import ImagePaths, image_for_restore, load_image
from pal.manager.identify import Identity, identify
from pal.manager.parked import ParkedVm
from pal.manager.spawned import disk_limits, spawn_result
from pal.manager.templates import TemplateCache, TemplateHost
from pal.manager.vm import LiveVm, VmRegistry
from pal.manager.vm_states import VmPhase, check_move
from pal.manager.vmnet import Brokered, VmNetworking, limits_json, read_names, wait_rule
from pal.sizes import size_name
from pal.snapshots.layout import SnapshotRef
from pal.snapshots.store import SnapshotStore
from pal.vmm import offload
from pal.vmm.host_cpu import LoadSampler
from pal.wire.models import SpawnRequest, SpawnResult

log = logging.getLogger(__name__)

PARKED_PREFETCH_WAIT_S = 2.0  # a parked resume waits this long at most for the working set


@dataclass
class BootSource:
    image: ImagePaths
    method: str  # restore | template | cold
    disk_src: Path  # the disk the VM's own is cloned from
    snap_dir: Path | None = None  # restore: the snapshot's files
    ref: SnapshotRef | None = None  # restore: the snapshot
    template: Path | None = None  # template: its files


@dataclass
class RestoreDeps:
    """Exactly what choosing a source and continuing a parked QEMU need."""

    settings: Settings
    store: SnapshotStore
    net: VmNetworking
    registry: VmRegistry
    templates: TemplateCache | None  # None: PAL_TEMPLATES=0
    template_host: TemplateHost  # builds a missing template in the background
    load: LoadSampler  # stretches the identify timeout on a busy host (host_cpu.py)


def snapshot_ref(req: SpawnRequest) -> SnapshotRef:
    r = req.restore
    assert r is not None
    return SnapshotRef(r.agent_version_id, r.source_vm_id, r.snapshot_id, r.tenant_id)


def brokered_of(req: SpawnRequest) -> Brokered:
    if not req.brokered or req.tenant_ca is None:
        return Brokered()
    return Brokered([r.model_dump(mode="json") for r in req.brokered], req.tenant_ca.model_dump())


def identity_of(req: SpawnRequest, mac: str) -> Identity:
    ca = req.tenant_ca.cert if req.tenant_ca and req.brokered else ""
    # A template's or a pool's VM has no tenant: it must not fix what each VM restored from
    # it should draw for itself (the kernel's boot_id).
    mounts = [{"export": v.volume_id, "path": v.path, "ro": v.read_only} for v in req.volumes]
    return Identity(
        req.vm_id, req.incarnation, req.token, req.env, mac, ca, own=bool(req.tenant_id), mounts=mounts
    )


def continued_timings(
    marks: tuple[float, float, float, float, float], guest: dict[str, float]
) -> dict[str, float]:
    """The steps of a spawn that continues a QEMU holding the VM's memory already (a parked
    resume, a pool claim), from ``marks``: start, network set, working set prefetched, QEMU
    continued, identified; ``guest``: the guest's own identify steps (docs/lifecycle.md,
    "The restore path")."""
    t0, t_net, t_prefetch, t_cont, t_end = marks
    return {
        "prepare_ms": round((t_net - t0) * 1000, 1),
        "prefetch_ms": round((t_prefetch - t_net) * 1000, 1),
        "qemu_cont_ms": round((t_cont - t_prefetch) * 1000, 1),
        "identify_ms": round((t_end - t_cont) * 1000, 1),
        **{f"identify_{k}": v for k, v in guest.items()},
    }


class Restores:
    def __init__(self, deps: RestoreDeps) -> None:
        self.d = deps

    async def source(self, req: SpawnRequest, pinned: contextlib.ExitStack) -> BootSource:
        """The spawn's source; a template restored from stays (not pruned) while
        ``pinned`` is open."""
        if req.restore is not None:
            ref = snapshot_ref(req)
            snap_dir = await asyncio.to_thread(self.d.store.open_for_restore, ref)
            # The snapshot's own kernel/initrd and root fs: not the image's current ones.
            boot_id = (await asyncio.to_thread(self.d.store.read_meta, ref)).get("boot")
            image = image_for_restore(self.d.settings, req.image, boot_id)
            return BootSource(image, "restore", snap_dir / "rootfs", snap_dir=snap_dir, ref=ref)
        image = load_image(self.d.settings, req.image)
        templates = self.d.templates
        if req.boot != "cold" and templates is not None:
            size = size_name(req.memory_mib, req.vcpus, req.disk_mib)
            template = pinned.enter_context(templates.use(image, size))
            if template is not None:
                return BootSource(image, "template", template / "rootfs", template=template)
            # This one boots cold; the next VM of this size restores warm (when its size is
            # one of PAL_TEMPLATE_SIZES).
            templates.ensure_in_background(self.d.template_host, image, size)
        return BootSource(image, "cold", image.rootfs)

    def _take_identity(
        self, lv: LiveVm, req: SpawnRequest, limits: dict[str, Any], mac: str, brokered: Brokered
    ) -> None:
        """A continued parked QEMU is the new incarnation's VM from now on (registered, its
        state file rewritten)."""
        lv.tenant_id, lv.incarnation, lv.token, lv.env = (
            req.tenant_id,
            req.incarnation,
            req.token,
            dict(req.env),
        )
        lv.volumes = list(req.volumes)
        lv.egress, lv.net_limits, lv.mac, lv.brokered, lv.wait = (
            req.egress,
            limits,
            mac,
            brokered,
            req.wait_pause,
        )
        lv.parked_snapshot = None
        lv.touch()
        self.d.registry.vms[req.vm_id] = lv
        self.d.registry.write_state(lv)

    async def unpark(self, pv: ParkedVm, req: SpawnRequest) -> SpawnResult:
        """Continue a parked QEMU as the resumed VM (parked.py): its RAM and disk are its
        snapshot's. It takes the new incarnation's identity like any restored guest, and
        gets new gateway state (the snapshot's DNS names, no connection)."""
        assert req.restore is not None
        lv = pv.lv
        check_move(lv, VmPhase.RUNNING)
        t0 = time.perf_counter()
        ref = snapshot_ref(req)
        if not await asyncio.to_thread(self.d.store.exists, ref):
            raise NotFound(f"snapshot {ref.snapshot_id} not found")
        names = read_names(self.d.store.path(ref))
        limits = limits_json(req.egress_mbps, req.max_connections)
        brokered = brokered_of(req)
        await pv.settled()  # an offload still running finishes first
        prefetch = None
        if pv.offloaded:
            prefetch = asyncio.create_task(
                asyncio.to_thread(offload.prefetch, lv.qemu.mem_path, pv.working_set)
            )
        await self.d.net.reregister(
            req.vm_id,
            lv.slot,
            req.egress,
            limits,
            brokered,
            wait_rule(req.wait_pause),
            names=names,
            new_guest=True,
        )
        t_net = time.perf_counter()
        if prefetch is not None:
            # The working set back first: the guest then takes minor faults only.
            with contextlib.suppress(TimeoutError, Exception):
                await asyncio.wait_for(asyncio.shield(prefetch), PARKED_PREFETCH_WAIT_S)
        t_prefetch = time.perf_counter()
        await lv.qemu.limit_disk(disk_limits(req))  # the operator's defaults may have changed
        await self.d.net.mount_volumes(req, lv.image)
        await lv.qemu.cont()
        t_vmm = time.perf_counter()
        who = identity_of(req, self.d.net.new_mac())
        timeout = self.d.settings.harness_ready_timeout_ms / 1000
        hb = self.d.settings.heartbeat_interval_s
        guest_steps = await identify(lv.channel, lv.qemu, who, timeout, hb, self.d.load)
        self._take_identity(lv, req, limits, who.mac, brokered)
        t_end = time.perf_counter()
        timings = {
            "parked_s": round(time.monotonic() - pv.parked_at, 1),
            "offloaded": 1.0 if pv.offloaded else 0.0,
            **continued_timings((t0, t_net, t_prefetch, t_vmm, t_end), guest_steps),
        }
        boot_ms = (t_end - t0) * 1000
        log.info(
            "VM %s up by its parked QEMU in %.0f ms (pid %s): %s", req.vm_id, boot_ms, lv.qemu.pid, timings
        )
        return spawn_result(
            req, lv.qemu, boot_ms, "restore", ref.agent_version_id, warm=True, timings=timings
        )
