"""The idle sweeper: suspends RUNNING VMs that saw no activity for ``idle_timeout_secs``,
in two tiers when the VM asks for the first one (docs/live-pause.md):

1. after ``idle_live_pause_secs``: a live pause with its RAM offloaded (the QEMU stays, with
   its warm TCG translation cache, so a wake costs about a warm exec); the slot is kept;
2. after ``idle_timeout_secs``: today's snapshot pause (from running, or from tier 1),
   which frees the slot and the node's memory and CPU for good.

A wait pause (wait management) is the same as tier 1 for this: a guest waiting on an
upstream that never answers would otherwise keep its QEMU and its slot forever, so after
``idle_timeout_secs`` with nothing the host saw (no request, no wake) and no answer
arriving (the gateway holds no byte for it), it takes the snapshot tier too. Which VMs
may take which tier is the transition table's word (IDLE_LIVE_PAUSE, IDLE_PAUSE).

A request wakes either tier transparently (wake.py).

Each sweep polls the node heartbeat itself (the reference reads a 30 s-old node heartbeat
and trails the timeout by up to ~40 s; polling here bounds the lag to one sweep interval
plus the pause). A VM is idle when it is RUNNING, has ``idle_timeout_secs > 0``, no exec or
file request is in flight (through this scheduler or the node), and it has been inactive
for longer than its timeout (:func:`last_active_ms`).

Activity is what the host observes: exec and file requests (stamped on the row by the
scheduler and by the node's manager), later ports and network. The guest's own claims
(``active``, ``last_activity_ms``) are untrusted (docs/security.md): a claim never counts
beyond *now*, and counts at most ``idle_timeout_secs`` past the last host-observed
activity. So a guest that says it is always busy (or reports a time in the future) is
suspended at most one timeout late, never kept awake forever; a workload that keeps
itself busy in the background after its exec ended gets that one extra timeout.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Protocol

from pal.scheduler import states
from pal.scheduler.deps import Deps
from pal.scheduler.states import Action, Marker, VmState
from pal.store import VmRecord
from pal.store.due import advance_activity, idle_due
from pal.wire import verbs
from pal.wire.models import Empty, VmActivity, VmRef

log = logging.getLogger(__name__)


def last_active_ms(vm: VmRecord, activity: VmActivity | None, now_ms: int, bound_s: int | None = None) -> int:
    """When the VM was last active: host-observed, extended by the guest's claims by at
    most one idle timeout (``bound_s``, default the VM's idle timeout) and never into the
    future. A live-paused guest claims nothing (it is stopped)."""
    host = max(vm.last_activity_unix_ms, activity.last_activity_unix_ms if activity else 0)
    if activity is None or activity.live is not None:
        return host
    bound = vm.idle_timeout_secs if bound_s is None else bound_s
    claimed = now_ms if activity.guest_active else min(activity.guest_last_activity_unix_ms, now_ms)
    return max(host, min(claimed, host + bound * 1000))


def idle_for_ms(vm: VmRecord, activity: VmActivity | None, now_ms: int, bound_s: int | None = None) -> int:
    return now_ms - last_active_ms(vm, activity, now_ms, bound_s)


class IdleSuspender(Protocol):
    """The two tiers (pause_resume.py): each re-checks ``still_idle`` under the VM's lock."""

    async def idle_pause(self, vm_id: str, *, still_idle: Callable[[VmRecord], bool]) -> VmRecord | None: ...

    async def idle_live_pause(
        self, vm_id: str, *, still_idle: Callable[[VmRecord], bool]
    ) -> VmRecord | None: ...


class IdleSweeper:
    def __init__(self, deps: Deps, suspender: IdleSuspender) -> None:
        self.d = deps
        self.suspender = suspender

    @staticmethod
    def may_sweep(vm: VmRecord) -> tuple[bool, bool]:
        """Whether the table lets the sweeper take ``vm`` to the (snapshot, live) tier: a
        running VM to either, an automatic live pause (idle tier, wait) to the snapshot."""
        st = VmState(vm.state)
        return (
            vm.idle_timeout_secs > 0 and states.allowed(st, Action.IDLE_PAUSE, vm.marker),
            vm.idle_live_pause_secs > 0 and states.allowed(st, Action.IDLE_LIVE_PAUSE, vm.marker),
        )

    def tier(self, vm: VmRecord, activity: VmActivity | None) -> str | None:
        """What an idle VM is due for: ``snapshot`` (idle_timeout_secs passed), ``live``
        (idle_live_pause_secs passed, still running), or None."""
        to_snapshot, to_live = self.may_sweep(vm)
        if not (to_snapshot or to_live):
            return None
        if activity is None or not activity.alive:
            return None  # not ours to judge: the reconciler handles VMs that are gone
        if activity.has_active_exec or self.d.locks.busy(vm.vm_id):
            return None
        now = self.d.now_ms()
        if to_snapshot and idle_for_ms(vm, activity, now) > vm.idle_timeout_secs * 1000:
            return "snapshot"
        live_after = vm.idle_live_pause_secs
        if to_live and idle_for_ms(vm, activity, now, live_after) > live_after * 1000:
            return "live"
        return None

    async def _answer_arriving(self, vm: VmRecord) -> bool:
        """A wait-paused VM whose upstream is answering (the gateway holds bytes for it, or
        its data is ready: a wake is due) is not idle: a snapshot would cut the answer."""
        if vm.marker != Marker.LIVE_WAIT:
            return False
        try:
            st = (await self.d.node(vm).call(verbs.LIVE_STATUS, VmRef(vm_id=vm.vm_id))).live
        except Exception as exc:
            log.warning("idle sweep: wait state of %s unknown: %s", vm.vm_id, exc)
            return True  # not knowing is no reason to cut a connection
        return st is not None and (st.ready or st.buffered_bytes > 0)

    def _recheck(self, activity: VmActivity | None, want: str, vm: VmRecord) -> bool:
        return self.tier(vm, activity) == want

    async def sweep(self) -> list[str]:
        """One tick: move every idle VM to the tier it is due for; returns the ids moved.

        Reads only the VMs whose row says a timeout has passed (store.due.idle_due: an
        index of due times; the node's activity can only make a VM idle later than its
        row says). One found busy on its node gets its row's activity moved forward to
        what the node saw, so it is not read again before it may be idle: a tick's cost
        follows what is due, never the fleet (docs/scale.md)."""
        candidates = [vm for vm in idle_due(self.d.store, self.d.now_ms()) if any(self.may_sweep(vm))]
        if not candidates:
            return []
        by_id: dict[str, VmActivity] = {}
        for node_id in sorted({vm.node_id or "" for vm in candidates}):
            if self.d.nodes.silent(node_id or None):
                continue
            try:  # each node's own report, fresh (not its last pushed heartbeat)
                hb = await self.d.nodes.client(node_id or None).call(verbs.HEARTBEAT, Empty())
            except Exception as exc:
                log.warning("idle sweep: node %s did not answer: %s", node_id, exc)
                continue
            by_id.update({a.vm_id: a for a in hb.vms})
        suspended = []
        for vm in candidates:
            activity = by_id.get(vm.vm_id)
            want = self.tier(vm, activity)
            if (
                want is None
                and activity is not None
                and activity.last_activity_unix_ms > vm.last_activity_unix_ms
            ):
                advance_activity(self.d.store, vm.vm_id, activity.last_activity_unix_ms)
            if want is None or (want == "snapshot" and await self._answer_arriving(vm)):
                continue
            # Re-checked under the VM's operation lock against the fresh row, so a request
            # that arrived since the heartbeat keeps the VM running.
            still = functools.partial(self._recheck, activity, want)
            try:
                if want == "live":
                    done = await self.suspender.idle_live_pause(vm.vm_id, still_idle=still)
                else:
                    done = await self.suspender.idle_pause(vm.vm_id, still_idle=still)
            except Exception as exc:
                log.warning("idle suspend of %s failed: %s", vm.vm_id, exc)
                continue
            if done is not None:
                log.info("suspended idle VM %s (%s tier)", vm.vm_id, want)
                suspended.append(vm.vm_id)
        return suspended
