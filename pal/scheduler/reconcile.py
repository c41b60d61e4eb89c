"""Reconciliation: bring every VM row to a true state after a crash, from what each VM's
node reports (``heartbeat()``) and whether snapshots are complete (``snapshot_status``).
Every fix goes through the one transition function.

- ``reconcile_all`` runs whenever a replica becomes leader (the previous one may have died
  in the middle of anything). The VMs of a node that does not answer are settled when it
  answers again (``reconcile_unanswered``, every tick) or by node-loss detection. A live VM
  (running, or live-paused) whose QEMU its node no longer has (it could not be adopted
  after a restart) is recovered from its newest complete snapshot when it has one: paused
  from it (``pausedBy: recovery``), resumable, with a ``recovered`` event saying why and
  from when; only a VM with no snapshot to come back to fails.
- ``reconcile_light`` runs every sweep: it fails live VMs (running or live-paused) whose
  QEMU is gone and settles live pauses the row and the node disagree on.
- the snapshot audit and sweep (snapshot_audit.py) run every sweep.

What each reads (docs/scale.md): never the fleet. A takeover reads the VMs that use a node
(the leader's live view, liveview.py) and asks every node at once; the sweep compares
each node's latest report with the view in memory and reads the rows of the VMs that
differ only; the snapshot audit and sweep take a page, or a node, per tick.
- ``lose_silent_nodes`` (every tick): a node silent for ``PAL_NODE_LOST_AFTER`` (30 s) has
  lost its VMs: the ones holding a slot there become FAILED ("node lost"), releasing their
  slots exactly once (the transition function's books); its PAUSED VMs stay resumable
  elsewhere (their snapshots are in S3). More than a tenth of the nodes silent at once is
  the control plane's own trouble (an overload: the benchmark at 1,000 nodes saw it fail
  every VM of 600 nodes whose heartbeats it was too slow to take): none is declared lost.
- ``node_heartbeat`` (a remote node's push) and ``stray_vms``: what a node that heartbeats
  runs but must not (a VM failed, deleted, paused or moved meanwhile, or an older
  incarnation): stopped by (id, incarnation), so a VM never runs twice.

Live pauses have no in-between state: the node acts first and records each one in the
VM's state.json, so its word is the truth (pal/scheduler/live.py). A RUNNING row whose
QEMU the node reports live-paused records that pause (by whom the node says); a
live-paused row whose QEMU runs records the resume. A live-paused VM uses its node like a
running one (slot, node loss, strays: ``states.holds_slot``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from pal.errors import Conflict, InvalidRequest, Unavailable
from pal.scheduler import nodes as nodes_mod
from pal.scheduler.deps import Deps, SpawnChore
from pal.scheduler.liveview import LiveVm
from pal.scheduler.snapshot_audit import snapshot_complete
from pal.scheduler.snapshot_books import SnapshotBooks
from pal.scheduler.states import (
    LIVE_MARKERS,
    SLOT_HOLDING,
    Action,
    Marker,
    VmState,
    has_live_qemu,
    holds_slot,
    is_live_paused,
)
from pal.scheduler.views import count_offload
from pal.store import VmRecord, utcnow
from pal.store.due import slot_mismatches, slot_rows, vms_by_ids
from pal.wire import verbs
from pal.wire.models import Empty, HeartbeatAck, LiveState, NodeHeartbeat, StopVm, VmActivity, VmSnapshots

log = logging.getLogger(__name__)
S = VmState
A = Action
# The node's word for who live-paused a VM -> the action that records it.
LIVE_ACTION = {"operator": A.LIVE_PAUSE, "idle": A.IDLE_LIVE_PAUSE, "wait": A.WAIT_PAUSE}

STALE_HEARTBEATS = 6  # heartbeat periods without one before a harness counts as gone (5 s x 6)
NODE_LOST_REASON = "node lost"
RECOVERED_EVENT = "recovered"
RECOVERY = "recovery"  # pausedBy of a VM recovered from its snapshot
LOCK_WAIT_S = 2.0  # a VM whose operation is stuck on a dead node is retried next tick
ASK_AT_ONCE = 32  # nodes asked for their heartbeat at the same time
# More nodes than this, and than this share of them, silent at once are not declared lost
# (lose_silent_nodes): the control plane's trouble, not theirs.
MASS_SILENCE_MIN, MASS_SILENCE_SHARE = 3, 0.1
YIELD_EVERY = 2000  # rows a takeover looks at between two turns of the event loop


def _silent_ms(a: VmActivity | None, now_ms: int) -> int:
    """How long the harness has been silent: in CPU time as its node counts it (a guest
    starved of CPU by a busy host is slow, not gone: pal/vmm/host_cpu.py), else in wall time."""
    if a is None or not a.last_heartbeat_unix_ms:
        return 0
    wall = now_ms - a.last_heartbeat_unix_ms
    return min(wall, a.silent_cpu_ms) if a.silent_cpu_ms is not None else wall


def _alive(alive: dict[str, VmActivity], vm: VmRecord | LiveVm) -> bool:
    a = alive.get(vm.vm_id)
    return a is not None and (a.incarnation is None or a.incarnation == vm.incarnation)


def _settled(vm: VmRecord, alive: dict[str, VmActivity]) -> bool:
    """Whether a VM that uses a node needs nothing done, as its row (read in a batch) and
    its node's report say: alive as this incarnation, its live pause agreed on, any
    offload counted. Anything else is looked at again under its lock (_fix)."""
    if not has_live_qemu(vm.state, vm.marker) or not _alive(alive, vm):
        return False
    a = alive[vm.vm_id]
    if (vm.state == S.RUNNING) != (a.live is None):
        return False
    return (
        a.live is None
        or not a.live.offloaded
        or count_offload(vm.live_stats, a.live.since, a.live.freed_mib) is None
    )


def _differs(e: LiveVm, a: VmActivity | None, now_ms: int, stale_ms: int) -> bool:
    """Whether a live VM the leader expects on a node looks otherwise in the node's report:
    gone (or another incarnation), its live pause not agreed on, or its harness silent."""
    if a is None or not a.alive or (a.incarnation is not None and a.incarnation != e.incarnation):
        return True
    if (e.state == S.RUNNING) != (a.live is None):
        return True
    return e.state == S.RUNNING and _silent_ms(a, now_ms) > stale_ms


@dataclass
class Reconciler:
    d: Deps
    # live.py's one record of an offload (counted once however it is reported)
    record_offload: Callable[[str, LiveState], bool]
    leader_since: Callable[[], float]  # when this replica last became leader (its clock)
    spawn_chore: SpawnChore
    books: SnapshotBooks  # an interrupted delete releases the snapshots as the delete would have
    # Nodes whose VMs the last reconciliation could not settle: settled when they answer
    # again (reconcile_unanswered).
    unreconciled_nodes: set[str | None] = field(default_factory=set)

    async def node_heartbeat(self, hb: NodeHeartbeat) -> HeartbeatAck:
        """A remote node's pushed heartbeat (leader only: the record is a fenced write).
        Registers or refreshes the node, and stops what it runs but must not (a VM declared
        lost while it was away, an older incarnation...): a VM never runs twice.

        Prerequisites: an http(s) URL (400), not the embedded node's id (409)."""
        nodes = self.d.nodes
        if not hb.url.startswith(("http://", "https://")):
            raise InvalidRequest("a node's heartbeat must carry the http(s) URL of its RPC")
        if nodes.is_local(hb.node_id):
            raise Conflict(f"node id {hb.node_id} is the embedded node's")
        async with self.d.telemetry.loops.tick("heartbeat"):  # each node's, counted as a loop
            rec = await nodes.record(hb, url=hb.url)
            strays = self.stray_vms(hb.node_id, hb)
        if strays:
            self.spawn_chore(self.stop_strays(hb.node_id, strays), f"strays-{hb.node_id}")
        return HeartbeatAck(node_id=hb.node_id, state=rec.state, stopping=[v for v, _ in strays])

    async def _snapshot_complete(self, vm: VmRecord, snapshot_id: str | None) -> bool | None:
        return await snapshot_complete(self.d, vm, snapshot_id)

    async def _fix_live(self, vm: VmRecord, a: VmActivity | None) -> str | None:
        """A live VM's pause as its node reports it (``a``: fresh, alive, this incarnation)."""
        t = self.d.transitions
        if a is None:
            return None
        if a.live is not None and a.live.offloaded:
            # An offload whose notice died with a restart is counted here (once: live.py).
            self.record_offload(vm.vm_id, a.live)
        if vm.state == S.RUNNING and a.live is not None:
            action = LIVE_ACTION[a.live.by]
            paused_at = datetime.fromtimestamp(a.live.since, UTC)
            await t.transition(
                vm.vm_id,
                action,
                reason="live pause found on the node",
                paused_by=a.live.by,
                paused_at=paused_at,
            )
            return f"live-paused on the node (by {a.live.by}) -> paused"
        if is_live_paused(vm.state, vm.marker) and a.live is None:
            await t.transition(
                vm.vm_id,
                A.LIVE_RESUME,
                reason="running on the node",
                paused_by=None,
                paused_at=None,
                last_activity_unix_ms=self.d.now_ms(),
            )
            return "live-paused but running on the node -> running"
        return None

    async def _fix(self, vm: VmRecord, alive: dict[str, VmActivity]) -> str | None:
        """Settle one VM (caller holds its operation lock). Returns a description of the fix."""
        t = self.d.transitions
        state, vid = S(vm.state), vm.vm_id
        live = vid in alive
        if has_live_qemu(state, vm.marker) and _alive(alive, vm):
            return await self._fix_live(vm, alive.get(vid))
        if is_live_paused(state, vm.marker):
            if live:  # a stale incarnation is running: it is not the VM we think it is
                await self.d.stop_quietly(vm)
            recovered = await self._recover(vm, "its QEMU was gone after a restart (it was live-paused)")
            if recovered is not None:
                return recovered
            await t.transition(vid, A.LOSE, reason="its QEMU is gone (it was live-paused)")
            return "live-paused but gone -> failed"
        if state == S.DRAINING and vm.marker == Marker.DELETING:
            if not await self.d.stop_quietly(vm):
                return None
            gone = await t.transition(vid, A.FINISH_DELETE, reason="deleted")
            await self.books.release(gone)
            return "interrupted delete -> terminated"
        if state == S.DRAINING:  # a pause (operator or idle) was under way
            return await self._fix_pause(vm, live)
        if state == S.SPAWNING and vm.marker == Marker.RESUMING:
            if _alive(alive, vm):
                await t.transition(vid, A.COME_UP, paused_by=None, paused_at=None)
                return "interrupted resume came up -> running"
            if live:
                await self.d.stop_quietly(vm)
            await t.transition(vid, A.ROLL_BACK_RESUME, reason="resume interrupted; resumable again")
            return "interrupted resume -> paused"
        if state == S.SPAWNING and vm.marker == Marker.FORKING:
            # A fork's children come up in one transaction (fork.py, _spawn_children): one
            # still spawning means that commit never happened, so none of them is kept.
            if live:
                await self.d.stop_quietly(vm)
            await t.transition(
                vid, A.FAIL_SPAWN, reason="fork interrupted (control plane restarted); not kept"
            )
            return "interrupted fork child -> failed"
        if state == S.SPAWNING:
            if _alive(alive, vm):
                await t.transition(vid, A.COME_UP)
                return "interrupted spawn came up -> running"
            if live:
                await self.d.stop_quietly(vm)
            await t.transition(vid, A.FAIL_SPAWN, reason="control plane restarted during spawn")
            return "interrupted spawn -> failed"
        if state == S.PENDING:
            await t.transition(vid, A.FAIL_SPAWN, reason="control plane restarted before placement")
            return "pending -> failed"
        if state == S.RUNNING and not _alive(alive, vm):
            if live:  # a stale incarnation is running: it is not the VM we think it is
                await self.d.stop_quietly(vm)
            recovered = await self._recover(vm, "its QEMU was gone after a restart")
            if recovered is not None:
                return recovered
            await t.transition(vid, A.LOSE, reason="QEMU exited")
            return "running but gone -> failed"
        if state == S.PAUSED:
            if live:
                await self.d.stop_quietly(vm)  # a paused VM has no process; this one is stray
            complete = await self._snapshot_complete(vm, vm.snapshot_id)
            if complete is False:
                await t.transition(vid, A.LOSE, reason="its snapshot is missing or incomplete")
                return "paused without a complete snapshot -> failed"
            return None
        if state in (S.FAILED, S.TERMINATED) and live:
            await self.d.stop_quietly(vm)
            return f"stray QEMU of a {state.value} VM stopped"
        return None

    async def _recover(self, vm: VmRecord, why: str) -> str | None:
        """A live VM whose QEMU is gone: paused from its newest complete snapshot on its
        node (resumable; ``pausedBy: recovery``; a ``recovered`` event names the snapshot and
        when it was taken: what came after it is lost). None when it has none (or its node
        cannot tell): the caller fails it."""
        if not vm.agent_version_id:
            return None
        try:
            at = VmSnapshots(agent_version_id=vm.agent_version_id, vm_id=vm.vm_id)
            snaps = (await self.d.node(vm).call(verbs.LIST_SNAPSHOTS, at)).snapshots
        except Exception as exc:
            log.warning("snapshots of %s unknown: %s", vm.vm_id, exc)
            return None
        for snap in sorted(snaps, key=lambda x: x.created_at or "", reverse=True):
            if await self._snapshot_complete(vm, snap.snapshot_id) is not True:
                continue
            taken = snap.created_at or "an unknown time"
            reason = f"{why}: paused from its newest snapshot {snap.snapshot_id} (taken {taken}); resume it"
            await self.d.transitions.transition(
                vm.vm_id,
                A.RECOVER,
                reason=reason,
                snapshot_id=snap.snapshot_id,
                paused_by=RECOVERY,
                paused_at=utcnow(),
            )
            details = {"snapshotId": snap.snapshot_id, "takenAt": snap.created_at}
            self.d.store.add_event(vm.vm_id, vm.tenant_id, RECOVERED_EVENT, reason=reason, details=details)
            return f"QEMU gone -> paused from snapshot {snap.snapshot_id} ({taken})"
        return None

    async def _fix_pause(self, vm: VmRecord, live: bool) -> str | None:
        """A snapshot pause that was under way (draining for a pause): completed if its
        snapshot is, else rolled back to running (its QEMU runs) or lost."""
        t, vid = self.d.transitions, vm.vm_id
        complete = await self._snapshot_complete(vm, vm.snapshot_id)
        if complete is None:
            return None
        if complete:
            if live:
                await self.d.stop_quietly(vm)
            by = "idle" if vm.marker == Marker.IDLE_PAUSING else "operator"
            await t.transition(vid, A.FINISH_PAUSE, reason=vm.reason, paused_by=by, paused_at=utcnow())
            return "interrupted pause completed -> paused"
        if live:
            await t.transition(
                vid,
                A.ROLL_BACK_PAUSE,
                reason="pause interrupted; still running",
                snapshot_id=None,
                paused_by=None,
                paused_at=None,
            )
            return "interrupted pause rolled back -> running"
        await t.transition(vid, A.LOSE, reason="pause interrupted and no complete snapshot")
        return "interrupted pause, VM gone -> failed"

    async def _heartbeats(
        self, node_ids: Iterable[str | None], ask_silent: bool = False
    ) -> dict[str | None, NodeHeartbeat]:
        """The heartbeat of each node that answers. Lost nodes are not asked; silent ones only
        with ``ask_silent`` (a new leader: heartbeats sent during the failover went nowhere, so
        a node's silence says nothing yet)."""
        out: dict[str | None, NodeHeartbeat] = {}
        gate = asyncio.Semaphore(ASK_AT_ONCE)

        async def ask(node_id: str | None) -> None:
            async with gate:
                try:
                    out[node_id] = await self.d.nodes.client(node_id).call(verbs.HEARTBEAT, Empty())
                except Exception as exc:
                    log.warning("node %s did not answer its heartbeat: %s", node_id, exc)

        asked = [
            n
            for n in sorted(set(node_ids), key=lambda n: n or "")
            if self.d.nodes.state_of(n) != nodes_mod.LOST and (ask_silent or not self.d.nodes.silent(n))
        ]
        await asyncio.gather(*(ask(n) for n in asked))
        return out

    async def reconcile_all(self, only: set[str | None] | None = None) -> list[str]:
        """Settle every VM that uses a node whose node answers (``only``: the VMs of these
        nodes), and stop what the nodes run that no VM row places there; returns a log of
        the fixes (also logged). The nodes that did not answer are left in
        ``self.unreconciled_nodes``: their VMs are settled when they answer again
        (``reconcile_unanswered``), or by node-loss detection if they never do.

        Reads the slot-holding rows (the live view, loaded here when ``only`` is None: a
        takeover) and the rows of VMs a node runs that hold no slot; the VMs whose row and
        node agree are left alone, the others are looked at again under their lock."""
        try:
            await self.d.nodes.register_local()
        except Exception as exc:
            raise Unavailable(
                f"cannot reconcile: the runtime manager did not answer its heartbeat: {exc}"
            ) from exc
        only_local = self.d.nodes.local_ids()[0] if len(self.d.nodes.local_ids()) == 1 else None
        if only is None:
            # On a worker thread: at 10^6 records these are 10^5 rows, and the event loop
            # must go on turning (the lease's keeper checks that it does).
            rows = await asyncio.to_thread(slot_rows, self.d.store)
            self.d.nodes.reload()  # the store's, as the previous leader left it
            await self.d.live.aload(rows)
            node_ids: set[str | None] = {vm.node_id for vm in rows if vm.node_id}
            node_ids |= set(self.d.nodes.local_ids())
            node_ids |= {n.node_id for n in self.d.nodes.nodes()}
        else:
            # Those nodes' VMs only; a row from before nodes existed belongs to the embedded node.
            rows = slot_rows(self.d.store, {n for n in only if n}, unplaced=only_local in only)
            node_ids = set(only)
        beats = await self._heartbeats(node_ids, ask_silent=True)
        if not beats and self.d.nodes.local_ids() and only is None:
            raise Unavailable("cannot reconcile: the runtime manager did not answer its heartbeat")
        # QEMUs the nodes run for VMs that hold no slot (failed, deleted, paused, moved...).
        live_ids = {vm.vm_id for vm in rows}
        others = {a.vm_id for hb in beats.values() for a in hb.vms if a.alive and a.vm_id not in live_ids}
        known = vms_by_ids(self.d.store, others)
        fixes: list[str] = []
        unanswered: set[str | None] = set()
        for i, vm in enumerate([*rows, *(known[k] for k in sorted(known))]):
            if i % YIELD_EVERY == 0:
                await asyncio.sleep(0)  # 10^5 rows: the event loop (and the lease's pulse) go on
            hb = beats.get(vm.node_id or only_local)
            if hb is None and vm.state != S.PENDING and holds_slot(vm.state, vm.marker):
                unanswered.add(vm.node_id or only_local)
                continue  # its node does not answer: settled when it does, or when it is lost
            alive = {a.vm_id: a for a in hb.vms if a.alive} if hb is not None else {}
            if _settled(vm, alive):
                continue
            fixes.extend(await self._settle(vm.vm_id, alive))
        kept = self.unreconciled_nodes - node_ids if only is not None else set()
        self.unreconciled_nodes = kept | unanswered
        for node_id, hb in beats.items():
            for a in hb.vms:
                if a.alive and a.vm_id not in live_ids and a.vm_id not in known:
                    await self._stop_on(node_id, a.vm_id, None)
                    fixes.append(f"{a.vm_id}: unknown VM on node {node_id} stopped")
        fixes.extend(await self.fix_slots())
        for f in fixes:
            log.warning("reconcile: %s", f)
        return fixes

    async def _settle(self, vm_id: str, alive: dict[str, VmActivity]) -> list[str]:
        """The fixes one VM needs, under its operation lock, from its fresh row."""
        fixes = []
        async with self.d.locks.op_lock(vm_id):
            # One fix may lead to another (an interrupted snapshot of a live-paused VM
            # rolls back to running, and the node says it is live-paused).
            for _ in range(3):
                fresh = self.d.store.get_vm(vm_id)
                if fresh is None:
                    break
                try:
                    fix = await self._fix(fresh, alive)
                except Exception as exc:
                    log.error("reconcile of %s failed: %s", vm_id, exc)
                    break
                if not fix:
                    break
                fixes.append(f"{vm_id}: {fix}")
        return fixes

    async def reconcile_unanswered(self) -> list[str]:
        """Every tick: settle the VMs of nodes that did not answer the last ``reconcile_all``
        once they heartbeat again (a VM mid-fork on a node that was silent during a failover
        would otherwise stay spawning forever). Lost nodes drop out: node loss settles them."""
        pending = self.unreconciled_nodes
        lost = {n for n in pending if self.d.nodes.state_of(n) == nodes_mod.LOST}
        self.unreconciled_nodes = pending - lost
        ready = {n for n in self.unreconciled_nodes if not self.d.nodes.silent(n)}
        return await self.reconcile_all(only=ready) if ready else []

    async def _stop_on(self, node_id: str | None, vm_id: str, incarnation: int | None) -> bool:
        try:
            await self.d.nodes.client(node_id).call(verbs.STOP, StopVm(vm_id=vm_id, incarnation=incarnation))
            return True
        except Exception as exc:
            log.warning("stop of %s on %s failed: %s", vm_id, node_id, exc)
            return False

    async def fix_slots(self) -> list[str]:
        """Make ``holds_slot`` agree with the state (states.holds_slot) for every row."""
        fixes = []
        for vm in slot_mismatches(self.d.store, SLOT_HOLDING, LIVE_MARKERS):
            should = holds_slot(vm.state, vm.marker)
            if vm.holds_slot != should and await self.d.transitions.repair_slot(vm.vm_id):
                fixes.append(f"{vm.vm_id}: slot {'reserved' if should else 'released'} ({vm.state})")
        return fixes

    async def reconcile_light(self) -> list[str]:
        """A live VM (running or live-paused) whose QEMU died, or a RUNNING one whose harness
        went silent (no heartbeat for STALE_HEARTBEATS periods: spec's "stale after 30 s"),
        -> FAILED, its QEMU stopped; a live pause the row and the node disagree on is settled
        by the node's word.

        Each node's latest report (pushed within 1.5 heartbeat periods; an embedded node,
        or one that did not push, is asked now) is compared in memory with the VMs the
        leader's view expects there. Only the VMs that differ are read, and their node is
        asked again before anything changes (a report can predate a spawn or a resume);
        each is then re-checked under its lock, so a VM that changed meanwhile is left alone."""
        view = self.d.live
        if not view.loaded:
            view.load()
        nodes = self.d.nodes
        fresh_s = 1.5 * self.d.settings.node_heartbeat_interval_s
        expected: dict[str | None, dict[str, LiveVm]] = {}
        for node_id in sorted(view.node_ids()) + ([None] if view.on_node(None) else []):
            on = {k: e for k, e in view.on_node(node_id).items() if has_live_qemu(e.state, e.marker)}
            if on and nodes.state_of(node_id) != nodes_mod.LOST:
                expected[node_id] = on
        if not expected:
            return []
        stale_ms = int(self.d.settings.heartbeat_interval_s * STALE_HEARTBEATS * 1000)
        reports: dict[str | None, NodeHeartbeat] = {}
        ask: list[str | None] = []
        for node_id in expected:
            hb = None if nodes.is_local(node_id) or node_id is None else nodes.report(node_id, fresh_s)
            if hb is None:
                ask.append(node_id)
            else:
                reports[node_id] = hb
        beats = await self._heartbeats(ask)

        def suspects(node_id: str | None, hb: NodeHeartbeat) -> list[str]:
            alive = {a.vm_id: a for a in hb.vms}
            now = self.d.now_ms()
            return [v for v, e in expected[node_id].items() if _differs(e, alive.get(v), now, stale_ms)]

        again = []
        for n, hb in reports.items():  # a node's report at a time: the event loop goes on between
            if suspects(n, hb):
                again.append(n)
            await asyncio.sleep(0)
        beats.update(await self._heartbeats(again))  # a pushed report may predate a change
        wanted = {}
        for n, hb in beats.items():
            wanted[n] = suspects(n, hb)
            await asyncio.sleep(0)
        rows = vms_by_ids(self.d.store, [v for ids in wanted.values() for v in ids])
        fixes: list[str] = []
        for node_id, ids in wanted.items():
            for vm_id in ids:
                vm = rows.get(vm_id)
                if vm is not None and vm.node_id == node_id and has_live_qemu(vm.state, vm.marker):
                    fixes.extend(await self._light_fix(vm, beats[node_id]))
        return fixes

    async def _light_fix(self, vm: VmRecord, hb: NodeHeartbeat) -> list[str]:
        stale_ms = int(self.d.settings.heartbeat_interval_s * STALE_HEARTBEATS * 1000)
        alive = {a.vm_id: a for a in hb.vms if a.alive}
        a = alive.get(vm.vm_id)
        if _alive(alive, vm) and a is not None and (vm.state == S.RUNNING) != (a.live is None):
            async with self.d.locks.op_lock(vm.vm_id):
                fresh = self.d.store.get_vm(vm.vm_id)
                if fresh is None or (fresh.state, fresh.incarnation, fresh.node_id) != (
                    vm.state,
                    vm.incarnation,
                    vm.node_id,
                ):
                    return []
                now_hb = await self.d.node(fresh).call(verbs.HEARTBEAT, Empty())
                fix = await self._fix_live(fresh, next((x for x in now_hb.vms if x.vm_id == vm.vm_id), None))
            if fix:
                log.warning("reconcile: %s %s", vm.vm_id, fix)
                return [f"{vm.vm_id}: {fix}"]
            return []
        silent_ms = _silent_ms(a, self.d.now_ms())
        stale = vm.state == S.RUNNING and silent_ms > stale_ms
        if _alive(alive, vm) and not stale:
            return []
        reason = f"harness silent for {silent_ms // 1000} s of CPU time" if stale else "QEMU exited"
        async with self.d.locks.op_lock(vm.vm_id):
            fresh = self.d.store.get_vm(vm.vm_id)
            if (
                fresh is None
                or (fresh.state, fresh.marker) != (vm.state, vm.marker)
                or fresh.incarnation != vm.incarnation
                or fresh.node_id != vm.node_id
            ):
                return []
            if vm.vm_id in alive:
                await self.d.stop_quietly(vm)
            await self.d.transitions.transition(vm.vm_id, A.LOSE, reason=reason)
        what = "running" if vm.state == S.RUNNING else "live-paused"
        log.warning("reconcile: %s %s but %s -> failed", vm.vm_id, what, reason)
        return [f"{vm.vm_id}: {what} but {reason} -> failed"]

    # -- nodes -------------------------------------------------------------------------------

    async def lose_silent_nodes(self) -> list[str]:
        """Mark nodes silent for ``node_lost_after_s`` lost, and fail the VMs that hold a slot
        on a lost node. Idempotent: a VM busy in another operation is retried next tick.

        Silence is counted from the later of the node's last heartbeat and the moment this
        replica became leader (heartbeats sent during a failover went nowhere)."""
        limit = self.d.settings.node_lost_after_s
        since_lead = self.d.clock() - self.leader_since()
        fixes: list[str] = []
        now = utcnow()
        watched = [
            n
            for n in self.d.nodes.nodes()
            if n.state != nodes_mod.LOST and not self.d.nodes.is_local(n.node_id)
        ]
        due = [
            (n, s) for n in watched if (s := min((now - n.last_seen_at).total_seconds(), since_lead)) > limit
        ]
        if len(due) > MASS_SILENCE_MIN and len(due) > MASS_SILENCE_SHARE * len(watched):
            # Many nodes at once: this control plane's own trouble (its intake of heartbeats
            # fell behind, its network) far likelier than that many nodes failing; failing
            # their VMs would turn an overload into an outage. They are lost once their
            # silence is their own.
            log.error("%d of %d nodes silent at once: not declared lost (the control plane's intake "
                      "or network, likelier than that many nodes)", len(due), len(watched))  # fmt: skip
            due = []
        for node, silent in due:
            if self.d.nodes.set_state(node.node_id, nodes_mod.LOST, expect=node.state):
                log.error("node %s silent for %.0f s: lost; its running VMs fail", node.node_id, silent)
                fixes.append(f"node {node.node_id}: lost")
        lost = {n.node_id for n in self.d.nodes.nodes() if n.state == nodes_mod.LOST}
        view = self.d.live
        if view.loaded:  # in memory: nothing is read while no lost node holds a VM
            ids = [v for n in sorted(lost) for v in view.on_node(n)]
            candidates = list(vms_by_ids(self.d.store, ids).values()) if ids else []
        else:
            candidates = slot_rows(self.d.store, lost)
        victims = [vm for vm in candidates if vm.node_id in lost and holds_slot(vm.state, vm.marker)]
        if not victims:
            return fixes
        results = await asyncio.gather(*(self._lose(vm) for vm in victims))
        fixes.extend(f for f in results if f)
        return fixes

    async def _lose(self, vm: VmRecord) -> str | None:
        lock = self.d.locks.op_lock(vm.vm_id)
        try:
            await asyncio.wait_for(lock.acquire(), LOCK_WAIT_S)
        except TimeoutError:
            return None
        try:
            fresh = self.d.store.get_vm(vm.vm_id)
            if fresh is None or fresh.node_id != vm.node_id or not holds_slot(fresh.state, fresh.marker):
                return None
            state, t = S(fresh.state), self.d.transitions
            if state == S.DRAINING and fresh.marker == Marker.DELETING:
                await t.transition(vm.vm_id, A.FINISH_DELETE, reason="deleted (its node was lost)")
            elif state == S.PENDING:
                await t.transition(vm.vm_id, A.FAIL_SPAWN, reason=NODE_LOST_REASON)
            else:
                await t.transition(vm.vm_id, A.LOSE, reason=NODE_LOST_REASON)
            log.error("VM %s on lost node %s: %s -> failed", vm.vm_id, vm.node_id, state.value)
            return f"{vm.vm_id}: {state.value} on lost node {vm.node_id} -> failed"
        except Exception as exc:
            log.error("failing VM %s of a lost node failed: %s", vm.vm_id, exc)
            return None
        finally:
            lock.release()

    def stray_vms(self, node_id: str, hb: NodeHeartbeat) -> list[tuple[str, int | None]]:
        """(vm id, incarnation) of the QEMUs ``node_id`` runs that the store does not place
        there as a live VM of that incarnation: to be stopped."""
        alive = [a for a in hb.vms if a.alive]
        view = self.d.live
        # The leader's view when it has one (nothing read), else the rows, in one read.
        here = view.on_node(node_id) if view.loaded else {}
        rows = {} if view.loaded else vms_by_ids(self.d.store, [a.vm_id for a in alive])
        out = []
        for a in alive:
            vm: VmRecord | LiveVm | None = here.get(a.vm_id) if view.loaded else rows.get(a.vm_id)
            legit = (
                vm is not None
                and vm.node_id == node_id
                and holds_slot(vm.state, vm.marker)  # a live-paused VM's QEMU belongs there too
                and (a.incarnation is None or a.incarnation == vm.incarnation)
            )
            if not legit:
                out.append((a.vm_id, a.incarnation))
        return out

    async def stop_strays(self, node_id: str, strays: list[tuple[str, int | None]]) -> None:
        for vm_id, incarnation in strays:
            if await self._stop_on(node_id, vm_id, incarnation):
                log.warning("stopped stray VM %s (incarnation %s) on node %s", vm_id, incarnation, node_id)
