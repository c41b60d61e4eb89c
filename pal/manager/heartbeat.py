"""What the node tells the control plane: its heartbeat (each live VM's activity, its
capacity, warm templates, images, health), its operator figures, its images, and the warm
templates built on request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pal.config import Settings
from pal.errors import InvalidRequest, PalError, Unavailable
from pal.images.builder import is_current
from pal.images.paths import ImagePaths, list_images, load_image
from pal.manager import admission
from pal.manager.live import LiveControl
from pal.manager.templates import TemplateCache, TemplateHost
from pal.manager.vm import VmRegistry
from pal.sizes import size_name
from pal.snapshots.store import SnapshotStore
from pal.vmm.host_cpu import LoadSampler
from pal.wire.models import (
    ImageInfo,
    NodeCapacity,
    NodeHeartbeat,
    NodeStats,
    VmActivity,
    WarmRequest,
    WarmResult,
    WarmTemplate,
)

log = logging.getLogger(__name__)

# What the host keeps for itself when PAL_NODE_MEMORY_MIB is not set.
HOST_RESERVE_MIB = 1024
# Below this much free space in the data dir the node reports itself unhealthy.
MIN_DISK_FREE_MIB = admission.MIN_FREE_MIB
# Snapshot byte counts walk the snapshot dir (and list S3): done at most this often.
STATS_MAX_AGE_S = 30.0


@dataclass
class NodeIdentity:
    node_id: str
    epoch: str  # this process's incarnation of the node
    accel: str
    url: str = ""  # where the control plane reaches this node (set by `pal node`)


@dataclass
class ReportDeps:
    """Exactly what the node's reports need."""

    me: NodeIdentity
    settings: Settings
    store: SnapshotStore
    registry: VmRegistry
    templates: TemplateCache | None  # None: PAL_TEMPLATES=0
    template_host: TemplateHost  # a warm build spawns through it
    load: LoadSampler  # a guest's silence in CPU time (host_cpu.py)


class NodeReports:
    def __init__(self, deps: ReportDeps) -> None:
        self.d = deps
        self._stats_cache: tuple[float, int, int | None] | None = None  # (monotonic, local, s3)
        self._stats_lock = asyncio.Lock()

    async def heartbeat(self) -> NodeHeartbeat:
        """Each live VM's activity: what the host saw (exec and file requests through this
        manager) apart from what the guest claims (already cleaned by the channel); the
        scheduler decides how much a claim may count (idle.py). The incarnation is the one
        this manager spawned, never the guest's word."""
        out: list[VmActivity] = []
        now_wall, now_mono = time.time(), time.monotonic()
        for lv in list(self.d.registry.vms.values()):
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
                    silent_cpu_ms=int(self.d.load.cpu_since(heard) * 1000) if heard else None,
                    live=LiveControl.state(lv),
                )
            )
        report = await asyncio.to_thread(self._node_report)
        return NodeHeartbeat(node_id=self.d.me.node_id, accel=self.d.me.accel, vms=out, **report)

    def _warm_templates(self) -> list[WarmTemplate]:
        templates = self.d.templates
        out = []
        for t in templates.warm() if templates is not None else []:
            with contextlib.suppress(KeyError, TypeError, ValueError):
                out.append(
                    WarmTemplate(
                        agent_version_id=str(t["agentVersionId"]),
                        memory_mib=int(t["memoryMib"]),
                        vcpus=int(t["vcpus"]),
                        disk_mib=int(t["diskMib"]),
                    )
                )
        return out

    def _node_report(self) -> dict[str, Any]:
        """Capacity, warm templates, images and health (file system reads: off the loop)."""
        settings = self.d.settings
        st = os.statvfs(settings.data_dir)
        disk_free_mib = st.f_bavail * st.f_frsize // (1024 * 1024)
        memory = settings.node_memory_mib or max(0, _host_memory_mib() - HOST_RESERVE_MIB)
        images = [self.image_info(i) for i in list_images(settings)]
        problems = []
        if not images:
            problems.append("no guest image built (pal image build)")
        if disk_free_mib < MIN_DISK_FREE_MIB:
            problems.append(f"data dir has {disk_free_mib} MiB free (< {MIN_DISK_FREE_MIB})")
        return {
            "epoch": self.d.me.epoch,
            "url": self.d.me.url,
            "region": settings.node_region,
            "labels": dict(settings.node_labels),
            "capacity": NodeCapacity(
                memory_mib=memory, vcpus=os.cpu_count() or 1, disk_free_mib=disk_free_mib
            ),
            "templates": self._warm_templates(),
            "images": images,
            "healthy": not problems,
            "health": "; ".join(problems) or None,
        }

    async def stats(self) -> NodeStats:
        """Operator figures; snapshot byte counts are at most STATS_MAX_AGE_S old."""
        store = self.d.store
        async with self._stats_lock:
            now = time.monotonic()
            if self._stats_cache is None or now - self._stats_cache[0] > STATS_MAX_AGE_S:
                local = await asyncio.to_thread(store.local_bytes)
                s3: int | None = None
                try:
                    s3 = await asyncio.to_thread(store.s3_bytes)
                except PalError as exc:
                    log.warning("S3 snapshot bytes unknown: %s", exc)
                    s3 = self._stats_cache[2] if self._stats_cache else None
                self._stats_cache = (time.monotonic(), local, s3)
            at, local, s3 = self._stats_cache
        return NodeStats(
            node_id=self.d.me.node_id,
            accel=self.d.me.accel,
            vms_live=len(self.d.registry.alive()),
            snapshot_bytes_local=local,
            snapshot_bytes_s3=s3,
            s3_queue_depth=store.s3_queue_depth(),
            seal_queue_depth=store.pending_seals(),
            stats_age_secs=round(time.monotonic() - at, 3),
        )

    # ------------------------------------------------------------------ images
    def image_info(self, image: ImagePaths) -> ImageInfo:
        m = image.meta
        templates = self.d.templates
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
            templates=templates.sizes(image.agent_version_id) if templates is not None else [],
            current=is_current(m),
        )

    async def images(self) -> list[ImageInfo]:
        """Every complete image of this node (visibility is the scheduler's business)."""
        images = await asyncio.to_thread(list_images, self.d.settings)
        return [self.image_info(i) for i in images]

    async def warm(self, req: WarmRequest) -> WarmResult:
        """Build the template of ``req.image`` at that size now (``--warm``); returns when
        it is ready (or could not be built). Prerequisite: templates enabled."""
        templates = self.d.templates
        if templates is None:
            raise Unavailable("warm templates are disabled on this node (PAL_TEMPLATES=0)")
        image = await asyncio.to_thread(load_image, self.d.settings, req.image)
        size = size_name(req.memory_mib, req.vcpus, req.disk_mib)
        key = templates.key(image, size)
        task = templates.ensure_in_background(self.d.template_host, image, size)
        if task is None:
            raise InvalidRequest(f"size {size} gets no template: it is not one of PAL_TEMPLATE_SIZES")
        # Shielded: a caller that gives up does not cancel a build other schedules wait for.
        path = await asyncio.shield(task)
        return WarmResult(key=key, ready=path is not None)


def _host_memory_mib() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 0
