"""The runtime scheduler: schedule, pause, resume, fork, delete, exec/files, per the reference
lifecycle's sequences (docs/lifecycle.md). Every operation names its action and checks it against
the table in states.py before any work; every state change goes through
``Transitioner.transition``.

Locking: besides the per-VM transition lock, each multi-step operation on a VM holds that
VM's *operation* lock from its first check to its last transition, so a concurrent exec
waits for an in-progress idle pause and then resumes, and two pauses cannot interleave.
Store calls are synchronous and short (SQLite, WAL); they run on the event loop.

Decisions the spec leaves open:
- delete of a paused VM releases its pause snapshot right away (and fork snapshots its
  children mapped), except while a live fork child still maps one; failures are left to
  retention. Older snapshots of the VM are left to the manager's retention.
- list() shows every VM of the tenant except those terminated more than an hour ago.
- a fork whose snapshot fails returns normally with every child FAILED (error set), so the
  caller sees the child ids; the source stays RUNNING unless its QEMU died.
- a delete whose stop fails answers 500 and leaves the VM DRAINING (scheduler:deleting);
  a repeated delete, or reconciliation, retries the stop.
- exec_stream raises its 404/409/402 on the first ``__anext__``, before any event.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import dataclasses
import logging
import secrets
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, TypeVar

from pal import failpoints
from pal.config import Settings
from pal.errors import (
    BackendError,
    Conflict,
    InsufficientStorage,
    InvalidRequest,
    NotFound,
    PalError,
    Unavailable,
    public_message,
)
from pal.images.paths import ImageNotFound
from pal.manager.api import RuntimeManager
from pal.manager.client import UNREACHABLE
from pal.manager.models import (
    BrokeredSet,
    EgressSet,
    ExecEvent,
    FileDeleted,
    FileList,
    FileWritten,
    HeartbeatAck,
    ImageInfo,
    NodeHeartbeat,
    RestoreFrom,
    SnapshotInfo,
    SnapshotRequest,
    SpawnRequest,
    SpawnResult,
    VmMetrics,
)
from pal.manager.tunnel import TunnelStream
from pal.scheduler import nodes as nodes_mod
from pal.scheduler import placement, states
from pal.scheduler.brokering import SecretBroker
from pal.scheduler.leader import Leadership, SingleProcessLeader
from pal.scheduler.live import LiveOps, is_live_paused_error, live_paused
from pal.scheduler.nodes import NodePool
from pal.scheduler.states import (
    AUTO_LIVE_MARKERS,
    FINAL,
    NEVER_STARTS,
    SLOT_HOLDING,
    Action,
    Marker,
    VmState,
    holds_slot,
)
from pal.scheduler.telemetry import Telemetry
from pal.scheduler.transition import Transitioner
from pal.scheduler.views import (
    ForkChild,
    ForkResult,
    NodeReport,
    OperatorStats,
    add_counters,
    add_live_stats,
)
from pal.spec import (
    AgentSpec,
    EgressUpdate,
    ExecRequest,
    Limits,
    PauseRequest,
    Placement,
    SecretUpdate,
    WaitPause,
    egress_from_json,
    egress_to_json,
)
from pal.store import EventRecord, NodeRecord, Store, VmRecord, utcnow

__all__ = ["ForkChild", "ForkResult", "Scheduler"]

log = logging.getLogger(__name__)
S = VmState
A = Action
M = Marker
R = TypeVar("R")

IDLE_REASON = "auto-suspended (idle timeout)"
# An exec or file call that meets a VM live-paused automatically after our state check
# wakes it and tries again (at most this many times).
WAKE_RETRIES = 2
EGRESS_CHANGED_EVENT = "egress_changed"
SECRET_ROTATED_EVENT = "secret_rotated"
AUTO_RESUME_EVENT = "auto_resume"
# list() keeps showing a terminated VM this long, then hides it (the row and events stay).
TERMINATED_VISIBLE = timedelta(hours=1)


def new_vm_id() -> str:
    return "vm-" + uuid.uuid4().hex[:24]


SHUTDOWN_REASON = "suspended (server shutdown); wakes on the next request"
MAX_RESUME_NODES = 3  # a resume tries at most this many nodes that turn out unreachable
DRAIN_REASON = "suspended (node draining); wakes on another node on the next request"
# A scrape of /metrics waits this long for each node's figures (asked at once), then shows
# the node as down: one silent node must not stall the operator's every scrape.
NODE_STATS_TIMEOUT_S = 5.0


def egress_reason(
    name: str | None, address: str | None, port: int | None, rule: str, more: int | None
) -> str:
    """An egress_denied event in words: `refused pypi.org (151.101.0.223) port 443: not in the
    allow list`."""
    dest = name or address or "?"
    if name and address:
        dest = f"{name} ({address})"
    text = f"refused {dest}" + (f" port {port}" if port else "") + f": {rule}"
    if more:
        text += f" ({more} earlier refusals not listed)"
    return text


def fork_mem_mode(vm: VmRecord) -> Literal["private", "shared"]:
    """How a fork child maps its RAM (docs/live-pause.md, "Memory"): copy-on-write from the
    snapshot (``private``: pages shared with its siblings through the page cache) unless
    it may be offloaded, which needs RAM of its own in a file (``shared``: a reflinked
    copy, its dirty pages writable back; MAP_PRIVATE pages it dirtied are anonymous and,
    without swap, could never leave memory)."""
    return "shared" if vm.wait_pause or vm.idle_live_pause_secs else "private"


def new_snapshot_id() -> str:
    return "snap-" + uuid.uuid4().hex[:24]


def new_token() -> str:
    return secrets.token_urlsafe(32)


def as_pal(exc: BaseException) -> PalError:
    """A manager failure as a PalError: its own status if it has one, else 500."""
    if isinstance(exc, PalError):
        return exc
    return BackendError(f"{type(exc).__name__}: {exc}")


class Scheduler:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        manager: RuntimeManager | None = None,
        *,
        nodes: NodePool | None = None,
        clock: Callable[[], float] = time.time,
        leader: Leadership | None = None,
    ) -> None:
        """``manager``: an embedded node (`pal up`, tests); ``nodes``: the node pool of a
        control plane (remote nodes register through heartbeats)."""
        self.settings = settings
        self.store = store
        self.nodes = nodes or NodePool(settings, store)
        if manager is not None:
            self.nodes.add_local(manager)
        self.clock = clock
        self.leader: Leadership = leader or SingleProcessLeader()
        self.transitions = Transitioner(store)
        self.telemetry = Telemetry()
        # Held weakly: a VM's lock lives while someone holds or awaits it, so the locks
        # of the VMs a long-lived server has seen do not pile up (a churn soak's finding).
        self._ops: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        # Requests (exec/files) in flight per VM: the idle sweeper never suspends such a VM,
        # whatever the (possibly stale) guest heartbeat says.
        self.inflight: dict[str, int] = {}
        self._background: asyncio.Task[None] | None = None
        self._egress_seq: dict[str, tuple[int, str]] = {}  # node id -> (seq, epoch) pulled so far
        self._leading = False
        self.leader_since = 0.0  # clock() when this replica last became leader
        # Nodes whose VMs the last reconciliation could not settle (pal/scheduler/reconcile.py);
        # _reconcile_due: the whole reconciliation after taking the lead still has to succeed.
        self.unreconciled_nodes: set[str | None] = set()
        self._reconcile_due = False
        self._placing = asyncio.Lock()  # one placement at a time: free memory is counted once
        self._node_images: dict[str, list[dict[str, str]]] = {}  # node id -> images asked last
        self._chores: set[asyncio.Task[Any]] = set()  # fire-and-forget node calls (stray stops)
        self.brokering = SecretBroker(settings, store)
        self.live = LiveOps(self)

    # -- lifecycle of the scheduler itself ----------------------------------------------

    async def start(self) -> None:
        """Take the lead if nobody holds it (then reconcile every VM), and start the loops:
        leadership renewal, and the leader's periodic chores. Unavailable if an embedded
        node does not answer its first heartbeat."""
        try:
            await self.nodes.register_local()
        except Exception as exc:
            raise Unavailable(f"the runtime manager did not answer its heartbeat: {exc}") from exc
        await self._lead_once()
        self._background = asyncio.create_task(self._loop(), name="pal-scheduler-loop")
        self.live.start()

    async def close(self) -> None:
        """Stop background tasks; VMs keep running."""
        task, self._background = self._background, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.live.close()
        for t in list(self._chores):
            t.cancel()
        await self.leader.release()
        self._leading = False
        await self.nodes.aclose()

    async def is_leader(self) -> bool:
        return await self.leader.is_leader()

    async def _lead_once(self) -> None:
        """Acquire or renew the lease; on becoming leader, reconcile everything first (the
        previous leader may have died in the middle of any operation)."""
        from pal.scheduler import reconcile

        leads = await self.leader.acquire()
        if leads and not self._leading:
            self._leading = True
            self.leader_since = self.clock()
            self._reconcile_due = True
        elif not leads and self._leading:
            self._leading = False
            log.warning("not the leader any more: background loops stop, mutations are forwarded")
        if self._leading and self._reconcile_due:
            try:
                await self.nodes.refresh_local()
                await reconcile.reconcile_all(self)
                self._reconcile_due = False
                self.reseal_secrets()
                await reconcile.sweep_snapshots(self)
            except Exception:
                log.exception("reconciliation after taking the lead failed; it is retried")

    def spawn_chore(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._chores.add(task)
        task.add_done_callback(self._chores.discard)

    async def _loop(self) -> None:
        from pal.scheduler import idle, reconcile

        sweeper = idle.IdleSweeper(self)
        tick = min(self.settings.idle_sweep_interval_s, self.leader.renew_interval_s, 1.0)
        last_sweep = last_nodes = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            try:
                await self._lead_once()
                if not self._leading:
                    continue
                now = time.monotonic()
                if now - last_nodes >= self.settings.node_heartbeat_interval_s:
                    last_nodes = now
                    await self.nodes.refresh_local()
                await reconcile.lose_silent_nodes(self)
                await reconcile.reconcile_unanswered(self)
                if now - last_sweep >= self.settings.idle_sweep_interval_s:
                    last_sweep = now
                    await reconcile.reconcile_light(self)
                    await sweeper.sweep()
                    await self.record_egress_events()
                    await self.purge_deleted_tenants()
            except Exception:
                log.exception("scheduler background tick failed")

    async def purge_deleted_tenants(self) -> builtins.list[str]:
        """`pal tenants rm` marked a tenant (its keys refused since): delete its VMs and
        their snapshots, then the tenant and its rows. Leader only; resumed after a crash.
        Returns the tenants removed."""
        done = []
        for tenant in self.store.list_tenants():
            if tenant.deleting_at is None:
                continue
            for vm in self.store.list_vms(tenant_id=tenant.id):
                try:
                    if vm.state == S.TERMINATED:
                        await self._release_snapshots(vm)
                    else:
                        await self._delete(vm.vm_id)
                except Exception as exc:
                    log.warning(
                        "deleting VM %s of removed tenant %s: %s (retried)", vm.vm_id, tenant.name, exc
                    )
            if self.store.delete_tenant(tenant.id):
                log.info("tenant %s (%s) deleted with its VMs and snapshots", tenant.name, tenant.id)
                done.append(tenant.id)
        return done

    def reseal_secrets(self) -> int:
        """Seal the plain secrets a Pal from before secrets were sealed stored in clear
        (each VM's row, once, by the leader). Returns how many rows changed."""
        n = 0
        for vm in self.store.list_vms():
            new = self.brokering.reseal(vm.tenant_id, vm.secrets or {})
            if new is not None:
                self.store.update_vm(vm.vm_id, secrets=new)
                n += 1
        if n:
            log.info("sealed the secrets of %d VM(s) stored in clear by an older Pal", n)
        return n

    async def shutdown_vms(self) -> None:
        """`pal up` on SIGTERM: leave no QEMU running, and lose no sandbox.

        Running VMs are suspended exactly like an idle suspend (same crash-safe pause path),
        so the next exec or file request after the restart wakes them transparently;
        VMs caught mid-spawn or mid-drain, or whose pause fails, are stopped (terminated).
        """
        live = self.occupying()

        async def settle(vm: VmRecord) -> None:
            # A live-paused VM becomes a snapshot too: an operator's stays the operator's
            # (never woken), an automatic one wakes on its next request.
            action = A.PAUSE if vm.marker == M.LIVE else A.IDLE_PAUSE
            if states.allowed(S(vm.state), action, vm.marker):
                try:
                    async with self.op_lock(vm.vm_id):
                        await self._pause_locked(vm.vm_id, action, reason=SHUTDOWN_REASON)
                    return
                except Exception as exc:
                    log.warning("shutdown: could not suspend VM %s (%s); stopping it", vm.vm_id, exc)
            if self._reload(vm.vm_id).state not in (S.PAUSED, S.TERMINATED):
                await self._delete(vm.vm_id)

        results = await asyncio.gather(*(settle(vm) for vm in live), return_exceptions=True)
        for vm, res in zip(live, results, strict=True):
            if isinstance(res, BaseException):
                log.error("shutdown: could not stop VM %s: %s", vm.vm_id, res)

    # -- helpers ------------------------------------------------------------------------------

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    def op_lock(self, vm_id: str) -> asyncio.Lock:
        return self._ops.setdefault(vm_id, asyncio.Lock())

    def _own(self, tenant_id: str, vm_id: str) -> VmRecord:
        vm = self.store.get_vm(vm_id)
        if vm is None or vm.tenant_id != tenant_id:
            raise NotFound(f"VM {vm_id} not found")
        return vm

    def _reload(self, vm_id: str) -> VmRecord:
        vm = self.store.get_vm(vm_id)
        if vm is None:
            raise NotFound(f"VM {vm_id} not found")
        return vm

    def occupying(self, node_id: str | None = None) -> builtins.list[VmRecord]:
        """The VMs that use a node (and a quota slot): the slot-holding states, and live
        pauses (their QEMU is still there). ``node_id``: of that node only."""
        rows = self.store.list_vms(states=[*SLOT_HOLDING, S.PAUSED])
        return [
            v for v in rows if holds_slot(v.state, v.marker) and (node_id is None or v.node_id == node_id)
        ]

    def node(self, vm: VmRecord) -> RuntimeManager:
        """The RPC client of the node the VM is placed on."""
        return self.nodes.client(vm.node_id)

    async def is_alive(self, vm: VmRecord, incarnation: int | None = None) -> bool | None:
        """Whether the VM's node reports it alive (None: the heartbeat itself failed)."""
        try:
            hb = await self.node(vm).heartbeat()
        except Exception as exc:
            log.warning("heartbeat failed while checking %s: %s", vm.vm_id, exc)
            return None
        for a in hb.vms:
            if a.vm_id == vm.vm_id and a.alive:
                return incarnation is None or a.incarnation in (None, incarnation)
        return False

    async def stop_quietly(self, vm: VmRecord, node_id: str | None = None) -> bool:
        """Stop the VM's QEMU on ``node_id`` (default: its node). True if stopped, or if
        its node is lost (a lost node stops strays itself when it re-registers)."""
        node_id = node_id if node_id is not None else vm.node_id
        if self.nodes.state_of(node_id) == nodes_mod.LOST:
            return True
        try:
            await self.nodes.client(node_id).stop(vm.vm_id)
            return True
        except Exception as exc:
            log.warning("stop of %s on %s failed: %s", vm.vm_id, node_id, exc)
            return False

    def _spawn_request(self, vm: VmRecord, restore: RestoreFrom | None) -> SpawnRequest:
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
            **self._brokered(vm),
            wait_pause=WaitPause.model_validate(vm.wait_pause) if vm.wait_pause else None,
        )

    def _brokered(self, vm: VmRecord) -> dict[str, Any]:
        rules = self.brokering.rules(vm.tenant_id, vm.secrets)
        if not rules:
            return {}
        return {"brokered": rules, "tenant_ca": self.brokering.tenant_ca(vm.tenant_id)}

    def _protected_snapshots(self, vm: VmRecord) -> builtins.list[str]:
        """Snapshots of ``vm`` that live fork children still map (retention must keep them)."""
        children = self.store.list_vms(parent_vm_id=vm.vm_id)
        return sorted(
            {c.mem_snapshot_id for c in children if c.mem_snapshot_id and c.state not in NEVER_STARTS}
        )

    # -- schedule -----------------------------------------------------------------------------

    async def _visible_images(self, tenant_id: str) -> builtins.list[ImageInfo]:
        """Images are per node; each is open to every tenant or to a list. The union over
        the nodes that answer (asked now: an image may have just been built)."""
        await self.nodes.register_local()
        ids = self.nodes.local_ids() + [
            n.node_id
            for n in self.nodes.nodes()
            if n.state != nodes_mod.LOST
            and not self.nodes.is_local(n.node_id)
            and not self.nodes.silent(n.node_id)
        ]
        seen: dict[str, ImageInfo] = {}
        for node_id in ids:
            try:
                images = await self.nodes.client(node_id).images()
            except Exception as exc:
                if self.nodes.is_local(node_id):
                    raise
                log.warning("images of node %s unavailable: %s", node_id, exc)
                continue
            # Fresher than the node's last heartbeat: placement uses it (an image imported
            # a second ago must be schedulable at once, not after the next heartbeat).
            self._node_images[node_id] = [
                {"name": i.name, "agentVersionId": i.agent_version_id} for i in images
            ]
            for i in images:
                if i.tenants is None or tenant_id in i.tenants:
                    seen.setdefault(i.name, i)
        return sorted(seen.values(), key=lambda i: i.name)

    async def list_images(self, tenant_id: str) -> builtins.list[ImageInfo]:
        return await self._visible_images(tenant_id)

    async def _require_image(self, tenant_id: str, name: str) -> None:
        # An image the tenant may not use is as unknown to it as a missing one.
        if name not in {i.name for i in await self._visible_images(tenant_id)}:
            raise ImageNotFound(name)

    @staticmethod
    def _need(vm: VmRecord, *, restore: bool) -> placement.Need:
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

    async def _choose(
        self,
        vm: VmRecord,
        *,
        restore: bool,
        prefer: str | None = None,
        prefer_why: str = "",
        exclude: tuple[str, ...] = (),
    ) -> placement.Choice:
        """Caller holds ``self._placing``. Unavailable (503, NO_NODE) when no node fits."""
        await self.nodes.register_local()
        return placement.choose(
            self._placeable_nodes(),
            placement.loads(self.occupying()),
            self._need(vm, restore=restore),
            prefer=prefer,
            prefer_why=prefer_why,
            exclude=exclude,
            silent_after_s=self._silent_after_s,
        )

    def _placeable_nodes(self) -> builtins.list[NodeRecord]:
        """The node records placement weighs, with the images each node last reported."""
        return [
            dataclasses.replace(n, images=self._node_images[n.node_id])
            if n.node_id in self._node_images
            else n
            for n in self.nodes.nodes()
        ]

    @property
    def _silent_after_s(self) -> float:
        """A node silent for longer (three heartbeat periods) gets nothing new placed on it."""
        return 3 * self.settings.node_heartbeat_interval_s

    async def schedule(self, tenant_id: str, spec: AgentSpec) -> tuple[VmRecord, str]:
        """The running VM and how it started (`cold`, `template`). Everything that can be
        checked is checked before any row or slot exists (400 before 402)."""
        await self._require_image(tenant_id, spec.image)
        await self.nodes.register_local()
        placement.check_satisfiable(self.nodes.nodes(), spec.placement.region, dict(spec.placement.labels))
        t0 = time.perf_counter()
        now = utcnow()
        vm_id = new_vm_id()
        vm = VmRecord(
            vm_id=vm_id,
            tenant_id=tenant_id,
            image=spec.image,
            limits=spec.limits.model_dump(),
            created_at=now,
            updated_at=now,
            idle_timeout_secs=spec.idle_timeout_secs,
            secrets=self.brokering.store_form(tenant_id, spec.secrets),
            boot=spec.boot,
            incarnation=1,
            token=new_token(),
            last_activity_unix_ms=self.now_ms(),
            egress=egress_to_json(spec.egress if spec.egress is not None else self.settings.egress_default),
            placement=spec.placement.model_dump() if spec.placement.region or spec.placement.labels else None,
            wait_pause=self._wait_rule(spec),
            idle_live_pause_secs=spec.idle_live_pause_secs,
        )
        async with self.op_lock(vm.vm_id):
            await self.transitions.create(tenant_id, [vm], A.SCHEDULE)  # 402 here leaves no row
            failpoints.hit("schedule:reserved")
            async with self._placing:
                try:
                    choice = await self._choose(vm, restore=False)
                except PalError as exc:
                    await self.transitions.transition(vm.vm_id, A.FAIL_SPAWN, reason=exc.message)
                    raise
                # The node and the reason it was chosen go with PENDING -> SPAWNING.
                vm = await self.transitions.transition(
                    vm.vm_id, A.PLACE, reason=choice.reason, node_id=choice.node_id
                )
            try:
                res = await self.node(vm).spawn(self._spawn_request(vm, None))
            except Exception as exc:
                err = as_pal(exc)
                # The manager leaves no QEMU behind on failure (api.py), so FAILED is final.
                await self.transitions.transition(
                    vm.vm_id, A.FAIL_SPAWN, reason=f"spawn failed: {err.message}"
                )
                raise err from exc
            failpoints.hit("schedule:spawned")
            vm = await self.transitions.transition(
                vm.vm_id,
                A.COME_UP,
                details=_spawn_details(res),
                agent_version_id=res.agent_version_id,
                last_activity_unix_ms=self.now_ms(),
            )
        self.telemetry.schedule.labels(boot=res.method).observe(time.perf_counter() - t0)
        self.telemetry.started(vm.vm_id, "schedule")
        return vm, res.method

    def _wait_rule(self, spec: AgentSpec) -> dict[str, object] | None:
        """The VM's wait management: its spec's, else the server's (PAL_WAIT_PAUSE)."""
        wait = spec.wait_pause if spec.wait_pause is not None else self.settings.wait_pause_default
        return wait.model_dump(by_alias=True) if isinstance(wait, WaitPause) else None

    # -- reads --------------------------------------------------------------------------------

    async def get(self, tenant_id: str, vm_id: str) -> VmRecord:
        return self._own(tenant_id, vm_id)

    async def network(self, vm: VmRecord) -> dict[str, int]:
        """The VM's network counters over its life (the node's live ones while it runs)."""
        live = None
        if vm.state == S.RUNNING or live_paused(vm):
            try:
                live = await self.node(vm).egress_counters(vm.vm_id)
            except Exception as exc:  # counters are informative: never fail a GET for them
                log.debug("egress counters of %s unavailable: %s", vm.vm_id, exc)
        return add_counters(vm.egress_stats, live)

    async def list(self, tenant_id: str) -> builtins.list[VmRecord]:
        """All the tenant's VMs except those terminated more than an hour ago."""
        cutoff = utcnow() - TERMINATED_VISIBLE
        return [
            vm
            for vm in self.store.list_vms(tenant_id=tenant_id)
            if not (vm.state == S.TERMINATED and vm.updated_at < cutoff)
        ]

    async def events(self, tenant_id: str, vm_id: str) -> builtins.list[EventRecord]:
        self._own(tenant_id, vm_id)
        return self.store.list_events(vm_id)

    async def metrics(self, tenant_id: str, vm_id: str) -> VmMetrics:
        """The VM's resource samples of the last 15 minutes, from the node that runs (or
        last ran) it. A VM that is not running answers its last samples or an empty series."""
        vm = self._own(tenant_id, vm_id)
        try:
            return await self.node(vm).vm_metrics(vm_id)
        except Unavailable:
            return VmMetrics(vm_id=vm_id, interval_secs=self.settings.metrics_interval_s, window_secs=900,
                             live=False, samples=[])  # fmt: skip

    async def snapshots(self, tenant_id: str, vm_id: str) -> builtins.list[SnapshotInfo]:
        """The VM's snapshots kept on its node, oldest first, with artifact sizes."""
        vm = self._own(tenant_id, vm_id)
        if not vm.agent_version_id:
            return []
        return await self.node(vm).list_snapshots(vm.agent_version_id, vm_id)

    async def operator_stats(self) -> OperatorStats:
        """Figures for the operator's /metrics: VMs by state, quota use per tenant, and every
        node the store knows (a lost one, or one that does not answer in time, as down).
        The nodes are asked at once, each for at most NODE_STATS_TIMEOUT_S."""
        with contextlib.suppress(Exception):  # an embedded node that does not answer is down
            await self.nodes.register_local()

        async def ask(rec: NodeRecord) -> NodeReport:
            if rec.state == nodes_mod.LOST:
                return NodeReport(rec.node_id, None)
            try:
                stats = await asyncio.wait_for(self.nodes.client(rec.node_id).stats(), NODE_STATS_TIMEOUT_S)
            except Exception as exc:
                log.warning("node stats of %s unavailable: %s", rec.node_id, as_pal(exc).message)
                return NodeReport(rec.node_id, None)
            return NodeReport(rec.node_id, stats)

        reports = list(await asyncio.gather(*(ask(rec) for rec in self.nodes.nodes())))
        if self.nodes.local_clients() and not self.nodes.local_ids():
            reports.append(NodeReport("local", None))  # embedded, never answered a heartbeat
        used = self.store.slots_by_tenant()
        tenants = [(t.id, used.get(t.id, 0), t.max_vms) for t in self.store.list_tenants()]
        return OperatorStats(vms_by_state=self.store.count_vms_by_state(), tenants=tenants, nodes=reports)

    # -- delete -------------------------------------------------------------------------------

    async def delete(self, tenant_id: str, vm_id: str) -> VmRecord:
        self._own(tenant_id, vm_id)
        return await self._delete(vm_id)

    async def _delete(self, vm_id: str) -> VmRecord:
        self.telemetry.forget(vm_id)
        async with self.op_lock(vm_id):
            vm = self._reload(vm_id)
            if vm.state == S.TERMINATED:
                return vm  # deleting twice answers the same
            # A delete whose stop failed left the VM draining for deletion: finish that one.
            if not states.allowed(S(vm.state), A.FINISH_DELETE, vm.marker):
                to = states.check(vm_id, vm.state, A.DELETE, vm.marker)
                reason = "deleted" if to == S.TERMINATED else "deleting"
                vm = await self.transitions.transition(vm_id, A.DELETE, reason=reason)
            if vm.state == S.DRAINING:
                failpoints.hit("delete:draining")
                try:
                    if self.nodes.state_of(vm.node_id) != nodes_mod.LOST:  # a lost node stops it on return
                        await self.node(vm).stop(vm_id)
                except Exception as exc:
                    # Stays DRAINING+deleting: a repeated delete or reconciliation retries.
                    raise BackendError(f"stopping VM {vm_id} failed: {as_pal(exc).message}") from exc
                failpoints.hit("delete:stopped")
                vm = await self.transitions.transition(vm_id, A.FINISH_DELETE, reason="deleted")
        await self._release_snapshots(vm)
        return vm

    async def _release_snapshots(self, vm: VmRecord) -> None:
        """Delete the snapshots a terminated VM leaves, locally and in S3, except those a
        live VM still needs: a snapshot its live fork children map stays until the last of
        them goes (that child's delete releases it, the parent being gone). When this VM is
        a fork child whose parent is gone, the parent's snapshot it mapped goes too unless
        another live child maps it. Best effort on every node that answers; what is left
        (an unreachable node, a crash) is found by the sweep (reconcile.sweep_snapshots)."""
        if not vm.agent_version_id:
            return
        live = [v for v in self.store.list_vms(parent_vm_id=vm.vm_id) if v.state not in NEVER_STARTS]
        keep = sorted({c.mem_snapshot_id for c in live if c.mem_snapshot_id})
        await self._delete_snapshots_of(vm.agent_version_id, vm.vm_id, keep)
        self._stamp_snapshot_bytes(vm.vm_id, 0 if not keep else None)
        if vm.parent_vm_id and vm.mem_snapshot_id:
            parent = self.store.get_vm(vm.parent_vm_id)
            if parent is None or parent.state in FINAL:
                users = [
                    v
                    for v in self.store.list_vms(mem_snapshot_id=vm.mem_snapshot_id)
                    if v.state not in NEVER_STARTS and v.vm_id != vm.vm_id
                ]
                if not users:
                    try:
                        await self.node(vm).delete_snapshot(
                            vm.agent_version_id, vm.parent_vm_id, vm.mem_snapshot_id
                        )
                    except Exception as exc:
                        log.warning(
                            "could not delete snapshot %s of %s: %s", vm.mem_snapshot_id, vm.parent_vm_id, exc
                        )
                    await self._refresh_snapshot_bytes(vm.parent_vm_id)

    async def _delete_snapshots_of(self, agent_version_id: str, vm_id: str, keep: builtins.list[str]) -> None:
        """Every snapshot of one VM but ``keep``, on every node that answers (a VM's older
        snapshots may sit on a node it ran on before) and in S3."""
        for node_id in self.nodes.reachable_ids():
            try:
                await self.nodes.client(node_id).delete_vm_snapshots(agent_version_id, vm_id, keep)
            except Exception as exc:
                log.warning("could not delete the snapshots of %s on %s: %s", vm_id, node_id, exc)

    # -- snapshot bytes (the tenant's snapshot limit) ---------------------------------------

    def _snapshot_estimate(self, vm: VmRecord) -> int:
        """About what a new snapshot of ``vm`` takes, before it exists: its RAM (the disk
        is a reflink whose own bytes are what the guest wrote since)."""
        return int(placement.vm_memory_mib(vm)) << 20

    def _stamp_snapshot_bytes(self, vm_id: str, value: int | None) -> None:
        if value is None:
            return
        try:
            self.store.update_vm(vm_id, snapshot_bytes=value)
        except Exception as exc:
            log.warning("could not record the snapshot bytes of %s: %s", vm_id, exc)

    async def _refresh_snapshot_bytes(self, vm_id: str) -> None:
        """Record what the VM's snapshots take on its node now (after a snapshot, a
        retention or a delete); best effort."""
        vm = self.store.get_vm(vm_id)
        if vm is None or not vm.agent_version_id or not vm.node_id:
            return
        try:
            snaps = await self.node(vm).list_snapshots(vm.agent_version_id, vm_id)
        except Exception as exc:
            log.warning("could not measure the snapshots of %s: %s", vm_id, exc)
            return
        self._stamp_snapshot_bytes(vm_id, sum(x.stored_bytes for x in snaps))

    # -- pause / resume ------------------------------------------------------------------------

    async def pause(self, tenant_id: str, vm_id: str, req: PauseRequest | None = None) -> VmRecord:
        """The operator's pause: a snapshot pause (default), or a live one (``mode: live``,
        optionally offloading the guest's RAM). Neither is ever woken automatically."""
        self._own(tenant_id, vm_id)
        async with self.op_lock(vm_id):
            if req is not None and req.mode == "live":
                paused = await self.live.pause(
                    vm_id, A.LIVE_PAUSE, offload=req.offload, reason="live-paused by operator"
                )
                assert paused is not None  # only a wait pause may find nothing to do
                return paused
            return await self._pause_locked(vm_id, A.PAUSE, reason="paused by operator")

    async def idle_live_pause(self, vm_id: str, *, still_idle: Callable[[VmRecord], bool]) -> VmRecord | None:
        """The idle sweeper's first tier (idleLivePauseSecs): live-pause and offload."""
        async with self.op_lock(vm_id):
            vm = self._reload(vm_id)
            if not states.allowed(S(vm.state), A.IDLE_LIVE_PAUSE, vm.marker):
                return None
            if self.inflight.get(vm_id, 0) or not still_idle(vm):
                return None
            return await self.live.pause(
                vm_id, A.IDLE_LIVE_PAUSE, offload=True, reason="live-paused (idle; wakes on the next request)"
            )

    async def idle_pause(self, vm_id: str, *, still_idle: Callable[[VmRecord], bool]) -> VmRecord | None:
        """The idle sweeper's suspend: same path as pause; skipped if the VM woke meanwhile."""
        async with self.op_lock(vm_id):
            vm = self._reload(vm_id)
            if not states.allowed(S(vm.state), A.IDLE_PAUSE, vm.marker):
                return None
            if self.inflight.get(vm_id, 0) or not still_idle(vm):
                return None
            return await self._pause_locked(vm_id, A.IDLE_PAUSE, reason=IDLE_REASON)

    async def _pause_locked(self, vm_id: str, action: Action, *, reason: str) -> VmRecord:
        """``action``: PAUSE (by the operator; never woken) or IDLE_PAUSE (woken on demand)."""
        t0 = time.perf_counter()
        vm = self._reload(vm_id)
        states.check(vm_id, vm.state, action, vm.marker)
        by = "idle" if action == A.IDLE_PAUSE else "operator"
        prev = vm.snapshot_id
        snap_id = new_snapshot_id()
        # A live pause ending in a snapshot (the idle tiers, shutdown, drain, the operator):
        # its time counts with the VM's live-paused time.
        was_live = live_paused(vm)
        live_ms = int((utcnow() - vm.paused_at).total_seconds() * 1000) if was_live and vm.paused_at else 0
        # The snapshot id is persisted with DRAINING, before the manager stops anything, so a
        # restarted control plane can check whether this snapshot completed (reconcile.py).
        await self.transitions.transition(
            vm_id,
            action,
            reason=reason,
            snapshot_id=snap_id,
            new_snapshot_bytes=self._snapshot_estimate(vm),
            tenant_limits=reason != SHUTDOWN_REASON,  # a shutdown suspends whatever the limits
        )
        failpoints.hit("pause:draining")
        try:
            result = await self.node(vm).snapshot(
                vm_id,
                SnapshotRequest(
                    snapshot_id=snap_id,
                    agent_version_id=vm.agent_version_id or "",
                    tenant_id=vm.tenant_id,
                    keep_running=False,
                    parent_snapshot_id=prev,
                    protected=self._protected_snapshots(vm),
                ),
            )
        except Exception as exc:
            err = as_pal(exc)
            alive = await self.is_alive(vm, vm.incarnation)
            if alive:
                # The node leaves the VM running (a live-paused one too: it was resumed).
                await self.transitions.transition(
                    vm_id,
                    A.ROLL_BACK_PAUSE,
                    reason=f"pause failed: {err.message}",
                    snapshot_id=prev,
                    paused_by=None,
                    paused_at=None,
                    live_stats=add_live_stats(vm.live_stats, livePausedMs=live_ms),
                )
                if isinstance(err, InsufficientStorage):  # refused before any work: say so (507)
                    raise InsufficientStorage(
                        f"pause of VM {vm_id} refused (it is still running): {err.message}"
                    ) from exc
                raise BackendError(
                    f"pause of VM {vm_id} failed (it is still running): {err.message}"
                ) from exc
            await self.stop_quietly(vm)  # in case the heartbeat was wrong or failed
            await self.transitions.transition(
                vm_id, A.LOSE, reason=f"pause failed and the VM is gone: {err.message}", snapshot_id=prev
            )
            raise BackendError(f"pause of VM {vm_id} failed and the VM is gone: {err.message}") from exc
        failpoints.hit("pause:snapshotted")
        paused = await self.transitions.transition(
            vm_id,
            A.FINISH_PAUSE,
            reason=reason,
            paused_by=by,
            paused_at=utcnow(),
            mem_snapshot_id=None,
            egress_stats=add_counters(vm.egress_stats, result.egress_counters),
            live_stats=add_live_stats(vm.live_stats, livePausedMs=live_ms),
        )
        self.telemetry.pause.labels(by=by).observe(time.perf_counter() - t0)
        self.telemetry.forget(vm_id)
        await self._refresh_snapshot_bytes(vm_id)
        return paused

    async def resume(self, tenant_id: str, vm_id: str) -> VmRecord:
        """A live-paused VM continues in its QEMU; a snapshot-paused one is restored."""
        self._own(tenant_id, vm_id)
        async with self.op_lock(vm_id):
            if live_paused(self._reload(vm_id)):
                return await self.live.resume(vm_id, "api", "resumed by operator")
            return await self._resume_locked(vm_id)

    async def _resume_locked(self, vm_id: str, trigger: str = "api") -> VmRecord:
        t0 = time.perf_counter()
        vm = self._reload(vm_id)
        states.check(vm_id, vm.state, A.RESUME, vm.marker)
        if not vm.snapshot_id:
            raise Conflict(f"VM {vm_id} has no snapshot to resume from")
        old_node = vm.node_id
        tried: builtins.list[str] = []
        while True:
            async with self._placing:
                # Its previous node when that is healthy and has room, else any node that
                # fits (which pulls the snapshot from S3 and verifies it).
                choice = await self._choose(
                    vm, restore=True, prefer=old_node, prefer_why="its previous node", exclude=tuple(tried)
                )
                # Reserves the slot in the same transaction: 402 changes nothing.
                vm = await self.transitions.transition(
                    vm_id,
                    A.RESUME,
                    reason=choice.reason,
                    node_id=choice.node_id,
                    # a new incarnation and token: credentials frozen in the snapshot are refused
                    incarnation=vm.incarnation + 1,
                    token=new_token(),
                )
            failpoints.hit("resume:spawning")
            if old_node is not None and choice.node_id != old_node:
                await self._publish_snapshot(vm, old_node, vm.snapshot_id or "")
            restore = RestoreFrom(
                snapshot_id=vm.snapshot_id or "",
                agent_version_id=vm.agent_version_id or "",
                source_vm_id=vm_id,
                tenant_id=vm.tenant_id,
                mem_mode="shared",
            )
            try:
                res = await self.node(vm).spawn(self._spawn_request(vm, restore))
                break
            except Exception as exc:
                err = as_pal(exc)
                # SPAWNING -> PAUSED releases the slot; the snapshot is untouched, so
                # resumable again. The VM stays attached to its previous node.
                vm = await self.transitions.transition(
                    vm_id, A.ROLL_BACK_RESUME, reason=f"resume failed: {err.message}", node_id=old_node
                )
                if err.code == UNREACHABLE and len(tried) < MAX_RESUME_NODES - 1:
                    # Its node died before anyone noticed: nothing happened there, try another.
                    tried.append(choice.node_id)
                    continue
                raise err from exc
        failpoints.hit("resume:spawned")
        if old_node is not None and choice.node_id != old_node:
            # It runs elsewhere now: its previous node lets go of its parked QEMU, if any.
            # In the background (that node may be the unreachable one this resume avoided),
            # best effort: a parked QEMU also goes when it is too old.
            self.spawn_chore(self._let_go(old_node, vm_id), f"let-go-{vm_id}")
        running = await self.transitions.transition(
            vm_id,
            A.COME_UP,
            details=_spawn_details(res),
            paused_by=None,
            paused_at=None,
            mem_snapshot_id=res.mem_snapshot_id,
            agent_version_id=res.agent_version_id or vm.agent_version_id,
            last_activity_unix_ms=self.now_ms(),
        )
        self.telemetry.resume.labels(trigger=trigger).observe(time.perf_counter() - t0)
        self.telemetry.started(vm_id, "resume" if trigger == "api" else trigger)
        return running

    async def _let_go(self, node_id: str, vm_id: str) -> None:
        with contextlib.suppress(Exception):
            await self.nodes.client(node_id).stop(vm_id)

    # -- fork ---------------------------------------------------------------------------------

    async def fork(self, tenant_id: str, vm_id: str, count: int) -> ForkResult:
        if isinstance(count, bool) or not isinstance(count, int):
            raise InvalidRequest("count must be an integer")
        limit = self.settings.max_fork_count
        if count < 1 or count > limit:
            raise InvalidRequest(f"count must be between 1 and {limit} (PAL_MAX_FORK_COUNT), got {count}")
        self._own(tenant_id, vm_id)
        t0 = time.perf_counter()
        async with self.op_lock(vm_id):
            src = self._reload(vm_id)
            states.check(vm_id, src.state, A.FORK_FROM, src.marker)
            # A live source (running, or live-paused: it stays paused) is captured now; a
            # snapshot-paused one forks from its pause snapshot.
            live_source = src.state == S.RUNNING or live_paused(src)
            if not live_source and not src.snapshot_id:
                raise Conflict(f"paused VM {vm_id} has no snapshot to fork from")
            snap_id = new_snapshot_id() if live_source else src.snapshot_id or ""
            children = [self._child_row(src, snap_id) for _ in range(count)]
            async with self._placing:
                # Placed before any row exists (503 NO_NODE leaves nothing), then all N rows
                # and slots in one transaction, before any snapshot I/O (402 leaves nothing).
                reasons = self._place_children(src, children)
                await self.transitions.create(
                    tenant_id,
                    children,
                    A.FORK,
                    reasons=[f"fork of {vm_id}; {r}" for r in reasons],
                    # a running source is snapshotted for them: the tenant's snapshot limit
                    new_snapshot_bytes=self._snapshot_estimate(src) if src.state == S.RUNNING else 0,
                )
            failpoints.hit("fork:reserved")
            if live_source:
                error = await self._fork_snapshot(src, snap_id)
                if error is not None:
                    for c in children:
                        await self.transitions.transition(
                            c.vm_id, A.FAIL_SPAWN, reason=error, mem_snapshot_id=None
                        )
                    return ForkResult(vm_id, snap_id, [ForkChild(c.vm_id, S.FAILED, error) for c in children])
                await self._refresh_snapshot_bytes(vm_id)
            failpoints.hit("fork:snapshotted")
        forks = await self._spawn_children(src, children, snap_id)
        self.telemetry.fork.observe(time.perf_counter() - t0)
        return ForkResult(source_vm_id=vm_id, snapshot_id=snap_id, forks=forks)

    def _place_children(self, src: VmRecord, children: builtins.list[VmRecord]) -> builtins.list[str]:
        """Caller holds ``_placing``. Children stay on the source's node while it has room
        (they share the snapshot's pages there); the rest spill to other nodes, which
        restore the snapshot from S3. Sets each child's node; returns each one's reason."""
        loads = placement.loads(self.occupying())
        nodes = self._placeable_nodes()
        reasons = []
        for child in children:
            choice = placement.choose(
                nodes,
                loads,
                self._need(child, restore=True),
                prefer=src.node_id,
                prefer_why="the source's node (shares its pages)",
                silent_after_s=self._silent_after_s,
            )
            child.node_id = choice.node_id
            loads.setdefault(choice.node_id, placement.NodeLoad()).add(
                child.tenant_id, placement.vm_memory_mib(child)
            )
            reasons.append(choice.reason)
        return reasons

    def _child_row(self, src: VmRecord, snap_id: str) -> VmRecord:
        now = utcnow()
        child_id = new_vm_id()
        return VmRecord(
            vm_id=child_id,
            tenant_id=src.tenant_id,
            image=src.image,
            limits=dict(src.limits),
            created_at=now,
            updated_at=now,
            agent_version_id=src.agent_version_id,
            idle_timeout_secs=src.idle_timeout_secs,
            secrets=dict(src.secrets),
            boot=src.boot,
            parent_vm_id=src.vm_id,
            mem_snapshot_id=snap_id,
            incarnation=1,  # its own identity: a fresh incarnation line and token
            token=new_token(),
            last_activity_unix_ms=self.now_ms(),
            egress=src.egress,
            placement=src.placement,
            wait_pause=src.wait_pause,
            idle_live_pause_secs=src.idle_live_pause_secs,
        )

    async def _fork_snapshot(self, src: VmRecord, snap_id: str) -> str | None:
        """Snapshot a running source, keeping it running; the error text on failure."""
        try:
            await self.node(src).snapshot(
                src.vm_id,
                SnapshotRequest(
                    snapshot_id=snap_id,
                    agent_version_id=src.agent_version_id or "",
                    tenant_id=src.tenant_id,
                    keep_running=True,
                    parent_snapshot_id=src.snapshot_id,
                    protected=self._protected_snapshots(src),
                ),
            )
            return None
        except Exception as exc:
            err = as_pal(exc)
            if await self.is_alive(src, src.incarnation) is False:
                await self.transitions.transition(
                    src.vm_id, A.LOSE, reason=f"QEMU exited during a fork snapshot: {err.message}"
                )
            return f"fork snapshot failed: {public_message(err.message)}"

    async def _publish_snapshot(self, vm: VmRecord, node_id: str, snapshot_id: str) -> None:
        """Make ``vm``'s snapshot restorable on other nodes: S3 must hold it. Asks the node
        that took it to upload it now; when that node is lost, S3's copy (uploaded after the
        pause) is all there is, and the restoring node says so if it is missing."""
        if self.nodes.state_of(node_id) == nodes_mod.LOST:
            return
        try:
            await self.nodes.client(node_id).ensure_uploaded(vm.agent_version_id or "", vm.vm_id, snapshot_id)
        except Exception as exc:
            log.warning(
                "could not publish snapshot %s of %s from %s: %s", snapshot_id, vm.vm_id, node_id, exc
            )

    async def _spawn_children(
        self, src: VmRecord, children: builtins.list[VmRecord], snap_id: str
    ) -> builtins.list[ForkChild]:
        """Restore every child (at most PAL_FORK_CONCURRENCY at once), then move the ones
        that came up to RUNNING in ONE transaction: a control plane that dies before it
        leaves every child SPAWNING, and reconciliation fails them all (a fork is all or
        nothing across a failover). Holds each child's operation lock throughout."""
        if any(c.node_id != src.node_id for c in children) and src.node_id is not None:
            await self._publish_snapshot(src, src.node_id, snap_id)
        sem = asyncio.Semaphore(max(1, self.settings.fork_concurrency))
        async with contextlib.AsyncExitStack() as stack:
            for c in sorted(children, key=lambda c: c.vm_id):
                await stack.enter_async_context(self.op_lock(c.vm_id))
            results = await asyncio.gather(*(self._spawn_child(src, c.vm_id, snap_id, sem) for c in children))
            up = [(cid, fields) for cid, fields, _ in results if fields is not None]
            failpoints.hit("fork:spawned")
            if up:
                await self.transitions.transition_all(up, A.COME_UP)
        out = []
        for cid, fields, settled in results:
            if fields is not None:
                self.telemetry.started(cid, "fork")
                out.append(ForkChild(cid, S.RUNNING))
            else:
                assert settled is not None
                out.append(settled)
        return out

    async def _spawn_child(
        self, src: VmRecord, child_id: str, snap_id: str, sem: asyncio.Semaphore
    ) -> tuple[str, dict[str, Any] | None, ForkChild | None]:
        """(child id, COME_UP fields if it came up, else how it ended)."""
        async with sem:
            child = self._reload(child_id)
            if not states.allowed(S(child.state), A.COME_UP, child.marker):
                return child_id, None, ForkChild(child_id, S(child.state), child.reason)
            restore = RestoreFrom(
                snapshot_id=snap_id,
                agent_version_id=src.agent_version_id or "",
                source_vm_id=src.vm_id,
                tenant_id=src.tenant_id,
                mem_mode=fork_mem_mode(child),
            )
            try:
                res = await self.node(child).spawn(self._spawn_request(child, restore))
            except Exception as exc:
                err = as_pal(exc)
                await self.transitions.transition(
                    child_id, A.FAIL_SPAWN, reason=f"fork spawn failed: {err.message}"
                )
                return child_id, None, ForkChild(child_id, S.FAILED, public_message(err.message))
            fields = {
                "agent_version_id": res.agent_version_id or child.agent_version_id,
                "mem_snapshot_id": res.mem_snapshot_id or snap_id,
                "last_activity_unix_ms": self.now_ms(),
                "details": _spawn_details(res),
            }
            return child_id, fields, None

    # -- egress -------------------------------------------------------------------------------

    async def set_egress(self, tenant_id: str, vm_id: str, update: EgressUpdate) -> VmRecord:
        """Change a VM's egress policy. A running (or live-paused) VM applies it at once
        (new connections follow it, open ones it refuses are reset); any other VM keeps it
        for its next incarnation. Stored only once the node took it, so the two never
        disagree."""
        self._own(tenant_id, vm_id)
        async with self.op_lock(vm_id):
            vm = self._reload(vm_id)
            states.check(vm_id, vm.state, A.SET_EGRESS, vm.marker)
            if vm.state == S.RUNNING or live_paused(vm):
                await self.node(vm).set_egress(
                    vm_id,
                    EgressSet(
                        egress=update.egress,
                        egress_mbps=vm.limits.get("egress_mbps"),
                        max_connections=vm.limits.get("max_connections"),
                    ),
                )
            self.store.update_vm(vm_id, egress=egress_to_json(update.egress))
            self.store.add_event(
                vm_id, vm.tenant_id, EGRESS_CHANGED_EVENT, details={"egress": egress_to_json(update.egress)}
            )
        return await self.get(tenant_id, vm_id)

    async def rotate_secret(self, tenant_id: str, vm_id: str, name: str, update: SecretUpdate) -> bool:
        """A brokered secret's new value. A running (or live-paused) VM's gateway uses it
        from its next request (the guest is not touched: it only ever held the
        placeholder; a live resume registers nothing again, so the value stays); any other
        VM gets it at its next start. Stored once the node took it. True when applied live."""
        self._own(tenant_id, vm_id)
        async with self.op_lock(vm_id):
            vm = self._reload(vm_id)
            new = self.brokering.rotated(vm.tenant_id, vm.secrets, name, update.value)
            states.check(vm_id, vm.state, A.SET_SECRET, vm.marker)
            live = vm.state == S.RUNNING or live_paused(vm)  # the rule of set_egress
            if live:
                rules = self.brokering.rules(vm.tenant_id, new)
                await self.node(vm).set_brokered(vm_id, BrokeredSet(brokered=rules))
            self.store.update_vm(vm_id, secrets=new)
            self.store.add_event(vm_id, vm.tenant_id, SECRET_ROTATED_EVENT, details={"name": name})
        return live

    async def record_egress_events(self) -> int:
        """Pull each node's new egress_denied events into the VMs' event logs (leader loop).
        Bounded: a node keeps the newest few thousand; a gap is not an error."""
        n = 0
        for rec in self.nodes.nodes():
            if rec.state == nodes_mod.LOST or self.nodes.silent(rec.node_id):
                continue
            try:
                n += await self._record_egress_events_of(rec.node_id)
            except Exception as exc:
                log.warning("egress events of node %s unavailable: %s", rec.node_id, exc)
        return n

    async def _record_egress_events_of(self, node_id: str) -> int:
        seq, epoch = self._egress_seq.get(node_id, (0, ""))
        got = await self.nodes.client(node_id).egress_events(seq, epoch)
        self._egress_seq[node_id] = (got.seq, got.epoch)
        n = 0
        tenants: dict[str, str | None] = {}
        for ev in got.events:
            if ev.vm_id not in tenants:
                row = self.store.get_vm(ev.vm_id)
                tenants[ev.vm_id] = row.tenant_id if row else None
            tenant = tenants[ev.vm_id]
            if tenant is None:
                continue  # a template VM, or a VM deleted since
            details = ev.model_dump(by_alias=True, exclude={"seq", "at", "vm_id", "kind"}, exclude_none=True)
            self.store.add_event(
                ev.vm_id,
                tenant,
                ev.kind,
                reason=egress_reason(ev.name, ev.address, ev.port, ev.rule, ev.suppressed),
                details=details,
                at=datetime.fromtimestamp(ev.at, UTC),
            )
            n += 1
        return n

    # -- exec and files -----------------------------------------------------------------------

    async def _ensure_running(self, tenant_id: str, vm_id: str) -> None:
        """Exec and files need a running VM. Paused automatically (idle suspend, either
        tier, or wait management): resume it transparently (audited). Anything else: 409."""
        vm = self._own(tenant_id, vm_id)
        if states.allowed(S(vm.state), A.EXEC):
            return
        async with self.op_lock(vm_id):
            vm = self._reload(vm_id)
            if states.allowed(S(vm.state), A.EXEC):
                return
            if vm.state == S.PAUSED and vm.marker in AUTO_LIVE_MARKERS:
                await self.live.resume(vm_id, "wake", "resumed for an exec or file request")
                self.store.add_event(
                    vm_id, vm.tenant_id, AUTO_RESUME_EVENT, reason="live-resumed for an exec or file request"
                )
                return
            if vm.paused_by == "idle" and states.allowed(S(vm.state), A.RESUME, vm.marker):
                await self._resume_locked(vm_id, trigger="wake")
                self.store.add_event(
                    vm_id, vm.tenant_id, AUTO_RESUME_EVENT, reason="resumed for an exec or file request"
                )
                return
            hint = f"VM {vm_id} was paused by an operator; resume it first" if vm.state == S.PAUSED else None
            states.check(vm_id, vm.state, A.EXEC, vm.marker, hint=hint)

    @contextlib.asynccontextmanager
    async def _request(self, tenant_id: str, vm_id: str) -> AsyncIterator[None]:
        # Ownership first: a request naming another tenant's VM is 404 and leaves no trace
        # on it (no in-flight count, no activity stamp that would keep it awake).
        self._own(tenant_id, vm_id)
        # Counted in flight before ensure_running, so the sweeper cannot suspend it between.
        self.inflight[vm_id] = self.inflight.get(vm_id, 0) + 1
        try:
            await self._ensure_running(tenant_id, vm_id)
            self._stamp(vm_id)
            yield
        finally:
            n = self.inflight.get(vm_id, 1) - 1
            if n <= 0:
                self.inflight.pop(vm_id, None)
            else:
                self.inflight[vm_id] = n
            self._stamp(vm_id)

    def _stamp(self, vm_id: str) -> None:
        # Best effort: a store that cannot write (disk full) must not fail the request; the
        # in-flight count keeps the VM awake meanwhile.
        try:
            self.store.update_vm(vm_id, last_activity_unix_ms=self.now_ms())
        except Exception as exc:
            log.warning("could not stamp activity of %s: %s", vm_id, exc)

    async def exec_stream(self, tenant_id: str, vm_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        """Errors (404/409/402) are raised on the first ``__anext__``, before any event."""
        t0 = time.perf_counter()
        async with self._request(tenant_id, vm_id):
            for attempt in range(WAKE_RETRIES + 1):
                events = self.node(self._reload(vm_id)).exec_stream(vm_id, req)
                try:
                    first = await events.__anext__()
                except StopAsyncIteration:
                    return
                except PalError as exc:
                    if is_live_paused_error(exc) and attempt < WAKE_RETRIES:
                        await self._ensure_running(tenant_id, vm_id)  # paused meanwhile: wake it
                        continue
                    raise
                self.telemetry.first_exec_done(vm_id, time.perf_counter() - t0)
                yield first
                async for ev in events:
                    yield ev
                return

    async def _files_call(
        self, tenant_id: str, vm_id: str, call: Callable[[RuntimeManager], Awaitable[R]]
    ) -> R:
        async with self._request(tenant_id, vm_id):
            return await self._woken_call(tenant_id, vm_id, call)

    async def _woken_call(
        self, tenant_id: str, vm_id: str, call: Callable[[RuntimeManager], Awaitable[R]]
    ) -> R:
        """``call`` on the VM's node (inside ``_request``), retried after a wake when an
        automatic live pause came between our check and the node (the node answers 409
        LIVE_PAUSED for a guest whose vCPUs are stopped)."""
        for attempt in range(WAKE_RETRIES + 1):
            try:
                return await call(self.node(self._reload(vm_id)))
            except PalError as exc:
                if not is_live_paused_error(exc) or attempt == WAKE_RETRIES:
                    raise
                await self._ensure_running(tenant_id, vm_id)
        raise AssertionError("unreachable")

    @contextlib.asynccontextmanager
    async def port_stream(self, tenant_id: str, vm_id: str, port: int) -> AsyncIterator[TunnelStream]:
        """A byte stream to the server on ``port`` in the VM, open while the context is.

        Like an exec, the request wakes an idle-suspended VM and waits for it (a VM an
        operator paused is 409), and counts as in flight until the context ends, so the
        idle sweeper leaves the VM alone meanwhile; bytes moved count as activity on the
        node. Failure: 400 (port), 404, 409, 502 when nothing listens on the port."""
        if not 1 <= port <= 65535:
            raise InvalidRequest(f"port {port} is outside 1-65535")
        async with self._request(tenant_id, vm_id):
            stream = await self._woken_call(tenant_id, vm_id, lambda n: n.open_port(vm_id, port))
            try:
                yield stream
            finally:
                await stream.aclose()

    async def open_port(self, tenant_id: str, vm_id: str, port: int) -> TunnelStream:
        """The same for long-lived streams (WebSockets, port-forward): in flight only while
        it opens, so an open but silent stream does not keep the VM awake; the bytes it
        moves count as activity. The caller closes the stream."""
        if not 1 <= port <= 65535:
            raise InvalidRequest(f"port {port} is outside 1-65535")
        async with self._request(tenant_id, vm_id):
            return await self._woken_call(tenant_id, vm_id, lambda n: n.open_port(vm_id, port))

    async def list_files(self, tenant_id: str, vm_id: str, path: str) -> FileList:
        return await self._files_call(tenant_id, vm_id, lambda n: n.list_files(vm_id, path))

    async def read_file(self, tenant_id: str, vm_id: str, path: str) -> tuple[bytes, bool]:
        return await self._files_call(tenant_id, vm_id, lambda n: n.read_file(vm_id, path))

    async def write_file(self, tenant_id: str, vm_id: str, path: str, data: bytes) -> FileWritten:
        return await self._files_call(tenant_id, vm_id, lambda n: n.write_file(vm_id, path, data))

    async def delete_file(self, tenant_id: str, vm_id: str, path: str) -> FileDeleted:
        async with self._request(tenant_id, vm_id):
            return await self.node(self._reload(vm_id)).delete_file(vm_id, path)

    # -- nodes (operator and node-facing) -------------------------------------------------------

    async def node_heartbeat(self, hb: NodeHeartbeat) -> HeartbeatAck:
        """A remote node's pushed heartbeat (leader only: the record is a fenced write).
        Registers or refreshes the node, and stops what it runs but must not (a VM declared
        lost while it was away, an older incarnation...): a VM never runs twice."""
        from pal.scheduler import reconcile

        if not hb.url.startswith(("http://", "https://")):
            raise InvalidRequest("a node's heartbeat must carry the http(s) URL of its RPC")
        if self.nodes.is_local(hb.node_id):
            raise Conflict(f"node id {hb.node_id} is the embedded node's")
        rec = self.nodes.record(hb, url=hb.url)
        strays = reconcile.stray_vms(self, hb.node_id, hb)
        if strays:
            self.spawn_chore(reconcile.stop_strays(self, hb.node_id, strays), f"strays-{hb.node_id}")
        return HeartbeatAck(node_id=hb.node_id, state=rec.state, stopping=[v for v, _ in strays])

    def node_views(self) -> builtins.list[dict[str, Any]]:
        loads = placement.loads(self.occupying())
        return [self.nodes.view(n, loads.get(n.node_id) or placement.NodeLoad()) for n in self.nodes.nodes()]

    async def set_node_active(self, node_id: str) -> dict[str, Any]:
        """Undo a drain: the node takes new VMs again (a lost node must heartbeat instead)."""
        rec = self.store.get_node(node_id)
        if rec is None:
            raise NotFound(f"node {node_id} not found")
        if rec.state == nodes_mod.LOST:
            raise Conflict(f"node {node_id} is lost: it becomes active when it heartbeats again")
        self.store.set_node_state(node_id, nodes_mod.ACTIVE)
        return {"nodeId": node_id, "state": nodes_mod.ACTIVE}

    async def drain_node(self, node_id: str, *, migrate: bool = False) -> dict[str, Any]:
        """`pal node drain`: nothing new is placed on the node; its running VMs are
        snapshot-paused (the idle-suspend path, so their next request resumes them on
        another node) and their snapshots published to S3. With ``migrate`` they resume
        elsewhere at once. Returns what happened to each VM."""
        rec = self.store.get_node(node_id)
        if rec is None:
            raise NotFound(f"node {node_id} not found")
        if rec.state == nodes_mod.LOST:
            raise Conflict(
                f"node {node_id} is lost: its running VMs have failed, its paused ones resume elsewhere"
            )
        self.store.set_node_state(node_id, nodes_mod.DRAINING)
        paused: builtins.list[str] = []
        migrated: dict[str, str | None] = {}
        failed: dict[str, str] = {}

        async def one(vm: VmRecord) -> None:
            try:
                async with self.op_lock(vm.vm_id):
                    fresh = self._reload(vm.vm_id)
                    if not (fresh.state == S.RUNNING or live_paused(fresh)) or fresh.node_id != node_id:
                        return
                    action = A.PAUSE if fresh.marker == M.LIVE else A.IDLE_PAUSE  # an operator's stays so
                    done = await self._pause_locked(vm.vm_id, action, reason=DRAIN_REASON)
                    await self._publish_snapshot(done, node_id, done.snapshot_id or "")
                    paused.append(vm.vm_id)
                    if migrate:
                        moved = await self._resume_locked(vm.vm_id, trigger="migrate")
                        migrated[vm.vm_id] = moved.node_id
            except Exception as exc:
                failed[vm.vm_id] = as_pal(exc).message

        running = [v for v in self.occupying(node_id) if v.state == S.RUNNING or live_paused(v)]
        sem = asyncio.Semaphore(max(1, self.settings.fork_concurrency))

        async def bounded(vm: VmRecord) -> None:
            async with sem:
                await one(vm)

        await asyncio.gather(*(bounded(vm) for vm in running))
        return {
            "nodeId": node_id,
            "state": nodes_mod.DRAINING,
            "paused": sorted(paused),
            "migrated": migrated,
            "failed": failed,
        }


def _spawn_details(res: SpawnResult) -> dict[str, Any]:
    """What a VM's coming up records in its status event: how it started and where the
    time went (the node's timings, docs/lifecycle.md "The restore path")."""
    out: dict[str, Any] = {
        "method": res.method,
        "bootMs": round(res.boot_ms, 1),
        "timings": dict(res.timings),
    }
    if res.warm:
        out["warm"] = True  # it continued its parked QEMU (docs/lifecycle.md, "Parked QEMUs")
    return out
