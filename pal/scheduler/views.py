"""What the scheduler hands the API besides store records (VMs and events are the store's
``VmRecord``/``EventRecord``; the API shows their public fields)."""

from __future__ import annotations

from dataclasses import dataclass

from pal.scheduler.states import VmState
from pal.store import VmRecord
from pal.wire.models import LiveState, NodeStats

COUNTERS = ("bytesIn", "bytesOut", "connections", "refused", "dnsQueries")


def add_counters(base: dict[str, int] | None, live: dict[str, int] | None) -> dict[str, int]:
    """A VM's network counters over its life: past incarnations' plus the current one's."""
    out = {k: int((base or {}).get(k, 0)) + int((live or {}).get(k, 0)) for k in COUNTERS}
    if live is not None and "active" in live:
        out["active"] = int(live["active"])
    return out


LIVE_STATS = ("livePauses", "waitPauses", "livePausedMs", "offloads", "freedMib", "bytesWhilePaused")


# Bookkeeping kept with the counters (not shown): the start, in unix microseconds by its
# node's clock, of the newest live pause whose offload they include. A pause offloads at
# most once and pauses come one after another, so counting an offload only when its pause
# is newer counts each one once, whichever report of it comes first: the pause's answer,
# the node's notice (late, or read again after a restart), reconciliation.
OFFLOADED_PAUSE = "offloadedPauseUs"


def add_live_stats(base: dict[str, int] | None, **add: int) -> dict[str, int]:
    """A VM's live-pause counters over its life plus ``add`` (names of LIVE_STATS)."""
    out = {k: int((base or {}).get(k, 0)) for k in LIVE_STATS}
    if base and OFFLOADED_PAUSE in base:
        out[OFFLOADED_PAUSE] = int(base[OFFLOADED_PAUSE])
    for k, v in add.items():
        if k not in LIVE_STATS:
            raise KeyError(f"unknown live-pause counter {k}")
        out[k] += int(v)
    return out


def count_offload(base: dict[str, int] | None, since: float, freed_mib: int) -> dict[str, int] | None:
    """The counters with the offload of the live pause that began at ``since`` (unix
    seconds, node clock) added, or None if they already include it (or a newer one)."""
    pause_us = round(since * 1_000_000)
    if int((base or {}).get(OFFLOADED_PAUSE, -1)) >= pause_us:
        return None
    out = add_live_stats(base, offloads=1, freedMib=freed_mib)
    out[OFFLOADED_PAUSE] = pause_us
    return out


@dataclass(frozen=True)
class Paused:
    """A pause's outcome: the VM's record, and for a live pause the node's account of it as
    it answered (what the pause's answer shows: no second round trip)."""

    vm: VmRecord
    live: LiveState | None = None


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
