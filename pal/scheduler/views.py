"""What the scheduler hands the API besides store records (VMs and events are the store's
``VmRecord``/``EventRecord``; the API shows their public fields)."""

from __future__ import annotations

from dataclasses import dataclass

from pal.manager.models import NodeStats
from pal.scheduler.states import VmState

COUNTERS = ("bytesIn", "bytesOut", "connections", "refused", "dnsQueries")


def add_counters(base: dict[str, int] | None, live: dict[str, int] | None) -> dict[str, int]:
    """A VM's network counters over its life: past incarnations' plus the current one's."""
    out = {k: int((base or {}).get(k, 0)) + int((live or {}).get(k, 0)) for k in COUNTERS}
    if live is not None and "active" in live:
        out["active"] = int(live["active"])
    return out


LIVE_STATS = ("livePauses", "waitPauses", "livePausedMs", "offloads", "freedMib", "bytesWhilePaused")


def add_live_stats(base: dict[str, int] | None, **add: int) -> dict[str, int]:
    """A VM's live-pause counters over its life plus ``add`` (names of LIVE_STATS)."""
    out = {k: int((base or {}).get(k, 0)) for k in LIVE_STATS}
    for k, v in add.items():
        if k not in out:
            raise KeyError(f"unknown live-pause counter {k}")
        out[k] += int(v)
    return out


@dataclass
class ForkChild:
    vm_id: str
    state: VmState
    error: str | None = None


@dataclass
class ForkResult:
    source_vm_id: str
    snapshot_id: str
    forks: list[ForkChild]


@dataclass
class NodeReport:
    node_id: str  # "local": an embedded node that never answered (its id is not known)
    stats: NodeStats | None  # None: lost, or did not answer at this scrape


@dataclass
class OperatorStats:
    vms_by_state: dict[str, int]
    tenants: list[tuple[str, int, int]]  # (tenant id, slots used, max VMs)
    nodes: list[NodeReport]  # every node the control plane knows, by id
