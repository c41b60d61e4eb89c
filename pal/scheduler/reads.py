"""What the API and the dashboard read: a tenant's VMs, their events, network counters,
metrics and snapshots, the images it may use, and the operator's figures (nodes, quotas).
Nothing here changes state or takes a VM's lock.

Decision the spec leaves open: list() shows every VM of the tenant except those terminated
more than an hour ago (retention.py takes them out of the list).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from pal.errors import Unavailable
from pal.scheduler import nodes as nodes_mod
from pal.scheduler import placement
from pal.scheduler.deps import Deps, as_pal
from pal.scheduler.spawning import Spawner
from pal.scheduler.states import VmState, has_live_qemu
from pal.scheduler.views import NodeReport, OperatorStats, add_counters
from pal.store import NodeRecord, VmRecord
from pal.store import volumes as volume_rows
from pal.store.paging import vm_page
from pal.wire import verbs
from pal.wire.models import Empty, ImageInfo, SnapshotInfo, VmMetrics, VmRef, VmSnapshots

log = logging.getLogger(__name__)
S = VmState

# A scrape of /metrics waits this long for each node's figures (asked at once), then shows
# the node as down: one silent node must not stall the operator's every scrape.
NODE_STATS_TIMEOUT_S = 5.0
LIST_PAGE = 1000  # list() reads the tenant's list in pages of this many


@dataclass(frozen=True)
class Reads:
    d: Deps
    spawner: Spawner

    async def list_images(self, tenant_id: str) -> list[ImageInfo]:
        return await self.spawner.visible_images(tenant_id)

    async def get(self, tenant_id: str, vm_id: str) -> VmRecord:
        return self.d.own(tenant_id, vm_id)

    async def find(self, vm_id: str) -> VmRecord | None:
        """The VM of that id, whoever owns it (None: none): for a front end that
        authenticates a call by the VM's id and a credential of the VM's own (the E2B agent
        listener's access tokens, pal/e2b/agent.py), then acts with the VM's tenant."""
        return self.d.store.get_vm(vm_id)

    async def mounts(self, vm_ids: list[str]) -> dict[str, list[tuple[str, str, bool]]]:
        """The volumes each of ``vm_ids`` mounts, in one store read: (volume name, path, read
        only) in path order (docs/volumes.md); the caller has already read the VMs as its own."""
        return volume_rows.named_mounts(self.d.store, vm_ids)

    async def list_vms(self, tenant_id: str) -> list[VmRecord]:
        """All the tenant's listed VMs (terminated ones leave the list an hour after they
        ended: retention.py)."""
        out: list[VmRecord] = []
        after = None
        while page := vm_page(self.d.store, tenant_id, after=after, limit=LIST_PAGE):
            out += page
            after = (page[-1].created_at, page[-1].vm_id)
        return out

    async def network(self, vm: VmRecord) -> dict[str, int]:
        """The VM's network counters over its life (the node's live ones while it has a
        live QEMU)."""
        live = None
        if has_live_qemu(vm.state, vm.marker):
            try:
                live = (await self.d.node(vm).call(verbs.EGRESS_COUNTERS, VmRef(vm_id=vm.vm_id))).counters
            except Exception as exc:  # counters are informative: never fail a GET for them
                log.debug("egress counters of %s unavailable: %s", vm.vm_id, exc)
        return add_counters(vm.egress_stats, live)

    async def metrics(self, tenant_id: str, vm_id: str) -> VmMetrics:
        """The VM's resource samples of the last 15 minutes, from the node that runs (or
        last ran) it. A VM that is not running answers its last samples or an empty series."""
        vm = self.d.own(tenant_id, vm_id)
        try:
            return await self.d.node(vm).call(verbs.VM_METRICS, VmRef(vm_id=vm_id))
        except Unavailable:
            return VmMetrics(vm_id=vm_id, interval_secs=self.d.settings.metrics_interval_s, window_secs=900,
                             live=False, samples=[])  # fmt: skip

    async def snapshots(self, tenant_id: str, vm_id: str) -> list[SnapshotInfo]:
        """The VM's snapshots kept on its node, oldest first, with artifact sizes."""
        vm = self.d.own(tenant_id, vm_id)
        if not vm.agent_version_id:
            return []
        at = VmSnapshots(agent_version_id=vm.agent_version_id, vm_id=vm_id)
        return (await self.d.node(vm).call(verbs.LIST_SNAPSHOTS, at)).snapshots

    def node_views(self) -> list[dict[str, Any]]:
        loads = placement.loads(self.d.occupying())
        nodes = self.d.nodes
        return [nodes.view(n, loads.get(n.node_id) or placement.NodeLoad()) for n in nodes.nodes()]

    async def operator_stats(self) -> OperatorStats:
        """Figures for the operator's /metrics: VMs by state, quota use per tenant, and every
        node the store knows (a lost one, or one that does not answer in time, as down).
        The nodes are asked at once, each for at most NODE_STATS_TIMEOUT_S."""
        nodes, store = self.d.nodes, self.d.store
        with contextlib.suppress(Exception):  # an embedded node that does not answer is down
            await nodes.register_local()

        async def ask(rec: NodeRecord) -> NodeReport:
            if rec.state == nodes_mod.LOST:
                return NodeReport(rec.node_id, None)
            try:
                asked = nodes.client(rec.node_id).call(verbs.STATS, Empty())
                stats = await asyncio.wait_for(asked, NODE_STATS_TIMEOUT_S)
            except Exception as exc:
                log.warning("node stats of %s unavailable: %s", rec.node_id, as_pal(exc).message)
                return NodeReport(rec.node_id, None)
            return NodeReport(rec.node_id, stats)

        reports = list(await asyncio.gather(*(ask(rec) for rec in nodes.nodes())))
        if nodes.local_clients() and not nodes.local_ids():
            reports.append(NodeReport("local", None))  # embedded, never answered a heartbeat
        used = store.slots_by_tenant()
        tenants = [(t.id, used.get(t.id, 0), t.max_vms) for t in store.list_tenants()]
        return OperatorStats(vms_by_state=store.count_vms_by_state(), tenants=tenants, nodes=reports)
