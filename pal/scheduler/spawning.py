"""Where a VM goes and what its node is asked to start: the images a tenant may use, the
placement of a VM (schedule, resume, fork children) under the one placement lock, and the
spawn request a node gets. Used by schedule.py, pause_resume.py (resume) and fork.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from pal.images.paths import ImageNotFound
from pal.limits import Limits
from pal.scheduler import nodes as nodes_mod
from pal.scheduler import placement
from pal.scheduler.brokering import SecretBroker
from pal.scheduler.deps import Deps
from pal.spec import Placement, WaitPause, egress_from_json
from pal.store import NodeRecord, VmRecord
from pal.store import volumes as volume_rows
from pal.wire import verbs
from pal.wire.models import Empty, ImageInfo, RestoreFrom, SpawnRequest, SpawnResult, VolumeMount

log = logging.getLogger(__name__)
ASK_AT_ONCE = 32  # nodes asked for their images at the same time
ASK_ALL_EVERY_S = 2.0  # every node is asked for its images at most this often


def came_up(res: SpawnResult) -> dict[str, Any]:
    """The columns a VM's coming up writes besides its state (the host limits its node
    applied) and its status event's ``details``: how it started, where the time went (the
    node's timings, docs/lifecycle.md "The restore path") and those limits."""
    limits = res.limits.model_dump(by_alias=True)
    details: dict[str, Any] = {
        "method": res.method,
        "bootMs": round(res.boot_ms, 1),
        "timings": dict(res.timings),
        "limitsApplied": limits,
    }
    if res.warm:
        details["warm"] = True  # it continued its parked QEMU (docs/lifecycle.md, "Parked QEMUs")
    return {"details": details, "limits_applied": limits}


def need(vm: VmRecord, *, restore: bool) -> placement.Need:
    """What placing ``vm`` needs of a node (``restore``: a resume or a fork child)."""
    size = Limits.model_validate(vm.limits)
    where = Placement.model_validate(vm.placement or {})
    return placement.Need(
        tenant_id=vm.tenant_id,
        image=vm.image,
        memory_mib=size.memory_mib,
        vcpus=size.vcpus,
        disk_mib=size.disk_mib,
        region=where.region,
        labels=dict(where.labels),
        restore=restore,
    )


class Spawner:
    def __init__(self, deps: Deps, brokering: SecretBroker) -> None:
        self.d = deps
        self.brokering = brokering
        # One placement at a time: free memory is counted once. Held by the caller of
        # choose() and place_children().
        self.placing = asyncio.Lock()
        # node id -> (monotonic, its images) as last asked
        self._node_images: dict[str, tuple[float, list[dict[str, Any]]]] = {}
        self._asked_all_at = -ASK_ALL_EVERY_S  # monotonic: when every node was last asked

    # -- images ------------------------------------------------------------------------------

    async def visible_images(self, tenant_id: str, *, ask_all: bool = False) -> list[ImageInfo]:
        """Images are per node; each is open to every tenant or to a list. The union over
        the nodes: the embedded ones asked now (an image may have just been built), the
        others as their last heartbeat said (at most a period old) or, with ``ask_all``,
        asked now too (at most ASK_ALL_EVERY_S apart: a name nobody has must not make
        every schedule ask every node)."""
        nodes = self.d.nodes
        await nodes.register_local()
        ask = list(nodes.local_ids())
        if ask_all and time.monotonic() - self._asked_all_at >= ASK_ALL_EVERY_S:
            self._asked_all_at = time.monotonic()
            ask += [n.node_id for n in self._remote_nodes()]
        gate = asyncio.Semaphore(ASK_AT_ONCE)

        async def one(node_id: str) -> None:
            async with gate:
                try:
                    images = (await nodes.client(node_id).call(verbs.IMAGES, Empty())).images
                except Exception as exc:
                    if nodes.is_local(node_id):
                        raise
                    log.warning("images of node %s unavailable: %s", node_id, exc)
                    return
            # Fresher than the node's last heartbeat: placement uses it (an image imported
            # a second ago must be schedulable at once, not after the next heartbeat).
            self._node_images[node_id] = (time.monotonic(), [i.model_dump(by_alias=True) for i in images])

        await asyncio.gather(*(one(n) for n in ask))
        seen: dict[str, ImageInfo] = {}
        for node_id in [*nodes.local_ids(), *(n.node_id for n in self._remote_nodes())]:
            rec = nodes.get(node_id)
            listed = self._images_of(node_id, rec.images if rec is not None else [])
            for raw in listed:
                i = ImageInfo.model_validate(raw)
                if i.tenants is None or tenant_id in i.tenants:
                    seen.setdefault(i.name, i)
        return sorted(seen.values(), key=lambda i: i.name)

    def _remote_nodes(self) -> list[NodeRecord]:
        nodes = self.d.nodes
        return [
            n
            for n in nodes.nodes()
            if n.state != nodes_mod.LOST and not nodes.is_local(n.node_id) and not nodes.silent(n.node_id)
        ]

    async def require_image(self, tenant_id: str, name: str) -> None:
        # An image the tenant may not use is as unknown to it as a missing one. Not in the
        # heartbeats: the nodes are asked (an image built since the last one).
        for ask_all in (False, True):
            if name in {i.name for i in await self.visible_images(tenant_id, ask_all=ask_all)}:
                return
        raise ImageNotFound(name)

    # -- placement (the caller holds ``placing``) ---------------------------------------------

    async def choose(
        self,
        vm: VmRecord,
        *,
        restore: bool,
        prefer: str | None = None,
        prefer_why: str = "",
        exclude: tuple[str, ...] = (),
    ) -> placement.Choice:
        """Unavailable (503, NO_NODE) when no node fits."""
        await self.d.nodes.register_local()
        return placement.choose(
            self.placeable_nodes(),
            self.d.live.loads(),
            need(vm, restore=restore),
            prefer=prefer,
            prefer_why=prefer_why,
            exclude=(*exclude, *self.off_volume_nodes(vm)),
            silent_after_s=self.silent_after_s,
        )

    def place_children(
        self, src: VmRecord, children: list[VmRecord], *, only: str | None = None
    ) -> list[str]:
        """Fork children stay on the source's node while it has room (they share the
        snapshot's pages there); the rest spill to other nodes, which restore the snapshot
        from S3 (``only``: that node or none, where no other node can read the snapshot).
        Sets each child's node; returns each one's reason."""
        loads = self.d.live.loads()
        nodes = self.placeable_nodes()
        if only is not None:
            nodes = [n for n in nodes if n.node_id == only]
        reasons = []
        for child in children:
            choice = placement.choose(
                nodes,
                loads,
                need(child, restore=True),
                prefer=src.node_id,
                prefer_why="the source's node (shares its pages)",
                exclude=self.off_volume_nodes(src),
                silent_after_s=self.silent_after_s,
            )
            child.node_id = choice.node_id
            loads.setdefault(choice.node_id, placement.NodeLoad()).add(
                child.tenant_id, placement.vm_memory_mib(child)
            )
            reasons.append(choice.reason)
        return reasons

    def _images_of(self, node_id: str, reported: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A node's images: as asked, while that is newer than its heartbeats can be."""
        asked = self._node_images.get(node_id)
        fresh_s = 2 * self.d.settings.node_heartbeat_interval_s
        if asked is not None and (self.d.nodes.is_local(node_id) or time.monotonic() - asked[0] < fresh_s):
            return asked[1]
        return reported

    def placeable_nodes(self) -> list[NodeRecord]:
        """The node records placement weighs, with the images each node last reported."""
        return [
            dataclasses.replace(n, images=self._images_of(n.node_id, n.images)) for n in self.d.nodes.nodes()
        ]

    @property
    def silent_after_s(self) -> float:
        """A node silent for longer (three heartbeat periods) gets nothing new placed on it."""
        return 3 * self.d.settings.node_heartbeat_interval_s

    # -- the spawn request ---------------------------------------------------------------------

    def request(self, vm: VmRecord, restore: RestoreFrom | None) -> SpawnRequest:
        """What the VM's node is asked to start: a boot or template (``restore`` None), or a
        restore of a snapshot (resume, fork child)."""
        size = Limits.model_validate(vm.limits)
        return SpawnRequest(
            vm_id=vm.vm_id,
            tenant_id=vm.tenant_id,
            image=vm.image,
            vcpus=size.vcpus,
            memory_mib=size.memory_mib,
            disk_mib=size.disk_mib,
            incarnation=vm.incarnation,
            token=vm.token,
            env=self.brokering.env(vm.tenant_id, vm.secrets),
            boot="cold" if vm.boot == "cold" else "auto",
            restore=restore,
            egress=egress_from_json(vm.egress),
            egress_mbps=vm.limits.get("egress_mbps"),
            max_connections=vm.limits.get("max_connections"),
            disk_read_mibps=size.disk_read_mibps,
            disk_write_mibps=size.disk_write_mibps,
            disk_iops=size.disk_iops,
            **self._brokered(vm),
            wait_pause=WaitPause.model_validate(vm.wait_pause) if vm.wait_pause else None,
            volumes=[
                VolumeMount(volume_id=vid, path=path, read_only=ro)
                for vid, path, ro, _ in volume_rows.mounts_of(self.d.store, vm.vm_id)
            ],
        )

    def off_volume_nodes(self, vm: VmRecord) -> tuple[str, ...]:
        """A VM that mounts volumes runs on their home node only, unless they live on
        PAL_VOLUMES_DIR, which every node mounts (docs/volumes.md): every other node, to
        exclude."""
        if self.d.settings.volumes_shared:
            return ()
        homes = {node for *_, node in volume_rows.mounts_of(self.d.store, vm.vm_id)}
        if not homes:
            return ()
        return tuple(n.node_id for n in self.d.nodes.nodes() if n.node_id not in homes)

    def _brokered(self, vm: VmRecord) -> dict[str, Any]:
        rules = self.brokering.rules(vm.tenant_id, vm.secrets)
        if not rules:
            return {}
        return {"brokered": rules, "tenant_ca": self.brokering.vm_ca(vm.tenant_id, rules)}
