"""Live pause in the scheduler (docs/live-pause.md): the operator's live pause and
resume, the wake of an automatic one, wait management's pause and wake, and the node's
notices that drive them.

Every operation takes the VM's operation lock, checks its action against the table in
states.py before any work, asks the node, and records the outcome through the one
transition function. Order: the node acts first, the row follows. A crash in between
leaves the node's word (its state.json) as the truth, and reconciliation adopts it
(reconcile.py), so there is no in-between state to roll back.

Who may wake what: an operator's live pause only the operator (exec answers 409); an idle
live pause any exec, file or port request (transparently, like today's auto-resume); a wait
pause also its held data and its guest's own timer (the node posts those).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pal.errors import BackendError
from pal.scheduler import nodes as nodes_mod
from pal.scheduler import states
from pal.scheduler.deps import Deps
from pal.scheduler.states import Action, Marker, VmState
from pal.scheduler.views import Paused, add_live_stats, count_offload
from pal.spec import WaitPause
from pal.store import VmRecord, utcnow
from pal.wire import verbs
from pal.wire.models import LiveBy, LivePauseRequest, LiveState, Notice, NoticesAfter, VmRef

log = logging.getLogger(__name__)
S, A, M = VmState, Action, Marker

BY: dict[Action, LiveBy] = {A.LIVE_PAUSE: "operator", A.IDLE_LIVE_PAUSE: "idle", A.WAIT_PAUSE: "wait"}
WAIT_PAUSE_EVENT, WAIT_OFFLOAD_EVENT, WAIT_RESUME_EVENT = "wait_pause", "wait_offload", "wait_resume"
LIVE_OFFLOAD_EVENT = "live_offload"  # an operator's or idle pause offloaded
# Long poll of the node's notices: a notice comes back at once, so this is only how often
# an idle node is asked again (the node's own bound, manager/notices.py MAX_WAIT_S): one
# poll per node, 1,000 of them at 1,000 nodes, each costing a request per period.
NOTICE_POLL_S = 30.0


def live_paused(vm: VmRecord) -> bool:
    return states.is_live_paused(vm.state, vm.marker)


def wait_rule(vm: VmRecord) -> WaitPause | None:
    return WaitPause.model_validate(vm.wait_pause) if vm.wait_pause else None


class LiveOps:
    """``is_leader``: whether this replica leads now (only the leader acts on notices)."""

    def __init__(self, deps: Deps, is_leader: Callable[[], Awaitable[bool]]) -> None:
        self.d = deps
        self._is_leader = is_leader
        self._notices: asyncio.Task[None] | None = None
        self._pollers: dict[str, asyncio.Task[None]] = {}  # node id -> its notices' long poll
        self._handling: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------ pause

    async def pause(self, vm_id: str, action: Action, *, offload: bool = False, reason: str) -> Paused | None:
        """A live pause (caller holds the VM's operation lock): the VM and the node's account
        of the pause. None: a wait pause found nothing waiting (nothing changed).

        Prerequisites: ``action`` (LIVE_PAUSE, IDLE_LIVE_PAUSE, WAIT_PAUSE) allowed: running,
        or for LIVE_PAUSE also live-paused (the operator takes it over, or offloads it).
        Success: paused with the action's live marker (the slot kept), the node first.
        Failure: the node's error, nothing changed; failed if its QEMU turned out gone."""
        s = self.d
        t0 = time.perf_counter()
        vm = s.reload(vm_id)
        states.check(vm_id, vm.state, action, vm.marker)
        by = BY[action]
        wait = wait_rule(vm)
        after_ms = wait.offload_after_ms if action == A.WAIT_PAUSE and wait is not None else None
        req = LivePauseRequest(
            vm_id=vm_id,
            by=by,
            offload=offload or after_ms == 0,
            offload_after_ms=after_ms or None,
            if_waiting=action == A.WAIT_PAUSE,
        )
        try:
            res = await s.node(vm).call(verbs.LIVE_PAUSE, req)
        except Exception as exc:
            await self._lost_if_gone(vm, f"live pause failed: {exc}")
            raise
        if not res.paused:
            return None
        fields: dict[str, Any] = {"paused_by": by}
        if vm.state == S.RUNNING:
            fields["paused_at"] = utcnow()
            fields["live_stats"] = add_live_stats(
                vm.live_stats, livePauses=1, waitPauses=int(action == A.WAIT_PAUSE)
            )
        paused = await s.transitions.transition(vm_id, action, reason=reason, **fields)
        if action == A.WAIT_PAUSE:
            s.store.add_event(
                vm_id,
                vm.tenant_id,
                WAIT_PAUSE_EVENT,
                reason=f"paused in {res.pause_ms:.1f} ms: the guest is idle and waits on its network",
                details={"pauseMs": res.pause_ms},
            )
        if res.state is not None and self.record_offload(vm_id, res.state):
            paused = s.reload(vm_id)
        s.telemetry.live_pause.labels(by=by).observe(time.perf_counter() - t0)
        return Paused(paused, res.state)

    async def _lost_if_gone(self, vm: VmRecord, reason: str) -> None:
        if await self.d.is_alive(vm, vm.incarnation) is False:
            await self.d.stop_quietly(vm)
            with contextlib.suppress(Exception):
                await self.d.transitions.transition(vm.vm_id, A.LOSE, reason=reason)

    # ------------------------------------------------------------------ resume

    async def resume(self, vm: VmRecord, trigger: str, why: str | None = None) -> VmRecord:
        """The same QEMU continues. ``vm``: its record as the caller read it under the VM's
        operation lock, which it holds (the wake of a request reads it once: wake.py).

        Prerequisites: LIVE_RESUME allowed (live-paused, any live marker).
        Success: running, the node first. Failure: 500; failed if its QEMU is gone."""
        s = self.d
        t0 = time.perf_counter()
        vm_id = vm.vm_id
        states.check(vm_id, vm.state, A.LIVE_RESUME, vm.marker)
        try:
            res = await s.node(vm).call(verbs.LIVE_RESUME, VmRef(vm_id=vm_id))
        except Exception as exc:
            await self._lost_if_gone(vm, f"live resume failed: {exc}")
            raise BackendError(f"live resume of VM {vm_id} failed: {exc}") from exc
        stats = add_live_stats(vm.live_stats, livePausedMs=res.paused_ms, bytesWhilePaused=res.buffered_bytes)
        running = await s.transitions.transition(
            vm_id,
            A.LIVE_RESUME,
            reason=why,
            paused_by=None,
            paused_at=None,
            last_activity_unix_ms=s.now_ms(),
            live_stats=stats,
        )
        if vm.marker == M.LIVE_WAIT:
            s.store.add_event(
                vm_id,
                vm.tenant_id,
                WAIT_RESUME_EVENT,
                reason=f"resumed after {res.paused_ms} ms ({why or trigger})",
                details={
                    "pausedMs": res.paused_ms,
                    "resumeMs": res.resume_ms,
                    "bufferedBytes": res.buffered_bytes,
                    "offloaded": res.offloaded,
                    "trigger": trigger,
                },
            )
        s.telemetry.live_resume.labels(trigger=trigger).observe(time.perf_counter() - t0)
        if trigger != "api":
            s.telemetry.started(vm_id, "live-wake")
        return running

    # ------------------------------------------------------------------ wait management

    async def wait_pause(self, vm_id: str) -> VmRecord | None:
        """The node says the VM is idle and waits on held I/O: pause it, unless it has no
        wait management or is no longer running (the node itself refuses while the guest
        computes, a request is being handed to it, or nothing waits any more).

        Prerequisites: wait management on, WAIT_PAUSE allowed (running); else None."""
        s = self.d
        async with s.locks.op_lock(vm_id):
            vm = s.store.get_vm(vm_id)
            if vm is None or not vm.wait_pause or not states.allowed(S(vm.state), A.WAIT_PAUSE, vm.marker):
                return None
            done = await self.pause(vm_id, A.WAIT_PAUSE, reason="waiting on the network (wait management)")
            return done.vm if done is not None else None

    async def wake(self, vm_id: str, trigger: str, why: str) -> VmRecord | None:
        """Resume a wait-paused VM for its data or its timer (an operator's pause and the
        idle tier are not woken by those).

        Prerequisites: marker live:wait and LIVE_RESUME allowed; else None."""
        s = self.d
        async with s.locks.op_lock(vm_id):
            vm = s.store.get_vm(vm_id)
            # The table allows a live resume of any live pause; data and timers wake only
            # the wait pauses.
            if (
                vm is None
                or vm.marker != M.LIVE_WAIT
                or not states.allowed(S(vm.state), A.LIVE_RESUME, vm.marker)
            ):
                return None
            return await self.resume(vm, trigger, why)

    def record_offload(self, vm_id: str, st: LiveState) -> bool:
        """Count the offload of the live pause ``st`` describes and say so in an event,
        once however many reports of it come (views.count_offload). The one place an
        offload is recorded; the caller holds the VM's operation lock, so this
        read-modify-write of the counters never crosses a pause's or a resume's."""
        s = self.d
        vm = s.store.get_vm(vm_id)
        if vm is None or not st.offloaded:
            return False
        stats = count_offload(vm.live_stats, st.since, st.freed_mib)
        if stats is None:
            return False
        kind = WAIT_OFFLOAD_EVENT if st.by == "wait" else LIVE_OFFLOAD_EVENT
        ms, freed, resident = st.offload_ms, st.freed_mib, st.resident_mib
        s.store.add_event(
            vm_id,
            vm.tenant_id,
            kind,
            reason=f"offloaded in {ms or 0:.0f} ms: {freed} MiB freed, {resident or 0} MiB resident",
            details={"offloadMs": ms, "freedMib": freed, "residentMib": resident},
        )
        s.store.update_vm(vm_id, live_stats=stats)
        return True

    async def _offloaded_notice(self, n: Notice) -> None:
        if n.since is None or n.by is None:  # a node that does not say which pause: not countable once
            log.warning("offload notice for %s names no pause; not counted", n.vm_id)
            return
        st = LiveState(
            by=n.by,
            since=n.since,
            offloaded=True,
            offload_ms=n.ms,
            freed_mib=n.freed_mib or 0,
            resident_mib=n.resident_mib,
        )
        async with self.d.locks.op_lock(n.vm_id):
            self.record_offload(n.vm_id, st)

    # ------------------------------------------------------------------ notices

    def start(self) -> None:
        if self._notices is None:
            self._notices = asyncio.create_task(self._watch_nodes(), name="pal-node-notices")

    async def close(self) -> None:
        task, self._notices = self._notices, None
        tasks = [t for t in [task, *self._pollers.values(), *self._handling] if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._pollers.clear()

    async def _watch_nodes(self) -> None:
        """One long poll per node that may hold live VMs (embedded or remote, not lost);
        the set is refreshed every tick."""
        s = self.d
        while True:
            try:
                ids = set(s.nodes.local_ids()) | {
                    n.node_id for n in s.nodes.nodes() if n.state != nodes_mod.LOST
                }
                for node_id in ids - set(self._pollers):
                    self._pollers[node_id] = asyncio.create_task(
                        self._notice_loop(node_id), name=f"pal-notices-{node_id}"
                    )
                for node_id in set(self._pollers) - ids:
                    self._pollers.pop(node_id).cancel()
            except Exception as exc:
                log.warning("node list for notices unavailable: %s", exc)
            await asyncio.sleep(max(1.0, s.settings.node_heartbeat_interval_s))

    async def _notice_loop(self, node_id: str) -> None:
        """Act on one node's notices as they come (leader only)."""
        s = self.d
        seq, epoch = 0, ""
        while True:
            try:
                if not await self._is_leader():
                    await asyncio.sleep(s.settings.idle_sweep_interval_s)
                    continue
                got = await s.nodes.client(node_id).call(
                    verbs.NOTICES, NoticesAfter(after=seq, epoch=epoch, wait_s=NOTICE_POLL_S)
                )
                seq, epoch = got.seq, got.epoch
                for n in got.notices:
                    t = asyncio.create_task(self.handle(n), name=f"notice-{n.kind}-{n.vm_id}")
                    self._handling.add(t)
                    t.add_done_callback(self._handling.discard)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("notices of node %s unavailable: %s", node_id, exc)
                await asyncio.sleep(1.0)

    async def handle(self, n: Notice) -> None:
        try:
            if n.kind == "wait-ready":
                await self.wait_pause(n.vm_id)
            elif n.kind == "wake":
                why = n.reason or "wake"
                trigger = "timer" if why == "timer" else "port" if why.startswith("port") else "data"
                await self.wake(n.vm_id, trigger, why)
            elif n.kind == "offloaded":
                await self._offloaded_notice(n)
        except Exception as exc:
            log.warning("node notice %s for %s not acted on: %s", n.kind, n.vm_id, exc)

    # ------------------------------------------------------------------ views

    async def view(self, vm: VmRecord, answered: LiveState | None = None) -> dict[str, Any] | None:
        """``pause`` of GET: its kind (tier), since when, and for a live one whether it is
        offloaded and how much guest RAM is resident (measured on the node now). With
        ``answered`` (the answer of a live pause), what the node said when it paused: no
        second round trip, and ``residentMiB`` only when the pause offloaded."""
        if vm.state != S.PAUSED:
            return None
        since = vm.paused_at.isoformat() if vm.paused_at else None
        if not live_paused(vm):
            return {"kind": "snapshot", "by": vm.paused_by, "since": since}
        st = answered
        if st is None:
            with contextlib.suppress(Exception):
                st = (await self.d.node(vm).call(verbs.LIVE_STATUS, VmRef(vm_id=vm.vm_id))).live
        return {
            "kind": "live",
            "by": vm.paused_by,
            "since": since,
            "offloaded": bool(st and st.offloaded),
            "residentMiB": st.resident_mib if st else None,
        }
