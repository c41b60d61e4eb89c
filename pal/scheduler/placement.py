"""Placement: which node runs a VM, and why. Pure functions over the nodes' last heartbeats
and the VMs the store says each node holds; the scheduler calls them under its placement
lock, so two placements never count the same free memory.

The rules, in order (issue 13 / the spec's "warm pool, region, fair share, cost, health"):

1. hard constraints: the node is active (not draining or lost), heartbeating (silent for no
   more than three heartbeat periods) and healthy, has the image,
   is in the requested region and carries the requested labels, and has room: guest RAM
   left (its capacity minus what its VMs hold: :func:`held_memory_mib`) and free disk for
   the VM's disk size;
2. a warm template for the image build and size (a schedule restores it instead of booting);
3. tenant fair share: the fewest VMs of this tenant (spreads a tenant's VMs);
4. load: the fewest VMs, then the most free guest RAM (then the node id, to be stable).

A *preferred* node (a paused VM's previous node, a fork source's node) wins whenever it
passes the hard constraints. The choice's reason is recorded in the VM's status event.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from pal.errors import InvalidRequest, Unavailable
from pal.scheduler.states import Marker
from pal.store import NodeRecord, VmRecord

ACTIVE = "active"


@dataclass(frozen=True)
class Need:
    tenant_id: str
    image: str
    memory_mib: int
    vcpus: int
    disk_mib: int
    region: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    restore: bool = False  # a resume or fork child: restores a snapshot, templates do not matter


@dataclass
class NodeLoad:
    memory_mib: int = 0  # guest RAM the VMs placed there hold (slot-holding states; held_memory_mib)
    vms: int = 0
    by_tenant: dict[str, int] = field(default_factory=dict)

    def add(self, tenant_id: str, memory_mib: int) -> None:
        self.memory_mib += memory_mib
        self.vms += 1
        self.by_tenant[tenant_id] = self.by_tenant.get(tenant_id, 0) + 1

    def remove(self, tenant_id: str, memory_mib: int) -> None:
        self.memory_mib -= memory_mib
        self.vms -= 1
        left = self.by_tenant.get(tenant_id, 0) - 1
        if left > 0:
            self.by_tenant[tenant_id] = left
        else:
            self.by_tenant.pop(tenant_id, None)

    def copy(self) -> NodeLoad:
        return NodeLoad(self.memory_mib, self.vms, dict(self.by_tenant))


@dataclass(frozen=True)
class Choice:
    node_id: str
    reason: str


# A VM in the idle tier (live-paused by the idle sweeper) has handed its RAM back to its
# file (pal/vmm/offload.py): it holds its QEMU and what of its working set comes back, not
# its RAM (about 50 MiB of PSS for a 256 MiB VM, docs/benchmarks/density.md). Placement
# counts it at this share of its RAM, so a node holds hundreds of idle sandboxes. A wake is
# never refused for memory: it only shrinks the node's free count (below zero, even), and
# new VMs go elsewhere (or wait) until VMs idle again. The RAM is a file on the data dir,
# so a node past its count pages guest RAM to that file rather than running out; the
# node's own admission (manager/admission.py) still checks the host's real free memory
# before it starts a QEMU.
IDLE_TIER_MEMORY_SHARE = 0.25


def vm_memory_mib(vm: VmRecord) -> int:
    return int(vm.limits.get("memory_mib") or 0)


def held_memory_mib(vm: VmRecord) -> int:
    """The guest RAM ``vm`` counts against its node's capacity."""
    mib = vm_memory_mib(vm)
    return math.ceil(mib * IDLE_TIER_MEMORY_SHARE) if vm.marker == Marker.LIVE_IDLE else mib


def loads(vms: Iterable[VmRecord]) -> dict[str, NodeLoad]:
    """What each node holds: the VMs in slot-holding states placed on it."""
    out: dict[str, NodeLoad] = {}
    for vm in vms:
        if vm.node_id and vm.holds_slot:
            out.setdefault(vm.node_id, NodeLoad()).add(vm.tenant_id, held_memory_mib(vm))
    return out


def free_memory_mib(node: NodeRecord, load: NodeLoad | None) -> int:
    return int(node.capacity.get("memoryMib") or 0) - (load.memory_mib if load else 0)


def _avid(node: NodeRecord, image: str) -> str | None:
    for i in node.images:
        if i.get("name") == image:
            return i.get("agentVersionId")
    return None


def has_warm_template(node: NodeRecord, need: Need) -> bool:
    avid = _avid(node, need.image)
    return any(
        t.get("agentVersionId") == avid
        and t.get("memoryMib") == need.memory_mib
        and t.get("vcpus") == need.vcpus
        and t.get("diskMib") == need.disk_mib
        for t in node.templates
    )


def _where_not(node: NodeRecord, region: str | None, labels: dict[str, str]) -> str | None:
    """The region or label ``node`` lacks, or None."""
    if region and node.region != region:
        return f"region {node.region or '(none)'} != {region}"
    for k, v in labels.items():
        if node.labels.get(k) != v:
            return f"label {k}={node.labels.get(k, '(unset)')} != {v}"
    return None


def check_satisfiable(nodes: Iterable[NodeRecord], region: str | None, labels: dict[str, str]) -> None:
    """400 when no known node, in any state, has the requested region and labels: the
    request can never be placed as written (a full or down node that matches is a 503 at
    placement instead, which waiting can cure)."""
    if not region and not labels:
        return
    nodes = list(nodes)
    misses = {n.node_id: _where_not(n, region, labels) for n in nodes}
    if nodes and all(misses.values()):
        detail = "; ".join(f"{k}: {v}" for k, v in sorted(misses.items()))
        raise InvalidRequest(f"no node has this placement's region and labels ({detail})")


def why_not(
    node: NodeRecord, load: NodeLoad | None, need: Need, silent_after_s: float | None = None
) -> str | None:
    """The hard constraint ``node`` fails for ``need``, or None if it can run it."""
    if node.state != ACTIVE:
        return node.state
    if silent_after_s is not None:
        silent = (datetime.now(UTC) - node.last_seen_at).total_seconds()
        if silent > silent_after_s:
            return f"silent for {silent:.0f} s"
    if not node.healthy:
        return f"unhealthy ({node.health or 'no reason given'})"
    # A restore (resume, fork child) needs no image: it boots the snapshot's own root fs
    # and boot set, so a VM still resumes after its image was replaced or removed.
    if not need.restore and _avid(node, need.image) is None:
        return f"no image {need.image!r}"
    where = _where_not(node, need.region, need.labels)
    if where:
        return where
    free = free_memory_mib(node, load)
    if free < need.memory_mib:
        return f"{free} MiB of guest RAM free < {need.memory_mib}"
    disk = int(node.capacity.get("diskFreeMib") or 0)
    if disk < need.disk_mib:
        return f"{disk} MiB of disk free < {need.disk_mib}"
    return None


def choose(
    nodes: Iterable[NodeRecord],
    node_loads: dict[str, NodeLoad],
    need: Need,
    *,
    prefer: str | None = None,
    prefer_why: str = "preferred",
    exclude: Iterable[str] = (),
    silent_after_s: float | None = None,
) -> Choice:
    """The node for ``need`` and the reason, or Unavailable (503) naming why each node
    was ruled out."""
    nodes = list(nodes)
    refused: dict[str, str] = {}
    fit: list[NodeRecord] = []
    excluded = set(exclude)
    for n in nodes:
        reason = (
            "did not answer"
            if n.node_id in excluded
            else why_not(n, node_loads.get(n.node_id), need, silent_after_s)
        )
        if reason is None:
            fit.append(n)
        else:
            refused[n.node_id] = reason
    if not fit:
        detail = "; ".join(f"{k}: {v}" for k, v in sorted(refused.items())) or "no node has registered"
        raise Unavailable(f"no node can run this VM ({detail})", code="NO_NODE")
    if prefer is not None and any(n.node_id == prefer for n in fit):
        return Choice(prefer, f"placed on {prefer}: {prefer_why}")
    skipped = f"; {prefer_why} node {prefer} ruled out: {refused.get(prefer, 'unknown')}" if prefer else ""

    def rank(n: NodeRecord) -> tuple[bool, int, int, int, str]:
        load = node_loads.get(n.node_id) or NodeLoad()
        warm = not need.restore and has_warm_template(n, need)
        return (
            not warm,
            load.by_tenant.get(need.tenant_id, 0),
            load.vms,
            -free_memory_mib(n, load),
            n.node_id,
        )

    best = min(fit, key=rank)
    load = node_loads.get(best.node_id) or NodeLoad()
    parts = []
    if not need.restore:
        parts.append("warm template" if has_warm_template(best, need) else "no warm template")
    parts.append(f"tenant has {load.by_tenant.get(need.tenant_id, 0)} VMs there")
    parts.append(f"{load.vms} VMs, {free_memory_mib(best, load)} MiB free")
    out = f" ({len(fit)} of {len(nodes)} nodes fit)"
    return Choice(best.node_id, f"placed on {best.node_id}: " + ", ".join(parts) + out + skipped)
